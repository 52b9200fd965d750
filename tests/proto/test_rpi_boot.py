"""A Raspberry Pi 4's network boot against a real ``layerpy serve``: the bootloader's
sequence played packet by packet (tests/rpi_player.py) from a namespace of its own, then
real TFTP clients (tftp-hpa, curl) from the Pi's address, then the agent's hello with the
token cmdline.txt carried (docs/hardware.md)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerpy.client import Client
from layerpy.proto.agent import PROTOCOL, Cmdline
from layerpy.proto.dhcp import pxe_boot_menu

LAYERPY = Path(sys.executable).parent / "layerpy"
PLAYER = Path(__file__).parent.parent / "rpi_player.py"
SERVER, PI_IP, STRANGER = "10.77.0.1", "10.77.0.31", "10.77.0.99"
SERIAL = "9ffefdef"
BASE = f"http://{SERVER}:8080"
RPI = f"""
[rpi]
dir = "rpi"
kernel = "vmlinuz"
initrd = "initrd"
cmdline = "console=ttyS1,115200"

[nodes.pi01]
ip = "{PI_IP}"
serial = "{SERIAL}"
"""
FIRMWARE = {"start4.elf": b"\x7fELF" * 700_000, "fixup4.dat": b"fixup" * 1100,
            "bcm2711-rpi-4-b.dtb": b"\xd0\x0d\xfe\xed" * 7000}  # fmt: skip

pytestmark = pytest.mark.netns


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def pi_server(link, make_config, tmp_path: Path):
    """`layerpy serve` in the server namespace with [rpi] and node pi01 known by its serial
    alone (the client namespace's MAC is nobody's in the file)."""
    (tmp_path / "rpi").mkdir()
    for name, data in FIRMWARE.items():
        (tmp_path / "rpi" / name).write_bytes(data)
    config = make_config(interface=link.server_if, server=SERVER, rpi=RPI)
    text = config.path.read_text().replace("[server]\n", "[server]\ndhcp_probe = 0.5\n")
    config.path.write_text(text)
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        server = link.server.popen([str(LAYERPY), "serve", "-c", str(config.path), "--debug"],
                                   stdout=log, stderr=log)  # fmt: skip
    deadline = time.monotonic() + 30
    while "layerpy.server: serving" not in log_path.read_text(errors="replace"):
        assert server.poll() is None, f"serve exited:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"serve not up in 30 s:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.1)
    return log_path


def play(link, tmp_path: Path, *options: str) -> dict:
    """The Pi's boot, played in the client namespace; its JSON record."""
    command = [sys.executable, str(PLAYER), link.client_if, link.client_mac(), SERIAL, *options]
    try:
        result = link.client.run(*command, timeout=120)
    except subprocess.CalledProcessError as failed:
        raise AssertionError(
            f"the player failed: {failed.stderr}\n{(tmp_path / 'serve.log').read_text()[-4000:]}"
        ) from None
    return json.loads(result.stdout)


def outcomes(record: dict) -> list[tuple[str, bool, str]]:
    """(name, probe, "ok" or the error) of every TFTP request, in order."""
    return [(f["name"], f["probe"], f.get("error", "ok")) for f in record["files"]]


def read(record: dict, name: str) -> dict:
    """The last full read of `name`."""
    return [f for f in record["files"] if f["name"] == name and not f["probe"]][-1]


