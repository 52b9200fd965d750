"""Sans-I/O DHCPv4 codec and reply builder (RFC 2131, 2132, 3046, 3396, 6842).

Bytes in, dataclasses out, and back: the asyncio service only moves datagrams, and
policy (which address, which bootfile) is decided elsewhere and handed in as an Offer.
"""

import struct
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address

DISCOVER, OFFER, REQUEST, DECLINE, ACK, NAK, RELEASE, INFORM = range(1, 9)

OPT_PAD = 0
OPT_SUBNET_MASK = 1
OPT_ROUTER = 3
OPT_DNS = 6
OPT_HOSTNAME = 12
OPT_DOMAIN = 15
OPT_VENDOR_SPECIFIC = 43
OPT_REQUESTED_IP = 50
OPT_LEASE_TIME = 51
OPT_OVERLOAD = 52
OPT_MESSAGE_TYPE = 53
OPT_SERVER_ID = 54
OPT_PARAM_LIST = 55
OPT_MESSAGE = 56
OPT_MAX_SIZE = 57
OPT_VENDOR_CLASS = 60
# PXE option 43: sub-option 6 (discovery control) = 8 (use the offered boot file), end.
PXE_BOOT_OFFERED_FILE = bytes((6, 1, 8, 255))
# The FourCCs a Raspberry Pi 4/5 bootloader puts first in its option 97 GUID (rpi-eeprom's
# DHCP_OPTION97: 0x34695052 little-endian, "RPi5" on a Pi 5; docs/hardware.md).
RPI_GUIDS = (b"RPi4", b"RPi5")
OPT_CLIENT_ID = 61
OPT_TFTP_SERVER = 66
OPT_BOOTFILE = 67
OPT_USER_CLASS = 77
OPT_RELAY_AGENT = 82
OPT_CLIENT_ARCH = 93
OPT_CLIENT_NDI = 94
OPT_UUID = 97
OPT_IPXE = 175
OPT_END = 255

IPXE_NO_PXEDHCP = 176
"""iPXE sub-option of 175: when 1, iPXE does not wait for ProxyDHCP offers."""

BROADCAST_FLAG = 0x8000
SERVER_PORT, CLIENT_PORT = 67, 68
MIN_LEN = 300  # RFC 951: BOOTP receivers may drop anything shorter
MIN_MAX_SIZE = 576  # RFC 2131: every client accepts this much (IP + UDP + DHCP)
IP_UDP_OVERHEAD = 28

_HEADER = struct.Struct("!4BIHH4I16s64s128sI")
_MAGIC = 0x63825363
_SNAME_AT, _FILE_AT, _OPTIONS_AT = 44, 108, _HEADER.size
ANY = IPv4Address(0)  # 0.0.0.0: no address (yet)
_NO_SNAME, _NO_FILE = bytes(64), bytes(128)
_REPLY_TYPE = {DISCOVER: OFFER, REQUEST: ACK, INFORM: ACK}
_ALWAYS_SENT = frozenset(
    (OPT_MESSAGE_TYPE, OPT_SERVER_ID, OPT_LEASE_TIME, OPT_CLIENT_ID, OPT_RELAY_AGENT)
)


class DhcpError(ValueError):
    """A packet that cannot be decoded; the message names the field and offset."""


