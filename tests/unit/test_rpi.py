"""Raspberry Pi 4/5 network boot, sans I/O: its option 97, the OFFER and ACK it needs, how a
Pi is known (MAC or serial), the node file's [rpi] and serial, and the TFTP file map with
its one token per boot (docs/hardware.md)."""

from __future__ import annotations

import asyncio
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from layerpy import boot, bundle
from layerpy.boot import Refused, firmware_of, phase_of
from layerpy.config import ConfigError, load
from layerpy.model import Phase
from layerpy.proto import dhcp
from layerpy.proto.agent import Cmdline
from layerpy.proto.rpi import parse_path
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

from dhcp_requests import BIOS, KNOWN, SERVER, STRANGER, request
from stores import local_policy

SERIAL = "9ffefdef"
PI_MAC = "dc:a6:32:01:36:c2"
PI_IP = "10.99.0.31"
# option 60 and 93 as a Pi 4 bootloader sends them: a BIOS PXE ROM's (rpi-eeprom issue 182)
PI_CLASS = {"o60": b"PXEClient:Arch:00000:UNDI:002001", "o93": b"\x00\x00", "o94": b"\x01\x02\x01"}
# dnsmasq's option 43 for pxe-service=0,"Raspberry Pi Boot", as the Pi documentation's capture
DOCUMENTED_43 = bytes([6, 1, 3, 10, 4, 0, 80, 88, 69, 9, 20, 0, 0, 17, *b"Raspberry Pi Boot", 255])


def guid(serial: str, model: bytes = b"RPi4", revision: int = 0x00C03111) -> bytes:
    """Option 97 as a Pi 4/5 bootloader sends it: type 0, FourCC, board revision, MAC low
    bytes, serial (little-endian words)."""
    words = (revision.to_bytes(4, "little"), bytes.fromhex("320136c2"))
    return b"\x00" + model + b"".join(words) + int(serial, 16).to_bytes(4, "little")


def old_guid(serial: str) -> bytes:
    """The old format (DHCP_OPTION97=0): the serial four times."""
    return b"\x00" + int(serial, 16).to_bytes(4, "little") * 4


def pi_discover(mac: str = PI_MAC, serial: str = SERIAL, **more: bytes) -> dhcp.DhcpPacket:
    return request(dhcp.DISCOVER, mac, **PI_CLASS, o97=guid(serial), **more)


def pi_request(mac: str = PI_MAC, serial: str = SERIAL) -> dhcp.DhcpPacket:
    """The Pi's REQUEST: no option 60 (rpi-eeprom issue 82), its GUID still there."""
    return request(
        dhcp.REQUEST, mac, o93=b"\x00\x00", o97=guid(serial), o54=SERVER.packed,
        o50=IPv4Address(PI_IP).packed,
    )  # fmt: skip


RPI = """
[rpi]
dir = "rpi"
kernel = "vmlinuz"
initrd = "initrd"
cmdline = "console=ttyS1,115200"
config = "dtoverlay=disable-bt"

[nodes.pi01]
ip = "10.99.0.31"
serial = "9ffefdef"
"""


@pytest.fixture
def pi_config(make_config, tmp_path: Path):
    firmware = tmp_path / "rpi"
    (firmware / "overlays").mkdir(parents=True)
    (firmware / "start4.elf").write_bytes(b"\x7fELF" * 1000)
    (firmware / "fixup4.dat").write_bytes(b"fixup" * 100)
    (firmware / "bcm2711-rpi-4-b.dtb").write_bytes(b"\xd0\x0d\xfe\xed" * 100)
    (firmware / "overlays" / "disable-bt.dtbo").write_bytes(b"\xd0\x0d\xfe\xed")
    return make_config(rpi=RPI)


@pytest.fixture
def service(pi_config) -> DhcpService:
    return DhcpService(local_policy(pi_config), SERVER, Stats(), log_requests=False)


def answer(service: DhcpService, packet: dhcp.DhcpPacket) -> dhcp.DhcpPacket | None:
    return service.handle(packet, ("0.0.0.0", 68))[1].reply


def fetch(service: DhcpService, remote: str, path: str):
    return asyncio.run(service.booter.loader_file(path, remote))


# -- option 97 and option 43 ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (guid("9ffefdef"), ("RPi4", "9ffefdef")),
        (guid("0123abcd", b"RPi5", 0x00D04170), ("RPi5", "0123abcd")),
        (old_guid("a2ef5644"), (None, "a2ef5644")),
        (bytes.fromhex("0044564ea244564ea244564ea244564ea3"), None),  # words differ
        (b"\x00" + bytes(range(16)), None),  # a PC's UUID
        (b"\x01" + b"RPi4" + bytes(12), None),  # not type 0
        (guid("9ffefdef")[:-1], None),  # short
    ],
)
def test_option_97(value: bytes, expected) -> None:
    assert request(dhcp.DISCOVER, o97=value).rpi_guid == expected


