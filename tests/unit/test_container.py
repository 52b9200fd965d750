"""The image runner for real: root, busybox namespaces, loop/squashfs/overlay/tmpfs mounts.

Images are a tiny rootfs (Debian's static busybox plus a few applet links and a marker
file) packed as a tar, and as a squashfs when tar2sqfs is installed, served by a loopback
http.server. Every test tears down its containers and mounts, also when it fails.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from layerpy.agent.container import Runner
from layerpy.agent.image import PullError, extract_tar
from layerpy.proto.agent import FILES_PATH, FileSpec, FilesSpec, ImageSpec, decode, encode

BUSYBOX = "/bin/busybox"
NODE = "node-t1"
APPLETS = ("sh", "echo", "sleep", "cat")
# What a test container runs: prints what the tests check, then sleeps until stopped.
PROBE = (
    'echo "up $MARK $(cat /etc/marker) in $PWD"; cat /proc/sys/kernel/hostname;'
    " echo procs /proc/[0-9]*; exec sleep 1000"
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(BUSYBOX), reason="needs root and /bin/busybox"
)


# -- images and the server they come from --------------------------------------------


def rootfs_tar(marker: str, init: str | None = None) -> bytes:
    """busybox + links + /etc/marker (+ /sbin/init), as a tar in memory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for d in ("bin", "etc", "sbin"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(ti)
        tf.add(BUSYBOX, "bin/busybox")
        for name in APPLETS:
            ti = tarfile.TarInfo(f"bin/{name}")
            ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
            tf.addfile(ti)
        files = {
            "etc/marker": (marker + "\n", 0o644),
            "etc/passwd": ("root:x:0:0::/root:/bin/sh\nmunge:x:107:113::/nonexistent:\n", 0o644),
            "etc/group": ("root:x:0:\nmunge:x:113:\n", 0o644),
        }
        if init is not None:
            files["sbin/init"] = (init, 0o755)
        for name, (text, mode) in files.items():
            data = text.encode()
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), mode
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


class Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the image directory; files under slow/ trickle (64 KiB per 50 ms)."""

    def log_message(self, *args: object) -> None:
        pass

    def copyfile(self, source: BinaryIO, outputfile: BinaryIO) -> None:
        if not self.path.startswith("/slow/"):
            return super().copyfile(source, outputfile)
        while chunk := source.read(65536):
            outputfile.write(chunk)
            time.sleep(0.05)
        return None


class Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """Superseded pulls hang up mid-file: not worth a traceback."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    root = tmp_path_factory.mktemp("images")
    (root / "slow").mkdir()
    srv = Server(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def image(server: tuple[Path, str]) -> Callable[..., dict]:
    """Builds and serves an image; returns the spec the server would send for it."""
    root, base = server

    def make(
        marker: str,
        fmt: str = "tar",
        cmd: list[str] | None = None,
        init: str | None = None,
        slow: bool = False,
        persist: list[str] | None = None,
    ) -> dict:
        data = rootfs_tar(marker, init)
        if fmt == "squashfs":
            out = root / f"{marker}.tmp"
            subprocess.run(["tar2sqfs", "-q", "-f", str(out)], input=data, check=True)
            data = out.read_bytes()
            out.unlink()
        sha = hashlib.sha256(data).hexdigest()
        name = f"{'slow/' if slow else ''}{sha}.{fmt}"
        (root / name).write_bytes(data)
        return {
            "name": "base",
            "digest": f"sha256:{hashlib.sha256(marker.encode()).hexdigest()}",
            "url": f"{base}/{name}",
            "format": fmt,
            "sha256": sha,
            "size": len(data),
            "config": {
                "Entrypoint": ["/bin/sh", "-c"],
                "Cmd": [PROBE],
                "Env": ["PATH=/bin", f"MARK={marker}"],
                "WorkingDir": "/srv/app",
                "User": "",
            },
            "systemd": init is not None,
            "command": cmd,
            "persist": persist or [],
        }

    return make


@pytest.fixture
def node_files(server: tuple[Path, str]) -> Callable[..., FilesSpec]:
    """Serves files where the agent fetches them; returns the FilesSpec naming them."""
    root, _ = server
    where = root / FILES_PATH.strip("/")
    where.mkdir(parents=True, exist_ok=True)

    def make(files: dict[str, tuple[bytes, int, str, str | None]]) -> FilesSpec:
        specs = []
        for path, (data, mode, owner, apply) in sorted(files.items()):
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            (where / digest).write_bytes(data)
            specs.append(FileSpec(path, digest, len(data), mode, owner, apply))
        revision = hashlib.sha256(repr(specs).encode()).hexdigest()[:16]
        return FilesSpec(revision, tuple(specs))

    return make


# -- runners, and cleaning up after them -----------------------------------------------


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4] for line in f]
    return [m for m in points if m.startswith(str(path.resolve()) + "/")]


def proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def hard_cleanup(state: Path) -> None:
    """Kill whatever still runs from ``state`` and unmount it, whatever the runner thinks."""
    needle = str(state.resolve()).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(proc_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for mount in reversed(mounts_under(state)):
        subprocess.run([BUSYBOX, "umount", "-l", mount], check=False)


class Agent:
    """A Runner plus the ticking the agent loop would do, with its log kept."""

    def __init__(self, state: Path, console: Path, **kw: Any) -> None:
        self.lines: list[str] = []
        self.seen: list[str] = []
        kw.setdefault("backoff", (0.05, 0.2))
        kw.setdefault("pull_backoff", (0.1, 0.2))
        kw.setdefault("stop_timeout", 5.0)
        self.r = Runner(str(state), self._log, NODE, console=str(console), **kw)

    def want(self, spec: dict | None, files: FilesSpec | None = None) -> None:
        """What the agent does with an answer: the contract checks the spec first."""
        self.r.want(None if spec is None else decode(ImageSpec, spec, "spec"), files)

    def report(self) -> dict:
        return encode(self.r.report())

    def _log(self, msg: str) -> None:
        print(msg)
        self.lines.append(msg)

    def wait(self, pred: Callable[[dict], bool], timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            self.r.tick()
            rep = self.report()
            if not self.seen or self.seen[-1] != rep["state"]:
                self.seen.append(rep["state"])
            if pred(rep):
                return rep
            if time.monotonic() > deadline:
                pytest.fail(f"timed out; last report {rep}")
            time.sleep(0.02)

    def state(self, state: str, digest: str | None = None) -> dict:
        """Waits for ``state`` (and ``digest``); "active" also waits for the container's
        PID 1, which exists a moment after ``unshare`` does."""
        return self.wait(
            lambda r: (
                r["state"] == state
                and (digest is None or r["digest"] == digest)
                and (state != "active" or r["container_pid"] is not None)
            )
        )


@pytest.fixture
def agent(tmp_path: Path, server: tuple[Path, str]) -> Iterator[Callable[..., Agent]]:
    made: list[Agent] = []

    def make(state: str = "state", **kw: Any) -> Agent:
        a = Agent(tmp_path / state, tmp_path / "console.log", **kw)
        a.r.server = server[1]
        made.append(a)
        return a

    yield make
    try:
        if made:  # only the last agent lives: the earlier ones stand for dead processes
            made[-1].want(None)
            made[-1].state("none")
    finally:
        hard_cleanup(tmp_path / "state")
    assert mounts_under(tmp_path / "state") == []
    assert not [ln for a in made for ln in a.lines if "did not stop" in ln]  # stops are prompt


def console(tmp_path: Path, text: str, timeout: float = 30.0) -> str:
    """The console log once it contains ``text``."""
    deadline = time.monotonic() + timeout
    while True:
        log = (tmp_path / "console.log").read_text() if (tmp_path / "console.log").exists() else ""
        if text in log:
            return log
        if time.monotonic() > deadline:
            pytest.fail(f"{text!r} not on the console:\n{log}")
        time.sleep(0.02)


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        return [int(x) for x in f.read().split()]


def runs(pid: int, command: str, timeout: float = 30.0) -> None:
    """Wait until process `pid` runs `command`: a shell's ``exec`` has happened (its
    environment in /proc is the one it was exec'ed with, not the shell's exports)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/comm").read_text().strip() != command:
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} did not exec {command} within {timeout:.0f} s")
        time.sleep(0.02)


def images(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / "state" / "images"))


# -- tar extraction (no mounts) --------------------------------------------------------


def make_tar(path: Path, *members: tuple[str, str, str]) -> None:
    """Members are (type, name, content or link target): type f, d, l (symlink), h (hard)."""
    with tarfile.open(path, "w") as tf:
        for kind, name, arg in members:
            ti = tarfile.TarInfo(name)
            ti.mode = 0o4755 if kind in "fh" else 0o755  # a hard link carries its file's
            ti.uid, ti.gid = (1234, 567) if kind in "fh" else (0, 0)
            if kind == "f":
                ti.size = len(arg)
                tf.addfile(ti, io.BytesIO(arg.encode()))
                continue
            ti.type = {"d": tarfile.DIRTYPE, "l": tarfile.SYMTYPE, "h": tarfile.LNKTYPE}[kind]
            ti.linkname = arg
            tf.addfile(ti)


def test_extract_tar_keeps_owners_modes_and_links(tmp_path: Path) -> None:
    make_tar(
        tmp_path / "ok.tar",
        ("d", "/usr", ""),
        ("f", "/usr/su", "x"),
        ("h", "usr/su2", "/usr/su"),
        ("l", "etc", "/usr"),  # absolute symlinks are fine: they resolve inside the chroot
    )
    root = tmp_path / "root"
    root.mkdir()
    extract_tar(str(tmp_path / "ok.tar"), str(root))
    st = os.stat(root / "usr" / "su")
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_nlink) == (0o4755, 1234, 567, 2)
    assert os.readlink(root / "etc") == "/usr"


@pytest.mark.parametrize(
    ("members", "bad"),
    [
        ([("f", "../evil", "x")], "../evil"),
        ([("l", "up", "/"), ("f", "up/tmp/evil", "x")], "up/tmp/evil"),
        ([("l", "up", "../../.."), ("d", "up/evil", "")], "up/evil"),
        ([("h", "pw", "../../etc/passwd")], "../../etc/passwd"),
    ],
)
def test_extract_tar_refuses_escapes(
    tmp_path: Path, members: list[tuple[str, str, str]], bad: str
) -> None:
    make_tar(tmp_path / "bad.tar", *members)
    root = tmp_path / "a" / "b" / "root"
    root.mkdir(parents=True)
    with pytest.raises(PullError, match=f"tar entry {re.escape(repr(bad))} escapes"):
        extract_tar(str(tmp_path / "bad.tar"), str(root))
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()


# -- containers ------------------------------------------------------------------------


def test_tar_image_runs_isolated_and_updates(tmp_path: Path, agent, image) -> None:
    a = agent()
    spec_a, spec_b = image("A"), image("B")
    a.want(spec_a)
    assert a.report()["state"] == "pulling"  # at once, not when the thread runs
    rep = a.state("active", spec_a["digest"])
    assert rep["name"] == "base" and rep["error"] is None
    pid = rep["container_pid"]
    log = console(tmp_path, "procs")
    assert "[base] up A A in /srv/app" in log
    assert f"[base] {NODE}\n" in log
    procs = log.split("[base] procs ")[1].split("\n")[0].split()
    assert procs[0] == "/proc/1" and len(procs) == 2  # its PID 1 (the shim) and itself
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        nspid = f.read().split("NSpid:")[1].split("\n")[0].split()
    assert nspid == [str(pid), "1"]
    for ns in ("pid", "uts", "ipc", "mnt"):
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
    assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    (cmd,) = children(pid)
    runs(cmd, "sleep")  # the image's sh exports PWD and SHLVL to what it execs
    with open(f"/proc/{cmd}/environ", "rb") as f:
        env = dict(v.split("=", 1) for v in f.read().decode().split("\0") if v)
    want = {"PATH": "/bin", "HOME": "/root", "HOSTNAME": NODE, "MARK": "A", "container": "layerpy"}
    assert env.pop("PWD") == "/srv/app" and env.pop("SHLVL") == "1"  # set by the image's sh
    assert env == want  # nothing of the agent's environment
    with open(tmp_path / "state" / "container.json", encoding="utf-8") as f:
        assert json.load(f)["image"]["spec"]["digest"] == spec_a["digest"]
    mounts_a = mounts_under(tmp_path / "state")
    assert len(mounts_a) == 1  # the tmpfs the tar went into; the tar file itself is gone
    (dir_a,) = images(tmp_path)
    assert os.listdir(tmp_path / "state" / "images" / dir_a) == ["root"]

    a.want(spec_b)
    assert a.report()["state"] == "updating"
    rep = a.state("active", spec_b["digest"])
    pid_b = rep["container_pid"]
    assert pid_b != pid and not proc_alive(pid)
    console(tmp_path, "[base] up B B")
    assert dir_a not in images(tmp_path) and len(images(tmp_path)) == 1
    assert mounts_a[0] not in mounts_under(tmp_path / "state")
    assert any("pulling (" in ln for ln in a.lines) and any("updating (" in ln for ln in a.lines)
    assert any(re.search(r"base sha256:\w{12}… active in \d+\.\d s", ln) for ln in a.lines)

    a.want(None)
    assert a.state("none")["container_pid"] is None and not proc_alive(pid_b)
    assert images(tmp_path) == [] and mounts_under(tmp_path / "state") == []
    assert not (tmp_path / "state" / "container.json").exists()


@pytest.mark.skipif(not shutil.which("tar2sqfs"), reason="tar2sqfs (squashfs-tools-ng) missing")
def test_squashfs_image_under_overlay_is_released(tmp_path: Path, agent, image) -> None:
    a = agent()
    spec = image("S", "squashfs", cmd=["/bin/sh", "-c", "echo w > /etc/written; " + PROBE])
    a.want(spec)
    pid = a.state("active", spec["digest"])["container_pid"]
    console(tmp_path, "[base] up S S")
    (cmd,) = children(pid)
    assert Path(f"/proc/{cmd}/root/etc/written").read_text() == "w\n"  # the overlay is writable
    assert len(mounts_under(tmp_path / "state")) == 3  # squashfs, tmpfs upper, overlay

    def loops() -> list[str]:
        found = []
        for dev in Path("/sys/block").glob("loop*"):
            backing = dev / "loop" / "backing_file"
            if backing.exists() and str(tmp_path) in backing.read_text():
                found.append(dev.name)
        return found

    assert len(loops()) == 1
    spec_t = image("T")
    a.want(spec_t)
    a.state("active", spec_t["digest"])
    assert len(mounts_under(tmp_path / "state")) == 1
    a.wait(lambda r: loops() == [], timeout=30.0)  # the loop device clears itself on release


def test_bad_sha256_is_an_error_and_the_old_container_keeps_running(
    tmp_path: Path, agent, image
) -> None:
    a = agent()
    good = image("A")
    a.want(good)
    pid = a.state("active")["container_pid"]
    bad = image("B")
    real = bad["sha256"]
    bad["sha256"] = "0" * 64
    a.want(bad)
    rep = a.state("error")
    assert rep["error"] == f"sha256 mismatch for {bad['digest']}: got {real}"
    assert rep["digest"] == bad["digest"] and rep["container_pid"] == pid
    a.wait(lambda r: sum("sha256 mismatch" in ln for ln in a.lines) >= 2)  # retried
    assert proc_alive(pid)
    a.want(good)  # the server goes back to what runs: no restart, error gone
    rep = a.state("active", good["digest"])
    assert rep["container_pid"] == pid and rep["error"] is None
    a.wait(lambda r: len(images(tmp_path)) == 1)


def test_crash_loop_backs_off_then_errors(tmp_path: Path, agent, image) -> None:
    a = agent()
    spec = image("C", cmd=["/bin/sh", "-c", "echo boom; exit 3"])
    a.want(spec)
    rep = a.state("error")
    assert re.fullmatch(r"container exited 5 times in \d+ s \(last: 3\)", rep["error"])
    delays = [ln.split("restarting in ")[1] for ln in a.lines if "exited with 3" in ln]
    assert delays[:5] == ["0.05 s", "0.1 s", "0.2 s", "0.2 s", "0.2 s"]
    assert console(tmp_path, "boom").count("[base] boom") >= 5
    assert "active" in a.seen  # it was up between deaths


def test_systemd_mode_execs_init_as_pid1_and_stops_it_with_sigrtmin3(
    tmp_path: Path, agent, image
) -> None:
    rtmin3 = int(signal.SIGRTMIN) + 3
    init = (
        "#!/bin/sh\n"
        'echo "init pid $$ container=$container"\n'
        'echo "cgroup $(cat /proc/self/cgroup)"\n'
        f"trap 'echo halting; exit 0' {rtmin3}\n"
        "while :; do sleep 1 & wait; done\n"
    )
    a = agent()
    spec = image("D", init=init)
    a.want(spec)
    a.state("active")
    console(tmp_path, "init pid 1 container=layerpy")
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():  # cgroup2: a namespace of its own
        console(tmp_path, "cgroup 0::/\n")  # its cgroup is the root of what it sees
    a.want(None)
    a.state("none")
    console(tmp_path, "halting")
    assert not any("did not stop" in ln for ln in a.lines)
    assert any(re.fullmatch(r"container stopped \(0\) in 0\.\d s", ln) for ln in a.lines)


def test_new_digest_supersedes_a_pull(tmp_path: Path, agent, image) -> None:
    a = agent()
    slow, fast = image("E", slow=True), image("F")
    a.want(slow)
    time.sleep(0.2)
    assert a.report()["state"] == "pulling"
    a.want(fast)
    a.state("active", fast["digest"])
    assert any("superseded, dropped" in ln for ln in a.lines)
    assert len(images(tmp_path)) == 1


def test_restarted_agent_adopts_the_container_and_cleans_up(tmp_path: Path, agent, image) -> None:
    spec = image("G")
    state = tmp_path / "state"
    # The first agent pulls, starts the container and dies (busybox init would respawn it).
    script = (
        "import json, os, sys, time\n"
        "from layerpy.agent.container import Runner\n"
        f"r = Runner({str(state)!r}, lambda m: None, {NODE!r}, console={str(tmp_path / 'console.log')!r})\n"
        "from layerpy.proto.agent import ImageSpec, decode\n"
        "r.want(decode(ImageSpec, json.loads(sys.argv[1]), 'spec'))\n"
        "while r.report().state != 'active' or not r.report().container_pid:\n"
        "    r.tick(); time.sleep(0.02)\n"
        "print(r.report().container_pid)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(spec)], capture_output=True, timeout=20
    )
    assert out.returncode == 0, out.stderr.decode()
    pid = int(out.stdout)
    console(tmp_path, "[base] up G G")

    junk = state / "images" / "junk" / "root"  # left by an agent killed mid-pull
    junk.mkdir(parents=True)
    subprocess.run([BUSYBOX, "mount", "-t", "tmpfs", "tmpfs", str(junk)], check=True)

    a2 = agent()
    rep = a2.report()
    assert rep["state"] == "active" and rep["container_pid"] == pid
    assert any("adopted container pid" in ln for ln in a2.lines)
    assert "junk" not in images(tmp_path) and str(junk) not in mounts_under(state)
    a2.want(spec)  # the server still wants it: nothing to do
    a2.wait(lambda r: True)
    assert a2.report()["container_pid"] == pid

    os.kill(pid, signal.SIGKILL)  # dies while its parent is not ours: no exit status
    rep = a2.wait(lambda r: r["container_pid"] not in (None, pid) and r["state"] == "active")
    assert any("exited with unknown status" in ln for ln in a2.lines)
    new = rep["container_pid"]

    # The second agent dies too: the third finds the container the second started.
    a3 = agent()
    assert a3.report()["container_pid"] == new
    assert any("adopted container pid" in ln for ln in a3.lines)

    # And the container dies while no agent runs: the next one restarts it from the
    # prepared image, without asking the server for anything.
    holder = json.loads((state / "container.json").read_text())["pid"]
    os.kill(new, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while proc_alive(holder) and time.monotonic() < deadline:  # nobody ticks: no agent runs
        time.sleep(0.02)
    a4 = agent()
    assert any("is gone; restarting it" in ln for ln in a4.lines)
    rep = a4.wait(lambda r: r["container_pid"] not in (None, new))
    assert rep["state"] == "active" and not any("pulling" in ln for ln in a4.lines)


@pytest.mark.parametrize(
    ("how", "caught", "blocked"), [("block", False, True), ("handle", True, False)]
)
def test_stop_readiness_sees_blocked_and_handled_signals(
    how: str, caught: bool, blocked: bool
) -> None:
    """systemd blocks SIGRTMIN+3 and reads it from a signalfd; a plain init traps it. The
    runner must see both, or it waits its whole stop timeout and kills systemd."""
    from layerpy.agent.process import _catches

    rtmin3 = int(signal.SIGRTMIN) + 3
    setup = (
        f"signal.pthread_sigmask(signal.SIG_BLOCK, [{rtmin3}])"
        if how == "block"
        else f"signal.signal({rtmin3}, lambda *_: None)"
    )
    program = f"import signal, sys, time; {setup}; print('ready', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        assert _catches(proc.pid, rtmin3) is caught
        assert _catches(proc.pid, rtmin3, "SigBlk") is blocked
    finally:
        proc.kill()
        proc.wait()


# -- the node's files and state ---------------------------------------------------------


def test_files_are_in_place_before_start_and_change_in_place(
    tmp_path: Path, agent, image, node_files
) -> None:
    a = agent()
    key = b"\x00secret\xff" * 8
    # /proc is the container's own mount: the command runs in its mount namespace
    apply = "echo applied $(cat /etc/app.conf) $(cat /proc/1/comm) >> /applied"
    conf = (b"v1\n", 0o644, "root:root", apply)
    files = node_files(
        {"/etc/app.conf": conf, "/etc/munge/munge.key": (key, 0o400, "munge:munge", None)}
    )
    cmd = ["/bin/sh", "-c", "echo conf $(cat /etc/app.conf); " + PROBE]
    a.want(image("F", cmd=cmd), files)
    pid = a.state("active")["container_pid"]
    console(tmp_path, "[base] conf v1")  # there when the container started
    a.wait(lambda r: a.r.files().revision == files.revision)
    (cmd_pid,) = children(pid)
    inside = Path(f"/proc/{cmd_pid}/root")
    info = os.stat(inside / "etc/munge/munge.key")
    assert (info.st_mode & 0o7777, info.st_uid, info.st_gid) == (0o400, 107, 113)
    assert (inside / "etc/munge/munge.key").read_bytes() == key
    assert not (inside / "applied").exists()  # a new container needs no apply

    changed = node_files({"/etc/app.conf": (b"v2\n", *conf[1:]),
                          "/etc/munge/munge.key": (key, 0o400, "munge:munge", None)})  # fmt: skip
    a.want(image("F", cmd=cmd), changed)
    a.wait(lambda r: a.r.files().revision == changed.revision)
    assert a.state("active")["container_pid"] == pid  # no restart
    assert (inside / "etc/app.conf").read_text() == "v2\n"
    shim = Path(f"/proc/{pid}/comm").read_text().strip()  # its PID 1
    assert (inside / "applied").read_text() == f"applied v2 {shim}\n"  # inside, once
    assert a.r.files().error is None
    assert any(
        f"files revision {changed.revision} in place (/etc/app.conf)" in ln for ln in a.lines
    )

    fewer = node_files({"/etc/app.conf": (b"v2\n", 0o644, "root:root", "exit 3")})
    a.want(image("F", cmd=cmd), fewer)
    a.wait(lambda r: a.r.files().revision == fewer.revision)
    assert not (inside / "etc/munge/munge.key").exists()  # no longer given: removed
    assert a.r.files().error is None  # app.conf did not change: nothing applied
    stored = sorted(os.listdir(tmp_path / "state" / "files"))
    assert stored == sorted([fewer.files[0].digest[7:], "placed.json"])  # old bytes gone
    assert os.stat(tmp_path / "state" / "files").st_mode & 0o777 == 0o700

    failing = node_files({"/etc/app.conf": (b"v3\n", 0o644, "root:root", "echo no; exit 3")})
    a.want(image("F", cmd=cmd), failing)
    a.wait(lambda r: a.r.files().revision == failing.revision)
    assert a.r.files().error == "apply 'echo no; exit 3': exit status 3: no"


def test_a_file_is_checked_and_never_written_through_a_symlink(
    tmp_path: Path, agent, image, node_files, server
) -> None:
    a = agent()
    cmd = ["/bin/sh", "-c", "ln -s / /escape; " + PROBE]
    a.want(image("L", cmd=cmd))
    pid = a.state("active")["container_pid"]
    console(tmp_path, "[base] up L")
    outside = tmp_path / "outside-marker"
    files = node_files({"/escape" + str(outside): (b"pwned\n", 0o644, "root:root", None)})
    a.want(image("L", cmd=cmd), files)
    a.wait(lambda r: (a.r.files().error or "").find("a symlink is not followed") > 0)
    assert not outside.exists()
    assert a.report()["container_pid"] == pid

    named = "sha256:" + "1" * 64
    (server[0] / FILES_PATH.strip("/") / named).write_bytes(b"abc")  # not what it names
    wrong = FilesSpec("0" * 16, (FileSpec("/etc/x", named, 3, 0o644, "root:root"),))
    a.want(image("L", cmd=cmd), wrong)
    a.wait(lambda r: "revision 0000000000000000" in (a.r.files().error or ""))
    assert "/etc/x: got 3 bytes of sha256:ba7816bf8f01…, not the 3 of sha256:111111111111…" in (
        a.r.files().error or ""
    )
    assert not (tmp_path / "state" / "files" / named[7:]).exists()


def test_persistent_paths_outlive_an_image_change_and_jobs_mark_the_node_busy(
    tmp_path: Path, agent, image
) -> None:
    a = agent()
    keep = "mkdir -p /var/keep; echo $MARK >> /var/keep/log; touch /run/layerpy/busy; "
    spec_a = image("PA", cmd=["/bin/sh", "-c", keep + PROBE], persist=["/var/keep"])
    a.want(spec_a)
    a.state("active", spec_a["digest"])
    console(tmp_path, "[base] up PA")
    assert (tmp_path / "state" / "node" / "busy").exists()  # the container's /run/layerpy
    spec_b = image("PB", cmd=["/bin/sh", "-c", keep + PROBE], persist=["/var/keep"])
    a.want(spec_b)
    pid = a.state("active", spec_b["digest"])["container_pid"]
    console(tmp_path, "[base] up PB")
    (cmd_pid,) = children(pid)
    assert Path(f"/proc/{cmd_pid}/root/var/keep/log").read_text() == "PA\nPB\n"
    assert (tmp_path / "state" / "persist" / "var" / "keep" / "log").exists()
    assert any("keeping /var/keep from now on" in ln for ln in a.lines)


@pytest.mark.skipif(not shutil.which("mkfs.ext4"), reason="needs e2fsprogs")
def test_persistent_paths_on_a_local_disk(tmp_path: Path, agent, image, monkeypatch) -> None:
    """layerpy.persist=LABEL=…: the node's disk holds them (found by its label, mounted
    once; a restarted agent finds it mounted); a missing disk leaves them in RAM."""
    label = f"lpt{os.getpid()}"[:16]
    disk = tmp_path / "disk.img"
    with disk.open("wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-L", label, str(disk)], check=True)
    loop = subprocess.run(["losetup", "-f", "--show", str(disk)], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    try:
        a = agent(persist_disk=f"LABEL={label}")
        assert a.r.persist == f"disk LABEL={label}"
        keep = "mkdir -p /var/keep; echo $MARK >> /var/keep/log; "
        spec = image("PD", cmd=["/bin/sh", "-c", keep + PROBE], persist=["/var/keep"])
        a.want(spec)
        a.state("active", spec["digest"])
        console(tmp_path, "[base] up PD")
        persist = str((tmp_path / "state" / "persist").resolve())
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            assert any(line.split()[4] == persist and loop in line for line in f)
        assert (tmp_path / "state" / "persist" / "var" / "keep" / "log").read_text() == "PD\n"
        assert agent(persist_disk=f"LABEL={label}").r.persist == f"disk LABEL={label}"
        monkeypatch.setattr("layerpy.agent.image.DISK_WAIT", 0.5)
        lost = agent(state="other", persist_disk="LABEL=nosuchdisk0")
        assert lost.r.persist == "ram (cannot mount LABEL=nosuchdisk0)"
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


def test_odd_files_in_the_image_neither_hang_nor_stop_the_agent(
    tmp_path: Path, agent, image, node_files
) -> None:
    """A FIFO where a file goes, or as /etc/passwd: replaced, or refused, never read."""
    a = agent()
    spec = image("O")
    a.want(spec)
    a.state("active", spec["digest"])
    (root,) = (tmp_path / "state" / "images").glob("*/root")
    os.mkfifo(root / "etc" / "fifo")
    files = node_files({"/etc/fifo": (b"now a file\n", 0o644, "root:root", None)})
    a.want(spec, files)
    a.wait(lambda r: a.r.files().revision == files.revision)
    assert (root / "etc" / "fifo").read_text() == "now a file\n"
    (root / "etc" / "passwd").unlink()
    os.mkfifo(root / "etc" / "passwd")
    keyed = node_files({"/etc/key": (b"k", 0o400, "munge:munge", None)})
    a.want(spec, keyed)
    a.wait(lambda r: "the image has no user 'munge'" in (a.r.files().error or ""))


def test_a_pull_follows_the_agent_to_another_server(tmp_path: Path, agent, image, server) -> None:
    """The agent moved to another instance: the image comes from there, and a pull that
    failed on the old one is retried at once, not after its backoff."""
    with socket.socket() as gone:  # bound, not listening: connections are refused
        gone.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{gone.getsockname()[1]}"
        a = agent(pull_backoff=(60.0, 60.0))
        a.r.use(dead)
        spec = image("MOVED")
        a.want({**spec, "url": spec["url"].replace(server[1], dead)})
        a.wait(lambda r: any("retrying in 60 s" in line for line in a.lines), timeout=30.0)
        a.r.use(server[1])
        a.wait(lambda r: r["state"] == "active" and r["container_pid"] is not None, timeout=20.0)
