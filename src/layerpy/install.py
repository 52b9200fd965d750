"""``layerpy install``: the program and a hardened systemd unit in place on a head node.

The unit and the service user's sysusers.d line are the files of systemd/ (one source, which
setup.py and packaging/pyz.py put in the package); install fills in the unit's placeholders.
The unit runs ``layerpy serve`` as the system user ``layerpy`` with one capability
(CAP_NET_BIND_SERVICE: DHCP's and TFTP's ports; binding a socket to an interface needs
none since Linux 5.7), writes only its state and cache directories, and tells systemd when
it is ready, reloading and stopping (``Type=notify``). ``systemd-analyze security`` rates
it 1.6 (OK). Everything the service must read (the node file, BMC password files) must be
readable by that user; its state directory is /var/lib/layerpy, the node file's default.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from layerpy import bundle

USER = "layerpy"
PREFIX = Path("/usr/local")
UNIT_PATH = Path("/etc/systemd/system/layerpy.service")
FDS_PER_NODE = 12
"""Descriptors a node needs in layerpy.budget's plan: consoles get a fifth of the limit at
two a session, so 10 a node captures every node's console, and boot HTTP's 35 % then holds
two connections a node (an iPXE fetch, an agent report) and TFTP one transfer."""
MIN_NOFILE = 65536
HIDDEN = (Path("/home"), Path("/root"), Path("/run/user"), Path("/tmp"), Path("/var/tmp"))
"""What the unit's ProtectHome= and PrivateTmp= hide from the service."""

SYSUSERS_PATH = Path("/etc/sysusers.d/layerpy.conf")
UNIT_FILE, SYSUSERS_FILE = "layerpy.service", "layerpy.sysusers.conf"  # in systemd/


@dataclass(frozen=True)
class Step:
    """One thing install does, said before it is done (and all that --dry-run does)."""

    says: str
    argv: tuple[str, ...] = ()  # a command to run, or
    # a file to put in place (atomically): path, mode, and its bytes, or a file to copy them
    # from (read only when the step runs, not for --dry-run)
    put: tuple[Path, int, bytes | Path] | None = None


def program(prefix: Path) -> Path:
    """The command the unit runs."""
    return prefix / "bin" / "layerpy"


def source(name: str) -> str:
    """The text of systemd/`name` as this layerpy carries it; ValueError without."""
    path = bundle.systemd_dir() / name
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ValueError(
            f"{path} is missing: this layerpy was built without systemd/ (setup.py's build "
            "step puts it in the package); build it again from a checkout, with "
            "packaging/pyz.py or pip"
        ) from None


def unit(program: Path, nodes: int) -> str:
    """The unit text for `program`, its descriptor limit sized for `nodes` nodes: the
    unit's two placeholders, @PROGRAM@ and @NOFILE@, filled in."""
    nofile = max(MIN_NOFILE, FDS_PER_NODE * nodes + 1024)
    return source(UNIT_FILE).replace("@PROGRAM@", str(program)).replace("@NOFILE@", str(nofile))


def running_pyz() -> Path | None:
    """The layerpy.pyz this process runs from, if it does."""
    path = Path(sys.argv[0]).resolve()
    return path if path.is_file() and zipfile.is_zipfile(path) else None


def steps(prefix: Path, nodes: int) -> list[Step]:
    """What installing takes on this host; ValueError when this layerpy cannot be run by the
    service where it is (a venv under /root, say)."""
    sysusers = source(SYSUSERS_FILE).encode()
    plan = [Step(f"write {SYSUSERS_PATH}", put=(SYSUSERS_PATH, 0o644, sysusers))]
    try:
        pwd.getpwnam(USER)
    except KeyError:
        plan.append(Step(
            f"add the system user {USER} (systemd-sysusers: home /var/lib/layerpy, no login)",
            argv=("systemd-sysusers", str(SYSUSERS_PATH)),
        ))  # fmt: skip
    command = program(prefix)
    pyz = running_pyz()
    if pyz is not None:
        installed = prefix / "lib" / "layerpy" / "layerpy.pyz"
        wrapper = f'#!/bin/sh\nexec /usr/bin/python3 {installed} "$@"\n'.encode()
        if pyz != installed:
            plan.append(Step(f"copy {pyz} to {installed}", put=(installed, 0o755, pyz)))
        plan.append(Step(f"write {command}, which runs it", put=(command, 0o755, wrapper)))
    else:
        entry = Path(sys.executable).parent / "layerpy"
        if any(entry.is_relative_to(hidden) for hidden in HIDDEN):
            raise ValueError(
                f"{entry} is under a directory the service cannot see (ProtectHome=, "
                "PrivateTmp=): install from layerpy.pyz, or from a venv under /opt"
            )
        if command != entry:
            plan.append(
                Step(f"link {command} to {entry}", argv=("ln", "-sfn", str(entry), str(command)))
            )
    plan.append(Step(f"write {UNIT_PATH}", put=(UNIT_PATH, 0o644, unit(command, nodes).encode())))
    if Path("/run/systemd/system").is_dir():  # systemd runs this host
        plan.append(Step("tell systemd (daemon-reload)", argv=("systemctl", "daemon-reload")))
    return plan


def run(plan: list[Step], say=print) -> None:
    """Carry the steps out in order; the first failure raises (OSError or CalledProcessError)."""
    for step in plan:
        say(f"install: {step.says}")
        if step.argv:
            subprocess.run(step.argv, check=True)
        elif step.put is not None:
            path, mode, content = step.put
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(path.name + ".part")
            if isinstance(content, Path):
                shutil.copyfile(content, part)
            else:
                part.write_bytes(content)
            part.chmod(mode)
            os.replace(part, path)
