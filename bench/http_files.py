"""HTTP file serving: CPU seconds per GB, nginx against ``layerpy serve``, same file, one run.

Both servers run side by side in a fresh pair of network namespaces (never on a host
interface), pinned to CPU 0, and serve the same 15 MiB file (a minOS kernel's size): nginx
(one process, sendfile on) at /minos/kernel by alias, layerpy at the route a node fetches
its kernel from, to the node's own address. curl, pinned to CPU 1, fetches it many times:
one connection after another, and 8 at once; a round does each case for both servers,
alternating which goes first. The figure is each server process's CPU (utime + stime of all
its threads, from /proc/PID/stat) per GB sent, the median over rounds; a warm-up round
checks the bytes (sha256).
Run as root: `.venv/bin/python bench/http_files.py [ROUNDS]`.
"""

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from reference import cpu_seconds, nginx_config, one_node_file, start_pinned  # noqa: E402

from netns import Link  # noqa: E402
from nodefile import BOOT_SECTIONS, write_boot_files  # noqa: E402
from packages import install_missing  # noqa: E402

LAYERPY = ROOT / ".venv" / "bin" / "layerpy"
SERVER, NODE, SIZE = "10.78.0.1", "10.78.0.11", 15 * 1024 * 1024
PORTS = {"nginx": 8081, "layerpy": 8080}
FETCHES, PARALLEL = 64, 8  # per case, server and round: 64 fetches (1 GB), 8 at once
SERVER_CPU, CLIENT_CPU = "0", "1"


def node_file(directory: Path, interface: str) -> Path:
    """One node, at the client's address; the stand-in boot files with a real-sized kernel."""
    write_boot_files(directory)
    (directory / "vmlinuz").write_bytes(os.urandom(SIZE))
    return one_node_file(directory, interface, SERVER, NODE, PORTS["layerpy"], BOOT_SECTIONS,
                         "52:54:00:78:00:11")  # fmt: skip


def start(link: Link, directory: Path, name: str, command: list[str]) -> subprocess.Popen:
    """`command` pinned to the server's CPU, once it answers."""
    url = f"http://{SERVER}:{PORTS[name]}/minos/kernel"
    return start_pinned(link, directory, name, command, url, SERVER_CPU)


def fetch(link: Link, port: int, count: int, out: str = "/dev/null") -> None:
    """One curl fetching the kernel `count` times at once, a connection each."""
    url = f"http://{SERVER}:{port}/minos/kernel"
    urls = [arg for _ in range(count) for arg in ("-o", out, url)]
    link.client.run("taskset", "-c", CLIENT_CPU, "curl", "-sSfZ", "--parallel-max", str(count),
                    *urls)  # fmt: skip


def main(rounds: int) -> None:
    install_missing({"nginx": "nginx-light"})
    cases = {"one at a time": 1, f"{PARALLEL} at once": PARALLEL}
    cpu: dict[tuple[str, str], list[float]] = {}
    wall: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        link = Link(server_addr=f"{SERVER}/24", client_addr=f"{NODE}/24")
        try:
            config = node_file(directory, link.server_if)
            kernel = directory / "vmlinuz"
            digest = hashlib.sha256(kernel.read_bytes()).hexdigest()
            route = f"location = /minos/kernel {{ alias {kernel}; }}"
            nginx = nginx_config(directory, f"listen {SERVER}:{PORTS['nginx']}; {route}", 1024)
            servers = {
                "nginx": start(link, directory, "nginx", ["nginx", "-c", str(nginx)]),
                "layerpy": start(link, directory, "layerpy",
                                 [str(LAYERPY), "serve", "-c", str(config)]),
            }  # fmt: skip
            for name in servers:  # warm-up, and a correctness check
                out = str(directory / "out")
                fetch(link, PORTS[name], 1, out)
                if hashlib.sha256(Path(out).read_bytes()).hexdigest() != digest:
                    sys.exit(f"{name}: corrupt download")
                fetch(link, PORTS[name], PARALLEL)
            for run in range(rounds):
                order = list(servers) if run % 2 else list(reversed(servers))
                for case, count in cases.items():
                    for name in order:
                        pid = servers[name].pid
                        before, began = cpu_seconds(pid), time.perf_counter()
                        for _ in range(FETCHES // count):
                            fetch(link, PORTS[name], count)
                        seconds = time.perf_counter() - began
                        gigabytes = FETCHES * SIZE / 1e9
                        cpu.setdefault((name, case), []).append(
                            (cpu_seconds(pid) - before) / gigabytes
                        )
                        wall.setdefault((name, case), []).append(gigabytes / seconds)
        finally:
            link.close()
    show(rounds, cpu, wall)


def show(rounds: int, cpu: dict[tuple[str, str], list[float]], wall: dict) -> None:
    print(f"{SIZE / 2**20:.0f} MiB file, {FETCHES} fetches per case, server and round, "
          f"{rounds} rounds; servers on CPU {SERVER_CPU}, curl on CPU {CLIENT_CPU}:")  # fmt: skip
    for case in dict.fromkeys(case for _, case in cpu):
        for name in PORTS:
            per_gb, rate = cpu[name, case], statistics.median(wall[name, case])
            print(f"  {case:12} {name:8} {statistics.median(per_gb):.3f} CPU-s/GB median "
                  f"({min(per_gb):.3f}-{max(per_gb):.3f}),"
                  f" {rate:.2f} GB/s")  # fmt: skip
        ratio = statistics.median(cpu["layerpy", case]) / statistics.median(cpu["nginx", case])
        print(f"  {case:12} layerpy/nginx CPU per GB: {ratio:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", nargs="?", type=int, default=5, help="(default 5)")
    main(parser.parse_args().rounds)
