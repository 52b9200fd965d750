"""Simulated agents at steady state for bench/ha_steady.py: N nodes in one asyncio process,
each booted once and then reporting a heartbeat every `--interval` seconds.

Boot, per node, from its own address (the namespace's `local` route makes every node
address the process's own): GET /boot/NAME.ipxe (the server answers only the node's
address; the script holds the boot token), then a hello report. Its heartbeats, from the
moment it has booted (a slot before that is skipped), go over `--connections` keep-alive
connections per server from one address, as raw HTTP/1.1 POSTs: a report's
admission reads the token in its body, not the address it came from, and 100 000 nodes'
own connections would cost this one client process more than the server. Nodes are spread
evenly over the interval; each report is sent in its slot, or counted late when the client
falls behind.

Prints one JSON line per second on stdout: {"t", "booted", "sent", "ok", "failed", "late",
"cpu", "p50_ms", "p99_ms"} (counts and this process's CPU seconds since the start;
latencies of that second). A line "reboot F" on stdin makes a fraction F of the nodes boot
again (a new boot script, a hello with a new boot id), as after a power cycle: a change
the servers must record, unlike heartbeats.

Run by bench/ha_steady.py (`--servers A,B`: node i boots from server i % 2, then reports
where the servers tell it to: its owner, in a cluster).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import resource
import sys
import time

import uvloop

from layerpy.proto.agent import PROTOCOL


class Connection:
    """One keep-alive HTTP/1.1 connection (a request at a time)."""

    def __init__(self, server: str, port: int, local: str | None = None) -> None:
        self.server, self.port, self.local = server, port, local
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        for attempt in range(5):
            try:
                return await asyncio.wait_for(self._once(method, path, body), 30)
            except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                self.close()
                await asyncio.sleep(0.2 * 2**attempt)
        raise ConnectionError(f"{method} {path} to {self.server}: no answer after 5 tries")

    async def _once(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            local = (self.local, 0) if self.local else None
            self.reader, self.writer = await asyncio.open_connection(
                self.server, self.port, local_addr=local
            )
        assert self.reader is not None
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.server}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        self.writer.write(head.encode() + body)
        answer = await self.reader.readuntil(b"\r\n\r\n")
        status = int(answer.split(b" ", 2)[1])
        length = re.search(rb"(?i)content-length: *(\d+)", answer)
        data = await self.reader.readexactly(int(length.group(1)) if length else 0)
        return status, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Agents:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        with open(args.nodes) as listing:
            self.nodes = [tuple(line.split()) for line in listing if line.strip()]
        self.servers = args.servers.split(",")
        self.tokens: dict[str, str] = {}
        self.boot_ids: dict[str, str] = {}
        self.seq = 0
        self.counts = {"booted": 0, "sent": 0, "ok": 0, "failed": 0, "late": 0}
        self.latencies: list[float] = []
        self.route = [self.servers[i % len(self.servers)] for i in range(len(self.nodes))]
        self.pools = {s: asyncio.Queue() for s in self.servers}
        for server in self.servers:
            for _ in range(args.connections):
                self.pools[server].put_nowait(Connection(server, args.port))

    def follow(self, index: int, said: bytes) -> None:
        """Report where the server says, as an agent does: the first of `layerpy.server=`
        (a boot script) or of an answer's "servers" (its owner, in a cluster)."""
        found = re.search(rb'(?:layerpy\.server=|"servers": *\[")http://([0-9.]+)', said)
        if found and found.group(1).decode() in self.pools:
            self.route[index] = found.group(1).decode()

    def body(self, index: int, event: str) -> bytes:
        name, mac, ip = self.nodes[index]
        self.seq += 1
        report = {"node": name, "token": self.tokens[name], "mac": mac, "ip": ip,
                  "boot_id": self.boot_ids[name], "seq": self.seq, "event": event,
                  "busy": False, "protocol": PROTOCOL, "uptime": 100.0}  # fmt: skip
        return json.dumps(report).encode()

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
            status, answer = await connection.request("POST", REPORT, self.body(index, "hello"))
            if status != 200:
                raise ConnectionError(f"{name}: hello HTTP {status}: {answer[:200]!r}")
            self.follow(index, answer)
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

    async def beat(self, index: int) -> None:
        pool = self.pools[self.route[index]]
        connection = await pool.get()
        began = time.perf_counter()
        try:
            status, answer = await connection.request("POST", REPORT, self.body(index, "heartbeat"))
            self.counts["ok" if status == 200 else "failed"] += 1
            self.follow(index, answer)
        except ConnectionError:
            self.counts["failed"] += 1
        finally:
            pool.put_nowait(connection)
        self.latencies.append(time.perf_counter() - began)

    async def heartbeats(self) -> None:
        """Each node once per interval, in a slot of its own; a slot already past when its
        connection frees is counted late (the client cannot keep up)."""
        loop = asyncio.get_running_loop()
        count, interval = len(self.nodes), self.args.interval
        start, pending = loop.time(), set()
        for tick in range(10**12):
            index = tick % count
            slot = start + tick * interval / count
            if (wait := slot - loop.time()) > 0:
                await asyncio.sleep(wait)
            elif wait < -1.0:
                self.counts["late"] += 1
            if self.nodes[index][0] not in self.tokens:
                continue  # not booted yet
            self.counts["sent"] += 1
            task = asyncio.create_task(self.beat(index))
            pending.add(task)
            task.add_done_callback(pending.discard)
            if len(pending) > 4 * self.args.connections * len(self.servers):
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    async def say(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            ranked = sorted(self.latencies)
            self.latencies = []
            used = resource.getrusage(resource.RUSAGE_SELF)
            line = {"t": time.time(), **self.counts, "cpu": used.ru_utime + used.ru_stime}
            if ranked:
                line |= {"p50_ms": 1000 * ranked[len(ranked) // 2],
                         "p99_ms": 1000 * ranked[int(len(ranked) * 0.99)]}  # fmt: skip
            print(json.dumps(line), flush=True)

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            word, fraction = line.split()
            assert word == "reboot", line
            chosen = random.sample(range(len(self.nodes)), int(len(self.nodes) * float(fraction)))
            await self.boot_all(chosen)
            print(json.dumps({"t": time.time(), "rebooted": len(chosen)}), flush=True)


REPORT = "/api/v1/agent/report"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", required=True, help="A[,B]: node i boots from server i %% n")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--nodes", required=True, help="a file of lines NAME MAC IP")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between beats")
    parser.add_argument("--connections", type=int, default=32, help="per server")
    parser.add_argument("--boot-concurrency", type=int, default=256)
    parser.add_argument("--boot-rate", type=float, default=0, help="boots a second (0: any)")
    args = parser.parse_args()
    agents = Agents(args)
    await asyncio.gather(agents.say(), agents.boot_all(list(range(len(agents.nodes)))),
                         agents.heartbeats(), agents.commands())  # fmt: skip


if __name__ == "__main__":
    uvloop.run(main())
