"""Debian packages a benchmark needs, installed only when missing and never started.

The reference servers (tftpd-hpa, Kea) are daemons: vm-lab/install-packages.sh installs
them with their package scripts forbidden to start them and their boot-time services
disabled again; the benchmarks run them by hand inside namespaces.
"""

import subprocess
from pathlib import Path

INSTALL = Path(__file__).resolve().parent.parent / "vm-lab" / "install-packages.sh"


def install_missing(packages: dict[str, str]) -> None:
    """`packages` maps a command to the package that brings it."""
    subprocess.run([str(INSTALL), *sorted(set(packages.values()))], check=True)
