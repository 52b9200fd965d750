"""LLDP (IEEE 802.1AB) frames: parse what a switch says about the port a node sits on.

Sans-I/O and standard library only: the minOS agent imports this module to learn its
switch chassis and port (location addressing), and the lab's LLDP "switch" builds its frames
with it. An LLDPDU is a list of TLVs, each a 16-bit header (7-bit type, 9-bit length) and a
value; Chassis ID, Port ID and TTL come first, in that order, and End (type 0) closes it.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

ETH_P_LLDP = 0x88CC
# nearest bridge (what switches send), nearest non-TPMR bridge, nearest customer bridge
LLDP_MULTICAST = (
    bytes.fromhex("0180c200000e"),
    bytes.fromhex("0180c2000003"),
    bytes.fromhex("0180c2000000"),
)

TLV_END = 0
TLV_CHASSIS_ID = 1
TLV_PORT_ID = 2
TLV_TTL = 3
TLV_PORT_DESCRIPTION = 4
TLV_SYSTEM_NAME = 5
TLV_SYSTEM_DESCRIPTION = 6
TLV_ORG_SPECIFIC = 127

# Chassis ID subtypes (802.1AB-2016 table 8-2)
CHASSIS_COMPONENT = 1
CHASSIS_INTERFACE_ALIAS = 2
CHASSIS_PORT_COMPONENT = 3
CHASSIS_MAC = 4
CHASSIS_NETWORK_ADDRESS = 5
CHASSIS_INTERFACE_NAME = 6
CHASSIS_LOCAL = 7
# Port ID subtypes (table 8-3)
PORT_INTERFACE_ALIAS = 1
PORT_COMPONENT = 2
PORT_MAC = 3
PORT_NETWORK_ADDRESS = 4
PORT_INTERFACE_NAME = 5
PORT_AGENT_CIRCUIT_ID = 6
PORT_LOCAL = 7

ADDRESS_SIZES = {1: 4, 2: 16}  # IANA address family number (IPv4, IPv6) -> address bytes
MIN_FRAME = 60  # Ethernet minimum without the FCS; shorter frames are padded with zeros


class LldpError(ValueError):
    """A frame or LLDPDU that cannot be decoded (or a Neighbor that cannot be encoded)."""


@dataclass
class Neighbor:
    """What one LLDPDU says about the sender: ids rendered as text, other TLVs kept raw."""

    chassis_id: str
    chassis_subtype: int
    port_id: str
    port_subtype: int
    ttl: int
    system_name: str | None = None
    port_description: str | None = None
    system_description: str | None = None
    other_tlvs: tuple[tuple[int, bytes], ...] = ()  # (type, value), e.g. org-specific 127


def _id_kind(tlv_type: int, subtype: int) -> str:
    """How an id subtype is rendered: "mac", "address" or "text"."""
    if (tlv_type, subtype) in ((TLV_CHASSIS_ID, CHASSIS_MAC), (TLV_PORT_ID, PORT_MAC)):
        return "mac"
    if (tlv_type, subtype) in (
        (TLV_CHASSIS_ID, CHASSIS_NETWORK_ADDRESS),
        (TLV_PORT_ID, PORT_NETWORK_ADDRESS),
    ):
        return "address"
    return "text"


def _decode_id(tlv_type: int, value: bytes) -> tuple[str, int]:
    """(rendered id, subtype) of a Chassis ID or Port ID value."""
    name = "chassis id" if tlv_type == TLV_CHASSIS_ID else "port id"
    if not 2 <= len(value) <= 256:
        raise LldpError(f"{name}: length {len(value)}, must be 2-256")
    subtype, raw = value[0], value[1:]
    kind = _id_kind(tlv_type, subtype)
    if kind == "mac":
        if len(raw) != 6:
            raise LldpError(f"{name}: MAC address of {len(raw)} bytes")
        return raw.hex(":"), subtype
    if kind == "address":
        if len(raw) != 1 + ADDRESS_SIZES.get(raw[0], -1):
            raise LldpError(f"{name}: network address family {raw[0]} with {len(raw) - 1} bytes")
        return str(ipaddress.ip_address(raw[1:])), subtype
    # some switches send binary "locally assigned" ids: shown as hex rather than mojibake
    text = raw.decode(errors="replace")
    return (text if text.isprintable() else raw.hex(":")), subtype


def _encode_id(tlv_type: int, subtype: int, text: str) -> bytes:
    name = "chassis id" if tlv_type == TLV_CHASSIS_ID else "port id"
    kind = _id_kind(tlv_type, subtype)
    try:
        if kind == "mac":
            raw = bytes.fromhex(text.replace(":", "").replace("-", ""))
            if len(raw) != 6:
                raise ValueError("not 6 bytes")
        elif kind == "address":
            address = ipaddress.ip_address(text)
            family = 1 if address.version == 4 else 2
            raw = bytes([family]) + address.packed
        else:
            raw = text.encode()
    except ValueError as error:
        raise LldpError(f"{name} {text!r} (subtype {subtype}): {error}") from None
    if not 1 <= len(raw) <= 255 or not 0 <= subtype <= 255:
        raise LldpError(f"{name} {text!r}: 1-255 bytes and subtype 0-255")
    return bytes([subtype]) + raw


def _text(value: bytes) -> str:
    return value.decode(errors="replace").rstrip("\0")


def parse_lldpdu(payload: bytes) -> Neighbor:
    """Decode an LLDPDU (the Ethernet payload); raise LldpError when it is malformed."""
    tlvs: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(payload):
        if pos + 2 > len(payload):
            raise LldpError(f"truncated TLV header at offset {pos}")
        (header,) = struct.unpack_from("!H", payload, pos)
        tlv_type, length = header >> 9, header & 0x1FF
        if tlv_type == TLV_END:
            break  # what follows is Ethernet padding
        if pos + 2 + length > len(payload):
            raise LldpError(
                f"TLV type {tlv_type} at offset {pos}: length {length} runs past the end "
                f"({len(payload) - pos - 2} bytes left)"
            )
        tlvs.append((tlv_type, payload[pos + 2 : pos + 2 + length]))
        pos += 2 + length
    mandatory = [TLV_CHASSIS_ID, TLV_PORT_ID, TLV_TTL]
    found = [tlv_type for tlv_type, _ in tlvs[:3]]
    if found != mandatory:
        raise LldpError(f"must start with chassis id, port id, ttl {mandatory}; found {found}")
    if any(tlv_type in mandatory for tlv_type, _ in tlvs[3:]):
        raise LldpError("more than one chassis id, port id or ttl TLV")
    chassis_id, chassis_subtype = _decode_id(TLV_CHASSIS_ID, tlvs[0][1])
    port_id, port_subtype = _decode_id(TLV_PORT_ID, tlvs[1][1])
    if len(tlvs[2][1]) != 2:
        raise LldpError(f"ttl TLV of {len(tlvs[2][1])} bytes, must be 2")
    (ttl,) = struct.unpack_from("!H", tlvs[2][1])
    texts: dict[int, str] = {}
    other: list[tuple[int, bytes]] = []
    for tlv_type, value in tlvs[3:]:
        if tlv_type in (TLV_PORT_DESCRIPTION, TLV_SYSTEM_NAME, TLV_SYSTEM_DESCRIPTION):
            texts.setdefault(tlv_type, _text(value))  # a repeated one is ignored
        else:
            other.append((tlv_type, value))
    return Neighbor(
        chassis_id,
        chassis_subtype,
        port_id,
        port_subtype,
        ttl,
        system_name=texts.get(TLV_SYSTEM_NAME),
        port_description=texts.get(TLV_PORT_DESCRIPTION),
        system_description=texts.get(TLV_SYSTEM_DESCRIPTION),
        other_tlvs=tuple(other),
    )


def parse_frame(frame: bytes) -> Neighbor:
    """Decode a whole Ethernet frame (no FCS): LLDP multicast destination, ethertype 0x88cc."""
    if len(frame) < 14:
        raise LldpError(f"frame of {len(frame)} bytes is shorter than an Ethernet header")
    if frame[:6] not in LLDP_MULTICAST:
        raise LldpError(f"destination {frame[:6].hex(':')} is not an LLDP multicast address")
    (ethertype,) = struct.unpack_from("!H", frame, 12)
    if ethertype != ETH_P_LLDP:
        raise LldpError(f"ethertype {ethertype:#06x} is not LLDP ({ETH_P_LLDP:#06x})")
    return parse_lldpdu(frame[14:])


def _tlv(tlv_type: int, value: bytes) -> bytes:
    if not 0 <= tlv_type <= 127 or len(value) > 511:
        raise LldpError(f"TLV type {tlv_type} with {len(value)} bytes does not fit a header")
    return struct.pack("!H", tlv_type << 9 | len(value)) + value


def build_lldpdu(neighbor: Neighbor) -> bytes:
    """Encode `neighbor` as an LLDPDU ending with the End TLV."""
    if not 0 <= neighbor.ttl <= 0xFFFF:
        raise LldpError(f"ttl {neighbor.ttl} out of range 0-65535")
    tlvs = [
        _tlv(
            TLV_CHASSIS_ID,
            _encode_id(TLV_CHASSIS_ID, neighbor.chassis_subtype, neighbor.chassis_id),
        ),
        _tlv(TLV_PORT_ID, _encode_id(TLV_PORT_ID, neighbor.port_subtype, neighbor.port_id)),
        _tlv(TLV_TTL, struct.pack("!H", neighbor.ttl)),
    ]
    for tlv_type, text in (
        (TLV_PORT_DESCRIPTION, neighbor.port_description),
        (TLV_SYSTEM_NAME, neighbor.system_name),
        (TLV_SYSTEM_DESCRIPTION, neighbor.system_description),
    ):
        if text is not None:
            tlvs.append(_tlv(tlv_type, text.encode()))
    for tlv_type, value in neighbor.other_tlvs:
        if tlv_type <= TLV_SYSTEM_DESCRIPTION:
            raise LldpError(f"other TLV of type {tlv_type}: only types 7-127 pass through")
        tlvs.append(_tlv(tlv_type, value))
    return b"".join(tlvs) + _tlv(TLV_END, b"")


def build_frame(src_mac: bytes, neighbor: Neighbor) -> bytes:
    """A whole Ethernet frame to the nearest-bridge address, padded to the 60-byte minimum."""
    if len(src_mac) != 6:
        raise LldpError(f"source MAC of {len(src_mac)} bytes")
    frame = LLDP_MULTICAST[0] + src_mac + struct.pack("!H", ETH_P_LLDP) + build_lldpdu(neighbor)
    return frame.ljust(MIN_FRAME, b"\0")