def test_old_guid_byte_order_is_the_captured_one() -> None:
    """raspberrypi/firmware issue 1362: option 97 44:56:ef:a2 x4, directory a2ef5644/."""
    value = bytes.fromhex("00" + "4456efa2" * 4)
    assert request(dhcp.DISCOVER, o97=value).rpi_guid == (None, "a2ef5644")


def test_option_43_is_the_documented_menu() -> None:
    assert dhcp.pxe_boot_menu("Raspberry Pi Boot") == DOCUMENTED_43


def test_a_pi_is_told_from_a_bios_by_option_97() -> None:
    assert firmware_of(pi_discover()) == "rpi"
    assert firmware_of(pi_request()) == "rpi"  # without option 60
    assert firmware_of(request(dhcp.DISCOVER, **PI_CLASS)) == "bios"
    assert firmware_of(request(dhcp.DISCOVER, **PI_CLASS, o97=old_guid(SERIAL))) == "bios"


# -- DHCP -----------------------------------------------------------------------------------


def check_pi_answer(reply: dhcp.DhcpPacket | None, kind: int) -> None:
    assert reply is not None and reply.message_type == kind
    assert reply.yiaddr == IPv4Address(PI_IP)
    assert reply.options[dhcp.OPT_VENDOR_SPECIFIC] == DOCUMENTED_43
    assert reply.options[dhcp.OPT_VENDOR_CLASS] == b"PXEClient"
    assert reply.options[dhcp.OPT_TFTP_SERVER] == b"10.99.0.1"
    assert reply.siaddr == SERVER
    assert dhcp.OPT_BOOTFILE not in reply.options
    assert reply.options[dhcp.OPT_HOSTNAME] == b"pi01"


def test_a_pi_known_by_serial_gets_its_address_and_the_pi_options(service) -> None:
    check_pi_answer(answer(service, pi_discover()), dhcp.OFFER)
    node = service.booter.nodes.nodes["pi01"]
    assert node.boot is not None and node.boot.firmware == "rpi"
    assert node.mac == PI_MAC
    check_pi_answer(answer(service, pi_request()), dhcp.ACK)
    assert Phase.DHCP_ACK in node.boot.phases


def test_a_pi_known_by_mac_is_answered_so_too(make_config, pi_config) -> None:
    config = make_config(rpi=RPI.replace('serial = "9ffefdef"', f'mac = "{PI_MAC}"'))
    service = DhcpService(local_policy(config), SERVER, Stats(), log_requests=False)
    check_pi_answer(answer(service, pi_discover(serial="01020304")), dhcp.OFFER)


def test_old_guid_is_a_pi_only_with_the_nodes_serial(make_config, pi_config) -> None:
    config = make_config(rpi=RPI.replace('serial = "9ffefdef"', f'mac = "{PI_MAC}"\n{""}')
                         + f'serial = "{SERIAL}"\n')  # fmt: skip
    service = DhcpService(local_policy(config), SERVER, Stats(), log_requests=False)
    discover = request(dhcp.DISCOVER, PI_MAC, **PI_CLASS, o97=old_guid(SERIAL))
    check_pi_answer(answer(service, discover), dhcp.OFFER)
    # a BIOS node whose UUID happens to repeat is still a BIOS
    bios = request(dhcp.DISCOVER, KNOWN, **BIOS, o97=old_guid("11223344"))
    assert answer(service, bios).options[dhcp.OPT_BOOTFILE] == b"undionly.kpxe"


def test_an_unknown_pi_gets_nothing(service) -> None:
    assert answer(service, pi_discover(mac=STRANGER, serial="01020304")) is None


def test_without_rpi_a_pi_gets_nothing(make_config) -> None:
    config = make_config(pi='\n[nodes.pi01]\nip = "10.99.0.31"\nserial = "9ffefdef"\n')
    service = DhcpService(local_policy(config), SERVER, Stats(), log_requests=False)
    assert answer(service, pi_discover()) is None


# -- TFTP file map --------------------------------------------------------------------------


