"""Simulated agents at steady state: N nodes in one asyncio process, each booted once and
then reporting a heartbeat every `--interval` seconds (bench/ha_steady.py, bench/steady.py).

Boot, per node, from its own address (the namespace's `local` route makes every node
address the process's own): GET /boot/NAME.ipxe (the server answers only the node's
address; the script holds the boot token), then a hello report: the body a real agent
sends (``layerpy.proto.agent.Report``), saying protocol `--protocol`. Then its heartbeats,
from the moment it has booted (a slot before that is skipped), nodes spread evenly over
the interval; each is sent in its slot, or counted late when the client falls behind.

A heartbeat is what the agent of that protocol sends (src/layerpy/agent/core.py):

- 1.4 and later, with a `beat` offer in the last answer: one datagram to the offered
  port, signed with the offered key (``layerpy.proto.beat``); a reply REPORT, or none
  within BEAT_WAIT, makes it a full report over HTTP (after BEAT_MISSES unanswered in a
  row, every beat of the node goes by HTTP, as the agent's do). The datagrams of all
  nodes share one socket: a reply is matched by its seq, which counts over all nodes.
- otherwise (1.3, or no offer): a full report over HTTP.

A full report goes, with `--connect each`, over a connection of its own from the node's
address, closed after the answer (what the agent's urllib does); with `--connect pool`,
over `--connections` keep-alive connections per server from one address, as raw
HTTP/1.1 POSTs (a report's admission reads the token in its body, not the address it came
from, and 100 000 nodes' own connections cost this one client process more than the
server).

Prints one JSON line per second on stdout: {"t", "booted", "sent", "ok", "failed", "late",
"http", "beats", "beats_ok", "beats_report", "beats_lost", "cpu", "p50_ms", "p99_ms"}
(counts and this process's CPU seconds since the start; latencies of that second, a
heartbeat's from its sending to its answer: a datagram's reply, or the HTTP answer after it).

Commands on stdin, a line each:
- ``reboot F``: a fraction F of the nodes boot again (a new boot script, a hello with a
  new boot id), as after a power cycle: a change the servers must record, unlike
  heartbeats; said by a line {"rebooted": n}.
- ``window``: latencies from now on are also kept for ``summary``, which prints
  {"summary": {"count", "p50_ms", "p99_ms", "max_ms"}} of the heartbeats since.
- ``aim HOST:PORT K``: from now on the heartbeats of every K-th node (the others skip
  their slot) are full HTTP reports to HOST:PORT, over a connection each (the reference
  server answering the same POSTs); ``aim`` alone: back to the servers.

Run by bench/ha_steady.py (`--servers A,B`: node i boots from server i % 2, then reports
where the servers tell it to: its owner, in a cluster) and bench/steady.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import resource
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from layerpy.proto import beat
from layerpy.proto.agent import (
    PROTOCOL,
    REPORT_PATH,
    Event,
    FilesStatus,
    ImageStatus,
    Milestone,
    Report,
    encode,
)

BEAT_WAIT = 2.0  # seconds for a datagram's reply, as the agent (agent/core.py)
BEAT_MISSES = 3  # unanswered in a row before a node's beats go by HTTP only, as the agent
SOON = 0.001  # seconds: the slots due this soon go now, with one wakeup of the loop
PROBE = 0.01  # seconds between looks at this process's own loop


class Connection:
    """One HTTP/1.1 connection (a request at a time); `close` (with a request's
    `Connection: close`) when the agent's urllib would close it after the answer."""

    def __init__(self, server: str, port: int, local: str | None = None) -> None:
        self.server, self.port, self.local = server, port, local
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", close: bool = False
    ) -> tuple[int, bytes]:
        for attempt in range(5):
            try:
                return await asyncio.wait_for(self._once(method, path, body, close), 30)
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                self.close()
                await asyncio.sleep(0.2 * 2**attempt)
        raise ConnectionError(f"{method} {path} to {self.server}: no answer after 5 tries")

    async def _once(self, method: str, path: str, body: bytes, close: bool) -> tuple[int, bytes]:
        if self.writer is None:
            local = (self.local, 0) if self.local else None
            self.reader, self.writer = await asyncio.open_connection(
                self.server, self.port, local_addr=local
            )
        assert self.reader is not None
        closing = "Connection: close\r\n" if close else ""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.server}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n{closing}\r\n")  # fmt: skip
        self.writer.write(head.encode())  # two sends, as urllib's http.client makes them
        if body:
            self.writer.write(body)
        answer = await self.reader.readuntil(b"\r\n\r\n")
        status = int(answer.split(b" ", 2)[1])
        length = re.search(rb"(?i)content-length: *(\d+)", answer)
        data = await self.reader.readexactly(int(length.group(1)) if length else 0)
        if close:
            self.close()
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Replies(asyncio.DatagramProtocol):
    """The one socket every node's beats go out of: each reply to `Agents.replied`."""

    def __init__(self, replied: Callable[[bytes], None]) -> None:
        self.replied = replied

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.replied(data)


