"""Steady state of N booted nodes on one `layerpy serve`: what a heartbeat costs, whether the
event loop stalls, the memory a node holds; nginx answering the same POSTs in the same run.

Namespaces only (bench/segment.py's): the nodes' namespace holds a bridge and every node
address (a `local` route); the server's namespace, joined to the bridge by a veth, holds
`layerpy serve` (pinned to CPU 0) and nginx (pinned to CPU 0 too, one process, answering
POST /api/v1/agent/report with a fixed answer of the size of layerpy's). The simulated
agents (bench/agents.py, one asyncio process pinned to CPU 1) boot every node once (its
boot script from its own address, then a hello) and report a heartbeat per node every
`--interval` s (5, the default heartbeat), spread evenly. Two kinds of agents, a fresh
server each:

- 1.4 (this release): after the full report its heartbeats are datagrams to the port and
  with the key the answer offered (`layerpy.proto.beat`), as the agent's `_beat()` sends.
- 1.3 (the last release): a full report over HTTP per heartbeat, a connection each.

Per size (`--sizes`) and kind (`--kinds`; 1.3 only at the sizes `--old-sizes`): once every
node has booted and an interval + `--settle` s have passed (a node's first heartbeat after
its hello is a full report: init -> ready), a window of `--window` s:

- CPU: the server process's CPU seconds (/proc/PID/stat) over the window's, as % of its
  core, and per heartbeat answered (a datagram's reply or an HTTP answer), in µs; beside
  it the server's CPU with the node file read and no node booted yet (idle: the loop-lag
  probe, the lost-node check...), over IDLE s;
- p50/p99: a heartbeat's round trip at the client (a datagram's reply; an HTTP report's
  connection, request and answer);
- stall: the longest event-loop pause in the window, from the server's loop-lag probe (the
  histogram `layerpy_event_loop_lag_seconds` of /metrics, read over the API's unix socket
  every `--scrape` s as Prometheus would, the bucket counts compared across the window):
  the highest bucket that gained a count (its bound, e.g. "<=10 ms"), and the pauses over
  20 ms (the goal's bound); beside it the full garbage collections in the window and the
  longest (`layerpy_gc_pause_seconds`, generation 2), the same way;
- RSS per node: the server's resident memory after the nodes booted (at the window's
  start) minus before any booted (the node file read, serving), divided by N;
- then nginx, the same window: the heartbeats of every K-th node (K: at most `--max-rate`
  reports a second, what one client process can open connections for) go to nginx as the
  full HTTP reports of a 1.3 agent, a connection each; its CPU per request and p99, and
  the ratio of layerpy's CPU per heartbeat to nginx's per request.

Run as root: `.venv/bin/python bench/steady.py [--sizes 1000,10000,50000] [--window 30]`.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from reference import cpu_seconds, nginx_config  # noqa: E402
from segment import ADDRESSES, Client, Segment, Server, load, node_file, node_list, wait_for  # noqa: E402

from netns import Netns  # noqa: E402
from packages import install_missing  # noqa: E402

SERVER_CPU = "0"
ADDRESS = ADDRESSES[0]
NGINX_PORT = 8081
LAG = "layerpy_event_loop_lag_seconds_bucket"
GC = "layerpy_gc_pause_seconds_bucket"
STALL = 0.020  # the goal: no pause of the event loop longer
IDLE = 5.0  # seconds of the server's CPU measured with no node booted
KINDS = {"1.4": ("--protocol", "1.4"), "1.3": ("--protocol", "1.3")}
# what layerpy answers a heartbeat report of a node without an image, in size
ANSWER = ('{"node": "g0n00001", "heartbeat": 5.0, "image": null, "files": null, "identity": '
          'null, "servers": null, "beat": {"port": 8080, "key": '
          '"00112233445566778899aabbccddeeff"}, "protocol": "1.4"}')  # fmt: skip


def rss(pid: int) -> int:
    """Resident bytes of a process."""
    found = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(found.group(1)) * 1024 if found else 0


class Scraper:
    """/metrics of the server every `every` s (as Prometheus would) on its API socket; the
    bucket counts of the loop-lag and full-collection histograms at the first and the last
    scrape of a window."""

    HISTOGRAMS = {"lag": rf'^{LAG}{{le="([^"]+)"}} ([0-9.e+]+)$',
                  "gc": rf'^{GC}{{generation="2",le="([^"]+)"}} ([0-9.e+]+)$'}  # fmt: skip

    def __init__(self, socket: Path, every: float) -> None:
        self.socket, self.every = socket, every
        self.first: dict[str, dict[float, float]] = {}
        self.last: dict[str, dict[float, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def scrape(self) -> dict[str, dict[float, float]]:
        said = subprocess.run(["curl", "-sSf", "--max-time", "30", "--unix-socket",
                               str(self.socket), "http://layerpy/metrics"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
        return {name: {float(bound): float(count) for bound, count in re.findall(rule, said, re.M)}
                for name, rule in self.HISTOGRAMS.items()}  # fmt: skip

    def _run(self) -> None:
        self.first = self.scrape()
        while not self.stop.wait(self.every):
            self.last = self.scrape()

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()
        self.last = self.scrape()

    def gained(self, name: str) -> tuple[float, float, float]:
        """Of histogram `name` over the window: the longest time observed (the bound of the
        highest bucket that gained a count), the times over STALL, and how many in all."""
        first, last = self.first.get(name, {}), self.last.get(name, {})
        gained = {bound: count - first.get(bound, 0) for bound, count in last.items()}
        longest, below = 0.0, 0.0
        for bound in sorted(gained):  # cumulative: a bucket that gained over the one below
            if gained[bound] > below:
                longest = bound
            below = gained[bound]
        over = below - max((n for b, n in gained.items() if b <= STALL), default=0)
        return longest, over, below


def start_nginx(netns: Netns, directory: Path) -> subprocess.Popen:
    route = (f"location = /api/v1/agent/report {{ default_type application/json; "
             f"return 200 '{ANSWER}'; }}")  # fmt: skip
    config = nginx_config(directory, f"listen {ADDRESS}:{NGINX_PORT}; {route}", 65536)
    with (directory / "nginx.log").open("wb") as log:
        return netns.popen(["taskset", "-c", SERVER_CPU, "nginx", "-c", str(config)],
                           stdout=log, stderr=log)  # fmt: skip


def summary(client: Client, after: float) -> dict[str, float]:
    """The client's summary line said after `after` (its heartbeats since `window`)."""
    client.tell("summary")

    def said() -> list[dict[str, float]]:
        return [line["summary"] for line in client.lines if "summary" in line and line["t"] > after]

    wait_for(said, 30, "the agents' summary")
    return said()[-1]