def test_the_pi_files(service, pi_config) -> None:
    answer(service, pi_discover())
    config_txt = fetch(service, PI_IP, f"{SERIAL}/config.txt").decode()
    assert "arm_64bit=1\n" in config_txt and "kernel=minos.kernel\n" in config_txt
    assert "initramfs minos.initrd followkernel\n" in config_txt
    assert config_txt.endswith("dtoverlay=disable-bt\n")
    assert fetch(service, PI_IP, "config.txt").decode() == config_txt  # prefix dropped
    firmware = pi_config.rpi.directory
    assert fetch(service, PI_IP, f"{SERIAL}/start4.elf") == firmware / "start4.elf"
    assert fetch(service, PI_IP, f"/{SERIAL}/overlays/disable-bt.dtbo") == (
        firmware / "overlays" / "disable-bt.dtbo"
    )
    assert fetch(service, PI_IP, f"{SERIAL}/minos.kernel") == pi_config.rpi.kernel
    assert fetch(service, PI_IP, f"{SERIAL}/minos.initrd") == pi_config.rpi.initrd
    # TFTP marks a file's phase once it was sent, as for every file
    names = [f"{SERIAL}/minos.kernel", "minos.initrd", f"{SERIAL}/start4.elf", "9ffefdef/x"]
    assert [phase_of(name) for name in names] == [
        Phase.KERNEL, Phase.INITRD, Phase.TFTP, Phase.TFTP,
    ]  # fmt: skip


def test_cmdline_carries_the_ipxe_paths_words_and_one_token_a_boot(service) -> None:
    policy = service.booter
    answer(service, pi_discover())
    first = fetch(service, PI_IP, f"{SERIAL}/cmdline.txt").decode()
    assert first.endswith("console=ttyS1,115200\n")
    assert first.startswith("console=ttyS0 layerpy.server=")  # [minos] cmdline first
    words = Cmdline.parse(first)
    assert (words.node, words.server, words.bootif) == ("pi01", policy.base_url, PI_MAC)
    assert policy.holds_token("pi01", words.token)
    # the probe, the read and start4.elf's second read: the same text, the token still good
    assert fetch(service, PI_IP, f"{SERIAL}/cmdline.txt").decode() == first
    assert fetch(service, PI_IP, "cmdline.txt").decode() == first
    assert policy.holds_token("pi01", words.token)
    # the iPXE script's kernel line carries the same words (one source), its own token
    script = asyncio.run(policy.script("pi01", PI_IP))
    kernel_line = next(line for line in script.splitlines() if line.startswith("kernel "))
    assert Cmdline.parse(kernel_line).node == "pi01"
    # a new boot (DISCOVER) issues a new token
    answer(service, pi_discover())
    again = Cmdline.parse(fetch(service, PI_IP, "cmdline.txt").decode())
    assert again.token != words.token and policy.holds_token("pi01", again.token)
    assert not policy.holds_token("pi01", words.token)


def test_a_cmdline_txt_read_while_no_boot_waits_is_refused(service) -> None:
    """A forged TFTP read from the Pi's address, before any boot or once its agent runs
    (its cmdline.txt kept no longer), issues no token and starts no boot."""
    policy = service.booter
    with pytest.raises(Refused):
        fetch(service, PI_IP, "cmdline.txt")
    assert policy.nodes.nodes["pi01"].boot is None
    answer(service, pi_discover())
    token = Cmdline.parse(fetch(service, PI_IP, "cmdline.txt").decode()).token
    policy._cmdlines.clear()  # CMDLINE_KEEP seconds later
    with pytest.raises(Refused):
        fetch(service, PI_IP, "cmdline.txt")
    assert policy.holds_token("pi01", token) and policy.nodes.nodes["pi01"].boots == 1


@pytest.mark.parametrize(
    "path",
    [
        "../nodes.toml",
        f"{SERIAL}/../nodes.toml",
        f"{SERIAL}/overlays/../start4.elf",
        "01020304/config.txt",  # another Pi's directory
        f"{SERIAL}/a/b/c",
        f"{SERIAL}/.hidden",
        f"{SERIAL}/missing.dtb",
        "start4.elf\0.txt",
        "x" * 200,
        f"{SERIAL}/con fig.txt",
        "",
    ],
)
def test_a_pis_path_outside_the_map_is_not_found(service, path: str) -> None:
    answer(service, pi_discover())
    with pytest.raises(FileNotFoundError):
        fetch(service, PI_IP, path)


def test_mac_prefix_is_the_pis_own(service) -> None:
    answer(service, pi_discover())
    assert fetch(service, PI_IP, "dc-a6-32-01-36-c2/fixup4.dat").name == "fixup4.dat"
    with pytest.raises(FileNotFoundError):
        fetch(service, PI_IP, "dc-a6-32-01-36-c3/fixup4.dat")


