"""minos/elfdeps.py, which finds the shared libraries of the minOS's Python without running
a loader (an arm64 one cannot run on the x86 build host), against the real loader here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ELFDEPS = Path(__file__).resolve().parents[2] / "minos" / "elfdeps.py"
LIBDIRS = ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"]
PYTHON = Path("/usr/bin/python3.11")
LDSO = Path("/lib64/ld-linux-x86-64.so.2")


def elfdeps(root: Path, *elfs: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ELFDEPS), str(root), *LIBDIRS, "--", *map(str, elfs)]
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(not (PYTHON.exists() and LDSO.exists()), reason="needs Debian's python3.11")
def test_the_libraries_are_those_the_loader_finds() -> None:
    """python3.11 and _ctypes need what ld.so --list says (each ELF asked on its own, as
    build.sh did; the loader itself too), as paths relative to the root."""
    ctypes = next(Path("/usr/lib/python3.11/lib-dynload").glob("_ctypes.cpython-311-*.so"))
    loader: set[str] = set()
    for elf in (PYTHON, ctypes):
        listed = subprocess.run([str(LDSO), "--list", str(elf)], capture_output=True,
                                text=True, check=True).stdout  # fmt: skip
        for line in listed.splitlines():  # "libc.so.6 => /lib/...", "/lib64/ld-linux... (0x..)"
            words = line.split()
            path = words[2] if "=>" in words else words[0]
            if path.startswith("/"):  # not the kernel's vDSO
                loader.add(Path(path).resolve().name)
    found = elfdeps(Path("/"), PYTHON, ctypes)  # this machine's root as the staged one
    assert found.returncode == 0, found.stderr
    paths = found.stdout.split()
    assert all(path.startswith(tuple(LIBDIRS)) for path in paths), paths
    assert {(Path("/") / path).resolve().name for path in paths} == loader


def test_a_missing_library_is_named(tmp_path: Path) -> None:
    (tmp_path / LIBDIRS[0]).mkdir(parents=True)
    found = elfdeps(tmp_path, PYTHON if PYTHON.exists() else Path(sys.executable))
    assert found.returncode != 0 and re.search(r"lib\w+\.so\.\d is in none of", found.stderr), (
        found.stderr
    )
    not_elf = tmp_path / "script"
    not_elf.write_text("#!/bin/sh\n")
    assert "not a 64-bit little-endian ELF" in elfdeps(tmp_path, not_elf).stderr
