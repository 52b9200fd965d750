"""Run the node's system image as a privileged container and swap it without a reboot.

The server names an image (digest, URL, sha256, format); the Runner downloads it into RAM,
prepares a root (squashfs under an overlay, or a tar extracted onto tmpfs) while the old
container keeps running, and only then swaps. A container is busybox ``unshare`` (Python
3.11 has no os.unshare) with new mount, PID, UTS and IPC namespaces and the host's network,
chrooted into the root. Containers do not depend on the agent or the server: the agent may
restart and re-adopts them from ``container.json``; a prepared image needs no network.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

BUSYBOX = "/bin/busybox"
MARKER = "layerpy-container"  # $0 of every container's PID 1: how a restarted agent knows ours
CGROUP = "layerpy.container"  # a systemd container's cgroup, below the agent's own (see SHIM)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HTTP_TIMEOUT = 30.0
CHUNK = 1 << 20
CRASH_LIMIT = 5  # deaths within CRASH_WINDOW seconds make the state "error"
CRASH_WINDOW = 300.0
STABLE = 60.0  # a run this long forgives earlier deaths
FORMATS = ("squashfs", "tar")

# PID 1 of every container, run by the host's busybox inside the new namespaces: build the
# container's view of /proc, /sys, /dev, /run, /tmp (these mounts die with the namespace),
# name it, then run the image's command. systemd is exec'd, as it must be PID 1; anything
# else runs as a child that SIGTERM is forwarded to, because PID 1 ignores signals it has no
# handler for, and because something has to reap the orphans of plain entrypoints. The trap
# is set first so that a stop during the set-up is not lost either.
#
# systemd also needs a cgroup2 hierarchy it may write to: the minOS mounts one on
# /sys/fs/cgroup (else the shim mounts it in the container), and the shim moves itself into
# a cgroup of its own (CGROUP, below its current one), emptied of what a previous run left.
# With no cgroup namespace (busybox unshare has no -C) systemd takes the cgroup it finds
# itself in as its root and builds init.scope, system.slice, ... below it. On a host with
# cgroup v1 (no cgroup.controllers) this is skipped and systemd copes on its own.
SHIM = r"""
set -e
bb=$1 root=$2 host=$3 mode=$4
shift 4
c= stop=
trap 'stop=1; [ -z "$c" ] || $bb kill -TERM $c 2>/dev/null' TERM
for d in proc sys dev run tmp; do [ -d "$root/$d" ] || $bb mkdir -p "$root/$d"; done
$bb mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
$bb mount --rbind /sys "$root/sys"
$bb mount --rbind /dev "$root/dev"
$bb mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs "$root/run"
$bb mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$root/tmp"
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
        $bb mkdir -p "$cg" && echo 0 >"$cg/cgroup.procs" ||
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


class PullError(Exception):
    """Download, verification or preparation failed; the message is the reason reported."""


class Superseded(Exception):
    """The server wants something else now: drop this pull."""


def _uptime() -> float:
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def _stderr(msg: str) -> None:
    print(f"layerpy-agent: {msg}", file=sys.stderr, flush=True)


def _short(digest: str) -> str:
    return digest[:19] + "…" if len(digest) > 19 else digest


def _label(spec: dict | None) -> str:
    if not isinstance(spec, dict):
        return "none"
    return f"{spec.get('name')} {_short(str(spec.get('digest')))}"


def _key(spec: dict | None) -> str | None:
    """What makes a new container: the image and how it is run (not the URL it comes from)."""
    if spec is None:
        return None
    return json.dumps([spec.get(k) for k in ("digest", "format", "systemd", "command", "config")])


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