def test_no_pi_file_for_other_addresses_or_x86_nodes(service) -> None:
    answer(service, pi_discover())
    assert fetch(service, "10.99.0.99", f"{SERIAL}/cmdline.txt") is None  # nobody's
    assert fetch(service, "10.99.0.11", f"{SERIAL}/cmdline.txt") is None  # cn001, a PC
    assert fetch(service, "10.99.0.11", "undionly.kpxe") is None  # its iPXE, from the root


@pytest.mark.parametrize(
    ("path", "prefix", "name"),
    [
        ("9ffefdef/start4.elf", "9ffefdef", "start4.elf"),
        ("/9ffefdef/overlays/vc4-kms-v3d.dtbo", "9ffefdef", "overlays/vc4-kms-v3d.dtbo"),
        ("config.txt", None, "config.txt"),
        ("overlays/overlay_map.dtb", None, "overlays/overlay_map.dtb"),
        ("dc-a6-32-01-36-c2/config.txt", "dc-a6-32-01-36-c2", "config.txt"),
    ],
)
def test_parse_path(path: str, prefix: str | None, name: str) -> None:
    parsed = parse_path(path)
    assert parsed is not None and (parsed.prefix, parsed.name) == (prefix, name)


# -- the node file --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tables", "problem"),
    [
        ('\n[nodes.pi02]\nip = "10.99.0.32"\nserial = "9FFEFDEG"\n', "not a Raspberry Pi serial"),
        ('\n[nodes.pi02]\nip = "10.99.0.32"\nserial = "1000000abcd1234"\n', "not a Raspberry"),
        ('\n[nodes.pi02]\nip = "10.99.0.32"\nserial = "100000009ffefdef"\n', "already used by pi01"),
        ('\n[nodes.pi02]\nip = "10.99.0.32"\nserial = "9ffefdef"\n', "already used by pi01"),
        ('\n[groups.pis]\nnodes = "p[1-2]"\nip = "10.99.0.[41-42]"\nserial = ["00000001"]\n',
         "has 1 entries for 2 nodes"),
        ("\n[rpi]\n", "rpi.kernel"),  # no kernel named, and no arm64 minOS to default to
    ],
)  # fmt: skip
def test_node_file_problems(make_config, pi_config, monkeypatch, tables: str, problem: str) -> None:
    text = pi_config.path.read_text()
    if tables.startswith("\n[rpi]"):
        text = text.replace('[rpi]\ndir = "rpi"\nkernel = "vmlinuz"\n', '[rpi]\ndir = "rpi"\n')
        text = text.replace(
            '[minos.arm64]\nkernel = "vmlinuz-arm64"\ninitrd = "initrd-arm64"\n', ""
        )
        monkeypatch.setattr(bundle, "minos", lambda arch="amd64": None)
        tables = ""
    pi_config.path.write_text(text + tables)
    with pytest.raises(ConfigError) as raised:
        load(pi_config.path)
    assert problem in raised.value.render()


def test_a_group_of_pis(pi_config) -> None:
    text = pi_config.path.read_text() + (
        '\n[groups.pis]\nnodes = "p[1-2]"\nip = "10.99.0.[41-42]"\n'
        'serial = ["0000000A", "0000000b"]\n'
    )
    pi_config.path.write_text(text)
    config = load(pi_config.path)
    assert config.serials == {"9ffefdef": "pi01", "0000000a": "p1", "0000000b": "p2"}


def test_rpi_dir_by_default(pi_config, monkeypatch) -> None:
    """No `dir`: the set-up script's directory, checked as if it were written."""
    text = pi_config.path.read_text().replace('[rpi]\ndir = "rpi"\n', "[rpi]\n")
    pi_config.path.write_text(text)
    monkeypatch.setattr(bundle, "rpi_dir", lambda: pi_config.rpi.directory)
    assert load(pi_config.path).rpi.directory == pi_config.rpi.directory
    monkeypatch.setattr(bundle, "rpi_dir", lambda: pi_config.path.parent / "none")
    with pytest.raises(ConfigError, match=r"rpi\.dir: \(default\) .*none has no start4"):
        load(pi_config.path)


def test_rpi_dir_without_firmware_is_refused(pi_config) -> None:
    (pi_config.rpi.directory / "start4.elf").unlink()
    with pytest.raises(ConfigError, match=r"has no start4\.elf"):
        load(pi_config.path)