@dataclass(slots=True)
class DhcpPacket:
    """One BOOTP/DHCP message; `options` is insertion-ordered and already reassembled."""

    op: int
    htype: int
    hlen: int
    hops: int
    xid: int
    secs: int
    flags: int
    ciaddr: IPv4Address
    yiaddr: IPv4Address
    siaddr: IPv4Address
    giaddr: IPv4Address
    chaddr: bytes
    sname: bytes
    file: bytes
    options: dict[int, bytes]
    # derived once, in __post_init__: every layer asks for them, several times a packet
    mac: str = field(init=False, repr=False, compare=False)
    message_type: int | None = field(init=False, compare=False)

    def __post_init__(self) -> None:
        self.mac = self.chaddr[: self.hlen].hex(":")
        value = self.options.get(OPT_MESSAGE_TYPE)
        self.message_type = value[0] if value else None

    @property
    def client_arch(self) -> int | None:
        """First architecture of option 93 (RFC 4578): 0 BIOS, 7/9 x86-64 UEFI, 16 HTTP, …"""
        value = self.options.get(OPT_CLIENT_ARCH, b"")
        return int.from_bytes(value[:2]) if len(value) >= 2 else None

    @property
    def is_ipxe(self) -> bool:
        return b"iPXE" in self.options.get(OPT_USER_CLASS, b"") or OPT_IPXE in self.options

    @property
    def is_pxe_client(self) -> bool:
        return self.options.get(OPT_VENDOR_CLASS, b"").startswith(b"PXEClient")

    @property
    def is_http_client(self) -> bool:
        """UEFI HTTP boot: it loads the boot file from an http:// URL, without TFTP."""
        return self.options.get(OPT_VENDOR_CLASS, b"").startswith(b"HTTPClient")

    @property
    def rpi_guid(self) -> tuple[str | None, str] | None:
        """A Raspberry Pi bootloader's option 97 as (model, serial): model ``RPi4`` or
        ``RPi5`` from its FourCC, with the serial in the GUID's last four bytes, or None
        for the old format (the serial four times, ``DHCP_OPTION97=0``: anything may look
        so, only a node's serial makes it a Pi). Serial: 8 lowercase hex digits, from the
        little-endian word (captures of the old format show it so). None: no such GUID."""
        return rpi_guid(self.options.get(OPT_UUID, b""))

    @property
    def requested_ip(self) -> IPv4Address | None:
        return _address(self.options.get(OPT_REQUESTED_IP))

    @property
    def server_id(self) -> IPv4Address | None:
        return _address(self.options.get(OPT_SERVER_ID))

    @property
    def hostname(self) -> str | None:
        value = self.options.get(OPT_HOSTNAME)
        return value.rstrip(b"\0").decode(errors="replace") if value else None

    @property
    def relay_agent(self) -> dict[int, bytes]:
        """Option 82's sub-options (RFC 3046: 1 circuit id, 2 remote id); {} when absent
        or malformed, since a relay's mistake must not cost the client its lease."""
        data = self.options.get(OPT_RELAY_AGENT, b"")
        found: dict[int, bytes] = {}
        offset = 0
        while offset + 2 <= len(data):
            code, length = data[offset], data[offset + 1]
            if offset + 2 + length > len(data):
                return {}
            found[code] = data[offset + 2 : offset + 2 + length]
            offset += 2 + length
        return found if offset == len(data) else {}

    @property
    def broadcast(self) -> bool:
        return bool(self.flags & BROADCAST_FLAG)


def rpi_guid(value: bytes) -> tuple[str | None, str] | None:
    """Option 97's value as DhcpPacket.rpi_guid reads it."""
    if len(value) != 17 or value[0] != 0:
        return None
    guid = value[1:]
    serial = f"{int.from_bytes(guid[12:16], 'little'):08x}"
    if guid[:4] in RPI_GUIDS:
        return guid[:4].decode(), serial
    if guid[:4] * 4 == guid:
        return None, serial
    return None


def _address(value: bytes | None) -> IPv4Address | None:
    """A 4-byte option as an address; anything else is treated as absent, not an error."""
    return IPv4Address(value) if value is not None and len(value) == 4 else None


def decode(data: bytes) -> DhcpPacket:
    """Parse a datagram; raises DhcpError for anything a server must not act on."""
    if len(data) < _OPTIONS_AT:
        raise DhcpError(f"truncated: {len(data)} bytes, header and magic cookie need 240")
    fields = _HEADER.unpack_from(data)
    op, hlen, magic = fields[0], fields[2], fields[14]
    if op not in (1, 2):
        raise DhcpError(f"op {op} at offset 0 is neither BOOTREQUEST (1) nor BOOTREPLY (2)")
    if hlen > 16:
        raise DhcpError(f"hlen {hlen} at offset 2 exceeds the 16-byte chaddr field")
    if magic != _MAGIC:
        raise DhcpError(f"bad magic cookie 0x{magic:08x} at offset 236")
    options: dict[int, bytes] = {}
    _walk(data, _OPTIONS_AT, len(data), options)
    overload = options.get(OPT_OVERLOAD)
    if overload is not None:
        if overload not in (b"\x01", b"\x02", b"\x03"):
            raise DhcpError(f"option 52 (overload) has invalid value {overload.hex()}")
        # RFC 3396 section 7: the aggregate buffer is options, then file, then sname.
        if overload[0] & 1:
            _walk(data, _FILE_AT, _FILE_AT + 128, options)
        if overload[0] & 2:
            _walk(data, _SNAME_AT, _SNAME_AT + 64, options)
    addresses = (IPv4Address(n) if n else ANY for n in fields[7:11])  # mostly 0.0.0.0
    return DhcpPacket(*fields[:7], *addresses, *fields[11:14], options)


def _walk(data: bytes, pos: int, end: int, options: dict[int, bytes]) -> None:
    """Collect the options in data[pos:end], concatenating repeats (RFC 3396)."""
    while pos < end:
        code = data[pos]
        if code == OPT_PAD:
            pos += 1
            continue
        if code == OPT_END:
            return
        if pos + 1 == end:
            raise DhcpError(f"option {code} at offset {pos}: length byte missing")
        stop = pos + 2 + data[pos + 1]
        if stop > end:
            raise DhcpError(
                f"option {code} at offset {pos}: length {data[pos + 1]} runs past the end "
                f"of its field at offset {end}"
            )
        options[code] = options.get(code, b"") + data[pos + 2 : stop]
        pos = stop