def test_a_pi_boots_through_layerpy(link, pi_server, tmp_path: Path) -> None:
    record = play(link, tmp_path)
    menu, server_hex = pxe_boot_menu("Raspberry Pi Boot").hex(), SERVER.encode().hex()
    for reply in (record["offer"], record["ack"]):  # what the bootloader needs, in both
        assert reply["yiaddr"] == PI_IP and reply["siaddr"] == SERVER
        options = reply["options"]
        assert options["43"] == menu and options["66"] == server_hex
        assert bytes.fromhex(options["60"]) == b"PXEClient"
        assert bytes.fromhex(options["12"]) == b"pi01"
        assert "67" not in options
    assert record["tftp_server"] == SERVER

    p = f"{SERIAL}/"
    nf = "file not found"
    assert outcomes(record) == [
        (p + "start4.elf", True, "ok"),
        (p + "config.txt", False, "ok"),
        (p + "pieeprom.sig", False, nf),
        (p + "recover4.elf", False, nf),
        (p + "start4.elf", False, "ok"),
        (p + "fixup4.dat", False, "ok"),
        (p + "config.txt", False, "ok"),
        (p + "dt-blob.bin", False, nf),
        (p + "bootcfg.txt", False, nf),
        (p + "bcm2711-rpi-4-b.dtb", True, "ok"),
        (p + "bcm2711-rpi-4-b.dtb", False, "ok"),
        (p + "overlays/overlay_map.dtb", False, nf),
        (p + "config.txt", False, "ok"),
        (p + "cmdline.txt", True, "ok"),
        (p + "cmdline.txt", False, "ok"),
        (p + "minos.kernel", True, "ok"),
        (p + "minos.kernel", False, "ok"),
        (p + "minos.initrd", True, "ok"),
        (p + "minos.initrd", False, "ok"),
    ]
    probe = record["files"][0]
    assert probe["tsize"] == len(FIRMWARE["start4.elf"])
    for name, data in FIRMWARE.items():
        assert read(record, p + name)["sha256"] == digest(data)
    kernel, initrd = (tmp_path / "vmlinuz").read_bytes(), (tmp_path / "initrd").read_bytes()
    assert read(record, p + "minos.kernel")["sha256"] == digest(kernel)
    assert read(record, p + "minos.initrd")["sha256"] == digest(initrd)
    config_txt = read(record, p + "config.txt")["text"]
    assert "arm_64bit=1\n" in config_txt and "kernel=minos.kernel\n" in config_txt

    # cmdline.txt: the iPXE path's words; the probe announced its true size (same token)
    cmdline_read = read(record, p + "cmdline.txt")
    text = cmdline_read["text"]
    assert record["files"][13]["tsize"] == cmdline_read["size"]
    assert text.startswith("console=ttyS0 layerpy.server=") and text.endswith("ttyS1,115200\n")
    words = Cmdline.parse(text)
    assert (words.node, words.server) == ("pi01", BASE)
    assert words.bootif == link.client_mac() and words.token

    # real TFTP clients from the Pi's address get the same files, the same token this boot
    got = tmp_path / "got"
    link.client.run("tftp", SERVER, "-m", "binary", "-c", "get", p + "cmdline.txt", str(got))
    assert got.read_text() == text
    fixup = link.client.run("curl", "-sS", "--interface", PI_IP, f"tftp://{SERVER}/{p}fixup4.dat")
    assert fixup.stdout.encode() == FIRMWARE["fixup4.dat"]
    link.client.run("atftp", "-g", "-r", p + "config.txt", "-l", str(got), SERVER)
    assert got.read_text() == config_txt

    # nothing for other addresses, other Pis' directories, or names outside the map
    link.client.run("ip", "addr", "add", f"{STRANGER}/24", "dev", link.client_if)
    for source, name in ((STRANGER, p + "cmdline.txt"), (PI_IP, "01020304/cmdline.txt"),
                         (PI_IP, p + "nodes.toml"), (PI_IP, p + "overlays/../cmdline.txt")):  # fmt: skip
        refused = link.client.run("curl", "-sS", "--path-as-is", "--interface", source,
                                  f"tftp://{SERVER}/{name}", check=False)  # fmt: skip
        assert refused.returncode != 0 and not refused.stdout, (source, name, refused)

    # the token is good for the agent's hello, as after the iPXE path
    hello = {"node": "pi01", "token": words.token, "mac": link.client_mac(), "ip": PI_IP,
             "boot_id": "b1", "seq": 1, "event": "hello", "busy": False, "protocol": PROTOCOL}  # fmt: skip
    answer = link.client.run("curl", "-sS", "--interface", PI_IP, "-w", "\n%{http_code}",
                             "-H", "Content-Type: application/json", "--data", json.dumps(hello),
                             f"{BASE}/api/v1/agent/report")  # fmt: skip
    body, _, code = answer.stdout.rpartition("\n")
    assert code == "200", body
    forged = dict(hello, token="x" * len(words.token))
    answer = link.client.run("curl", "-sS", "--interface", PI_IP, "-o", "/dev/null", "-w",
                             "%{http_code}", "-H", "Content-Type: application/json", "--data",
                             json.dumps(forged), f"{BASE}/api/v1/agent/report")  # fmt: skip
    assert answer.stdout != "200"
    node = Client(str(tmp_path / "state" / "api.sock")).call("/api/v1/nodes/pi01")
    assert node["mac"] == link.client_mac() and node["run_state"] == "init"
    timeline = node["boot"]["timeline"]
    for phase in ("dhcp_discover", "dhcp_ack", "tftp", "script", "kernel", "initrd",
                  "agent_hello"):  # fmt: skip
        assert timeline.get(phase) is not None, (phase, timeline)
    assert node["boot"]["firmware"] == "rpi"


def test_a_pi_5_is_served_too(link, pi_server, tmp_path: Path) -> None:
    """A Pi 5 says RPi5 in option 97 and asks no GPU firmware (its EEPROM has it); its
    device tree is the admin's to add to [rpi] dir (Debian 12 has none)."""
    (tmp_path / "rpi" / "bcm2712-rpi-5-b.dtb").write_bytes(b"\xd0\x0d\xfe\xed" * 10)
    record = play(link, tmp_path, "--model", "RPi5")
    assert record["ack"]["yiaddr"] == PI_IP
    assert bytes.fromhex(record["ack"]["options"]["43"]) == pxe_boot_menu("Raspberry Pi Boot")
    served = {f["name"] for f in record["files"] if "error" not in f}
    assert served == {f"{SERIAL}/{name}" for name in ("config.txt", "bcm2712-rpi-5-b.dtb",
                      "cmdline.txt", "minos.kernel", "minos.initrd")}  # fmt: skip
    assert Cmdline.parse(read(record, f"{SERIAL}/cmdline.txt")["text"]).node == "pi01"
