"""The nodes' segment of the steady-state benches (bench/ha_steady.py, bench/steady.py): its
namespace, a `layerpy serve` joined to it, the simulated agents (bench/agents.py) on it.

The nodes' namespace holds a bridge (the boot segment), the client's address and every
node address (a `local` route: the one agents process is every node); a server sits in a
namespace of its own, joined to the bridge by a veth, pinned to SERVER_CPU, the agents
to CLIENT_CPU.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from reference import cpu_seconds  # noqa: E402

from netns import Netns, sh, unique_name  # noqa: E402
from nodefile import BOOT_SECTIONS, big_groups, big_ip, big_mac, write_boot_files  # noqa: E402

LAYERPY = ROOT / ".venv" / "bin" / "layerpy"
PYTHON = ROOT / ".venv" / "bin" / "python"
AGENTS = Path(__file__).with_name("agents.py")
SERVER_CPU, CLIENT_CPU = "0", "1"
SUBNET = "10.2.0.0/15"
ADDRESSES = ("10.3.255.253", "10.3.255.252")  # the servers' on the boot segment
CLIENT = "10.3.255.254"
NODE_ROUTES = ("10.2.0.0/16", "10.3.0.0/17", "10.3.128.0/18", "10.3.192.0/21")  # big_ip's
GROUP = 25_000
COUNTS = ("sent", "ok", "failed", "late", "cpu")  # in bench/agents.py's lines, from its start
STOP_WITHIN = 30.0  # seconds from SIGTERM to a server's exit before it is killed


def name_of(index: int) -> str:
    group, i = divmod(index, GROUP)
    return f"g{group}n{i + 1:05d}"


class Segment:
    """The nodes' namespace: a bridge, the client's address, every node address its own."""

    def __init__(self) -> None:
        self.netns = Netns("lphn")
        self.netns.run("ip", "link", "add", "br0", "type", "bridge")
        self.netns.run("ip", "link", "set", "br0", "up")
        self.netns.run("ip", "addr", "add", f"{CLIENT}/15", "dev", "br0")
        for route in NODE_ROUTES:
            self.netns.run("ip", "route", "add", "local", route, "dev", "lo")

    def join(self, netns: Netns, address: str) -> None:
        """A veth `boot0` from netns (with address) onto the bridge."""
        here, there = unique_name("vh"), unique_name("vn")
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", here, "netns", netns.name)
        sh("ip", "link", "set", there, "netns", self.netns.name)
        self.netns.run("ip", "link", "set", there, "master", "br0", "up")
        netns.run("ip", "link", "set", here, "name", "boot0")
        netns.run("ip", "addr", "add", f"{address}/15", "dev", "boot0")
        netns.run("ip", "link", "set", "boot0", "up")
        for route in NODE_ROUTES:  # through the client's address: one neighbour, not N
            netns.run("ip", "route", "add", route, "via", CLIENT)


def node_file(directory: Path, nodes: int, address: str, interval: float, cluster: str) -> Path:
    """The node file of one server: `nodes` in big groups, heartbeat `interval`; `cluster`
    is its [cluster] table ("" for the single instance)."""
    write_boot_files(directory)
    path = directory / "nodes.toml"
    path.write_text(
        f'[server]\ninterface = "boot0"\naddress = "{address}"\nstate_dir = "state"\n'
        f'dhcp = "off"\nheartbeat = {interval:g}\n\n[api]\nlisten = []\n\n{cluster}\n'
        f'[network]\nsubnet = "{SUBNET}"\n\n{BOOT_SECTIONS}\n{big_groups(nodes)}'
    )  # fmt: skip
    return path


def node_list(directory: Path, nodes: int) -> Path:
    path = directory / "agents.txt"
    path.write_text("".join(f"{name_of(i)} {big_mac(i)} {big_ip(i)}\n" for i in range(nodes)))
    return path


class Server:
    """One `layerpy serve` in its namespace, pinned to SERVER_CPU."""

    def __init__(self, netns: Netns, directory: Path, config: Path) -> None:
        self.directory, self.log = directory, directory / "serve.log"
        with self.log.open("ab") as sink:
            self.proc = netns.popen(
                ["taskset", "-c", SERVER_CPU, str(LAYERPY), "serve", "-c", str(config)],
                stdout=sink, stderr=sink, cwd=directory,
            )  # fmt: skip

    def serving(self) -> bool:
        return b"layerpy.server: serving" in self.log.read_bytes()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def journal_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.directory / "state").rglob("*.jsonl"))

    def stop(self) -> float:
        """SIGTERM; the seconds to exit (SIGKILL after STOP_WITHIN: said, and infinite)."""
        if self.proc.poll() is not None:
            return 0.0
        asked = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_WITHIN)
        except subprocess.TimeoutExpired:
            print(f"not stopped {STOP_WITHIN:g} s after SIGTERM, killed: see {self.log}",
                  flush=True)  # fmt: skip
            self.proc.kill()
            self.proc.wait()
            return float("inf")
        return time.monotonic() - asked


def wait_for(condition: Callable[[], object], timeout: float, what: str, *servers: Server) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [s for s in servers if not s.alive()]
        if dead or time.monotonic() > deadline:
            said = "".join(f"\n--- {s.log}:\n{s.log.read_text()[-3000:]}" for s in servers)
            sys.exit(f"no {what} after {timeout:g} s{said}")
        time.sleep(0.1)


class Client:
    """bench/agents.py in the nodes' namespace; its last JSON lines."""

    def __init__(self, segment: Segment, listing: Path, servers: list[str], interval: float,
                 boot_rate: float, *options: str) -> None:  # fmt: skip
        """`options`: more of bench/agents.py's (`--protocol 1.3`, `--connect each`)."""
        command = ["taskset", "-c", CLIENT_CPU, str(PYTHON), str(AGENTS), "--nodes", str(listing),
                   "--servers", ",".join(servers), "--interval", f"{interval:g}",
                   "--boot-rate", f"{boot_rate:g}", *options]  # fmt: skip
        with (listing.parent / "agents.log").open("wb") as log:
            self.proc = segment.netns.popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
            )
        self.lines: list[dict[str, Any]] = []
        self.said = listing.parent / "agents.jsonl"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.said.open("wb") as copy:  # kept with --keep
            for raw in self.proc.stdout:
                copy.write(raw)
                copy.flush()
                self.lines.append(json.loads(raw))

    def last(self) -> dict[str, Any]:
        counts = [line for line in self.lines if "sent" in line]
        return counts[-1] if counts else dict.fromkeys(("booted", *COUNTS), 0)

    def tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def load() -> str:
    """The machine's load averages (1, 5, 15 min): other work shares these 2 cores."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
