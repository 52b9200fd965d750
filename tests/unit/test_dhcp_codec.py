"""DHCPv4 codec and reply builder: wire format, RFC corner cases, and dpkt as an oracle."""

import contextlib
import random
import struct
from dataclasses import replace
from ipaddress import IPv4Address

import dpkt
import pytest

from layerpy.proto import dhcp
from layerpy.proto.dhcp import DhcpError, DhcpPacket, Offer, build_nak, build_reply, decode, encode

IP = IPv4Address
ZERO = IP(0)
MAC = bytes.fromhex("525400123456")
XID = 0x1234ABCD
PXE_VENDOR = b"PXEClient:Arch:00007:UNDI:003016"


def packet(options: dict[int, bytes], *, op: int = 1, **fields) -> DhcpPacket:
    """A full-width packet, as decode() returns it, so round trips compare equal."""
    base = dict(htype=1, hlen=6, hops=0, xid=XID, secs=0, flags=0, ciaddr=ZERO, yiaddr=ZERO,
                siaddr=ZERO, giaddr=ZERO, chaddr=MAC.ljust(16, b"\0"), sname=bytes(64),
                file=bytes(128))  # fmt: skip
    return DhcpPacket(op=op, options=options, **(base | fields))


def client(message_type: int, extra: dict[int, bytes] | None = None, **fields) -> DhcpPacket:
    return packet({dhcp.OPT_MESSAGE_TYPE: bytes((message_type,)), **(extra or {})}, **fields)


def raw(options: bytes, *, sname: bytes = b"", file: bytes = b"", cookie: int = 0x63825363):
    """Wire bytes assembled by hand, independent of encode()."""
    header = struct.pack("!4BIHH16s16s64s128sI", 1, 1, 6, 0, XID, 0, 0, bytes(16),
                         MAC.ljust(16, b"\0"), sname, file, cookie)  # fmt: skip
    return header + options


# A DISCOVER's options the way iPXE's EFI build sends them.
IPXE_OPTIONS = b"".join(
    bytes((code, len(value))) + value
    for code, value in [
        (53, b"\x01"),  # DISCOVER
        (57, b"\x05\xc0"),  # max message size 1472
        (93, b"\x00\x07"),  # arch 7: x86-64 UEFI
        (94, b"\x01\x03\x10"),  # NDI: UNDI 3.16
        (60, PXE_VENDOR),
        (77, b"iPXE"),  # user class as iPXE sends it (not RFC 3004 length-prefixed)
        (55, bytes([1, 3, 6, 7, 12, 15, 43, 60, 67, 175])),
        (175, b"\xb1\x05\x01\x80\x86\x10\x0e"),  # iPXE feature block
        (61, b"\x01" + MAC),  # client id
        (97, b"\x00" + bytes(range(16))),  # UUID
    ]
)


def ipxe_discover() -> DhcpPacket:
    return decode(raw(IPXE_OPTIONS + b"\xff").ljust(300, b"\0"))


OFFER = Offer(
    address=IP("10.99.0.11"),
    server_id=IP("10.99.0.1"),
    subnet_mask=IP("255.255.255.0"),
    lease_time=3600,
    router=IP("10.99.0.1"),
    dns=(IP("10.99.0.1"), IP("1.1.1.1")),
    domain="lab",
    hostname="cn001",
    next_server=IP("10.99.0.1"),
    bootfile="undionly.kpxe",
)


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        client(
            dhcp.DISCOVER, {61: b"\x01" + MAC, 12: b"cn001", 55: bytes([1, 3, 6]), 57: b"\x05\xc0"}
        ),
        client(dhcp.REQUEST, {50: IP("10.99.0.11").packed, 54: IP("10.99.0.1").packed}),
        build_reply(client(dhcp.DISCOVER), OFFER),
        build_reply(client(dhcp.REQUEST, ciaddr=IP("10.99.0.11")), OFFER),
    ],
    ids=["discover", "request", "offer", "ack"],
)
def test_round_trip_keeps_fields_and_option_order(shape: DhcpPacket) -> None:
    again = decode(encode(shape))
    assert again == shape
    assert list(again.options) == list(shape.options)


