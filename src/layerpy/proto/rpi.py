"""The Raspberry Pi 4/5 bootloader's network boot, sans I/O: what its TFTP paths may be,
and the ``config.txt`` layerpy writes for it (docs/hardware.md has the whole sequence).

The bootloader asks for ``PREFIX/NAME`` (its serial number's 8 hex digits by default, or
its MAC as ``dc-a6-32-01-36-c2`` with ``TFTP_PREFIX=2``) or plain ``NAME`` once it has
dropped the prefix; NAME is one or two plain components (``overlays/x.dtbo``). A hostile
client may ask anything: everything else is refused here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MENU = "Raspberry Pi Boot"  # the PXE menu item its bootloader looks for in option 43
KERNEL = "minos.kernel"  # what config.txt names the kernel and initramfs
INITRD = "minos.initrd"
CONFIG = "config.txt"
CMDLINE = "cmdline.txt"
_PREFIX = re.compile(r"[0-9a-f]{8}|[0-9a-f]{2}(-[0-9a-f]{2}){5}")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,63}")
MAX_PATH = 128


@dataclass(frozen=True, slots=True)
class PiPath:
    """A Pi's TFTP request: the directory it named (a serial or a MAC; None: none) and
    the file."""

    prefix: str | None
    name: str


def parse_path(requested: str) -> PiPath | None:
    """The Pi request in a TFTP file name, or None when it is not one a Pi makes."""
    if len(requested) > MAX_PATH:
        return None
    parts = requested.lstrip("/").split("/")
    prefix = parts[0] if len(parts) > 1 and _PREFIX.fullmatch(parts[0]) else None
    name = parts[1:] if prefix else parts
    if not 1 <= len(name) <= 2 or not all(_PART.fullmatch(part) for part in name):
        return None
    return PiPath(prefix, "/".join(name))


def prefixes(serial: str | None, mac: str | None) -> frozenset[str]:
    """The directories a Pi of this serial and MAC may name (TFTP_PREFIX 0 or 2)."""
    return frozenset(p for p in (serial, mac.replace(":", "-") if mac else None) if p)


def config_txt(node: str, extra: str = "") -> str:
    """The bootloader's and GPU firmware's settings: 64-bit, the minOS kernel and its
    initramfs right after it, the UART on, upstream device tree names (as Debian's
    raspi-firmware writes them), then the admin's lines."""
    lines = [
        f"# written by layerpy for {node}",
        "arm_64bit=1",
        "enable_uart=1",
        "upstream_kernel=1",
        f"kernel={KERNEL}",
        f"initramfs {INITRD} followkernel",
    ]
    if extra.strip():
        lines.append(extra.strip())
    return "\n".join(lines) + "\n"
