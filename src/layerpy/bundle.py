"""The files layerpy brings along: the minOS (kernel and initramfs, x86-64 and arm64), the
iPXE binaries, Debian's signed shim and GRUB and the Raspberry Pi firmware, which a node
file that names none of them gets; and the systemd unit and sysusers.d line that
``layerpy install`` writes.

``layerpy.pyz`` (packaging/pyz.py) carries them in the package, under ``bundled/``, and so
does a wheel the systemd files (setup.py copies systemd/ there); a checkout has them where
minos/build.sh, Debian's ipxe package and the vm-lab/ fetch scripts put them, and in
systemd/.
"""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).resolve().parent / "bundled"
CHECKOUT = Path(__file__).resolve().parents[2]
DEBIAN_IPXE = Path("/usr/lib/ipxe")
FETCHED_SIGNED = Path("/var/cache/layerpy/signed")  # where vm-lab/signed-loaders.sh puts them
FETCHED_RPI = Path("/var/cache/layerpy/rpi")  # where vm-lab/rpi-firmware.sh puts it


def minos(arch: str = "amd64") -> tuple[Path, Path] | None:
    """(kernel, initramfs) of the bundled minOS of a CPU architecture, else of the
    checkout's (minos/out, minos/out-arm64); None without."""
    suffix = "" if arch == "amd64" else f"-{arch}"
    for directory in (PACKAGED / f"minos{suffix}", CHECKOUT / "minos" / f"out{suffix}"):
        kernel, initrd = directory / "vmlinuz", directory / "initrd"
        if kernel.is_file() and initrd.is_file():
            return kernel, initrd
    return None


def ipxe_dir() -> Path:
    """The bundled iPXE binaries, else Debian's ipxe package's."""
    return PACKAGED / "ipxe" if (PACKAGED / "ipxe").is_dir() else DEBIAN_IPXE


def signed_dir() -> Path:
    """The bundled signed shim and GRUB, else those vm-lab/signed-loaders.sh fetched."""
    return PACKAGED / "signed" if (PACKAGED / "signed").is_dir() else FETCHED_SIGNED


def rpi_dir() -> Path:
    """The bundled Raspberry Pi firmware, else the one vm-lab/rpi-firmware.sh fetched."""
    return PACKAGED / "rpi" if (PACKAGED / "rpi").is_dir() else FETCHED_RPI


def systemd_dir() -> Path:
    """The packaged systemd/ files, else the checkout's (one source: the checkout's)."""
    return PACKAGED / "systemd" if (PACKAGED / "systemd").is_dir() else CHECKOUT / "systemd"
