#!/usr/bin/env python3
"""Build ``dist/layerpy.pyz``: one file that runs with Debian 12's /usr/bin/python3 and
nothing else installed, carrying everything a boot needs.

    .venv/bin/python packaging/pyz.py [-o dist/layerpy.pyz]

It is a shiv zipapp (shiv, from the venv): the layerpy package with, under
``layerpy/bundled/``, every boot file of docs/hardware.md's table: the x86-64 and arm64
minOS (minos/out and minos/out-arm64, built first if missing), Debian's iPXE binaries
(x86 and arm64, as vm-lab/ipxe-arm64.sh gathers them), Debian's signed shim and GRUB for
x86-64 and arm64 and the Raspberry Pi firmware (fetched first if missing, by the vm-lab/
scripts), and (setup.py's build step) systemd/, the unit and sysusers.d line ``layerpy
install`` writes; plus the dependencies' wheels for this platform (CPython 3.11, x86-64
Linux: what Debian 12 runs). On its first start it unpacks itself to $SHIV_ROOT (default
~/.shiv; the systemd unit points it at the cache directory). Prints the size of the file
and of each part.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("LAYERPY_CACHE", "/var/cache/layerpy"))
# BIOS, x86-64 UEFI (Debian 12's) and arm64 UEFI (Debian 13's), as vm-lab/ipxe-arm64.sh puts them
IPXE_FILES = ("undionly.kpxe", "ipxe.pxe", "snponly.efi", "ipxe.efi", "ipxe-arm64.efi")
SIGNED_FILES = ("shimx64.efi", "grubx64.efi", "shimaa64.efi", "grubaa64.efi")
SHIV = Path(sys.executable).with_name("shiv")


@dataclass(frozen=True)
class Part:
    """Boot files the pyz carries: where they come from, the names taken (None: the whole
    directory), the bundled/ directory they go to (bundle.py reads them there), and the
    command that makes them when they are missing (ipxe-arm64.sh needs Debian's ipxe
    package for the x86 ones: vm-lab/setup.sh installs it)."""

    label: str
    source: Path
    names: tuple[str, ...] | None
    into: str
    make: tuple[str, ...]

    def missing(self) -> bool:
        names = self.names or ("start4.elf",)  # the Pi firmware: its bootloader's first file
        return not all((self.source / name).is_file() for name in names)


PARTS = (
    Part("minOS", REPO / "minos" / "out", ("vmlinuz", "initrd"), "minos",
         ("minos/build.sh",)),
    Part("minOS arm64", REPO / "minos" / "out-arm64", ("vmlinuz", "initrd"), "minos-arm64",
         ("minos/build.sh", "--arch", "arm64")),
    Part("iPXE", CACHE / "ipxe", IPXE_FILES, "ipxe", ("vm-lab/ipxe-arm64.sh",)),
    Part("signed", CACHE / "signed", SIGNED_FILES, "signed",
         ("vm-lab/signed-loaders.sh", "amd64", "arm64")),
    Part("Pi firmware", CACHE / "rpi", None, "rpi", ("vm-lab/rpi-firmware.sh",)),
)  # fmt: skip


def mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def stage(into: Path) -> dict[str, int]:
    """The source tree to build from, with the boot files in the package; their sizes."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, into / name)
    for name in ("src", "systemd"):
        shutil.copytree(REPO / name, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    bundled = into / "src" / "layerpy" / "bundled"
    sizes = {}
    for part in PARTS:
        target = bundled / part.into
        if part.names is None:
            shutil.copytree(part.source, target)
            size = sum(path.stat().st_size for path in target.rglob("*") if path.is_file())
            sizes[part.label] = size
            continue
        target.mkdir(parents=True)
        for name in part.names:
            copied = shutil.copy(part.source / name, target / name)  # a symlink's target
            sizes[f"{part.label} {name}"] = Path(copied).stat().st_size
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=REPO / "dist" / "layerpy.pyz")
    args = parser.parse_args()
    if not SHIV.exists():
        sys.exit(f"pyz: needs shiv in the venv ({SHIV}); vm-lab/setup.sh installs it")
    for part in (part for part in PARTS if part.missing()):
        subprocess.run([str(REPO / part.make[0]), *part.make[1:]], check=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="layerpy-pyz-") as tmp:
        source = Path(tmp) / "source"
        source.mkdir()
        sizes = stage(source)
        command = [
            str(SHIV), "--output-file", str(args.output), "--entry-point", "layerpy.cli:main",
            "--python", "/usr/bin/env python3", "--compressed", "--reproducible",
            "--no-cache-dir", "--only-binary=:all:", str(source),
        ]  # fmt: skip
        built = subprocess.run(command, capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"pyz: shiv failed:\n{built.stdout}{built.stderr}")
    size = args.output.stat().st_size
    print(f"pyz: {args.output} {mb(size)} (boot files {mb(sum(sizes.values()))} of it)")
    for part, part_size in sizes.items():
        print(f"pyz:   {part:20} {mb(part_size)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
