"""List the shared libraries ELF files need, found in a staged root, for the minOS build.

  elfdeps.py ROOT LIBDIR... -- ELF...

Prints, one per line and sorted, the path (relative to ROOT) of every library the ELF
files name in DT_NEEDED, and of what those need in turn, looked up in ROOT/LIBDIR in the
order given. Reads the ELF headers itself (no ld.so run, no binutils), so it works the
same for a staged arm64 root on an x86 build host, where the staged loader cannot run.
Exits non-zero, naming the library, when one is not found in ROOT.
"""

from __future__ import annotations

import os
import struct
import sys

SHT_DYNAMIC = 6
DT_NEEDED = 1


def needed(path: str) -> list[str]:
    """The DT_NEEDED names of one 64-bit little-endian ELF file (none for a static one)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, _, _, _, _, shentsize, shnum = struct.unpack_from("<QIHHHHH", data, 0x28)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != SHT_DYNAMIC:
            continue
        strtab = sections[link][4]
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == DT_NEEDED:
                end = data.index(b"\0", strtab + value)
                names.append(data[strtab + value : end].decode())
    return names


def closure(root: str, libdirs: list[str], elfs: list[str]) -> list[str]:
    """Every library `elfs` need, transitively, as paths relative to `root`."""
    found: set[str] = set()
    todo = list(elfs)
    while todo:
        for name in needed(todo.pop()):
            places = [os.path.join(d, name) for d in libdirs]
            rel = next((p for p in places if os.path.exists(os.path.join(root, p))), None)
            if rel is None:
                raise SystemExit(f"elfdeps: {name} is in none of {libdirs} under {root}")
            if rel not in found:
                found.add(rel)
                todo.append(os.path.join(root, rel))
    return sorted(found)


def main(argv: list[str]) -> None:
    if "--" not in argv or len(argv) < 3:
        raise SystemExit(__doc__)
    split = argv.index("--")
    root, libdirs, elfs = argv[0], argv[1:split], argv[split + 1 :]
    for rel in closure(root, libdirs, elfs):
        print(rel)


if __name__ == "__main__":
    main(sys.argv[1:])
