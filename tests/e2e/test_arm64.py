"""An arm64 node (QEMU virt, cortex-a72, under TCG) boots the arm64 minOS that
`minos/build.sh --arch arm64` builds, reaches ready with `layerpy serve` and runs the arm64
image of a multi-architecture image index (issue 28, point 1).

The loader is not part of this test: QEMU loads the minOS kernel and initrd itself
(firmware "direct"). The test plays the loader's one request instead: it fetches the
node's boot script from the node's own address, as GRUB or iPXE would, and hands its
kernel arguments (server, node, per-boot token, BOOTIF) to QEMU's -append. Everything after
the kernel is the real path: the minOS's /init loads virtio_pci and virtio_net for the
hardware it finds, the agent's DHCP, its reports (platform linux/arm64/v8), the catalog's
pull of the index's arm64 manifest, the download and the container. Slow under TCG: one VM,
timeouts that say what they waited for.
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from lab import VmSpec
from oci import BUSYBOX, build_multiarch, debian_busybox
from session import MACHINES, LabSession, lab_text

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MINOS = REPO / "minos" / "out-arm64"
CACHE = Path(os.environ.get("LAYERPY_CACHE", "/var/cache/layerpy"))
NODE, IP = "arm001", "10.99.0.21"
MARKER = "ARM64-LAB-IMAGE"
COMMAND = ["/bin/sh", "-c", f"echo {MARKER} $(cat /arch) $(uname -m); exec sleep 1000000"]


def arm64_busybox(into: Path) -> Path:
    binary = debian_busybox("arm64", CACHE)
    if binary is None or not (MINOS / "initrd").exists():
        pytest.skip("no arm64 minOS: run minos/build.sh --arch arm64 (vm-lab/setup.sh does)")
    path = into / "busybox-arm64"
    path.write_bytes(binary)
    return path


# arm64 servers booting by their own UEFI (AAVMF): PXE (arch 11) and HTTP boot (arch 19)
# load the lab's arm64 iPXE ([ipxe] arm64); a node with secure_boot = true gets Debian's
# signed shim and GRUB instead, by PXE only (GRUB has no HTTP)
BY_NETWORK = {
    "uefi-pxe": VmSpec("arm002", "52:54:00:99:00:22", "uefi-pxe", arch="arm64", memory_mb=512),
    "uefi-http": VmSpec("arm003", "52:54:00:99:00:23", "uefi-http", arch="arm64", memory_mb=512),
    # AAVMF with Microsoft's keys enrolled and Secure Boot on; the node has secure_boot
    "uefi-pxe-signed": VmSpec(
        "arm004", "52:54:00:99:00:24", "uefi-sb", arch="arm64", memory_mb=512
    ),
}
SIGNED = "uefi-pxe-signed"


def arm64_ipxe() -> Path:
    """The lab's arm64 iPXE binary ([ipxe] of configs/lab.toml), or skip without it."""
    table = tomllib.loads(lab_text())["ipxe"]
    assert "arm64" in table, "configs/lab.toml: [ipxe] names no arm64 binary"
    binary = Path(table["dir"]) / table["arm64"]
    if not binary.is_file():
        pytest.skip(f"no arm64 iPXE {binary}: run vm-lab/ipxe-arm64.sh (vm-lab/setup.sh does)")
    return binary


def node_file(run_dir: Path, layout: Path) -> Path:
    """The lab's node file plus the arm64 nodes (no BMC: QEMU is started by the test)."""
    macs = [MACHINES[NODE].mac, *(spec.mac for spec in BY_NETWORK.values())]
    text = lab_text() + (
        f'\n[images.multi]\nsource = "oci-layout:{layout}:latest"\n'
        f'\n[groups.arm]\nnodes = "arm[001-004]"\nip = "10.99.0.[21-24]"\n'
        f'mac = {json.dumps(macs)}\nimage = "multi"\n'
        f"\n[nodes.{BY_NETWORK[SIGNED].name}]\nsecure_boot = true\n"
    )
    path = run_dir / "nodes.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def arm_lab(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("arm64", numbered=True)
    busyboxes = {"amd64": BUSYBOX, "arm64": arm64_busybox(tmp)}
    arm64_ipxe()  # the lab's node file names it: no lab without it
    digests = build_multiarch(tmp / "multi", busyboxes, COMMAND)
    session = LabSession(tmp / "lab", node_file(tmp, tmp / "multi"))
    yield session, digests
    session.close()