class Agents:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        with open(args.nodes) as listing:
            self.nodes = [tuple(line.split()) for line in listing if line.strip()]
        self.servers = args.servers.split(",")
        self.tokens: dict[str, str] = {}
        self.boot_ids: dict[str, str] = {}
        self.offers: dict[int, tuple[int, bytes]] = {}  # node: the beat offer (port, key)
        self.misses: dict[int, int] = {}  # node: its datagrams unanswered in a row
        self.seq = 0
        self.counts = dict.fromkeys(("booted", "sent", "ok", "failed", "late", "http", "beats",
                                     "beats_ok", "beats_report", "beats_lost"), 0)  # fmt: skip
        self.latencies: list[float] = []
        self.window: list[float] | None = None
        self.aimed: tuple[str, int, int] | None = None  # the reference: host, port, every K-th
        self.route = [self.servers[i % len(self.servers)] for i in range(len(self.nodes))]
        self.pools = {server: asyncio.Queue[Connection]() for server in self.servers}
        if args.connect == "pool":
            for server in self.servers:
                for _ in range(args.connections):
                    self.pools[server].put_nowait(Connection(server, args.port))
        self.datagrams: asyncio.DatagramTransport | None = None
        # beats awaiting their reply, oldest first: seq -> (node, key, sent at)
        self.waiting: dict[int, tuple[int, bytes, float]] = {}
        self.reporting: set[asyncio.Task[None]] = set()
        # full reports on the wire at once, whatever sent them: lost beats come in bursts
        # after a pause, and one process cannot open a connection for each of them at once
        self.most = args.in_flight or 4 * args.connections * len(self.servers)
        self.in_flight = asyncio.Semaphore(self.most)
        self.failing = False
        self.lag = 0.0  # seconds: the loop's longest pause (probe)

    async def open_datagrams(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind(("0.0.0.0", 0))
        loop = asyncio.get_running_loop()
        replies = Replies(self.replied)
        self.datagrams, _ = await loop.create_datagram_endpoint(lambda: replies, sock=sock)

    def follow(self, index: int, said: bytes) -> None:
        """Report where the server says, as an agent does: the first of `layerpy.server=`
        (a boot script) or of an answer's "servers" (its owner, in a cluster)."""
        found = re.search(rb'(?:layerpy\.server=|"servers": *\[")http://([0-9.]+)', said)
        if found and found.group(1).decode() in self.pools:
            self.route[index] = found.group(1).decode()

    def answered(self, index: int, answer: bytes) -> None:
        """An answer to a full report: where to report, and the beat offer (1.4)."""
        self.follow(index, answer)
        if beat.speaks(self.args.protocol):
            offer = json.loads(answer).get("beat")
            if offer is None:
                self.offers.pop(index, None)
            elif self.offers.get(index, (0, b""))[1] != (key := bytes.fromhex(offer["key"])):
                self.offers[index] = (offer["port"], key)
                self.misses[index] = 0  # a new key: try datagrams again

    def body(self, index: int, event: Event) -> bytes:
        """The report a real agent of this protocol sends (no image yet, no LLDP)."""
        name, mac, ip = self.nodes[index]
        self.seq += 1
        report = Report(
            node=name, token=self.tokens[name], mac=mac, ip=ip, boot_id=self.boot_ids[name],
            seq=self.seq, event=event, hostname=name, uptime=100.0,
            timeline={Milestone.AGENT_START: 3.1, Milestone.NIC_UP: 3.4,
                      Milestone.IP_ACQUIRED: 4.2, Milestone.HELLO: 4.3},
            agent_version="0.1.0", image=ImageStatus(), files=FilesStatus(),
            protocol=self.args.protocol,
        )  # fmt: skip
        return json.dumps(encode(report)).encode()

    async def boot(self, index: int) -> None:
        """The boot script from the node's address, then the hello on that connection."""
        name, _, ip = self.nodes[index]
        connection = Connection(self.servers[index % len(self.servers)], self.args.port, ip)
        try:
            status, script = await connection.request("GET", f"/boot/{name}.ipxe")
            if status != 200:
                raise ConnectionError(f"{name}: boot script HTTP {status}: {script[:200]!r}")
            self.follow(index, script)
            self.tokens[name] = re.search(rb"layerpy\.token=(\S+)", script).group(1).decode()
            self.boot_ids[name] = f"{random.getrandbits(64):016x}"
            status, answer = await connection.request(
                "POST", REPORT_PATH, self.body(index, Event.HELLO), close=True
            )
            if status != 200:
                raise ConnectionError(f"{name}: hello HTTP {status}: {answer[:200]!r}")
            self.answered(index, answer)
        finally:
            connection.close()

    async def boot_all(self, indexes: list[int]) -> None:
        """Up to --boot-concurrency at once, and (--boot-rate) at most so many a second."""
        gate = asyncio.Semaphore(self.args.boot_concurrency)
        loop, rate = asyncio.get_running_loop(), self.args.boot_rate
        start = loop.time()

        async def one(k: int, index: int) -> None:
            if rate:
                await asyncio.sleep(max(0.0, start + k / rate - loop.time()))
            async with gate:
                await self.boot(index)
                self.counts["booted"] += 1

        await asyncio.gather(*(one(k, i) for k, i in enumerate(indexes)))

    async def report(self, index: int, server: str, port: int) -> bool:
        """A full heartbeat report over HTTP; True when answered 200."""
        body = self.body(index, Event.HEARTBEAT)
        if self.args.connect == "each" or server not in self.pools:
            connection = Connection(server, port, self.nodes[index][2])
            try:
                status, answer = await connection.request("POST", REPORT_PATH, body, close=True)
            finally:
                connection.close()
        else:
            pool = self.pools[server]
            connection = await pool.get()
            try:
                status, answer = await connection.request("POST", REPORT_PATH, body)
            finally:
                pool.put_nowait(connection)
        self.counts["http"] += 1
        if status != 200 and not self.failing:
            self.failing = True  # the first failure said, on stderr (the bench keeps it)
            print(
                f"{self.nodes[index][0]}: report HTTP {status}: {answer[:300]!r}", file=sys.stderr
            )
        if status == 200 and server in self.pools:
            self.answered(index, answer)
        return status == 200

    def datagram(self, index: int) -> None:
        """One beat as the agent's `_beat()` sends it; its reply comes to `replied`, or
        `unanswered` counts it lost after BEAT_WAIT. No task or timer a beat: 10 000 beats
        a second must leave this one process room to spare."""
        port, key = self.offers[index]
        self.seq += 1
        self.waiting[self.seq] = (index, key, time.perf_counter())
        assert self.datagrams is not None
        self.datagrams.sendto(beat.beat(key, self.nodes[index][0], self.seq, 100.0),
                              (self.route[index], port))  # fmt: skip
        self.counts["beats"] += 1

    def replied(self, data: bytes) -> None:
        seq = int.from_bytes(data[4:12]) if len(data) >= 12 else -1
        found = self.waiting.get(seq)
        if found is None:
            return
        index, key, sent = found
        verdict = beat.read_reply(key, seq, data)
        if verdict is None:
            return
        del self.waiting[seq]
        self.misses[index] = 0
        if verdict == beat.Verdict.OK:
            self.counts["beats_ok"] += 1
            self.counts["ok"] += 1
            self.took(time.perf_counter() - sent)
        else:  # the agent then reports in full
            self.counts["beats_report"] += 1
            self.spawn(self.heartbeat(index, sent, self.route[index], self.args.port))

    async def unanswered(self) -> None:
        """Beats unanswered after BEAT_WAIT: lost, and reported in full, as the agent does."""
        while True:
            await asyncio.sleep(0.1)
            old = time.perf_counter() - BEAT_WAIT
            while self.waiting:
                seq, (index, _, sent) = next(iter(self.waiting.items()))
                if sent > old:
                    break
                del self.waiting[seq]
                self.counts["beats_lost"] += 1
                self.misses[index] = self.misses.get(index, 0) + 1
                self.spawn(self.heartbeat(index, sent, self.route[index], self.args.port))

    def spawn(self, report: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(report)
        self.reporting.add(task)
        task.add_done_callback(self.reporting.discard)
        return task

    async def heartbeat(self, index: int, began: float, server: str, port: int) -> None:
        """A heartbeat reported in full over HTTP."""
        try:
            async with self.in_flight:
                ok = await self.report(index, server, port)
            self.counts["ok" if ok else "failed"] += 1
        except ConnectionError:
            self.counts["failed"] += 1
        self.took(time.perf_counter() - began)

    def took(self, seconds: float) -> None:
        self.latencies.append(seconds)
        if self.window is not None:
            self.window.append(seconds)

    async def heartbeats(self) -> None:
        """Each node once per interval, in a slot of its own; a slot already past when its
        turn comes is counted late (the client cannot keep up)."""
        loop = asyncio.get_running_loop()
        count, interval = len(self.nodes), self.args.interval
        start = loop.time()
        for tick in range(10**12):
            index = tick % count
            slot = start + tick * interval / count
            if (wait := slot - loop.time()) > SOON:
                await asyncio.sleep(wait)
            elif wait < -1.0:
                self.counts["late"] += 1
            if self.nodes[index][0] not in self.tokens:
                continue  # not booted yet
            if self.aimed is not None and index % self.aimed[2]:
                continue  # the reference hears every K-th node only
            self.counts["sent"] += 1
            if (
                self.aimed is None
                and index in self.offers
                and self.misses.get(index, 0) < BEAT_MISSES
            ):
                self.datagram(index)
                continue
            server, port = self.aimed[:2] if self.aimed else (self.route[index], self.args.port)
            self.spawn(self.heartbeat(index, time.perf_counter(), server, port))
            if len(self.reporting) > self.most:
                await asyncio.wait(self.reporting, return_when=asyncio.FIRST_COMPLETED)

    async def probe(self) -> None:
        """The longest pause of this process's own loop since `window` (a round trip timed
        here includes it)."""
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await asyncio.sleep(PROBE)
            self.lag = max(self.lag, loop.time() - began - PROBE)

    async def say(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            used = resource.getrusage(resource.RUSAGE_SELF)
            line = {"t": time.time(), **self.counts, "cpu": used.ru_utime + used.ru_stime}
            print(json.dumps(line | percentiles(self.latencies)), flush=True)
            self.latencies = []

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            word, *rest = line.split()
            if word == "reboot":
                chosen = random.sample(range(len(self.nodes)),
                                       int(len(self.nodes) * float(rest[0])))  # fmt: skip
                await self.boot_all(chosen)
                print(json.dumps({"t": time.time(), "rebooted": len(chosen)}), flush=True)
            elif word == "window":
                self.window, self.lag = [], 0.0
            elif word == "summary":
                said = {"count": len(self.window or [])} | percentiles(self.window or [])
                said["client_lag_ms"] = 1000 * self.lag
                print(json.dumps({"t": time.time(), "summary": said}), flush=True)
                self.window = None
            elif word == "aim":
                if rest:
                    host, port = rest[0].rsplit(":", 1)
                    self.aimed = (host, int(port), int(rest[1]))
                else:
                    self.aimed = None
            else:
                raise ValueError(f"unknown command {line!r}")


def percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {}
    ranked = sorted(latencies)
    return {"p50_ms": 1000 * ranked[len(ranked) // 2],
            "p99_ms": 1000 * ranked[int(len(ranked) * 0.99)],
            "max_ms": 1000 * ranked[-1]}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", required=True, help="A[,B]: node i boots from server i %% n")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--nodes", required=True, help="a file of lines NAME MAC IP")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between beats")
    parser.add_argument("--protocol", default=PROTOCOL, help="what the agents say they speak")
    parser.add_argument(
        "--connect",
        choices=("pool", "each"),
        default="pool",
        help="full reports over a keep-alive pool, or a connection each",
    )
    parser.add_argument("--connections", type=int, default=32, help="per server (pool)")
    parser.add_argument(
        "--in-flight",
        type=int,
        default=0,
        help="heartbeats at once, at most (0: 4 per pooled connection)",
    )
    parser.add_argument("--boot-concurrency", type=int, default=256)
    parser.add_argument("--boot-rate", type=float, default=0, help="boots a second (0: any)")
    args = parser.parse_args()
    agents = Agents(args)
    await agents.open_datagrams()
    everyone = list(range(len(agents.nodes)))
    await asyncio.gather(agents.say(), agents.probe(), agents.boot_all(everyone),
                         agents.heartbeats(), agents.unanswered(), agents.commands())  # fmt: skip


if __name__ == "__main__":
    uvloop.run(main())