def test_proxy_mode_gives_a_pi_the_boot_options_and_no_address(make_config, pi_config) -> None:
    """Beside a site's DHCP server (dnsmasq's proxy mode in the Pi's own tutorial): the OFFER
    names no address, carries option 43, 60 and siaddr; TFTP then goes by the node's `ip`,
    the site's reservation (a Pi does not ask on port 4011)."""
    text = pi_config.path.read_text().replace("heartbeat = 2\n", 'heartbeat = 2\ndhcp = "proxy"\n')
    text = text.replace('pool = "10.99.0.200-10.99.0.250"\n', "")
    pi_config.path.write_text(text)
    policy = local_policy(load(pi_config.path))
    service = DhcpService(policy, SERVER, Stats(), log_requests=False, port=67, proxy=True)
    offer = service.handle(pi_discover(), ("0.0.0.0", 68))[1].reply
    assert offer is not None and offer.yiaddr == IPv4Address(0)
    assert offer.options[dhcp.OPT_VENDOR_SPECIFIC] == DOCUMENTED_43
    assert offer.options[dhcp.OPT_VENDOR_CLASS] == b"PXEClient" and offer.siaddr == SERVER
    assert b"layerpy.node=pi01" in fetch(service, PI_IP, f"{SERIAL}/cmdline.txt")


def test_an_unknown_pi_boots_the_discovery_minos_from_the_pool(pi_config) -> None:
    """With network.discover, an unknown Pi gets a pool address and the Pi options, then
    the minOS with a discovery token, only at that address (as an unknown PC through iPXE)."""
    text = pi_config.path.read_text().replace('pool = "', 'discover = true\npool = "', 1)
    pi_config.path.write_text(text)
    service = DhcpService(local_policy(load(pi_config.path)), SERVER, Stats(), log_requests=False)
    offer = answer(service, pi_discover(mac=STRANGER, serial="01020304"))
    assert offer is not None and offer.options[dhcp.OPT_VENDOR_SPECIFIC] == DOCUMENTED_43
    pooled = str(offer.yiaddr)
    assert pooled.startswith("10.99.0.2")
    policy = service.booter
    assert policy.nodes.unknown.get(STRANGER).firmware == "rpi"
    text = fetch(service, pooled, "01020304/cmdline.txt").decode()
    words = Cmdline.parse(text)
    assert words.node == "discover" and words.bootif == STRANGER
    assert policy.nodes.unknown.check_token(STRANGER, words.token) is not None
    assert fetch(service, pooled, "cmdline.txt").decode() == text  # one token a boot
    assert b"kernel=minos.kernel" in fetch(service, pooled, "config.txt")
    assert fetch(service, "10.99.0.201", "cmdline.txt") is None  # no machine holds it
    # an unknown PC in the pool gets no Pi files (its iPXE binary comes from the root)
    answer(service, request(dhcp.DISCOVER, "52:54:00:00:00:02", **BIOS))
    pc = str(policy.discovery_address("52:54:00:00:00:02"))
    assert fetch(service, pc, "cmdline.txt") is None


def test_without_kernel_and_initrd_pis_boot_the_arm64_minos(pi_config) -> None:
    rpi = '[rpi]\ndir = "rpi"\n'
    text = pi_config.path.read_text().replace(rpi + 'kernel = "vmlinuz"\ninitrd = "initrd"\n', rpi)
    pi_config.path.write_text(text)
    config = load(pi_config.path)
    assert (config.rpi.kernel, config.rpi.initrd) == config.minos.files("arm64")
    assert config.rpi.kernel.name == "vmlinuz-arm64"


def test_a_link_in_the_firmware_directory_to_elsewhere_is_not_served(service, pi_config) -> None:
    (pi_config.rpi.directory / "leak.dtb").symlink_to("/etc/passwd")
    (pi_config.rpi.directory / "fine.dtb").symlink_to(pi_config.rpi.directory / "fixup4.dat")
    with pytest.raises(FileNotFoundError):
        fetch(service, PI_IP, f"{SERIAL}/leak.dtb")
    assert fetch(service, PI_IP, f"{SERIAL}/fine.dtb").name == "fixup4.dat"


def test_a_pi_of_a_secure_boot_node_gets_no_pi_path(pi_config, caplog) -> None:
    """A Pi's bootloader checks no signature: a node with secure_boot = true is only ever
    given the signed path, which a Pi cannot run, so it gets nothing, and the log says why."""
    text = pi_config.path.read_text().replace(
        'serial = "9ffefdef"\n', 'serial = "9ffefdef"\nsecure_boot = true\n'
    )
    pi_config.path.write_text(text)
    secure = DhcpService(local_policy(load(pi_config.path)), SERVER, Stats(), log_requests=False)
    boot.quiet.end("unbootable firmware")  # refusals are logged a few a minute: a fresh window
    with caplog.at_level("WARNING", "layerpy.dhcp"):
        assert answer(secure, pi_discover()) is None
    assert "verifies nothing, and the node has secure_boot = true" in caplog.text
