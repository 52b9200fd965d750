"""Fuzzing the LLDP codec the agent runs on whatever its NIC hears: any frame decodes or
raises LldpError, ids come out printable, and what it builds it reads back."""

from __future__ import annotations

import struct

from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.proto import lldp

from fuzzing import FUZZ, rarely


def tlv(tlv_type: int, value: bytes) -> bytes:
    return struct.pack("!H", tlv_type << 9 | min(len(value), 511)) + value


ids = st.one_of(
    st.tuples(st.sampled_from([4, 3]), st.binary(min_size=6, max_size=6)),  # MAC
    st.tuples(
        st.just(5),
        st.sampled_from([b"\x01\x0a\x63\x00\xfe", b"\x02" + bytes(16), b"\x01\x0a", b"\x07abc"]),
    ),
    st.tuples(
        st.integers(0, 255),
        st.one_of(st.sampled_from([b"swp3", b"\x1b[2J"]), st.binary(max_size=40)),
    ),
).map(lambda pair: bytes((pair[0],)) + pair[1])


@st.composite
def lldpdus(draw: st.DrawFn) -> bytes:
    """Chassis id, port id, ttl and optional TLVs, mostly in order, now and then shuffled,
    repeated, cut short or with a length that lies."""
    tlvs = [tlv(1, draw(ids)), tlv(2, draw(ids)), tlv(3, draw(st.binary(min_size=2, max_size=2)))]
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.one_of(st.sampled_from([4, 5, 6, 7, 8, 127]), st.integers(0, 127)))
        tlvs.append(tlv(kind, draw(st.binary(max_size=60))))
    if draw(rarely):
        tlvs = draw(st.permutations(tlvs))
    data = b"".join(tlvs) + (tlv(0, b"") if draw(st.booleans()) else b"")
    if draw(rarely):
        data = data[: draw(st.integers(0, len(data)))]
    if draw(rarely):
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=3)) + data[at + 1 :]
    return data


frames = st.builds(
    lambda destination, payload: destination + bytes(6) + b"\x88\xcc" + payload,
    st.one_of(*[st.sampled_from(lldp.LLDP_MULTICAST)] * 4, st.binary(min_size=6, max_size=6)),
    st.one_of(*[lldpdus()] * 4, st.binary(max_size=100)),
)


@FUZZ
@given(st.one_of(*[frames] * 4, st.binary(max_size=120)))
def test_frames_decode_or_raise_lldp_error(frame: bytes) -> None:
    try:
        neighbor = lldp.parse_frame(frame)
    except lldp.LldpError:
        event("refused")
        return
    event("decoded")
    assert neighbor.chassis_id.isprintable() and neighbor.port_id.isprintable()
    assert 0 <= neighbor.ttl <= 0xFFFF


neighbors = st.builds(
    lldp.Neighbor,
    chassis_id=st.one_of(st.just("44:38:9c:00:0a:01"), st.text(min_size=1, max_size=30)),
    chassis_subtype=st.sampled_from([7, 4, 5, 0]),
    port_id=st.one_of(st.just("swp3"), st.just("10.99.0.254"), st.text(min_size=1, max_size=30)),
    port_subtype=st.sampled_from([5, 7, 3, 4]),
    ttl=st.one_of(*[st.integers(0, 0xFFFF)] * 5, st.sampled_from([-1, 0x10000])),
    system_name=st.one_of(st.none(), st.text(max_size=30)),
    port_description=st.one_of(st.none(), st.text(max_size=30)),
    other_tlvs=st.lists(st.tuples(st.integers(7, 127), st.binary(max_size=20)), max_size=2).map(
        tuple
    ),
)


@FUZZ
@given(neighbors)
def test_built_frames_read_back(neighbor: lldp.Neighbor) -> None:
    """Build refuses with LldpError or makes a frame that parses to the same ids."""
    try:
        frame = lldp.build_frame(bytes(6), neighbor)
    except lldp.LldpError:
        event("refused")
        return
    event("built")
    read = lldp.parse_frame(frame)
    assert (read.chassis_subtype, read.port_subtype, read.ttl) == (
        neighbor.chassis_subtype,
        neighbor.port_subtype,
        neighbor.ttl,
    )
    if neighbor.port_id.isprintable() and "\0" not in neighbor.port_id:
        assert read.port_id == neighbor.port_id
