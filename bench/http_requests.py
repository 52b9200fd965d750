"""HTTP per-request cost: a node's iPXE boot script from ``layerpy serve`` against the same
bytes from nginx, in one run.

Both servers run side by side in a fresh pair of network namespaces (never on a host
interface), pinned to CPU 0. layerpy answers GET /boot/bn001.ipxe as it answers a node's
iPXE: to the node's own address only, with a fresh boot token (a new boot each time, as a
reboot is), about 1 KiB; nginx serves a copy of that script as a static file at the same
path. The client (bench/script_client.py, pinned to CPU 1) asks as iPXE does, one request
at a time: a new connection per request (iPXE's way for a script), and all on one
kept-alive connection. A round does each case for both servers, alternating which goes
first. The figures: each server process's CPU (user + system, from /proc/PID/stat) in µs
per request, the median over rounds; latency p50/p99 over every request of every round,
from connect to last byte; and layerpy/nginx for the CPU.
Run as root: `.venv/bin/python bench/http_requests.py [--rounds 5] [--requests 4000]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from reference import cpu_split, nginx_config, one_node_file, start_pinned  # noqa: E402

from netns import Link  # noqa: E402
from nodefile import write_boot_files  # noqa: E402
from packages import install_missing  # noqa: E402

PYTHON = ROOT / ".venv" / "bin" / "python"
LAYERPY = ROOT / ".venv" / "bin" / "layerpy"
SERVER, NODE = "10.79.0.1", "10.79.0.11"
PORTS = {"nginx": 8081, "layerpy": 8080}
SCRIPT = "/boot/bn001.ipxe"
MODES = {"close": "a connection each", "keep": "one kept-alive"}
PAD = "layerpy.bench=" + "x" * 687  # kernel arguments that bring the script to ~1 KiB
SERVER_CPU, CLIENT_CPU = "0", "1"


def node_file(directory: Path, interface: str) -> Path:
    """One node at the client's address; its kernel command line padded to ~1 KiB."""
    write_boot_files(directory)
    boot = f"""\
[minos]
kernel = "vmlinuz"
initrd = "initrd"
cmdline = "console=ttyS0 {PAD}"

[ipxe]
dir = "ipxe"
"""
    return one_node_file(directory, interface, SERVER, NODE, PORTS["layerpy"], boot,
                         "52:54:00:79:00:11")  # fmt: skip


def start(link: Link, directory: Path, name: str, command: list[str]) -> subprocess.Popen:
    """`command` pinned to the server's CPU, once it answers the script."""
    url = f"http://{SERVER}:{PORTS[name]}{SCRIPT}"
    return start_pinned(link, directory, name, command, url, SERVER_CPU)


class Client:
    """bench/script_client.py in the client namespace, on the client's CPU."""

    def __init__(self, link: Link) -> None:
        program = ROOT / "bench" / "script_client.py"
        command = ["taskset", "-c", CLIENT_CPU, str(PYTHON), str(program), SERVER, SCRIPT]
        self.process = link.client.popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
        )
        assert self.process.stdout is not None and self.process.stdin is not None
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        if self.stdout.readline() != b"ready\n":
            sys.exit("the client did not start")

    def fetch(self, port: int, mode: str, count: int) -> dict:
        self.stdin.write(f"{port} {mode} {count}\n".encode())
        line = self.stdout.readline()
        if not line:
            sys.exit("the client failed")
        return json.loads(line)


def main(rounds: int, requests: int) -> None:
    install_missing({"nginx": "nginx-light"})
    cpu: dict[tuple[str, str], list[tuple[float, float]]] = {}
    latency: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        link = Link(server_addr=f"{SERVER}/24", client_addr=f"{NODE}/24")
        try:
            config = node_file(directory, link.server_if)
            layerpy = start(link, directory, "layerpy", [str(LAYERPY), "serve", "-c", str(config)])
            url = f"http://{SERVER}:{PORTS['layerpy']}{SCRIPT}"
            script = link.client.run("curl", "-sf", url).stdout.encode()
            copy = directory / "bn001.ipxe"
            copy.write_bytes(script)
            route = f"location = {SCRIPT} {{ default_type text/plain; alias {copy}; }}"
            reference = nginx_config(directory, f"listen {SERVER}:{PORTS['nginx']}; {route}", 1024)
            servers = {"nginx": start(link, directory, "nginx", ["nginx", "-c", str(reference)]),
                       "layerpy": layerpy}  # fmt: skip
            client = Client(link)
            for name in servers:  # warm-up, and a check of what each answers
                for mode in MODES:
                    got = client.fetch(PORTS[name], mode, 200)
                    if got["status"] != 200 or got["length"] != len(script):
                        sys.exit(f"{name} answered {got['status']}, {got['length']} bytes")
            for run in range(rounds):
                order = list(servers) if run % 2 else list(reversed(servers))
                for mode in MODES:
                    for name in order:
                        pid = servers[name].pid
                        before = cpu_split(pid)
                        got = client.fetch(PORTS[name], mode, requests)
                        after = cpu_split(pid)
                        (user, system), (user0, system0) = after, before
                        user, system = (
                            (user - user0) / requests * 1e6,
                            (system - system0) / requests * 1e6,
                        )
                        cpu.setdefault((name, mode), []).append((user, system))
                        latency.setdefault((name, mode), []).extend(got["latencies_us"])
        finally:
            link.close()
    show(len(script), rounds, requests, cpu, latency)


def show(size: int, rounds: int, requests: int, cpu: dict, latency: dict) -> None:
    print(f"iPXE script of {size} bytes, {requests} requests per case, server and round, "
          f"{rounds} rounds; servers on CPU {SERVER_CPU}, client on CPU {CLIENT_CPU}:")  # fmt: skip
    for mode, what in MODES.items():
        medians = {}
        for name in PORTS:
            runs = cpu[name, mode]
            total = [user + system for user, system in runs]
            medians[name] = statistics.median(total)
            user = statistics.median(user for user, _ in runs)
            system = statistics.median(system for _, system in runs)
            cuts = statistics.quantiles(latency[name, mode], n=100)
            print(f"  {what:17} {name:8} {medians[name]:4.0f} µs CPU a request "
                  f"({min(total):.0f}-{max(total):.0f}; user {user:.0f}, system {system:.0f}), "
                  f"latency p50 {cuts[49]:.0f} µs, p99 {cuts[98]:.0f} µs")  # fmt: skip
        ratio = medians["layerpy"] / medians["nginx"]
        print(f"  {what:17} layerpy/nginx CPU a request: {ratio:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="(default 5)")
    parser.add_argument("--requests", type=int, default=4000, help="per case (default 4000)")
    args = parser.parse_args()
    main(args.rounds, args.requests)
