"""Power-on to ready on every boot path of docs/hardware.md's table, one VM at a time.

Each row is one lab VM (vm-lab/lab.py: QEMU under TCG on this machine, 512 MB, virtio-net)
started by the bench and booted by ``layerpy serve`` (vm-lab/session.py, the lab's node
file plus one node per path, no image: *ready* is the server's state after the agent's
hello and first report). Paths, by the firmware the VM runs:

- x86-64 SeaBIOS with the NIC's iPXE ROM; OVMF with it; OVMF's own PXE (then iPXE,
  ``snponly.efi``, by TFTP); OVMF's UEFI HTTP boot (``snponly.efi`` by HTTP);
- OVMF with Secure Boot on and Microsoft's keys (Debian's signed shim, signed GRUB and
  signed kernel: the node has ``secure_boot = true``);
- arm64 (QEMU ``virt``, cortex-a72, AAVMF): UEFI PXE and UEFI HTTP boot (Debian 13's
  ``ipxe-arm64.efi``), Secure Boot on (AAVMF with Microsoft's keys) through Debian's signed
  shim and GRUB (a ``secure_boot`` node), and QEMU loading the arm64 minOS itself (no
  loader: the floor of the arm64 rows).

The Raspberry Pi path is not here: its bootloader is played packet by packet
(tests/e2e/test_rpi_minos.py prints its times). The times are QEMU's start to the server's
``ready``, polled every 0.2 s; VMs one after the other, so each has the machine's second
core to itself; medians over ``--rounds``.

Run: ``.venv/bin/python bench/boot_paths.py [--rounds 3] [--only NAME,...]`` (as root,
after vm-lab/setup.sh).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "vm-lab"))

from lab import VmSpec  # noqa: E402
from session import LabSession, lab_text  # noqa: E402

TIMEOUT = 900.0  # seconds a VM may take to ready under TCG before its row says so


@dataclass(frozen=True)
class BootPath:
    name: str  # the VM's and the node's name
    what: str  # the row's words
    spec: VmSpec
    secure_boot: bool = False


def paths() -> list[BootPath]:
    def vm(name: str, number: int, firmware: str, arch: str = "amd64") -> VmSpec:
        return VmSpec(name, f"52:54:00:99:00:{number:02x}", firmware, memory_mb=512, arch=arch)

    direct = REPO / "minos" / "out-arm64"
    return [
        BootPath("pbios", "x86-64 BIOS (SeaBIOS), NIC's iPXE ROM", vm("pbios", 0x41, "bios")),
        BootPath("puefi", "x86-64 UEFI (OVMF), NIC's iPXE ROM", vm("puefi", 0x42, "uefi")),
        BootPath("ppxe", "x86-64 UEFI PXE -> snponly.efi", vm("ppxe", 0x43, "uefi-pxe")),
        BootPath("phttp", "x86-64 UEFI HTTP -> snponly.efi", vm("phttp", 0x44, "uefi-http")),
        BootPath(
            "psb",
            "x86-64 Secure Boot: shim -> GRUB -> signed kernel",
            vm("psb", 0x45, "uefi-sb"),
            secure_boot=True,
        ),
        BootPath(
            "papxe", "arm64 UEFI PXE -> ipxe-arm64.efi", vm("papxe", 0x46, "uefi-pxe", "arm64")
        ),
        BootPath(
            "pahttp", "arm64 UEFI HTTP -> ipxe-arm64.efi", vm("pahttp", 0x47, "uefi-http", "arm64")
        ),
        BootPath(
            "pasign",
            "arm64 Secure Boot (AAVMF): shim -> GRUB -> signed kernel",
            vm("pasign", 0x49, "uefi-sb", "arm64"),
            secure_boot=True,
        ),
        BootPath(
            "padir",
            "arm64, QEMU loads the minOS (no loader)",
            replace(
                vm("padir", 0x48, "direct", "arm64"),
                kernel=direct / "vmlinuz",
                initrd=direct / "initrd",
            ),
        ),
    ]


def node_file(run_dir: Path, chosen: list[BootPath]) -> Path:
    text = lab_text()
    for number, path in enumerate(chosen):
        text += f'\n[nodes.{path.name}]\nip = "10.99.0.{60 + number}"\nmac = "{path.spec.mac}"\n'
        text += "secure_boot = true\n" if path.secure_boot else ""
    file = run_dir / "nodes.toml"
    file.write_text(text)
    return file


def boot(session: LabSession, path: BootPath, address: str) -> float | None:
    """Seconds from QEMU's start to the node's ready; None past TIMEOUT."""
    before = session.nodes()[path.name]["boots"]  # ready again: a later boot's
    spec = path.spec
    started = time.monotonic()  # a direct boot's script fetch is its loader's part
    if spec.firmware == "direct":
        spec = replace(spec, append=session.direct_append(path.name, address))
    vm = session.lab.add_vm(spec)
    try:
        while time.monotonic() < started + TIMEOUT:
            node = session.nodes().get(path.name, {})
            if node.get("run_state") == "ready" and node.get("boots", 0) > before:
                return time.monotonic() - started
            time.sleep(0.2)
        return None
    finally:
        vm.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="node names, comma-separated")
    args = parser.parse_args()
    chosen = [p for p in paths() if not args.only or p.name in args.only.split(",")]
    times: dict[str, list[float | None]] = {p.name: [] for p in chosen}
    with tempfile.TemporaryDirectory(prefix="boot-paths-") as tmp:
        run_dir = Path(tmp)
        session = LabSession(run_dir / "lab", node_file(run_dir, chosen))
        try:
            for round_number in range(args.rounds):
                for number, path in enumerate(chosen):
                    took = boot(session, path, f"10.99.0.{60 + number}")
                    shown = "not ready" if took is None else f"{took:.1f} s"
                    print(f"round {round_number + 1}: {path.what}: {shown}", flush=True)
                    times[path.name].append(took)
        finally:
            session.close()
    print(f"\npower-on to ready, median of {args.rounds} (TCG, one VM at a time)")
    for path in chosen:
        done = [t for t in times[path.name] if t is not None]
        median = f"{statistics.median(done):6.1f} s" if done else "  not ready"
        print(f"  {path.what:55} {median}  ({len(done)}/{args.rounds} ready)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
