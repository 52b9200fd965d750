"""Node files for tests: the boot files every node file names, written as small stand-ins."""

from __future__ import annotations

from pathlib import Path

BOOT_SECTIONS = """\
[minos]
kernel = "vmlinuz"
initrd = "initrd"
cmdline = "console=ttyS0"

[ipxe]
dir = "ipxe"
"""


def write_boot_files(directory: Path) -> None:
    """The kernel, initrd and iPXE binaries BOOT_SECTIONS names, as stand-in bytes."""
    for name in ("vmlinuz", "initrd"):
        (directory / name).write_bytes(name.encode() * 1000)
    (directory / "ipxe").mkdir(exist_ok=True)
    for name in ("undionly.kpxe", "snponly.efi"):
        (directory / "ipxe" / name).write_bytes(b"\x90" * 3000)
