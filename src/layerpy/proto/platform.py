"""Which image of a multi-architecture OCI index a node runs: its platform, and the match.

A node's platform is ``os/architecture[/variant]`` in OCI's words (``linux/amd64``,
``linux/arm64/v8``). The agent names its own from the kernel's machine name and reports it;
the server picks that platform's manifest from an image index. Sans I/O, standard library
only: the agent in the minOS and the server's image store import it alike.

Matching follows the OCI image index and containerd: the OS and the architecture must be
equal; an arm64 entry without a variant is v8; an entry with the node's own variant beats
one that names none, and an entry of another variant never fits. An entry without any
platform (the one image of an OCI layout's index.json) fits every node, below any entry
that names its platform. Attestation manifests (``unknown/unknown``) fit nobody.
"""

from __future__ import annotations

import re
from typing import Any

DEFAULT = "linux/amd64"  # what an agent that reports no platform (protocol < 1.3) runs on
# the kernel's machine name (uname -m) -> OCI architecture and variant
MACHINES = {
    "x86_64": "amd64",
    "aarch64": "arm64/v8",
    "armv7l": "arm/v7",
    "armv6l": "arm/v6",
    "riscv64": "riscv64",
    "ppc64le": "ppc64le",
    "s390x": "s390x",
}
DEFAULT_VARIANT = {"arm64": "v8"}  # an entry or a node that names none has this one
# What a node may report: the platforms of the machines above, no other (each one a node
# names is a table of the image catalog's, and a node must not make them without end)
KNOWN = frozenset(f"linux/{arch}" for arch in MACHINES.values())


def of_machine(machine: str, system: str = "linux") -> str:
    """The platform of a Linux machine from ``os.uname().machine`` (an unknown name is
    passed on as the architecture, so the server says plainly that it knows no such
    platform)."""
    arch = MACHINES.get(machine, re.sub(r"[^a-z0-9_]", "", machine.lower())[:16] or "unknown")
    return f"{system}/{arch}"


def split(platform: str) -> tuple[str, str, str]:
    """(os, architecture, variant) with the architecture's default variant filled in."""
    osname, _, rest = platform.partition("/")
    arch, _, variant = rest.partition("/")
    return osname, arch, variant or DEFAULT_VARIANT.get(arch, "")


def architecture(platform: str) -> str:
    return split(platform)[1]


def _entry_platform(platform: dict) -> tuple[str, str, str]:
    arch = str(platform.get("architecture", ""))
    variant = str(platform.get("variant") or DEFAULT_VARIANT.get(arch, ""))
    return str(platform.get("os", "")), arch, variant


def choose(index: Any, platform: str) -> tuple[str | None, list[str]]:
    """The digest of the manifest in `index` (an OCI index or Docker manifest list, as
    parsed JSON) that best fits `platform`, or None; and the platforms the index offers,
    for the message that says none fits."""
    want = split(platform)
    best: tuple[int, str] | None = None
    offered = []
    entries = index.get("manifests") if isinstance(index, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("digest"), str):
            continue
        found = entry.get("platform")
        if not isinstance(found, dict):
            score = 1  # no platform named: the only image of a layout
        else:
            osname, arch, variant = _entry_platform(found)
            offered.append("/".join(p for p in (osname, arch, found.get("variant")) if p))
            if (osname, arch) != want[:2]:
                continue
            if variant == want[2]:
                score = 3
            elif not variant:
                score = 2  # the entry names no variant: it fits any of its architecture
            else:
                continue  # another variant (arm/v6 on an arm/v7 node, amd64/v3 on a v2 one)
        if best is None or score > best[0]:
            best = (score, entry["digest"])
    return (best[1] if best else None), offered
