"""The container of one prepared image: its process, kept running until it is stopped.

A container is busybox ``unshare`` (Python 3.11 has no os.unshare) with new mount, PID,
UTS and IPC namespaces and the host's network, running SHIM, which chroots into the
image's root. It does not depend on the agent: it is recorded in ``container.json`` so
that a restarted agent adopts it, or restarts it from the prepared root when it is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from layerpy.agent.image import DEFAULT_PATH, Image, Roots, mount_points

NODE_DIR = "/run/layerpy"  # in a container: what it tells the agent (a file "busy")
APPLY_TIMEOUT = 120.0  # seconds a file's apply command may take
MARKER = "layerpy-container"  # $0 of every container's PID 1: how a restarted agent knows ours
CGROUP = "layerpy.container"  # a systemd container's cgroup, below the agent's own (see SHIM)
CRASH_LIMIT = 5  # deaths within CRASH_WINDOW seconds make the state "error"
CRASH_WINDOW = 300.0
STABLE = 60.0  # a run this long forgives earlier deaths

# PID 1 of every container, run by the host's busybox inside the new namespaces: build the
# container's view of /proc, /sys, /dev, /run, /tmp, bind the node's directories in (its
# /run/layerpy, the image's persistent paths; these mounts die with the namespace), name it,
# then run the image's command. systemd is exec'd, as it must be PID 1; anything
# else runs as a child that SIGTERM is forwarded to, because PID 1 ignores signals it has no
# handler for, and because something has to reap the orphans of plain entrypoints. The trap
# is set first so that a stop during the set-up is not lost either.
#
# systemd also needs a cgroup2 hierarchy it may write to: the minOS mounts one on
# /sys/fs/cgroup (else the shim mounts it in the container), and the shim moves itself into
# a cgroup of its own (CGROUP, below its current one), emptied of what a previous run left,
# then enters a cgroup namespace rooted there (cgroupns.py: busybox unshare has no -C), so
# systemd sees that cgroup as /sys/fs/cgroup and builds init.scope, system.slice, ... in
# it, as under systemd-nspawn. On a host with cgroup v1 (no cgroup.controllers) this is
# skipped and systemd copes on its own.
SHIM = r"""
set -e
bb=$1 py=$2 root=$3 host=$4 mode=$5 binds=$6
shift 6
c= stop=
trap 'stop=1; [ -z "$c" ] || $bb kill -TERM $c 2>/dev/null' TERM
for d in proc sys dev run tmp; do [ -d "$root/$d" ] || $bb mkdir -p "$root/$d"; done
$bb mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
$bb mount --rbind /sys "$root/sys"
$bb mount --rbind /dev "$root/dev"
$bb mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs "$root/run"
$bb mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$root/tmp"
while [ "$binds" -gt 0 ]; do
    [ -d "$root$2" ] || $bb mkdir -p "$root$2"
    $bb mount --bind "$1" "$root$2"
    shift 2
    binds=$((binds - 1))
done
r=$root/etc/resolv.conf
if [ -s /etc/resolv.conf ] && [ -f "$r" ] && [ ! -L "$r" ]; then
    $bb mount --bind /etc/resolv.conf "$r"
fi
$bb hostname "$host"
set +e
[ -z "$stop" ] || exit 143
if [ "$mode" = systemd ]; then
    fs=$root/sys/fs/cgroup
    if [ "$($bb stat -f -c %T "$fs")" = sysfs ]; then  # nothing mounted there
        $bb mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$fs"
    fi
    if [ -f "$fs/cgroup.controllers" ]; then
        own=$($bb sed -n 's/^0:://p' /proc/self/cgroup)
        cg=$fs${own%/}/CGROUP
        [ -d "$cg" ] && $bb find "$cg" -mindepth 1 -depth -type d -exec $bb rmdir {} \;
        if $bb mkdir -p "$cg" && echo 0 >"$cg/cgroup.procs"; then
            exec "$py" -m layerpy.agent.cgroupns "$bb" "$root" "$@"
        fi
        echo "layerpy: systemd gets no cgroup of its own ($cg)" >&2
    fi
    exec "$@"
fi
"$@" &
c=$!
[ -z "$stop" ] || $bb kill -TERM $c
while :; do
    wait $c
    s=$?
    $bb kill -0 $c 2>/dev/null || exit $s
done
""".replace("CGROUP", CGROUP)


def backoff(bounds: tuple[float, float], failures: int) -> float:
    """The delay after ``failures`` failures in a row: doubling from low, capped at high."""
    low, high = bounds
    return min(low * 2 ** (failures - 1), high)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in ticks) of a process, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _catches(pid: int, sig: int, field: str = "SigCgt") -> bool:
    """Whether a process has a handler for ``sig`` (SigCgt in /proc/<pid>/status), or with
    ``field="SigBlk"`` blocks it (systemd blocks what it reads from a signalfd: a blocked
    signal is queued for PID 1, never dropped)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _drop_cgroup(fs: str = "/sys/fs/cgroup") -> None:
    """Remove the cgroups a stopped systemd container left behind, deepest first. Best
    effort: one still busy (a process not yet reaped) goes when the shim next starts."""
    if not os.path.exists(os.path.join(fs, "cgroup.controllers")):
        return  # no cgroup2 here: the shim mounted its own inside the container
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            own = next(line[3:].strip() for line in f if line.startswith("0::"))
    except (OSError, StopIteration):
        return
    top = fs + own.rstrip("/") + "/" + CGROUP
    for path, _, _ in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            os.rmdir(path)