def _mount_points() -> list[str]:
    """Mount points in mount order (mountinfo escapes spaces and the like as octal)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    unescape = re.compile(r"\\([0-7]{3})")
    return [unescape.sub(lambda m: chr(int(m[1], 8)), ln.split()[4]) for ln in lines]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def download(
    url: str,
    path: str,
    sha256: str,
    size: int | None,
    label: str,
    check: Callable[[], None] = lambda: None,
) -> None:
    """Stream ``url`` to ``path``, hashing as it comes.

    ``check`` runs between chunks and raises to abandon the download. Failures raise
    PullError naming ``label`` (the digest the server knows the image by).
    """
    digest = hashlib.sha256()
    n = 0
    # No proxies: the server is on the node's own boot network, whatever the environment says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=HTTP_TIMEOUT) as resp, open(path, "wb") as f:
            while chunk := resp.read(CHUNK):
                check()
                n += len(chunk)
                if size is not None and n > size:
                    raise PullError(f"size mismatch for {label}: more than {size} bytes")
                digest.update(chunk)
                f.write(chunk)
    except urllib.error.HTTPError as e:
        e.close()
        raise PullError(f"download of {label} failed: HTTP {e.code} {e.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise PullError(f"download of {label} failed: {reason}") from None
    if size is not None and n != size:
        raise PullError(f"size mismatch for {label}: got {n} bytes, expected {size}")
    if digest.hexdigest() != sha256.lower():
        raise PullError(f"sha256 mismatch for {label}: got {digest.hexdigest()}")


def extract_tar(path: str, root: str, check: Callable[[], None] = lambda: None) -> None:
    """Unpack a rootfs tar into ``root`` with owners, modes (setuid too), links and devices.

    Refuses entries (and hard link targets) that would land outside ``root``, also through
    symlinks unpacked earlier; symlinks themselves may point anywhere: they are resolved
    inside the chroot.
    """
    root = os.path.realpath(root)
    # Our own checks replace the extraction filters of newer Pythons (which drop setuid bits).
    kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}

    def checked(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
        for m in tf:  # lazily: each check sees the links extracted before it
            check()
            m.name = m.name.lstrip("/")
            names = [m.name]
            if m.islnk():
                m.linkname = m.linkname.lstrip("/")
                names.append(m.linkname)
            for name in names:
                if not _inside(os.path.realpath(os.path.join(root, name)), root):
                    raise PullError(f"tar entry {name!r} escapes the image root")
            yield m

    try:
        with tarfile.open(path, "r:") as tf:
            tf.extractall(root, members=checked(tf), numeric_owner=True, **kw)
    except (OSError, tarfile.TarError) as e:
        raise PullError(f"cannot unpack the tar: {e}") from None


class Image:
    """A prepared root: what runs in it, and the mounts and files to drop afterwards."""

    def __init__(self, spec: dict, dir: str, mounts: list[str], argv: list[str]) -> None:
        self.spec = spec
        self.dir = dir
        self.mounts = mounts  # mount points in mount order
        self.argv = argv  # what the shim runs: env -i ... nsenter --root ... command

    @property
    def root(self) -> str:
        return os.path.join(self.dir, "root")

    @property
    def label(self) -> str:
        return _label(self.spec)

    def record(self) -> dict:
        return {"spec": self.spec, "dir": self.dir, "mounts": self.mounts, "argv": self.argv}


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


def _kill(pid: int | None, sig: int) -> None:
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


class Runner:
    """Keeps the image the server wants running. want(), tick() and report() return quickly:
    pulls run in a worker thread, restarts are driven by tick()."""

    def __init__(
        self,
        state_dir: str = "/run/layerpy",
        log: Callable[[str], None] = _stderr,
        hostname: str = "",
        *,
        busybox: str = BUSYBOX,
        console: str = "/dev/console",
        stop_timeout: float = 10.0,
        backoff: tuple[float, float] = (1.0, 30.0),
        pull_backoff: tuple[float, float] = (5.0, 300.0),
    ) -> None:
        self.state_dir = os.path.realpath(state_dir)
        self.images_dir = os.path.join(self.state_dir, "images")
        self.record_path = os.path.join(self.state_dir, "container.json")
        self.log = log
        self.hostname = hostname or socket.gethostname()
        self.busybox = busybox
        self.console = console
        self.stop_timeout = stop_timeout
        self.backoff = backoff
        self.pull_backoff = pull_backoff
        # (state, spec it is about, error, uptime since): one tuple, so report() reads it whole
        self._status: tuple[str, dict | None, str | None, float] = ("none", None, None, _uptime())
        self._want: dict | None = None
        self._want_key: str | None = None
        self._image: Image | None = None
        self._proc: Proc | None = None
        self._loggers: list[subprocess.Popen] = []
        self._started = 0.0  # monotonic time of the last container start
        self._restart_at: float | None = None
        self._deaths: list[float] = []
        self._crash_error: str | None = None
        self._pull_error: tuple[str | None, dict | None, str] | None = None  # key, spec, reason
        self._pull_fails = 0
        self._retry_at = 0.0
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()  # the container and the current image
        self._state_lock = threading.RLock()  # the wanted spec, the worker, the state reported
        self._adopt()

    # -- the API the agent loop calls --

    def want(self, spec: dict | None) -> None:
        """The server's answer: the image to run, or None for nothing."""
        if spec is not None and not isinstance(spec, dict):
            spec = {"name": None, "digest": repr(spec)}  # fails in the pull, reported
        key = _key(spec)
        if key == self._want_key:
            self._want = spec  # same container; the URL may have moved
            return
        with self._state_lock:
            self._want, self._want_key = spec, key
        self._kick()

    def tick(self) -> None:
        """Reap and restart a dead container, start pending pulls; skips while a swap runs."""
        if self._lock.acquire(blocking=False):
            try:
                self._watch()
            finally:
                self._lock.release()
        self._kick()

    def report(self) -> dict:
        state, spec, error, since = self._status
        proc = self._proc
        return {
            "image_state": state,
            "image": spec.get("name") if spec else None,
            "image_digest": spec.get("digest") if spec else None,
            "image_error": error,
            "container_pid": proc.init_pid() if proc else None,
            "image_since": since,
        }

    # -- state --

    def _set(self, state: str, spec: dict | None, error: str | None = None) -> None:
        old, old_spec, old_error, since = self._status
        digest = spec.get("digest") if spec else None
        if (old, old_spec.get("digest") if old_spec else None, old_error) != (state, digest, error):
            since = _uptime()
        self._status = (state, spec, error, since)

    def _settle(self) -> None:
        """The resting state, once no pull is under way."""
        with self._state_lock:
            image = self._image
            if self._worker is not None:
                return
            if self._pull_error is not None:
                self._set("error", self._pull_error[1], self._pull_error[2])
            elif image is not None and self._crash_error:
                self._set("error", image.spec, self._crash_error)
            elif image is not None:
                self._set("active", image.spec)
            else:
                self._set("none", None)

    def _check(self, key: str | None) -> None:
        if self._want_key != key:
            raise Superseded

    # -- pulls (worker thread) --

    def _kick(self) -> None:
        """Start a worker when the server wants something else than what runs."""
        with self._state_lock:
            if self._worker is not None:
                return
            spec, key = self._want, self._want_key
            if key == (_key(self._image.spec) if self._image else None):
                if self._pull_error is not None:  # the server went back to what runs
                    self._pull_error = None
                    self._settle()
                return
            if (
                self._pull_error
                and self._pull_error[0] == key
                and time.monotonic() < self._retry_at
            ):
                return
            if spec is not None:  # reported from now on, not when the thread gets going
                self._set("updating" if self._image else "pulling", spec)
            self._worker = threading.Thread(
                target=self._work, args=(spec, key), name="layerpy-image", daemon=True
            )
            self._worker.start()

    def _work(self, spec: dict | None, key: str | None) -> None:
        try:
            if spec is None:
                with self._lock:
                    self._check(key)
                    if self._image is not None:
                        self.log(f"image {self._image.label}: stopping, the server wants none")
                        self._stop()
                        self._drop_image()
            else:
                self._switch(spec, key)
            self._pull_error, self._pull_fails = None, 0
        except Superseded:
            self.log(f"image {_label(spec)}: superseded, dropped")
        except Exception as e:  # whatever it was, the old container keeps running
            reason = str(e) if isinstance(e, PullError) else f"{type(e).__name__}: {e}"
            same = self._pull_error is not None and self._pull_error[0] == key
            self._pull_fails = self._pull_fails + 1 if same else 1
            low, high = self.pull_backoff
            delay = min(low * 2 ** (self._pull_fails - 1), high)
            self._retry_at = time.monotonic() + delay
            self._pull_error = (key, spec, reason)
            self.log(f"image {_label(spec)}: {reason}; retrying in {delay:g} s")
        finally:
            with self._state_lock:
                self._worker = None
            self._settle()
            self._kick()

    def _switch(self, spec: dict, key: str | None) -> None:
        t0 = time.monotonic()
        image = self._pull(spec, key, "updating" if self._image else "pulling")
        try:
            with self._lock:
                self._check(key)
                self._stop()
                self._drop_image()
                self._image = image
                self._start()
        finally:
            if self._image is not image:
                self._teardown(image)
        self.log(f"image {image.label} active in {time.monotonic() - t0:.1f} s")

    def _pull(self, spec: dict, key: str | None, verb: str) -> Image:
        """Download and prepare an image while the old container keeps running."""
        digest, fmt, sha = spec.get("digest"), spec.get("format"), spec.get("sha256")
        size, url = spec.get("size"), spec.get("url")
        if not (isinstance(digest, str) and isinstance(url, str) and fmt in FORMATS):
            raise PullError("bad image spec: needs digest, url and format squashfs or tar")
        if not (isinstance(sha, str) and re.fullmatch(r"[0-9a-fA-F]{64}", sha)):
            raise PullError("bad image spec: sha256 is not 64 hex digits")
        if not (size is None or isinstance(size, int)):
            raise PullError("bad image spec: size is not an integer")
        mb = f"{size / 1e6:.1f} MB" if size is not None else "size unknown"
        self.log(f"image {_label(spec)} {verb} ({mb})")
        os.makedirs(self.images_dir, exist_ok=True)
        image = Image(spec, tempfile.mkdtemp(prefix=sha[:12] + "-", dir=self.images_dir), [], [])
        try:
            path = os.path.join(image.dir, f"rootfs.{fmt}")
            download(url, path, sha, size, digest, lambda: self._check(key))
            if fmt == "squashfs":
                lower, rw = os.path.join(image.dir, "lower"), os.path.join(image.dir, "rw")
                self._mount(image, lower, "-t", "squashfs", "-o", "loop,ro", path)
                self._mount(image, rw, "-t", "tmpfs", "-o", "mode=0755", "tmpfs")
                for d in ("upper", "work"):
                    os.mkdir(os.path.join(rw, d))
                opts = f"lowerdir={lower},upperdir={rw}/upper,workdir={rw}/work"
                self._mount(image, image.root, "-t", "overlay", "-o", opts, "overlay")
            else:
                self._mount(image, image.root, "-t", "tmpfs", "-o", "mode=0755", "tmpfs")
                extract_tar(path, image.root, lambda: self._check(key))
                os.unlink(path)  # the tree is on tmpfs now: give the RAM back
            image.argv = self._command(image)
            return image
        except BaseException:
            self._teardown(image)
            raise

    def _command(self, image: Image) -> list[str]:
        """env -i + nsenter --root/--wd + the command: what the shim runs, chrooted."""
        spec, root = image.spec, image.root
        cfg = spec.get("config") or {}
        if spec.get("systemd"):
            cmd = ["/sbin/init"]
        elif spec.get("command"):
            cmd = list(spec["command"])
        else:
            cmd = list(cfg.get("Entrypoint") or []) + list(cfg.get("Cmd") or [])
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise PullError(f"{_label(spec)} has no command (Entrypoint, Cmd or command)")
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": self.hostname}
        env.update(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        env["container"] = "layerpy"  # systemd's container interface; also a marker
        wd = os.path.realpath(os.path.join(root, (cfg.get("WorkingDir") or "/").lstrip("/")))
        if not _inside(wd, os.path.realpath(root)):
            raise PullError(f"WorkingDir {cfg.get('WorkingDir')!r} leaves the image root")
        os.makedirs(wd, exist_ok=True)
        if cfg.get("User") not in (None, "", "root", "0", "0:0"):
            self.log(f"image {_label(spec)} asks for User {cfg['User']!r}; runs as root")
        bb = self.busybox
        envs = [f"{k}={v}" for k, v in env.items()]
        return [bb, "env", "-i", *envs, bb, "nsenter", f"--root={root}", f"--wd={wd}", "--", *cmd]

    def _mount(self, image: Image, target: str, *args: str) -> None:
        os.makedirs(target, exist_ok=True)
        self._bb("mount", *args, target)
        image.mounts.append(target)

    def _bb(self, *args: str) -> None:
        try:
            p = subprocess.run(
                [self.busybox, *args], capture_output=True, text=True, timeout=120, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PullError(f"{args[0]} failed: {e}") from None
        if p.returncode != 0:
            detail = p.stderr.strip() or f"status {p.returncode}"
            raise PullError(f"{' '.join(args[:1] + args[-1:])} failed: {detail}")

    def _teardown(self, image: Image) -> None:
        """Unmount and delete a root: its RAM goes back to the node."""
        if not self._umount(reversed(image.mounts)):
            self.log(f"image {image.label}: kept {image.dir}, it is still mounted")
            return
        shutil.rmtree(image.dir, ignore_errors=True)

    def _umount(self, targets: Iterator[str] | list[str]) -> bool:
        ok = True
        for target in targets:
            try:
                self._bb("umount", target)
            except PullError:
                try:  # busy (a process elsewhere holds it): detach, freed when released
                    self._bb("umount", "-l", target)
                except PullError as e:
                    ok = False
                    self.log(f"cannot unmount {target}: {e}")
        return ok

    def _drop_image(self) -> None:
        image, self._image = self._image, None
        self._crash_error, self._deaths = None, []
        self._forget()
        if image is not None:
            self._teardown(image)

    # -- the container (under self._lock) --

    def _start(self) -> None:
        image = self._image
        if image is None:
            return
        systemd = bool(image.spec.get("systemd"))
        mode = "systemd" if systemd else "run"
        argv = [self.busybox, "unshare", "-m", "-p", "-u", "-i", "-f", "--propagation", "private"]
        argv += ["--", self.busybox, "sh", "-c", SHIM, MARKER, self.busybox, image.root]
        argv += [self.hostname, mode, *image.argv]
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
                awk = [self.busybox, "awk", "-v", f"p=[{image.spec.get('name')}] "]
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
                env={"PATH": "/sbin:/usr/sbin:/bin:/usr/bin"},
            )
        except OSError as e:
            self.log(f"cannot start the container: {e}")
            self._died(f"start failure ({e})")
            return
        finally:
            for fd in fds:
                os.close(fd)
        st = _stat(popen.pid)
        self._proc = Proc(popen.pid, st[1] if st else 0, popen)
        self._save()
        cmd = image.argv[image.argv.index("--") + 1 :]
        self.log(f"container started (unshare pid {popen.pid}): {' '.join(cmd)}")

    def _stop(self) -> None:
        """Stop the container and wait: SIGTERM (systemd: SIGRTMIN+3), SIGKILL when late."""
        proc, self._proc, self._restart_at = self._proc, None, None
        if proc is None or self._image is None:
            return
        t0 = time.monotonic()
        deadline = t0 + self.stop_timeout
        systemd = bool(self._image.spec.get("systemd"))
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

    def _watch(self) -> None:
        self._loggers = [p for p in self._loggers if p.poll() is None]
        now = time.monotonic()
        if self._proc is not None:
            status = self._proc.exited()
            if status is None:
                if self._deaths and now - self._started >= STABLE:
                    self._deaths, self._crash_error = [], None
                    self._settle()
                return
            self._proc = None
            self._died(status)
        elif self._restart_at is not None and now >= self._restart_at:
            self._start()

    def _died(self, status: str) -> None:
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < CRASH_WINDOW] + [now]
        low, high = self.backoff
        delay = min(low * 2 ** (len(self._deaths) - 1), high)
        self._restart_at = now + delay
        self.log(f"container exited with {status}, restarting in {delay:g} s")
        if len(self._deaths) >= CRASH_LIMIT and self._image is not None:
            self._crash_error = (
                f"container exited {len(self._deaths)} times in"
                f" {now - self._deaths[0]:.0f} s (last: {status})"
            )
            self._settle()

    # -- surviving agent restarts --

    def _save(self) -> None:
        if self._proc is None or self._image is None:
            return
        rec = {"pid": self._proc.pid, "start": self._proc.start, "image": self._image.record()}
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

    def _adopt(self) -> None:
        """Take over what a previous agent left: its container if alive, else its prepared
        image (restarting the container from it); unmount and delete everything else."""
        try:
            with open(self.record_path, encoding="utf-8") as f:
                rec = json.load(f)
            image = Image(**rec["image"])
            pid, start = int(rec["pid"]), int(rec["start"])
        except (OSError, ValueError, TypeError, KeyError):
            image = None
        mounts = _mount_points()
        if image is not None and image.root in mounts:
            self._image = image
            self._want, self._want_key = image.spec, _key(image.spec)
            st = _stat(pid)
            if (
                st
                and st[1] == start
                and st[0] != "Z"
                and MARKER in (cmd := _cmdline(pid))
                and (image.root in cmd)
            ):
                self._proc = Proc(pid, start)
                self._started = time.monotonic()
                self.log(f"adopted container pid {pid} running {image.label}")
            else:
                self._restart_at = time.monotonic()
                self.log(f"container of {image.label} is gone; restarting it")
            self._settle()
        else:
            image = None
            self._forget()
        keep = image.dir if image else None
        stale = [
            m for m in mounts if _inside(m, self.images_dir) and not (keep and _inside(m, keep))
        ]
        if not self._umount(stale[::-1]):
            return
        try:
            names = os.listdir(self.images_dir)
        except OSError:
            names = []
        for name in names:
            path = os.path.join(self.images_dir, name)
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)
