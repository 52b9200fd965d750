"""Debian packages a benchmark needs, installed only when missing and never started.

The reference servers (tftpd-hpa, Kea) are daemons: policy-rc.d must forbid the package
scripts to start them on the host, and the benchmarks run them by hand in namespaces.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

POLICY = Path("/usr/sbin/policy-rc.d")


def install_missing(packages: dict[str, str]) -> None:
    """`packages` maps a command to the package that brings it."""
    missing = sorted({package for tool, package in packages.items() if not shutil.which(tool)})
    if not missing:
        return
    if not POLICY.exists():
        POLICY.write_text("#!/bin/sh\nexit 101\n")
        POLICY.chmod(0o755)
    if subprocess.run([str(POLICY)]).returncode != 101:
        sys.exit(f"{POLICY} does not exit 101; refusing to install a service")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", *missing], check=True, env=env)