def test_encode_of_decoded_wire_bytes_is_identical() -> None:
    wire = raw(b"\x35\x01\x01\x3c\x04PXEC\x0c\x02ab\xff").ljust(300, b"\0")
    assert encode(decode(wire)) == wire


def test_encode_pads_to_bootp_minimum_and_ends_options() -> None:
    small = encode(client(dhcp.DISCOVER))
    assert len(small) == 300
    assert small[240:244] == b"\x35\x01\x01\xff"
    big = encode(client(dhcp.DISCOVER, {43: bytes(200), 60: bytes(200)}))
    assert len(big) == 240 + 3 + 202 + 202 + 1


def test_encode_refuses_oversize_fixed_fields() -> None:
    with pytest.raises(ValueError, match="longer than its field"):
        encode(client(dhcp.OFFER, file=bytes(129)))


# --- RFC 3396 long options ------------------------------------------------------------


def test_long_option_split_on_encode_and_joined_on_decode() -> None:
    value = bytes(range(256)) * 2 + bytes(88)  # 600 bytes
    wire = encode(client(dhcp.ACK, {43: value, 12: b"x"}))
    assert wire[243:245] == b"\x2b\xff"
    assert wire[245 + 255 : 247 + 255] == b"\x2b\xff"
    assert wire[247 + 510 : 249 + 510] == bytes((43, 90))
    assert decode(wire).options == {53: b"\x05", 43: value, 12: b"x"}


def test_repeated_options_in_input_are_concatenated() -> None:
    got = decode(raw(b"\x0c\x03abc\x35\x01\x01\x00\x00\x0c\x02de\xff"))
    assert got.hostname == "abcde"
    assert list(got.options) == [12, 53]


def test_empty_option_survives_round_trip() -> None:
    shape = client(dhcp.DISCOVER, {80: b""})  # rapid commit is a zero-length option
    assert decode(encode(shape)).options[80] == b""


# --- option overload (RFC 2132 9.3) -----------------------------------------------------


def test_overload_both_fields_parsed_after_options_file_first() -> None:
    wire = raw(
        b"\x35\x01\x02\x34\x01\x03\x2b\x02ab\xff",
        file=b"\x2b\x02cd\x43\x09boot.ipxe\xff",
        sname=b"\x42\x0810.0.0.1\xff",
    )
    got = decode(wire)
    assert list(got.options) == [53, 52, 43, 67, 66]
    assert got.options[43] == b"abcd"
    assert got.options[67] == b"boot.ipxe"
    assert got.options[66] == b"10.0.0.1"


@pytest.mark.parametrize(("overload", "expect"), [(1, {67}), (2, {66}), (3, {66, 67})])
def test_overload_reads_only_the_named_fields(overload: int, expect: set[int]) -> None:
    # An un-overloaded field holds a plain name, which must not be parsed as options.
    sname = b"\x42\x08server-1\xff" if overload & 2 else b"server-1"
    file = b"\x43\x06pxe.0a\xff" if overload & 1 else b"pxelinux.0"
    got = decode(
        raw(b"\x35\x01\x02\x34\x01" + bytes((overload,)) + b"\xff", sname=sname, file=file)
    )
    assert set(got.options) - {52, 53} == expect


def test_overload_option_running_past_its_field_names_the_field_end() -> None:
    wire = raw(b"\x34\x01\x01\xff", file=bytes(120) + b"\x0c\x09abcdef")
    with pytest.raises(DhcpError, match=r"option 12 at offset 228: length 9 .* offset 236"):
        decode(wire)


