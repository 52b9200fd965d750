"""The Slurm demo's controller: munged and slurmctld beside ``layerpy serve``, in the lab.

The nodes run slurmd and munged in the slurm image (``debian-image.py --flavour slurm``),
with /etc/slurm/slurm.conf, /etc/munge/munge.key and /etc/hosts that layerpy renders from
vm-lab/slurm/. The controller renders the same slurm.conf.j2 from the same context, plus
``slurm_controller`` (its munge socket and state directory), so there is one source of
truth; everything it starts runs inside the lab's network namespace, as root
(``SlurmUser=root``), with its sockets, state and logs in its run directory:

    key = make_munge_key(run_dir / "munge.key")      # the node file's secret, too
    with Controller(lab, run_dir / "slurm", key, context_from_node_file(config)) as ctl:
        ctl.wait_nodes(["cn001", "cn002", "cn003"], "idle", 300)
        print(ctl.srun("-N3", "hostname").stdout)

Its own munged listens on a private socket (``AuthInfo=socket=`` in the controller's copy
of slurm.conf only; the nodes keep the default /run/munge/munge.socket.2): a host may run
its own munged, and the lab must not touch it. slurmctld must find its own name in
``SlurmctldHost`` (``layerpy``), so it runs in a UTS namespace of its own with that
hostname; the nodes reach it at ``server.address`` (port 6817), it reaches them at their
``NodeAddr`` (6818), and srun's I/O comes back to the lab's bridge address on an
ephemeral port.

Importable (``sys.path.insert(0, "vm-lab"); import slurm_controller``); needs the Debian
packages slurmctld, slurm-client and munge (vm-lab/setup.sh installs them, never enabled)
and the venv's jinja2 and layerpy.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "slurm"
SLURM_CONF = TEMPLATES / "slurm.conf.j2"
HOSTS = TEMPLATES / "hosts.j2"
CONTROLLER_NAME = "layerpy"  # SlurmctldHost's name in slurm.conf.j2
MUNGE_KEY_BYTES = 1024  # munged takes 32 to 1024
RELEASE_PORT = 7999  # a held job (`held_job`) ends when this port opens at the controller
# the listener that releases held jobs: accepts and closes, until stopped
RELEASE = (
    "import socket, sys\ns = socket.create_server((sys.argv[1], int(sys.argv[2])))\n"
    "while True:\n    s.accept()[0].close()\n"
)

# What the nodes of the slurm image need from layerpy's [files]: slurm.conf and /etc/hosts
# from the templates beside this file, and the munge key (a secret). `apply` restarts the
# daemon a changed file is for, with systemd: a container without it takes a changed file at
# its next start.
NODE_FILES = """
[files."/etc/slurm/slurm.conf"]
template = "{templates}/slurm.conf.j2"
groups = ["{group}"]{slurmd}

[files."/etc/hosts"]
template = "{templates}/hosts.j2"{hosts_groups}

[files."/etc/munge/munge.key"]
secret = "{key}"
owner = "munge:munge"
groups = ["{group}"]{munge}
"""


class LabLike(Protocol):
    """What the controller needs of vm-lab/lab.py's Lab."""

    netns: str

    def run(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess: ...

    def popen(self, cmd: list[str], log: Path | None = None, **kw: Any) -> subprocess.Popen: ...


def make_munge_key(path: Path, size: int = MUNGE_KEY_BYTES) -> Path:
    """A new random munge key at `path` (mode 0400, created so: never readable by others);
    an existing file is left as it is. Returns `path`."""
    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.unlink(missing_ok=True)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(size))
    part.rename(path)
    return path


def node_files(key: Path, group: str = "compute", systemd: bool = True,
               hosts_everywhere: bool = True) -> str:  # fmt: skip
    """The [files] tables (TOML) that give `group`'s nodes slurm.conf, the munge key `key`
    and /etc/hosts (to every node, or only to `group`'s)."""
    return NODE_FILES.format(
        templates=TEMPLATES, group=group, key=key,
        slurmd='\napply = "systemctl restart slurmd"' if systemd else "",
        munge='\napply = "systemctl restart munge"' if systemd else "",
        hosts_groups="" if hosts_everywhere else f'\ngroups = ["{group}"]',
    )  # fmt: skip


