"""`vm-lab/demo.sh --ha` (vm-lab/ha_session.py) run as a user runs it: a 3-member etcd and
two instances in namespaces, the owner of a node killed and the other taking over; and its
teardown leaving nothing behind, also on Ctrl-C.

The failover runs with one lab VM (cn001: booted, then kept running through the take-over,
its agent reporting to the survivor) and without any (ownership of the node file's nodes
only: the same take-over, a minute quicker).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns import need_root

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# Ctrl-C must reach the demo even when this suite runs where SIGINT is ignored (a background
# job of a shell, as a CI runner starts it): ignoring is inherited, and Python keeps ignoring
DEMO = ["env", "--default-signal=INT", sys.executable, str(REPO / "vm-lab" / "ha_session.py")]


def left_behind(pid: int, run_dir: Path) -> tuple[list[str], list[str]]:
    """Namespaces the demo process `pid` made (lab.py's lplab-<pid>-n, tests/etcd.py's
    lpe*<pid>x<n>) and processes started on its run directory, still there."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    own = re.compile(rf"lplab-{pid}-\d+|lpe[mbi]{pid % 100000}x\d+")
    namespaces = [line.split()[0] for line in names.splitlines() if own.fullmatch(line.split()[0])]
    procs = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if entry.name.isdigit() and str(run_dir) in cmdline:
            procs.append(f"{entry.name}: {cmdline[:200]}")
    return namespaces, procs


def sweep(namespaces: list[str], procs: list[str]) -> None:
    """Kill what the demo left (processes on its run directory, anything in its namespaces)
    and delete its namespaces: only what it made."""
    pids = [int(line.split(":")[0]) for line in procs]
    for name in namespaces:
        found = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        pids += [int(pid) for pid in found.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for name in namespaces:
        subprocess.run(["ip", "netns", "del", name], check=False)


def run_demo(run_dir: Path, vms: str, timeout: float) -> str:
    """The demo until the failover is shown; its output, checked for success and cleanup."""
    command = [*DEMO, "--vms", vms, "--until-failover", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the demo tears its lab down
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"demo --ha not done within {timeout:.0f} s:\n{out}")
    except BaseException:  # the test itself interrupted: the demo too
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        raise
    print(out)
    assert proc.returncode == 0, f"demo --ha failed ({proc.returncode}):\n{out}"
    assert left_behind(proc.pid, run_dir) == ([], []), "demo --ha left namespaces or processes"
    return out


def test_failover_without_vms(tmp_path: Path) -> None:
    """Both instances own some of the file's nodes; kill -9 of one: the other owns them
    all within 10 s, and `layerpy cluster` shows it before and after."""
    need_root()
    out = run_demo(tmp_path / "run", "", 240)
    before, after = out.split("kill -9 ", 1)
    assert before.count("alive") >= 2, (
        f"`layerpy cluster` before: not two live instances:\n{before}"
    )
    took = re.search(r"owns .* ([\d.]+) s after the kill", after)
    assert took and float(took[1]) < 10, after
    assert "gone" in after, f"`layerpy cluster` after the kill shows no instance gone:\n{after}"


def test_failover_with_a_vm(tmp_path: Path) -> None:
    """cn001 boots to ready, its owner is killed: it keeps running (no boot more), and its
    agent reports to the other instance."""
    need_root()
    out = run_demo(tmp_path / "run", "cn001", 600)
    assert "cn001: ready" in out and "(not booted again)" in out, out


def test_ctrl_c_tears_everything_down(tmp_path: Path) -> None:
    """Ctrl-C while the instances run: every namespace and process of the demo is gone."""
    need_root()
    run_dir = tmp_path / "run"
    command = [*DEMO, "--vms", "", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # ends if the demo exits early
            lines.append(line)
            if line.startswith("instances serving"):
                break
        assert proc.poll() is None, f"demo --ha exited before serving:\n{''.join(lines)}"
        namespaces, procs = left_behind(proc.pid, run_dir.resolve())
        assert len(namespaces) == 1 + 3 + 1 + 2 and procs, (
            namespaces,
            procs,
        )  # lab, etcd, instances
        proc.send_signal(signal.SIGINT)
        try:  # reading on: a demo blocked writing to a full pipe would never end
            lines.append(proc.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired as timeout:
            partial = timeout.output or b""  # bytes, even in text mode
            said = "".join(lines) + (
                partial.decode(errors="replace") if isinstance(partial, bytes) else partial
            )
            raise AssertionError(f"demo --ha still running 60 s after Ctrl-C:\n{said}") from None
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            sweep(*left_behind(proc.pid, run_dir.resolve()))  # a failed test leaves nothing
    deadline = time.monotonic() + 10
    while left_behind(proc.pid, run_dir.resolve()) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_behind(proc.pid, run_dir.resolve()) == ([], []), "left after Ctrl-C"