# --- malformed input ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wire", "fragment"),
    [
        (b"", "truncated: 0 bytes"),
        (raw(b"")[:100], "truncated: 100 bytes"),
        (raw(b"")[:238], "truncated: 238 bytes"),
        (raw(b"\xff", cookie=0xDEADBEEF), "bad magic cookie 0xdeadbeef at offset 236"),
        (raw(b"\x35\x01\x01\x0c\x10abc"), "option 12 at offset 243: length 16 runs past"),
        (raw(b"\x35\x01\x01\x0c"), "option 12 at offset 243: length byte missing"),
        (b"\x01\x01\x11" + raw(b"\xff")[3:], "hlen 17 at offset 2"),
        (b"\x07" + raw(b"\xff")[1:], "op 7 at offset 0"),
        (raw(b"\x34\x01\x04\xff"), "option 52 (overload) has invalid value 04"),
    ],
)
def test_malformed_packets_raise_with_what_and_where(wire: bytes, fragment: str) -> None:
    with pytest.raises(DhcpError) as caught:
        decode(wire)
    assert fragment in str(caught.value)


def _touch(got: DhcpPacket) -> None:
    """Every helper must cope with whatever decode() let through."""
    _ = (got.mac, got.message_type, got.client_arch, got.is_ipxe, got.is_pxe_client)
    _ = (got.requested_ip, got.server_id, got.hostname, got.broadcast)


def test_every_truncation_decodes_or_raises_dhcp_error() -> None:
    wire = encode(build_reply(ipxe_discover(), OFFER))
    for cut in range(len(wire) + 1):
        with contextlib.suppress(DhcpError):
            _touch(decode(wire[:cut]))


