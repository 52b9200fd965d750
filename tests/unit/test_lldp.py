"""The LLDP codec: frames laid out byte by byte per IEEE 802.1AB, round trips, malformed input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from layerpy.proto import lldp
from layerpy.proto.lldp import LldpError, Neighbor, build_frame, parse_frame, parse_lldpdu

SRC_MAC = bytes.fromhex("020000000a01")
ETH = bytes.fromhex("0180c200000e") + SRC_MAC + b"\x88\xcc"


def tlv(tlv_type: int, value: bytes) -> bytes:
    """A TLV header by hand: 7 bits of type, 9 bits of length."""
    return bytes([tlv_type << 1 | len(value) >> 8, len(value) & 0xFF]) + value


# What a Linux switch running lldpd sends for swp3 (chassis by MAC, port by interface name),
# with the optional TLVs and 802.1/802.3 organisation-specific ones that pass through raw.
SWITCH_FRAME = (
    ETH
    + b"\x02\x07\x04" + bytes.fromhex("44389c000a01")  # chassis id, MAC
    + b"\x04\x05\x05swp3"  # port id, interface name
    + b"\x06\x02\x00\x78"  # ttl 120
    + b"\x08\x0bto cn003 p1"  # port description
    + b"\x0a\x06leaf01"  # system name
    + b"\x0c\x13Cumulus Linux 5.4.0"  # system description
    + b"\x0e\x04\x00\x14\x00\x14"  # system capabilities (bridge, router): type 7
    + b"\x10\x0c\x05\x01\x0a\x63\x00\xfe\x02\x00\x00\x00\x02\x00"  # management address: type 8
    + b"\xfe\x06\x00\x80\xc2\x01\x00\x64"  # 802.1 port VLAN id 100: type 127
    + b"\x00\x00"  # end
)  # fmt: skip


def test_parses_a_switch_frame_byte_by_byte() -> None:
    neighbor = parse_frame(SWITCH_FRAME)
    assert neighbor == Neighbor(
        chassis_id="44:38:9c:00:0a:01",
        chassis_subtype=lldp.CHASSIS_MAC,
        port_id="swp3",
        port_subtype=lldp.PORT_INTERFACE_NAME,
        ttl=120,
        system_name="leaf01",
        port_description="to cn003 p1",
        system_description="Cumulus Linux 5.4.0",
        other_tlvs=(
            (7, b"\x00\x14\x00\x14"),
            (8, b"\x05\x01\x0a\x63\x00\xfe\x02\x00\x00\x00\x02\x00"),
            (127, b"\x00\x80\xc2\x01\x00\x64"),
        ),
    )


def test_rebuilding_a_parsed_frame_gives_the_same_bytes() -> None:
    rebuilt = build_frame(SRC_MAC, parse_frame(SWITCH_FRAME))
    assert rebuilt[:14] == SWITCH_FRAME[:14]
    assert parse_lldpdu(rebuilt[14:]) == parse_lldpdu(SWITCH_FRAME[14:])
    assert rebuilt == SWITCH_FRAME  # same TLV order, and already longer than 60 bytes


def test_minimal_frame_is_padded_and_padding_is_ignored() -> None:
    neighbor = Neighbor("02:00:00:00:0a:01", lldp.CHASSIS_MAC, "swp1", lldp.PORT_INTERFACE_NAME, 20)
    frame = build_frame(SRC_MAC, neighbor)
    assert len(frame) == 60
    assert frame == (
        ETH
        + b"\x02\x07\x04\x02\x00\x00\x00\x0a\x01"
        + b"\x04\x05\x05swp1"
        + b"\x06\x02\x00\x14"
        + b"\x00\x00"
    ).ljust(60, b"\0")
    assert parse_frame(frame) == neighbor


def test_end_tlv_is_optional_at_the_very_end() -> None:
    payload = tlv(1, b"\x07rack1") + tlv(2, b"\x07p1") + tlv(3, b"\x00\x00")
    neighbor = parse_lldpdu(payload)
    assert (neighbor.chassis_id, neighbor.port_id, neighbor.ttl) == ("rack1", "p1", 0)


@pytest.mark.parametrize(
    ("chassis", "port"),
    [
        ((lldp.CHASSIS_MAC, "aa:bb:cc:dd:ee:ff"), (lldp.PORT_MAC, "52:54:00:99:00:11")),
        ((lldp.CHASSIS_LOCAL, "sw1"), (lldp.PORT_LOCAL, "1/0/3")),
        ((lldp.CHASSIS_NETWORK_ADDRESS, "10.99.0.254"), (lldp.PORT_INTERFACE_ALIAS, "uplink")),
        ((lldp.CHASSIS_NETWORK_ADDRESS, "fd00::a"), (lldp.PORT_NETWORK_ADDRESS, "192.0.2.7")),
        ((lldp.CHASSIS_INTERFACE_NAME, "mgmt0"), (lldp.PORT_AGENT_CIRCUIT_ID, "vlan10:p3")),
        ((lldp.CHASSIS_COMPONENT, "ch0"), (lldp.PORT_COMPONENT, "Ethernet1/1")),
    ],
)
def test_id_subtypes_round_trip(chassis: tuple[int, str], port: tuple[int, str]) -> None:
    neighbor = Neighbor(chassis[1], chassis[0], port[1], port[0], 65535, "sw1", "p", "d")
    assert parse_frame(build_frame(SRC_MAC, neighbor)) == neighbor


def test_network_address_ids_are_family_plus_address() -> None:
    payload = tlv(1, b"\x05\x01\x0a\x63\x00\xfe") + tlv(2, b"\x04\x02" + bytes(15) + b"\x01")
    neighbor = parse_lldpdu(payload + tlv(3, b"\x00\x1e"))
    assert (neighbor.chassis_id, neighbor.port_id) == ("10.99.0.254", "::1")


def test_binary_locally_assigned_id_is_shown_as_hex() -> None:
    payload = tlv(1, b"\x07\x00\x01\xff") + tlv(2, b"\x05swp1") + tlv(3, b"\x00\x1e")
    assert parse_lldpdu(payload).chassis_id == "00:01:ff"


def test_text_tlvs_drop_a_trailing_nul_and_keep_the_first_of_repeats() -> None:
    payload = tlv(1, b"\x07sw") + tlv(2, b"\x05p1") + tlv(3, b"\x00\x1e")
    payload += tlv(5, b"leaf01\x00") + tlv(5, b"other") + tlv(4, b"")
    neighbor = parse_lldpdu(payload)
    assert (neighbor.system_name, neighbor.port_description) == ("leaf01", "")


def test_long_tlv_uses_the_ninth_length_bit() -> None:
    description = "x" * 300
    neighbor = Neighbor(
        "sw", lldp.CHASSIS_LOCAL, "p1", lldp.PORT_LOCAL, 30, None, None, description
    )
    frame = build_frame(SRC_MAC, neighbor)
    assert b"\x0d\x2c" + b"x" * 300 in frame  # type 6, length 0x12c
    assert parse_frame(frame).system_description == description


GOOD = tlv(1, b"\x07sw") + tlv(2, b"\x05p1") + tlv(3, b"\x00\x1e")


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", r"must start with chassis id, port id, ttl \[1, 2, 3\]; found \[\]"),
        (GOOD[:-1], r"TLV type 3 at offset 10: length 2 runs past the end \(1 bytes left\)"),
        (GOOD + b"\x0a", r"truncated TLV header at offset 14"),
        (GOOD + b"\x0a\x09leaf", r"TLV type 5 at offset 14: length 9 runs past the end"),
        (tlv(2, b"\x05p1") + tlv(1, b"\x07sw") + tlv(3, b"\x00\x1e"), r"found \[2, 1, 3\]"),
        (tlv(1, b"\x07sw") + tlv(2, b"\x05p1"), r"found \[1, 2\]"),
        (GOOD + tlv(1, b"\x07sw2"), "more than one chassis id, port id or ttl TLV"),
        (tlv(1, b"\x07") + GOOD[5:], r"chassis id: length 1, must be 2-256"),
        (tlv(1, b"\x04\x00\x01\x02\x03\x04") + GOOD[5:], "chassis id: MAC address of 5 bytes"),
        (tlv(1, b"\x05\x03\x0a\x00\x00\x01") + GOOD[5:], "network address family 3 with 4 bytes"),
        (GOOD[:5] + tlv(2, b"\x03" + bytes(7)) + GOOD[10:], "port id: MAC address of 7 bytes"),
        (GOOD[:10] + tlv(3, b"\x1e"), r"ttl TLV of 1 bytes, must be 2"),
    ],
)
def test_malformed_lldpdus_are_refused(payload: bytes, message: str) -> None:
    with pytest.raises(LldpError, match=message):
        parse_lldpdu(payload)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (ETH[:13], "frame of 13 bytes is shorter than an Ethernet header"),
        (ETH[:12] + b"\x08\x00" + GOOD, r"ethertype 0x0800 is not LLDP \(0x88cc\)"),
        (bytes.fromhex("525400990011") + ETH[6:] + GOOD, "destination 52:54:00:99:00:11 is not"),
    ],
)
def test_frames_that_are_not_lldp_are_refused(frame: bytes, message: str) -> None:
    with pytest.raises(LldpError, match=message):
        parse_frame(frame)


def test_all_three_lldp_group_addresses_are_accepted() -> None:
    for dst in ("0180c200000e", "0180c2000003", "0180c2000000"):
        assert parse_frame(bytes.fromhex(dst) + ETH[6:] + GOOD).port_id == "p1"


@pytest.mark.parametrize(
    ("neighbor", "message"),
    [
        (Neighbor("aa:bb", lldp.CHASSIS_MAC, "p", 5, 1), r"chassis id 'aa:bb' \(subtype 4\)"),
        (Neighbor("sw", 7, "10.0.0.300", 4, 1), r"port id '10.0.0.300' \(subtype 4\)"),
        (Neighbor("x" * 256, 7, "p", 5, 1), "1-255 bytes"),
        (Neighbor("sw", 7, "", 5, 1), "1-255 bytes"),
        (Neighbor("sw", 7, "p", 5, 65536), "ttl 65536 out of range"),
        (Neighbor("sw", 7, "p", 5, 1, other_tlvs=((3, b"\0\1"),)), "only types 7-127"),
        (Neighbor("sw", 7, "p", 5, 1, "n" * 512), "TLV type 5 with 512 bytes"),
    ],
)
def test_neighbors_that_cannot_be_encoded_are_refused(neighbor: Neighbor, message: str) -> None:
    with pytest.raises(LldpError, match=message):
        build_frame(SRC_MAC, neighbor)


def test_source_mac_must_be_six_bytes() -> None:
    with pytest.raises(LldpError, match="source MAC of 5 bytes"):
        build_frame(SRC_MAC[:5], Neighbor("sw", 7, "p", 5, 1))


def test_lldp_error_is_a_value_error() -> None:
    assert issubclass(LldpError, ValueError)


def test_codec_and_listener_import_only_the_standard_library() -> None:
    """The minOS agent imports both: nothing outside the stdlib may creep in."""
    src = Path(lldp.__file__).resolve().parents[2]
    code = (
        f"import sys; sys.path.insert(0, {str(src)!r}); import layerpy.agent.lldp; "
        "tops = {name.split('.')[0] for name in sys.modules}; "
        "print(sorted(tops - set(sys.stdlib_module_names) - {'__main__', 'layerpy'}))"
    )
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
