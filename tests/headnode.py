"""A head node's root file system and a systemd container made of it, for the tests of
``layerpy.pyz`` and of the service: Debian bookworm's Essential packages and python3 (and,
for the service, systemd and dbus), made by mmdebstrap through apt's mirror and cached as
a tar in /var/cache/layerpy/headnode. Nothing of layerpy, nor pip, nor iproute2 is in it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

CACHE = Path(os.environ.get("LAYERPY_CACHE", "/var/cache/layerpy")) / "headnode"
HOOKS = ("/usr/share/mmdebstrap/hooks/merged-usr",)
EXCLUDES = ("/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*", "/usr/share/info/*")


def root(dest: Path, *, systemd: bool) -> Path:
    """A fresh copy of the root in `dest` (built once, then copied from the cache)."""
    packages = ["python3"] + (["systemd", "systemd-sysv", "dbus"] if systemd else [])
    recipe = {"suite": "bookworm", "variant": "essential", "packages": packages,
              "hooks": HOOKS, "excludes": EXCLUDES}  # fmt: skip
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    tar = CACHE / f"{key}.tar"
    if not tar.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        part = tar.with_suffix(".part")
        command = ["mmdebstrap", "--quiet", "--mode=root", "--variant=essential",
                   f"--include={','.join(packages)}", "--format=tar"]  # fmt: skip
        command += [f"--hook-dir={hook}" for hook in HOOKS]
        command += [f"--dpkgopt=path-exclude={pattern}" for pattern in EXCLUDES]
        subprocess.run([*command, "bookworm", str(part)], check=True, capture_output=True)
        part.rename(tar)
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(tar), "-C", str(dest), "--same-owner"], check=True)
    return dest


class Container:
    """systemd as PID 1 of `root`, inside network namespace `netns`: systemd-nspawn without
    machined or a host systemd (--register=no --keep-unit)."""

    def __init__(self, root: Path, netns: str, log: Path) -> None:
        (root / "etc" / "machine-id").write_text("")  # a new one at each boot
        self.log = log
        command = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit",
                   f"--network-namespace-path=/run/netns/{netns}", "-D", str(root), "--boot"]  # fmt: skip
        with log.open("wb") as out:
            self.nspawn = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )
        self.pid = self._init_pid()
        self.wait(lambda: self.run("systemctl", "is-system-running").stdout.strip()
                  in ("running", "degraded"), 120, "systemd in the container up")  # fmt: skip

    def _init_pid(self) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children")
            found = children.read_text().split() if children.exists() else []
            if found and Path(f"/proc/{found[0]}/comm").read_text().strip() == "systemd":
                return int(found[0])
            if self.nspawn.poll() is not None:
                raise AssertionError(f"systemd-nspawn exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(
            f"no systemd in the container after 60 s: {self.log.read_text()[-2000:]}"
        )

    def run(
        self, *command: str, check: bool = False, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """A command inside the container (its namespaces, as root)."""
        enter = ["nsenter", "-t", str(self.pid), "-m", "-u", "-i", "-n", "-p", "--"]
        return subprocess.run([*enter, *command], capture_output=True, text=True, check=check,
                              timeout=timeout)  # fmt: skip

    def wait(self, condition, timeout: float, what: str) -> float:
        return wait_for(condition, timeout, what, self.nspawn, self.log)

    def close(self) -> None:
        if self.nspawn.poll() is None:
            self.run("systemctl", "poweroff", "--no-block")
            try:
                self.nspawn.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.nspawn.pid, 9)
                self.nspawn.wait()


def copy_into(root: Path, source: Path, inside: str) -> None:
    target = root / inside.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)


def wait_for(condition, timeout: float, what: str, process: subprocess.Popen, log: Path) -> float:
    """Poll `condition` until it holds (returns the seconds it took); fail saying what was
    awaited, with the tail of `log`, on the timeout or when `process` exits first."""
    started = time.monotonic()
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"it exited while waiting for {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() - started > timeout:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.2)
    return time.monotonic() - started