def test_random_byte_flips_decode_or_raise_dhcp_error() -> None:
    rng = random.Random(20240611)
    wire = raw(IPXE_OPTIONS + b"\x34\x01\x03\xff", file=b"\x43\x03a.b\xff", sname=b"\x0c\x01x")
    for _ in range(3000):
        mutated = bytearray(wire)
        for _ in range(rng.randint(1, 6)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        with contextlib.suppress(DhcpError):
            _touch(decode(bytes(mutated)))


# --- what real clients send -------------------------------------------------------------


def test_ipxe_discover_is_recognised() -> None:
    got = ipxe_discover()
    assert got.op == 1 and got.xid == XID
    assert got.mac == "52:54:00:12:34:56"
    assert got.message_type == dhcp.DISCOVER
    assert got.client_arch == 7
    assert got.is_ipxe and got.is_pxe_client
    assert got.options[dhcp.OPT_UUID] == b"\x00" + bytes(range(16))


def test_firmware_pxe_and_plain_clients() -> None:
    bios = client(dhcp.DISCOVER, {60: b"PXEClient:Arch:00000:UNDI:002001", 93: b"\x00\x00"})
    assert (bios.client_arch, bios.is_pxe_client, bios.is_ipxe) == (0, True, False)
    udhcpc = client(dhcp.DISCOVER, {60: b"udhcp 1.36.1", 12: b"cn001\0"})
    assert (udhcpc.client_arch, udhcpc.is_pxe_client, udhcpc.is_ipxe) == (None, False, False)
    assert udhcpc.hostname == "cn001"
    ipxe_by_175 = client(dhcp.DISCOVER, {175: b"\xb1\x05\x01\x80\x86\x10\x0e"})
    assert ipxe_by_175.is_ipxe


def test_helpers_treat_malformed_values_as_absent() -> None:
    got = client(dhcp.REQUEST, {50: b"\x0a\x00\x00", 54: IP("10.0.0.1").packed, 93: b"\x07"})
    assert got.requested_ip is None
    assert got.server_id == IP("10.0.0.1")
    assert got.client_arch is None
    assert packet({}).message_type is None
    assert packet({}, flags=0x8000).broadcast and not packet({}).broadcast


# --- dpkt as an independent oracle -------------------------------------------------------


def test_dpkt_reads_our_offer() -> None:
    reply = build_reply(ipxe_discover(), replace(OFFER, ipxe_no_pxedhcp=True))
    theirs = dpkt.dhcp.DHCP(encode(reply))
    opts = dict(theirs.opts)
    assert (theirs.op, theirs.xid, theirs.yiaddr) == (2, XID, int(IP("10.99.0.11")))
    assert theirs.siaddr == int(IP("10.99.0.1"))
    assert theirs.file.rstrip(b"\0") == b"undionly.kpxe"
    assert opts[53] == bytes((dhcp.OFFER,))
    assert opts[54] == IP("10.99.0.1").packed
    assert opts[51] == (3600).to_bytes(4)
    assert opts[1] == IP("255.255.255.0").packed
    assert opts[3] == IP("10.99.0.1").packed
    assert opts[67] == b"undionly.kpxe"
    assert opts[175] == b"\xb0\x01\x01"


def test_we_read_a_dpkt_packet() -> None:
    theirs = dpkt.dhcp.DHCP(
        op=1,
        xid=XID,
        chaddr=MAC,
        giaddr=int(IP("10.1.0.1")),
        opts=((53, b"\x03"), (50, IP("10.99.0.11").packed), (12, b"cn001"), (93, b"\x00\x10")),
    )
    got = decode(bytes(theirs))
    assert got.xid == XID and got.mac == "52:54:00:12:34:56"
    assert got.giaddr == IP("10.1.0.1")
    assert got.message_type == dhcp.REQUEST
    assert got.requested_ip == IP("10.99.0.11")
    assert got.hostname == "cn001"
    assert got.client_arch == 16


# --- build_reply ----------------------------------------------------------------------


def test_discover_gets_offer() -> None:
    request = client(dhcp.DISCOVER, flags=0x8000, hops=1, giaddr=IP("10.1.0.1"))
    reply = build_reply(request, OFFER)
    assert reply.op == 2 and reply.message_type == dhcp.OFFER
    assert (reply.xid, reply.flags, reply.hops, reply.giaddr, reply.chaddr) == (
        XID, 0x8000, 1, IP("10.1.0.1"), request.chaddr)  # fmt: skip
    assert (reply.ciaddr, reply.yiaddr, reply.siaddr) == (ZERO, OFFER.address, OFFER.next_server)
    assert reply.file == b"undionly.kpxe".ljust(128, b"\0")
    assert list(reply.options) == [53, 54, 51, 1, 3, 6, 15, 12, 66, 67]
    assert reply.options[6] == IP("10.99.0.1").packed + IP("1.1.1.1").packed
    assert reply.options[66] == b"10.99.0.1"
    assert reply.options[51] == b"\x00\x00\x0e\x10"


def test_request_gets_ack_and_keeps_ciaddr_when_renewing() -> None:
    reply = build_reply(client(dhcp.REQUEST, ciaddr=OFFER.address), OFFER)
    assert reply.message_type == dhcp.ACK
    assert (reply.ciaddr, reply.yiaddr) == (OFFER.address, OFFER.address)


def test_inform_gets_ack_without_address_or_lease() -> None:
    reply = build_reply(client(dhcp.INFORM, ciaddr=IP("10.99.0.50")), OFFER)
    assert reply.message_type == dhcp.ACK
    assert reply.yiaddr == ZERO and reply.ciaddr == IP("10.99.0.50")
    assert dhcp.OPT_LEASE_TIME not in reply.options


def test_other_message_types_get_no_reply() -> None:
    with pytest.raises(ValueError, match="type 7"):
        build_reply(client(dhcp.RELEASE), OFFER)


def test_relay_agent_info_and_client_id_echoed_verbatim_relay_last() -> None:
    relay = b"\x01\x06sw1:p3\x02\x06\x02\x00\x00\x00\x0a\x01"
    request = client(dhcp.DISCOVER, {82: relay, 61: b"\x01" + MAC}, giaddr=IP("10.1.0.1"))
    for reply in (build_reply(request, OFFER), build_nak(request, OFFER.server_id)):
        assert reply.options[82] == relay
        assert reply.options[61] == b"\x01" + MAC
        assert list(reply.options)[-1] == 82


def test_ipxe_no_pxedhcp_is_encapsulated_in_175() -> None:
    offer = replace(OFFER, ipxe_no_pxedhcp=True)
    wire = encode(build_reply(ipxe_discover(), offer))
    assert b"\xaf\x03\xb0\x01\x01" in wire  # 175, len 3, [176, len 1, value 1]
    assert 175 not in build_reply(ipxe_discover(), OFFER).options


def test_pxeclient_vendor_class_only_for_pxe_clients_with_a_bootfile() -> None:
    pxe = client(dhcp.DISCOVER, {60: PXE_VENDOR})
    assert build_reply(pxe, OFFER).options[60] == b"PXEClient"
    assert 60 not in build_reply(pxe, replace(OFFER, bootfile=None)).options
    assert 60 not in build_reply(client(dhcp.DISCOVER, {60: b"udhcp 1.36.1"}), OFFER).options


def test_parameter_request_list_sets_order() -> None:
    request = client(dhcp.DISCOVER, {55: bytes([67, 3, 53, 99, 1, 6, 3])})
    assert list(build_reply(request, OFFER).options) == [53, 54, 67, 3, 1, 6, 51, 15, 12, 66]


def test_long_bootfile_goes_only_in_option_67() -> None:
    url = "http://10.99.0.1:8080/boot/" + "x" * 200
    reply = build_reply(client(dhcp.DISCOVER), replace(OFFER, bootfile=url))
    assert reply.file == bytes(128)
    assert reply.options[67] == url.encode()


BIG = replace(OFFER, dns=tuple(IP(f"10.0.0.{i}") for i in range(60)), domain="d" * 200)


# Unrequested options go first, from the end of our default order: 66, then 15.
@pytest.mark.parametrize(
    ("max_size", "dropped"), [(None, {66, 15}), (b"\x01\x2c", {66, 15}), (b"\x05\xdc", set())]
)
def test_max_message_size_drops_unrequested_options(
    max_size: bytes | None, dropped: set[int]
) -> None:
    extra = {55: bytes([1, 3, 67, 12])} | ({57: max_size} if max_size else {})
    reply = build_reply(client(dhcp.DISCOVER, extra), BIG)
    assert set(reply.options) == {53, 54, 51, 1, 3, 67, 12, 66, 6, 15} - dropped
    limit = max(576, int.from_bytes(max_size or b"")) - 28
    assert len(encode(reply)) <= limit


def test_nak() -> None:
    request = client(dhcp.REQUEST, ciaddr=IP("10.99.0.77"))
    nak = build_nak(request, OFFER.server_id, "wrong network")
    assert nak.op == 2 and nak.message_type == dhcp.NAK
    assert nak.options == {53: b"\x06", 54: OFFER.server_id.packed, 56: b"wrong network"}
    assert (nak.ciaddr, nak.yiaddr, nak.siaddr, nak.flags) == (ZERO, ZERO, ZERO, 0)
    relayed = build_nak(client(dhcp.REQUEST, giaddr=IP("10.1.0.1")), OFFER.server_id)
    assert relayed.broadcast and 56 not in relayed.options


@pytest.mark.parametrize(
    ("fields", "nak", "expect"),
    [
        ({"giaddr": IP("10.1.0.1"), "ciaddr": IP("10.99.0.11")}, False, ("10.1.0.1", 67)),
        ({"ciaddr": IP("10.99.0.11")}, False, ("10.99.0.11", 68)),
        ({"ciaddr": IP("10.99.0.11")}, True, ("255.255.255.255", 68)),
        ({}, False, ("255.255.255.255", 68)),
        ({"flags": 0x8000}, False, ("255.255.255.255", 68)),
    ],
)
def test_reply_destination(fields: dict, nak: bool, expect: tuple[str, int]) -> None:
    request = client(dhcp.REQUEST, **fields)
    reply = build_nak(request, OFFER.server_id) if nak else build_reply(request, OFFER)
    assert dhcp.reply_destination(request, reply) == expect


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (bytes.fromhex("01047377703102026877"), {1: b"swp1", 2: b"hw"}),
        (bytes.fromhex("01047377"), {}),  # truncated sub-option
        (b"", {}),
    ],
)
def test_relay_agent_sub_options(value: bytes, expected: dict) -> None:
    options = {dhcp.OPT_MESSAGE_TYPE: b"\x01"} | ({dhcp.OPT_RELAY_AGENT: value} if value else {})
    assert packet(options).relay_agent == expected