def encode(packet: DhcpPacket) -> bytes:
    """Serialise; long options are split (RFC 3396) and the result padded to 300 bytes."""
    p = packet
    if len(p.chaddr) > 16 or len(p.sname) > 64 or len(p.file) > 128:
        raise ValueError("chaddr, sname or file longer than its field (16/64/128 bytes)")
    fixed = (p.op, p.htype, p.hlen, p.hops, p.xid, p.secs, p.flags)
    addresses = (int(p.ciaddr), int(p.yiaddr), int(p.siaddr), int(p.giaddr))
    out = bytearray(_HEADER.pack(*fixed, *addresses, p.chaddr, p.sname, p.file, _MAGIC))
    out += encode_options(p.options)
    out.append(OPT_END)
    if len(out) < MIN_LEN:
        out += bytes(MIN_LEN - len(out))
    return bytes(out)


def encode_options(options: dict[int, bytes]) -> bytes:
    """The options as code, length, value, in order; a value over 255 bytes is split into
    pieces of the same code (RFC 3396). No END, no padding."""
    out = bytearray()
    for code, value in options.items():
        if len(value) <= 255:
            out += bytes((code, len(value))) + value
            continue
        for at in range(0, len(value), 255):
            chunk = value[at : at + 255]
            out += bytes((code, len(chunk))) + chunk
    return bytes(out)


