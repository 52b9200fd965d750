"""Fuzzing what a Raspberry Pi (or anyone playing one) sends: option 97 of any bytes, and
any TFTP name through the Pi path policy, which never lets a name out of its map."""

from __future__ import annotations

from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.proto import dhcp, rpi

from fuzzing import FUZZ

guids = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda tail: b"\x00RPi4" + tail, st.binary(min_size=10, max_size=14)),
    st.builds(lambda word: b"\x00" + word * 4, st.binary(min_size=4, max_size=4)),
)
names = st.one_of(
    st.sampled_from(["9ffefdef/start4.elf", "9ffefdef/../x", "/9ffefdef//config.txt",
                     "overlays/a/b.dtbo", "..", ".", "a\0b", "dc-a6-32-01-36-c2/x", "x" * 300]),
    st.text(max_size=80),
    st.lists(st.sampled_from(["9ffefdef", "..", ".", "", "overlays", "a.dtb", "\udcff"]),
             max_size=5).map("/".join),
)  # fmt: skip


@FUZZ
@given(guids)
def test_option_97_is_a_pi_or_not(value: bytes) -> None:
    packet = dhcp.DhcpPacket(
        1, 1, 6, 0, 1, 0, 0, dhcp.ANY, dhcp.ANY, dhcp.ANY, dhcp.ANY, bytes(16), bytes(64),
        bytes(128), {dhcp.OPT_MESSAGE_TYPE: b"\x01", dhcp.OPT_UUID: value},
    )  # fmt: skip
    found = packet.rpi_guid
    event("pi" if found else "not a pi")
    if found is not None:
        model, serial = found
        assert model in (None, "RPi4", "RPi5") and len(serial) == 8
        int(serial, 16)


@FUZZ
@given(names)
def test_a_pi_path_stays_in_its_map(name: str) -> None:
    parsed = rpi.parse_path(name)
    event("pi path" if parsed else "refused")
    if parsed is None:
        return
    parts = parsed.name.split("/")
    assert 1 <= len(parts) <= 2
    assert all(part and part not in (".", "..") and not part.startswith(".") for part in parts)
    assert all(c.isascii() and (c.isalnum() or c in "._+-") for c in parsed.name.replace("/", ""))
