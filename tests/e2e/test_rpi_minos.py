"""A Raspberry Pi's boot, end to end as far as this lab can take it: the bootloader's DHCP
and TFTP played by tests/rpi_player.py against `layerpy serve` (Debian's real Pi firmware
from /var/cache/layerpy/rpi, the arm64 minOS as kernel and initramfs), then what it
fetched booted: QEMU `virt` (cortex-a72, TCG; QEMU 7.2 cannot emulate a Pi 4) loads the
kernel and initramfs TFTP served with the cmdline.txt TFTP served, and the node reaches
ready with the token that file carried (docs/hardware.md, "What was tested how").

The arm64 minOS comes from `minos/build.sh --arch arm64` (minos/out-arm64), or from
LAYERPY_ARM64_MINOS; the Pi firmware from vm-lab/rpi-firmware.sh. One VM, slow under TCG.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from layerpy import bundle
from layerpy.client import Client
from layerpy.proto.agent import Cmdline

from netns import Link

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MINOS = Path(os.environ.get("LAYERPY_ARM64_MINOS", REPO / "minos" / "out-arm64"))
PLAYER = REPO / "tests" / "rpi_player.py"
LAYERPY = Path(sys.executable).parent / "layerpy"
MAC, SERIAL, IP = "52:54:00:99:00:31", "9ffefdef", "10.77.0.31"
NODE_FILE = f"""
[server]
interface = "lpsrv0"
address = "10.77.0.1"
state_dir = "state"
dhcp_probe = 0.5
heartbeat = 5

[network]
subnet = "10.77.0.0/24"
gateway = "10.77.0.1"

[minos]
kernel = "{MINOS}/vmlinuz"
initrd = "{MINOS}/initrd"

[ipxe]
dir = "ipxe"

[rpi]
kernel = "{MINOS}/vmlinuz"
initrd = "{MINOS}/initrd"
cmdline = "console=ttyAMA0"

[nodes.pi01]
ip = "{IP}"
serial = "{SERIAL}"
mac = "{MAC}"
"""


def wait(condition, timeout: float, what: str, log: Path) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}:\n{tail}")
        time.sleep(1)
    return time.monotonic() - started


def test_a_pi_boots_the_arm64_minos_that_tftp_served(tmp_path: Path) -> None:
    if not (MINOS / "vmlinuz").exists() or not (bundle.rpi_dir() / "start4.elf").exists():
        pytest.skip("no arm64 minOS or Pi firmware: minos/build.sh --arch arm64, rpi-firmware.sh")
    (tmp_path / "ipxe").mkdir()
    for name in ("undionly.kpxe", "snponly.efi"):
        (tmp_path / "ipxe" / name).write_bytes(b"\x90" * 100)
    (tmp_path / "nodes.toml").write_text(NODE_FILE)
    got = tmp_path / "got"
    got.mkdir()
    link = Link()
    try:
        pi = link.client  # the Pi's side: its veth and QEMU's tap on one bridge
        pi.run("ip", "link", "add", "br0", "type", "bridge")
        pi.run("ip", "link", "set", link.client_if, "master", "br0")
        pi.run("ip", "tuntap", "add", "tap0", "mode", "tap")
        pi.run("ip", "link", "set", "tap0", "master", "br0")
        for interface in ("br0", "tap0"):
            pi.run("ip", "link", "set", interface, "up")
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            serve = link.server.popen([str(LAYERPY), "serve", "-c", str(tmp_path / "nodes.toml")],
                                      stdout=out, stderr=out)  # fmt: skip
        wait(lambda: "layerpy.server: serving" in log.read_text(errors="replace")
             or serve.poll() is not None, 60, "layerpy serve up", log)  # fmt: skip
        assert serve.poll() is None, log.read_text()[-3000:]

        started = time.monotonic()
        played = pi.run(sys.executable, str(PLAYER), "br0", MAC, SERIAL, "--save", str(got),
                        timeout=300)  # fmt: skip
        record = json.loads(played.stdout)
        errors = {f["name"] for f in record["files"] if "error" in f}
        assert errors == {f"{SERIAL}/{name}" for name in ("pieeprom.sig", "recover4.elf",
                          "dt-blob.bin", "bootcfg.txt", "overlays/overlay_map.dtb")}  # fmt: skip
        assert (got / "minos.kernel").read_bytes() == (MINOS / "vmlinuz").read_bytes()
        cmdline = (got / "cmdline.txt").read_text().strip()
        assert Cmdline.parse(cmdline).node == "pi01" and cmdline.endswith("console=ttyAMA0")

        pi.run("ip", "addr", "flush", "dev", "br0")  # the address is the minOS's now
        serial = tmp_path / "serial.log"
        pi.popen(["qemu-system-aarch64", "-M", "virt", "-cpu", "cortex-a72", "-m", "1024",
                  "-nographic", "-no-reboot", "-monitor", "none", "-serial", f"file:{serial}",
                  "-kernel", str(got / "minos.kernel"), "-initrd", str(got / "minos.initrd"),
                  "-append", cmdline, "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no",
                  "-device", f"virtio-net-pci,netdev=n0,mac={MAC},romfile="])  # fmt: skip
        api = Client(str(tmp_path / "state" / "api.sock"))
        ready = wait(lambda: api.call("/api/v1/nodes/pi01")["run_state"] == "ready", 900,
                     "pi01 ready after QEMU booted what TFTP served", serial)  # fmt: skip
        node = api.call("/api/v1/nodes/pi01")
        assert node["ip"] == IP and node["mac"] == MAC and node["boot"]["firmware"] == "rpi"
        timeline = node["boot"]["timeline"]
        assert all(timeline.get(phase) is not None for phase in
                   ("dhcp_ack", "tftp", "script", "kernel", "initrd", "agent_hello")), timeline  # fmt: skip
        print(
            f"\npi01: player {record['seconds']:.1f} s, QEMU to ready {ready:.1f} s, "
            f"whole {time.monotonic() - started:.1f} s"
        )
    finally:
        link.close()