def window(client: Client, pid: int, seconds: float) -> dict[str, float]:
    """`seconds` of the process `pid`: its CPU, the heartbeats answered, their latencies."""
    before, cpu, began = client.last(), cpu_seconds(pid), time.monotonic()
    client.tell("window")
    time.sleep(seconds)
    cpu, elapsed = cpu_seconds(pid) - cpu, time.monotonic() - began
    said = summary(client, time.time() - 1)
    after = client.last()
    answered = sum(after[k] - before[k] for k in ("http", "beats_ok", "beats_report"))
    return {"cpu": cpu / elapsed, "per_report": cpu / max(answered, 1), "rate": answered / elapsed,
            "client_cpu": (after["cpu"] - before["cpu"]) / elapsed,
            **{k: after[k] - before[k] for k in ("failed", "late", "beats_lost", "http")},
            **said}  # fmt: skip


def measure(nodes: int, kind: str, args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    segment = Segment()
    place = Netns("lphs")
    client = server = None
    try:
        segment.join(place, ADDRESS)
        server = Server(place, directory, node_file(directory, nodes, ADDRESS, args.interval, ""))
        nginx = start_nginx(place, directory)
        wait_for(server.serving, 300, "layerpy serve started", server)
        time.sleep(2.0)
        empty, cpu = rss(server.proc.pid), server.cpu()
        time.sleep(IDLE)
        idle = (server.cpu() - cpu) / IDLE
        listing = node_list(directory, nodes)
        client = Client(segment, listing, [ADDRESS], args.interval, 0, *KINDS[kind],
                        "--connect", "each", "--in-flight", "2048")  # fmt: skip
        began = time.monotonic()
        wait_for(lambda: client.last()["booted"] >= nodes, 120 + nodes / 50,
                 f"{nodes} nodes booted", server)  # fmt: skip
        booting = time.monotonic() - began
        time.sleep(args.settle + args.interval)
        booted = rss(server.proc.pid)
        with Scraper(directory / "state" / "api.sock", args.scrape) as scraper:
            ours = window(client, server.proc.pid, args.window)
        stall, stalls, _ = scraper.gained("lag")
        collection, _, collections = scraper.gained("gc")
        every = max(1, math.ceil(nodes / (args.max_rate * args.interval)))
        client.tell(f"aim {ADDRESS}:{NGINX_PORT} {every}")
        time.sleep(2.0)  # the heartbeats to layerpy in flight are done
        theirs = window(client, nginx.pid, args.window)
        client.tell("aim")
        return {"nodes": nodes, "kind": kind, "ours": ours, "theirs": theirs, "every": every,
                "idle": idle,
                "stall": stall, "stalls": stalls, "gc": collection, "gcs": collections,
                "boot_s": booting,
                "rss_node": (booted - empty) / nodes, "rss": booted, "load": load()}  # fmt: skip
    finally:
        if client is not None:
            client.stop()
        if server is not None:
            server.stop()
        place.close()
        segment.netns.close()


def show(rows: list[dict[str, Any]]) -> None:
    print(f"{'nodes':>6} {'agents':>6} | {'idle %':>6} {'CPU %':>5} {'µs/beat':>7} {'beats/s':>7} "
          f"{'p50 ms':>6} {'p99 ms':>6} {'stall ms':>8} {'>20ms':>5} {'full gc':>11} "
          f"{'KB/node':>7} | "
          f"{'nginx µs':>8} {'p99 ms':>6} {'req/s':>6} | {'ratio':>5}")  # fmt: skip
    for row in rows:
        ours, theirs = row["ours"], row["theirs"]
        stall, gc = (f"<={1000 * row[k]:g}" if math.isfinite(row[k]) else ">1000"
                     for k in ("stall", "gc"))  # fmt: skip
        print(f"{row['nodes']:>6} {row['kind']:>6} | {100 * row['idle']:>6.1f} "
              f"{100 * ours['cpu']:>5.1f} {1e6 * ours['per_report']:>7.1f} {ours['rate']:>7.0f} "
              f"{ours.get('p50_ms', math.nan):>6.2f} {ours.get('p99_ms', math.nan):>6.2f} "
              f"{stall:>8} {row['stalls']:>5.0f} {row['gcs']:>3.0f}x{gc:>7} "
              f"{row['rss_node'] / 1024:>7.2f} | "
              f"{1e6 * theirs['per_report']:>8.1f} {theirs.get('p99_ms', math.nan):>6.2f} "
              f"{theirs['rate']:>6.0f} | "
              f"{ours['per_report'] / max(theirs['per_report'], 1e-9):>5.2f}")  # fmt: skip
    for row in rows:
        ours, theirs = row["ours"], row["theirs"]
        notes = [f"booted in {row['boot_s']:.0f} s", f"server RSS {row['rss'] / 2**20:.0f} MB",
                 f"client CPU {100 * ours['client_cpu']:.0f} %",
                 f"client's longest pause {ours.get('client_lag_ms', math.nan):.0f} ms",
                 f"nginx heard every {row['every']}. node", f"load {row['load']}"]  # fmt: skip
        for name, figures in (("layerpy", ours), ("nginx", theirs)):
            trouble = {k: figures[k] for k in ("failed", "late", "beats_lost") if figures[k]}
            if trouble:
                notes.append(f"{name}: " + ", ".join(f"{v} {k}" for k, v in trouble.items()))
            if name == "layerpy" and figures["http"]:
                notes.append(f"{figures['http']} full reports over HTTP")
        print(f"  {row['nodes']} {row['kind']}: " + "; ".join(notes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,50000", help="node counts")
    parser.add_argument("--kinds", default="1.4,1.3", help="agents' protocols")
    parser.add_argument("--old-sizes", default="1000,10000", help="sizes of the 1.3 agents")
    parser.add_argument("--interval", type=float, default=5.0, help="heartbeat, s")
    parser.add_argument("--settle", type=float, default=10.0, help="s after the last boot")
    parser.add_argument("--window", type=float, default=30.0, help="s measured, each server")
    parser.add_argument("--scrape", type=float, default=15.0, help="s between /metrics reads")
    parser.add_argument("--max-rate", type=float, default=2000, help="nginx's requests/s")
    parser.add_argument("--keep", action="store_true", help="keep the logs (the path is said)")
    args = parser.parse_args()
    install_missing({"nginx": "nginx-light"})
    directory = Path(tempfile.mkdtemp(prefix="layerpy-steady-"))
    old = {int(size) for size in args.old_sizes.split(",")}
    rows = []
    try:
        for nodes in (int(size) for size in args.sizes.split(",")):
            for kind in args.kinds.split(","):
                if kind == "1.3" and nodes not in old:
                    continue
                here = directory / f"{nodes}-{kind}"
                here.mkdir()
                rows.append(measure(nodes, kind, args, here))
                show(rows[-1:])
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"\nheartbeat {args.interval:g} s, window {args.window:g} s; server and nginx on CPU "
          f"{SERVER_CPU}, agents on CPU 1; ratio: layerpy's CPU per heartbeat / nginx's per "
          "request")  # fmt: skip
    show(rows)
    if args.keep:
        print(f"logs in {directory}")


if __name__ == "__main__":
    main()
