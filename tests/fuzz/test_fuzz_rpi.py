"""Fuzzing what a Raspberry Pi (or anyone playing one) sends: option 97 of any bytes, and
any TFTP name through the Pi path policy and the boot policy's TFTP lookup, which never
let a name out of the Pi's map nor give anything to another address."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.boot import Refused
from layerpy.config import load
from layerpy.proto import dhcp, rpi

from fuzzing import FUZZ, SERVER
from nodefile import BOOT_SECTIONS, write_boot_files
from stores import local_policy

guids = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda tail: b"\x00RPi4" + tail, st.binary(min_size=10, max_size=14)),
    st.builds(lambda word: b"\x00" + word * 4, st.binary(min_size=4, max_size=4)),
)
names = st.one_of(
    st.sampled_from(["9ffefdef/start4.elf", "9ffefdef/../x", "/9ffefdef//config.txt",
                     "9ffefdef/overlays/x.dtbo", "../secret.txt", "9ffefdef/../../secret.txt",
                     "9ffefdef/minos.kernel", "cmdline.txt", "01020304/config.txt",
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


@pytest.fixture(scope="module")
def pi_policy(tmp_path_factory):
    """A boot policy whose node file has [rpi] and pi01 (10.99.0.31, by serial) beside the
    group's PCs (10.99.0.11, 10.99.0.12)."""
    directory = tmp_path_factory.mktemp("fuzz-rpi")
    write_boot_files(directory)
    (directory / "rpi" / "overlays").mkdir(parents=True)
    for name in ("start4.elf", "fixup4.dat", "overlays/x.dtbo"):
        (directory / "rpi" / name).write_bytes(b"firmware")
    (directory / "secret.txt").write_text("not for any Pi")
    (directory / "nodes.toml").write_text(
        f'[server]\ninterface = "br0"\naddress = "{SERVER}"\nstate_dir = "state"\n\n'
        '[network]\nsubnet = "10.99.0.0/24"\n\n' + BOOT_SECTIONS + '\n[rpi]\ndir = "rpi"\n'
        'kernel = "vmlinuz"\ninitrd = "initrd"\n\n[groups.compute]\nnodes = "cn[001-002]"\n'
        'ip = "10.99.0.[11-12]"\n\n[nodes.pi01]\nip = "10.99.0.31"\nserial = "9ffefdef"\n'
    )
    return local_policy(load(directory / "nodes.toml"))


@FUZZ
@given(names, st.sampled_from(["10.99.0.31", "10.99.0.11", "10.99.0.99", "::1", ""]))
def test_a_pi_file_is_the_map_s_or_nothing(pi_policy, name: str, remote: str) -> None:
    """Whatever is asked from wherever: nothing (None: the TFTP root's business), not found,
    a file written for the node, or a file inside [rpi] dir or the minOS's; only pi01's
    address ever gets anything."""
    try:
        found = asyncio.run(pi_policy.loader_file(name, remote))
    except FileNotFoundError:
        event("not found")
        assert remote == "10.99.0.31"
        return
    except Refused:  # a command line while no boot of its waits for one
        event("refused")
        assert remote == "10.99.0.31"
        return
    event(type(found).__name__)
    if found is None:
        return
    assert remote == "10.99.0.31"
    if isinstance(found, Path):
        settings = pi_policy.config.rpi
        assert found in (settings.kernel, settings.initrd) or (
            found.resolve().is_relative_to(settings.directory.resolve()) and found.is_file()
        )