def held_job(address: str, port: int = RELEASE_PORT) -> str:
    """A bash command line that lasts until `port` opens at `address` (`Controller.release`),
    then says where it ran: a job that runs for as long as a test needs."""
    return (f"until (exec 3<>/dev/tcp/{address}/{port}) 2>/dev/null; do sleep 1; done;"
            " echo job done on $(hostname)")  # fmt: skip


def render(template: Path, context: dict[str, Any]) -> str:
    """`template` rendered as layerpy renders a node's file (its sandboxed environment,
    StrictUndefined, the ``hostlist`` filter)."""
    from layerpy.files import environment

    return environment().from_string(Path(template).read_text()).render(**context)


def context_from_node_file(config: Path, node: str | None = None, group: str = "compute") -> dict:
    """The template context layerpy gives `node` (by default the first node of `group`)
    in node file `config`: the controller's slurm.conf then matches the nodes' copies."""
    from layerpy.config import load
    from layerpy.files import context

    loaded = load(config)
    if node is None:
        node = next(name for name, found in loaded.nodes.items() if found.group == group)
    return context(loaded, loaded.nodes[node])


def controller_conf(context: dict[str, Any], munge_socket: Path, state_dir: Path) -> str:
    """slurm.conf as the controller (and the clients beside it) read it."""
    extra = {"munge_socket": str(munge_socket), "state_dir": str(state_dir)}
    return render(SLURM_CONF, {**context, "slurm_controller": extra})


