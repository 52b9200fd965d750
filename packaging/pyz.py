#!/usr/bin/env python3
"""Build ``dist/layerpy.pyz``: one file that runs with Debian 12's /usr/bin/python3 and
nothing else installed, carrying everything a boot needs.

    .venv/bin/python packaging/pyz.py [-o dist/layerpy.pyz]

It is a shiv zipapp (shiv, from the venv): the layerpy package with, under
``layerpy/bundled/``, the minOS kernel and initramfs (minos/out, built first if missing),
Debian's x86 iPXE binaries and (setup.py's build step) systemd/, the unit and sysusers.d
line ``layerpy install`` writes; plus the dependencies' wheels for this platform (CPython
3.11, x86-64 Linux: what Debian 12 runs). On its first start it unpacks itself to
$SHIV_ROOT (default ~/.shiv; the systemd unit points it at the cache directory).
Prints the size of the file and of each part.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MINOS = REPO / "minos" / "out"
IPXE = Path("/usr/lib/ipxe")
IPXE_FILES = ("undionly.kpxe", "ipxe.pxe", "snponly.efi", "ipxe.efi")  # BIOS and x86-64 UEFI
SHIV = Path(sys.executable).with_name("shiv")


def mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def stage(into: Path) -> dict[str, int]:
    """The source tree to build from, with the boot files in the package; their sizes."""
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, into / name)
    for name in ("src", "systemd"):
        shutil.copytree(REPO / name, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    bundled = into / "src" / "layerpy" / "bundled"
    (bundled / "minos").mkdir(parents=True)
    (bundled / "ipxe").mkdir()
    sizes = {}
    for name in ("vmlinuz", "initrd"):
        sizes[f"minOS {name}"] = shutil.copy(MINOS / name, bundled / "minos" / name).stat().st_size
    for name in IPXE_FILES:
        sizes[f"iPXE {name}"] = shutil.copy(IPXE / name, bundled / "ipxe" / name).stat().st_size
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=REPO / "dist" / "layerpy.pyz")
    args = parser.parse_args()
    if not SHIV.exists():
        sys.exit(f"pyz: needs shiv in the venv ({SHIV}); vm-lab/setup.sh installs it")
    if not (MINOS / "vmlinuz").exists() or not (MINOS / "initrd").exists():
        subprocess.run([str(REPO / "minos" / "build.sh")], check=True)
    missing = [name for name in IPXE_FILES if not (IPXE / name).is_file()]
    if missing:
        sys.exit(f"pyz: {IPXE} lacks {', '.join(missing)} (apt-get install ipxe)")
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