def _shim_environment() -> dict[str, str]:
    """PATH, and where the agent's Python finds itself and layerpy (for cgroupns.py)."""
    layerpy_parent = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    env = {"PATH": "/sbin:/usr/sbin:/bin:/usr/bin", "PYTHONPATH": layerpy_parent}
    if "PYTHONHOME" in os.environ:
        env["PYTHONHOME"] = os.environ["PYTHONHOME"]
    return env


def _kill(pid: int | None, sig: int) -> None:
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


class Proc:
    """The busybox ``unshare`` holding a container: our child, or adopted from an old agent."""

    def __init__(self, pid: int, start: int, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.start = start
        self.popen = popen
        self._init: int | None = None

    def exited(self) -> str | None:
        """None while it runs, else how it ended."""
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is None:
                return None
            return f"signal {-rc}" if rc < 0 else str(rc)
        st = _stat(self.pid)  # not our child: no exit status to collect
        return None if st and st[1] == self.start and st[0] != "Z" else "unknown status"

    def wait(self, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while (status := self.exited()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return status

    def init_pid(self) -> int | None:
        """The container's PID 1 as the host sees it: the child ``unshare -f`` forked."""
        if self._init is None:
            try:
                with open(f"/proc/{self.pid}/task/{self.pid}/children", encoding="ascii") as f:
                    kids = f.read().split()
            except OSError:
                kids = []
            self._init = int(kids[0]) if kids else None
        return self._init


class Container:
    """The container of the current image: started, restarted with backoff when it dies
    (its deaths counted into ``error``), stopped, and recorded for a restarted agent.
    The caller serialises the calls."""

    def __init__(
        self,
        roots: Roots,
        record_path: str,
        log: Callable[[str], None],
        *,
        node_dir: str,
        busybox: str,
        console: str,
        stop_timeout: float,
        backoff: tuple[float, float],
    ) -> None:
        self.roots = roots
        self.record_path = record_path
        self.log = log
        self.node_dir = node_dir  # the container's /run/layerpy (a job marks the node busy)
        self.busybox = busybox
        self.console = console
        self.stop_timeout = stop_timeout
        self.backoff = backoff
        self.image: Image | None = None
        self.proc: Proc | None = None
        self.error: str | None = None  # set when it keeps dying
        self._loggers: list[subprocess.Popen] = []
        self._started = 0.0  # monotonic time of the last start
        self._restart_at: float | None = None
        self._deaths: list[float] = []

    def replace(self, image: Image | None, hostname: str) -> None:
        """Stop the container, tear its root down, and start one from ``image``."""
        self._stop()
        old, self.image = self.image, None
        self.error, self._deaths = None, []
        self._forget()
        if old is not None:
            self.roots.teardown(old)
        self.image = image
        self._start(hostname)

    def watch(self, hostname: str) -> bool:
        """Reap a dead container and restart it when its backoff is over; True when
        ``error`` may have changed."""
        self._loggers = [p for p in self._loggers if p.poll() is None]
        error = self.error
        now = time.monotonic()
        if self.proc is not None:
            status = self.proc.exited()
            if status is None:
                if self._deaths and now - self._started >= STABLE:
                    self._deaths, self.error = [], None
                    return True
                return False
            self.proc = None
            self._died(status)
        elif self._restart_at is not None and now >= self._restart_at:
            self._start(hostname)
        return self.error != error

    def adopt(self) -> Image | None:
        """Take over what a previous agent left: its container if alive, else its prepared
        image (restarting the container from it at the next watch). Returns the image."""
        try:
            with open(self.record_path, encoding="utf-8") as f:
                rec = json.load(f)
            image = Image.from_record(rec["image"])
            proc = Proc(int(rec["pid"]), int(rec["start"]))
        except (OSError, ValueError, TypeError, KeyError):
            image = None
        if image is None or image.root not in mount_points():
            self._forget()
            return None
        self.image = image
        if proc.exited() is None and MARKER in (cmd := _cmdline(proc.pid)) and image.root in cmd:
            self.proc = proc
            self._started = time.monotonic()
            self.log(f"adopted container pid {proc.pid} running {image.label}")
        else:
            self._restart_at = time.monotonic()
            self.log(f"container of {image.label} is gone; restarting it")
        return image

    def _start(self, hostname: str) -> None:
        image = self.image
        if image is None:
            return
        systemd = image.spec.systemd
        mode = "systemd" if systemd else "run"
        argv = [self.busybox, "unshare", "-m", "-p", "-u", "-i", "-f", "--propagation", "private"]
        binds = [(self.node_dir, NODE_DIR), *image.binds]
        argv += ["--", self.busybox, "sh", "-c", SHIM, MARKER, self.busybox, sys.executable]
        argv += [image.root]
        argv += [hostname, mode, str(len(binds)), *(p for bind in binds for p in bind)]
        argv += image.argv
        self._restart_at = None
        self._started = time.monotonic()
        fds: list[int] = []
        try:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOCTTY
            console = out = os.open(self.console, flags, 0o644)
            fds.append(console)
            if not systemd:  # prefix each line; a separate process, so it outlives the agent
                r, out = os.pipe()
                fds += [r, out]
                awk = [self.busybox, "awk", "-v", f"p=[{image.spec.name}] "]
                self._loggers.append(
                    subprocess.Popen(
                        [*awk, "{ print p $0; fflush() }"],
                        stdin=r, stdout=console, stderr=console, start_new_session=True,
                    )
                )  # fmt: skip
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # no console signals; survives the agent
                env=_shim_environment(),
            )
        except OSError as e:
            self.log(f"cannot start the container: {e}")
            self._died(f"start failure ({e})")
            return
        finally:
            for fd in fds:
                os.close(fd)
        st = _stat(popen.pid)
        self.proc = Proc(popen.pid, st[1] if st else 0, popen)
        self._save()
        cmd = image.argv[image.argv.index("--") + 1 :]
        self.log(f"container started (unshare pid {popen.pid}): {' '.join(cmd)}")

    def run_inside(self, command: str) -> str | None:
        """Run a shell command line as root in the running container (its namespaces, its
        root); None when it succeeded, else what went wrong with the end of its output."""
        init = self.proc.init_pid() if self.proc is not None else None
        if init is None or self.image is None:
            return "no container runs"
        bb, root = self.busybox, self.image.root
        env = [f"PATH={DEFAULT_PATH}", "HOME=/root", "container=layerpy"]
        argv = [bb, "env", "-i", *env, bb, "nsenter", "-t", str(init), "-m", "-u", "-i", "-p"]
        # chroot once inside its mount namespace: nsenter --root would open the directory
        # before entering it, and miss the container's own mounts (/run, /sys, …)
        argv += ["--", bb, "chroot", root, "/bin/sh", "-c", command]
        with tempfile.TemporaryFile() as out:  # its output, whatever its size, not in RAM
            try:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=out, start_new_session=True)  # fmt: skip
            except OSError as e:
                return str(e)
            try:
                status = proc.wait(APPLY_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):  # nsenter forked the command: its session
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return f"still running after {APPLY_TIMEOUT:g} s: killed"
            if status == 0:
                return None
            out.seek(max(0, out.tell() - 300))
            tail = out.read().decode(errors="replace").strip()
        return f"exit status {status}" + (f": {tail}" if tail else "")

    def _stop(self) -> None:
        """Stop the container and wait: SIGTERM (systemd: SIGRTMIN+3), SIGKILL when late."""
        proc, self.proc, self._restart_at = self.proc, None, None
        if proc is None or self.image is None:
            return
        t0 = time.monotonic()
        deadline = t0 + self.stop_timeout
        systemd = self.image.spec.systemd
        while proc.exited() is None and time.monotonic() < deadline:
            init = proc.init_pid()
            # systemd halts on SIGRTMIN+3; the shim (also before it execs systemd) on SIGTERM
            shim = init is not None and MARKER in _cmdline(init)
            sig = signal.SIGRTMIN + 3 if systemd and not shim else signal.SIGTERM
            # PID 1 ignores what it neither catches nor blocks (systemd: blocked, signalfd)
            ready = init is not None and _catches(init, sig)
            if init is not None and systemd and not shim and not ready:
                ready = _catches(init, sig, "SigBlk")
            if ready:
                _kill(init, sig)
                break
            time.sleep(0.02)
        status = proc.wait(max(0.0, deadline - time.monotonic()))
        if status is None:
            self.log(f"container did not stop in {self.stop_timeout:g} s; killing it")
            _kill(proc.init_pid(), signal.SIGKILL)  # PID 1 of the namespace: takes all along
            _kill(proc.pid, signal.SIGKILL)
            status = proc.wait(5.0)
        self.log(f"container stopped ({status or 'still there'}) in {time.monotonic() - t0:.1f} s")
        if systemd:
            _drop_cgroup()
        self._forget()

    def _died(self, status: str) -> None:
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < CRASH_WINDOW] + [now]
        delay = backoff(self.backoff, len(self._deaths))
        self._restart_at = now + delay
        self.log(f"container exited with {status}, restarting in {delay:g} s")
        if len(self._deaths) >= CRASH_LIMIT:
            self.error = (
                f"container exited {len(self._deaths)} times in"
                f" {now - self._deaths[0]:.0f} s (last: {status})"
            )

    def _save(self) -> None:
        if self.proc is None or self.image is None:
            return
        rec = {"pid": self.proc.pid, "start": self.proc.start, "image": self.image.record()}
        tmp = self.record_path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(rec, f)
            os.replace(tmp, self.record_path)
        except OSError as e:
            self.log(f"cannot record the container in {self.record_path}: {e}")

    def _forget(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.record_path)