class Controller:
    """munged + slurmctld in `lab`'s namespace, and the Slurm clients to talk to them.

    Starts both at once and waits until slurmctld answers; ``close()`` (or leaving the
    ``with`` block) stops exactly the two processes it started.
    """

    def __init__(
        self,
        lab: LabLike,
        run_dir: Path,
        munge_key: Path,
        context: dict[str, Any],
        *,
        timeout: float = 30,
    ) -> None:
        self.lab = lab
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o755)  # munged refuses a socket directory others may write
        self.munge_socket = self.run_dir / "munge.socket"
        self.state_dir = self.run_dir / "state"
        self.state_dir.mkdir(exist_ok=True)
        self.conf = self.run_dir / "slurm.conf"
        self.conf.write_text(controller_conf(context, self.munge_socket, self.state_dir))
        self.munged_log = self.run_dir / "munged.log"
        self.slurmctld_log = self.run_dir / "slurmctld.log"
        self.procs: list[subprocess.Popen] = []
        try:
            self.munged = self._start_munged(Path(munge_key).resolve(), timeout)
            self.slurmctld = self._start_slurmctld(timeout)
        except BaseException:
            self.close()
            raise

    def _start_munged(self, key: Path, timeout: float) -> subprocess.Popen:
        """munged in the foreground, as root (``--force``: its checks would refuse a key
        root owns and a run directory under /tmp), with every path in the run dir."""
        self.munge_socket.unlink(missing_ok=True)
        command = ["munged", "--foreground", "--force", f"--key-file={key}",
                   f"--socket={self.munge_socket}", f"--pid-file={self.run_dir / 'munged.pid'}",
                   f"--seed-file={self.run_dir / 'munged.seed'}",
                   f"--log-file={self.munged_log}"]  # fmt: skip
        proc = self._popen(command, self.run_dir / "munged.out")
        self._wait(self.munge_socket.exists, timeout, "munged's socket", proc)
        return proc

    def _start_slurmctld(self, timeout: float) -> subprocess.Popen:
        """slurmctld in the foreground (-D) in a UTS namespace named like SlurmctldHost."""
        name = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', CONTROLLER_NAME]
        command = [*name, "slurmctld", "-D", "-f", str(self.conf), "-L", str(self.slurmctld_log)]
        proc = self._popen(command, self.run_dir / "slurmctld.out")
        self._wait(lambda: self.ping(), timeout, "slurmctld answering", proc)
        return proc

    def _popen(self, command: list[str], log: Path) -> subprocess.Popen:
        proc = self.lab.popen(command, log=log, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def _wait(self, ready: Any, timeout: float, what: str, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"slurm controller: no {what}:\n{self.logs()}")
            time.sleep(0.2)

    # --- the clients, in the lab's namespace with this controller's conf and munge ---------

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def client(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Any Slurm command (``scontrol``, ``squeue``, ``scancel``…), captured."""
        # cwd /: srun's job steps start in the same directory on the nodes
        return self.lab.run(list(argv), env=self.env, check=check, timeout=timeout, cwd="/")

    def ping(self) -> bool:
        done = self.client("scontrol", "ping", check=False, timeout=10)
        return done.returncode == 0 and "UP" in done.stdout

    def sinfo(self, *args: str) -> str:
        return self.client("sinfo", *args).stdout

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo gives it (``idle``, ``alloc``, ``down*``…)."""
        lines = self.sinfo("-h", "-N", "-o", "%N %t").split()
        return dict(zip(lines[::2], lines[1::2], strict=True))

    def slurmd_started(self) -> dict[str, str]:
        """When each node's slurmd last registered (``SlurmdStartTime``): a slurmd that
        restarted shows a new one, where its state may still read ``idle`` from before."""
        started = {}
        for line in self.client("scontrol", "-o", "show", "node").stdout.splitlines():
            fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
            started[fields.get("NodeName", "?")] = fields.get("SlurmdStartTime", "")
        return started

    def wait_nodes(self, names: Iterable[str], state: str, timeout: float) -> float:
        """Seconds until every node of `names` is in `state`; TimeoutError otherwise."""
        names = list(names)
        started = time.monotonic()
        while True:
            states = self.node_states()
            if all(states.get(name) == state for name in names):
                return time.monotonic() - started
            if self.slurmctld.poll() is not None:
                raise RuntimeError(f"slurmctld exited:\n{self.logs()}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"nodes {names} not {state} within {timeout:.0f} s: {states}")
            time.sleep(1)

    def srun(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        """``srun ARGS`` (e.g. ``"-N3", "hostname"``), waiting for it to end."""
        return self.client("srun", *args, check=check, timeout=timeout)

    def srun_background(self, *args: str, log: Path | None = None) -> subprocess.Popen:
        """``srun ARGS`` left running (stopped by ``close()`` if still running)."""
        proc = self.lab.popen(
            ["srun", *args], log=log, env=self.env, stdin=subprocess.DEVNULL, cwd="/"
        )
        self.procs.append(proc)
        return proc

    def sbatch(self, *args: str) -> int:
        """``sbatch --parsable ARGS``: the job's id."""
        return int(self.client("sbatch", "--parsable", *args).stdout.split(";")[0])

    def squeue(self, *args: str) -> str:
        return self.client("squeue", *args).stdout

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList…); {} once slurmctld
        has forgotten it (MinJobAge after its end)."""
        shown = self.client("scontrol", "-o", "show", "job", str(job_id), check=False)
        return dict(word.split("=", 1) for word in shown.stdout.split() if "=" in word)

    def release(self, address: str, port: int = RELEASE_PORT) -> subprocess.Popen:
        """Open `port` at `address` (in the lab's namespace): every `held_job` on it ends.
        Stopped by ``close()`` if not before."""
        return self._popen([sys.executable, "-c", RELEASE, address, str(port)],
                           self.run_dir / "release.out")  # fmt: skip

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for path in (self.munged_log, self.run_dir / "munged.out", self.slurmctld_log,
                     self.run_dir / "slurmctld.out"):  # fmt: skip
            with contextlib.suppress(FileNotFoundError):
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    def close(self, grace: float = 10) -> None:
        """SIGTERM what this controller started (each its own process group), SIGKILL after
        `grace` seconds. Idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