def encoded_size(options: dict[int, bytes]) -> int:
    """What encode() will produce before padding: every 255-byte piece costs 2 more bytes."""
    size = _OPTIONS_AT + 1
    for value in options.values():
        n = len(value)
        size += n + 2 if n <= 255 else n + 2 * -(-n // 255)
    return size


@dataclass
class Offer:
    """What policy decided to give one client; build_reply turns it into options."""

    address: IPv4Address
    server_id: IPv4Address
    subnet_mask: IPv4Address
    lease_time: int
    router: IPv4Address | None = None
    dns: tuple[IPv4Address, ...] = ()
    domain: str | None = None
    hostname: str | None = None
    next_server: IPv4Address | None = None
    bootfile: str | None = None
    ipxe_no_pxedhcp: bool = False
    pxe_menu: str | None = None  # a PXE boot menu item to offer (option 43), with no file

    def of(self, address: IPv4Address) -> "Offer":
        """The same offer of another address (a pool's, for each client), copied without
        the dataclass's field-by-field __init__ (a fifth of the cost)."""
        other = object.__new__(Offer)
        other.__dict__.update(self.__dict__)
        other.address = address
        return other


def pxe_boot_menu(item: str) -> bytes:
    """Option 43 naming one PXE boot menu item, as dnsmasq's ``pxe-service=0,"ITEM"``
    sends it and a Raspberry Pi bootloader looks for it: discovery control 3 (no boot
    server discovery), a prompt with timeout 0, the menu (type 0 and the item), end."""
    text = item.encode()[:250]
    return (
        bytes((6, 1, 3, 10, 4, 0))
        + b"PXE"
        + bytes((9, len(text) + 3, 0, 0, len(text)))
        + text
        + bytes((255,))
    )


def build_reply(request: DhcpPacket, offer: Offer, *, proxy: bool = False) -> DhcpPacket:
    """OFFER for DISCOVER, ACK for REQUEST and INFORM, sized to what the client accepts.

    A ProxyDHCP reply (`proxy`) carries what to boot and nothing else: no address (yiaddr
    0), no lease and no network options, since those are the site's server's to give."""
    kind = _REPLY_TYPE.get(request.message_type or 0)
    if kind is None:
        raise ValueError(f"DHCP message type {request.message_type} gets no OFFER/ACK")
    options = offered_options(request, offer, kind, proxy=proxy)
    options.update(_echoed(request))
    _fit(options, max_size(request))
    bootfile = offer.bootfile.encode() if offer.bootfile else b""
    # A bootfile too long for the file field still reaches the client through option 67.
    file = bootfile.ljust(128, b"\0") if len(bootfile) < 128 else _NO_FILE
    inform = request.message_type == INFORM
    r = request  # keeps htype, hlen, hops, xid, flags, giaddr and chaddr (RFC 2131 table 3)
    return DhcpPacket(
        2, r.htype, r.hlen, r.hops, r.xid, 0, r.flags,
        ANY if kind == OFFER else r.ciaddr,
        ANY if inform or proxy else offer.address,
        offer.next_server or ANY,
        r.giaddr, r.chaddr, _NO_SNAME, file, options,
    )  # fmt: skip


def offered_options(
    request: DhcpPacket, offer: Offer, kind: int, *, proxy: bool = False
) -> dict[int, bytes]:
    """The options of build_reply's OFFER or ACK (`kind`) before the client's own are echoed
    and the whole is fitted to its size: message type and server first, then what the
    client asked for, in its order, then the rest in ours."""
    inform = request.message_type == INFORM
    bootfile = offer.bootfile.encode() if offer.bootfile else b""
    extra = {} if proxy else _lease_options(offer, inform)
    if bootfile:
        extra[OPT_BOOTFILE] = bootfile
        if request.is_pxe_client:
            # PXE clients take an offer with vendor class PXEClient as coming from a PXE
            # server; without discovery control "boot the file in this offer" (43.6 = 8),
            # UEFI firmware would first ask a boot server on port 4011 and give up.
            extra[OPT_VENDOR_CLASS] = b"PXEClient"
            extra[OPT_VENDOR_SPECIFIC] = PXE_BOOT_OFFERED_FILE
        elif request.is_http_client:  # UEFI takes an HTTP boot offer only with this echoed
            extra[OPT_VENDOR_CLASS] = b"HTTPClient"
    if offer.pxe_menu:  # also in the ACK to a REQUEST without option 60 (a Pi's)
        extra[OPT_VENDOR_CLASS] = b"PXEClient"
        extra[OPT_VENDOR_SPECIFIC] = pxe_boot_menu(offer.pxe_menu)
    if offer.ipxe_no_pxedhcp and not proxy:
        extra[OPT_IPXE] = bytes((IPXE_NO_PXEDHCP, 1, 1))
    wanted = request.options.get(OPT_PARAM_LIST, b"")
    options = {OPT_MESSAGE_TYPE: bytes((kind,)), OPT_SERVER_ID: offer.server_id.packed}
    # Requested options first, in the client's order; then the rest in ours.
    options.update((code, extra[code]) for code in wanted if code in extra)
    options.update(extra)  # keys already present keep their position
    return options


def _lease_options(offer: Offer, inform: bool) -> dict[int, bytes]:
    """What a client needs to use its address: lease time, mask, router, DNS, names."""
    options: dict[int, bytes] = {}
    if not inform:
        options[OPT_LEASE_TIME] = offer.lease_time.to_bytes(4)
    options[OPT_SUBNET_MASK] = offer.subnet_mask.packed
    if offer.router:
        options[OPT_ROUTER] = offer.router.packed
    if offer.dns:
        options[OPT_DNS] = b"".join(a.packed for a in offer.dns)
    if offer.domain:
        options[OPT_DOMAIN] = offer.domain.encode()
    if offer.hostname:
        options[OPT_HOSTNAME] = offer.hostname.encode()
    if offer.next_server:
        options[OPT_TFTP_SERVER] = str(offer.next_server).encode()
    return options


def build_nak(
    request: DhcpPacket, server_id: IPv4Address, message: str | None = None
) -> DhcpPacket:
    """A DHCPNAK; broadcast through a relay because the client has no usable address."""
    options = {OPT_MESSAGE_TYPE: bytes((NAK,)), OPT_SERVER_ID: server_id.packed}
    if message:
        options[OPT_MESSAGE] = message.encode()
    options.update(_echoed(request))
    flags = request.flags | (0 if request.giaddr.is_unspecified else BROADCAST_FLAG)
    return replace(
        request,
        op=2,
        secs=0,
        flags=flags,
        ciaddr=ANY,
        yiaddr=ANY,
        siaddr=ANY,
        sname=bytes(64),
        file=bytes(128),
        options=options,
    )


def reply_destination(request: DhcpPacket, reply: DhcpPacket) -> tuple[str, int]:
    """Where to send a reply (RFC 2131 4.1); unicast to yiaddr would need ARP injection."""
    if not request.giaddr.is_unspecified:
        return str(request.giaddr), SERVER_PORT
    if not request.ciaddr.is_unspecified and reply.message_type != NAK:
        return str(request.ciaddr), CLIENT_PORT
    return "255.255.255.255", CLIENT_PORT


def _echoed(request: DhcpPacket) -> dict[int, bytes]:
    """Options a server must return verbatim: client id (RFC 6842), relay info last (RFC 3046)."""
    return {c: request.options[c] for c in (OPT_CLIENT_ID, OPT_RELAY_AGENT) if c in request.options}


def max_size(request: DhcpPacket) -> int:
    """Largest DHCP payload the client accepts: option 57 counts IP and UDP headers too."""
    value = request.options.get(OPT_MAX_SIZE, b"")
    size = int.from_bytes(value) if len(value) == 2 else 0
    return max(size, MIN_MAX_SIZE) - IP_UDP_OVERHEAD


def _fit(options: dict[int, bytes], limit: int) -> None:
    """Drop options from the least wanted end until the packet fits (the order is priority)."""
    for code in reversed(list(options)):
        if encoded_size(options) <= limit:
            return
        if code not in _ALWAYS_SENT:
            del options[code]