def test_arm64_node_boots_the_arm64_minos_to_ready_and_runs_its_image(arm_lab) -> None:
    session, digests = arm_lab
    append = session.direct_append(NODE, IP)
    assert f"layerpy.node={NODE}" in append and "layerpy.token=" in append, append
    spec = replace(MACHINES[NODE], firmware="direct", kernel=MINOS / "vmlinuz",
                   initrd=MINOS / "initrd", append=append)  # fmt: skip
    started = time.monotonic()
    vm = session.lab.add_vm(spec)
    ready = session.wait_state([NODE], "ready", timeout=600)
    node = session.nodes()[NODE]
    assert node["ip"] == IP and node["agent"]["platform"] == "linux/arm64/v8", node

    def running_arm64() -> bool:
        image = session.nodes()[NODE]["image"]
        return image["state"] == "active" and image["digest"] == digests["arm64"]

    session.wait(running_arm64, 600, f"{NODE} running the arm64 image {digests['arm64'][:19]}")
    active = time.monotonic() - started
    assert vm.wait_serial(rf"{MARKER} arm64 aarch64", 60), "the image's own line on the console"
    serial = vm.serial_log.read_text(errors="replace")
    assert "virtio_net" in serial.split("modules:", 1)[1].splitlines()[0], "/init's driver"
    images = {(i["name"], i["platform"]): i for i in session.api("/api/v1/images")}
    assert images["multi", "linux/arm64/v8"]["digest"] == digests["arm64"]
    assert images["multi", "linux/amd64"]["digest"] == digests["amd64"]
    print(f"\n{NODE}: QEMU start to ready {ready:.1f} s, to its arm64 image active {active:.1f} s")


@pytest.mark.parametrize("firmware", list(BY_NETWORK))
def test_arm64_uefi_boots_by_the_network_to_ready(arm_lab, firmware: str) -> None:
    """AAVMF's own PXE or HTTP boot: DHCP gives the lab's arm64 iPXE (by TFTP, or by its
    http:// URL), which runs on the firmware's network driver (SNP) and loads the node's
    boot script; or, for a secure_boot node, Debian's signed arm64 shim, which loads the
    signed GRUB beside it, GRUB its config from layerpy. Script and config name the arm64
    minOS because the node's firmware said arch 11 or 19 (option 93)."""
    session, digests = arm_lab
    spec = BY_NETWORK[firmware]
    started = time.monotonic()
    vm = session.lab.add_vm(spec)

    def tail() -> str:
        return vm.serial_log.read_text(errors="replace")[-3000:]

    signed = firmware == SIGNED
    loader = "shim, shim GRUB, GRUB its config" if signed else "iPXE arm64, iPXE its script"
    assert vm.wait_serial(rf"layerpy: booting {spec.name} into the minOS", 600), (
        f"AAVMF's {spec.firmware} loading {loader} from layerpy:\n{tail()}"
    )
    ipxe = "using SNP on SNP-" in vm.serial_log.read_text(errors="replace")
    assert ipxe != signed, f"{loader} expected:\n{tail()}"
    session.wait_state([spec.name], "ready", timeout=900)
    ready = time.monotonic() - started
    node = session.nodes()[spec.name]
    assert node["agent"]["platform"] == "linux/arm64/v8", node
    assert node["boot"]["firmware"] == {"uefi-http": "uefi-arm64-http"}.get(firmware, "uefi-arm64")
    assert node["secure_boot"] is signed and node["problem"] is None, node  # as its agent said

    def running_arm64() -> bool:
        image = session.nodes()[spec.name]["image"]
        return image["state"] == "active" and image["digest"] == digests["arm64"]

    session.wait(running_arm64, 600, f"{spec.name} running the arm64 image")
    took = time.monotonic() - started
    print(
        f"\n{spec.name} ({firmware}): QEMU start to ready {ready:.1f} s, image active {took:.1f} s"
    )
