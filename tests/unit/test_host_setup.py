"""The set-up leaves this host as it found it: no daemon it installed starts at boot."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNIT = re.compile(
    r"^/(?:usr/)?lib/systemd/system/([^/@]+\.(?:socket|timer|path|target)|[^/@]+(?=\.service$))"
    r"(?:\.service)?$|^/etc/init\.d/([^/]+)$"
)


def setup_packages() -> list[str]:
    text = (ROOT / "vm-lab" / "setup.sh").read_text()
    found = re.search(r"^PACKAGES=\((.*?)\)", text, re.S | re.M)
    assert found, "vm-lab/setup.sh has no PACKAGES=(...) list"
    return found.group(1).split()


def services(package: str) -> set[str]:
    listed = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True)
    return {m.group(1) or m.group(2) for m in map(UNIT.match, listed.stdout.splitlines()) if m}


@pytest.mark.skipif(not shutil.which("systemctl"), reason="no systemctl on this host")
def test_no_daemon_the_setup_installed_is_enabled_at_boot() -> None:
    daemons = {unit: p for p in setup_packages() for unit in services(p)}
    assert "docker-registry" in daemons and "isc-dhcp-relay" in daemons  # the test sees them
    enabled = [
        f"{unit} (from {package})"
        for unit, package in daemons.items()
        if subprocess.run(
            ["systemctl", "is-enabled", unit], capture_output=True, text=True
        ).stdout.strip()
        == "enabled"
    ]
    assert not enabled, f"enabled at boot after vm-lab/setup.sh: {', '.join(enabled)}"
