"""One instance's membership and ownership, as a process for the ownership tests: the test
runs it in a namespace, kills it with -9 or cuts it off from etcd.

    python cluster_instance.py PREFIX ENDPOINT[,ENDPOINT…] NAME NODES [--ttl 5] [--segment CIDR]
    python cluster_instance.py PREFIX ENDPOINT[,ENDPOINT…] --observe

NODES is a count: the nodes are n000…, node i at 10.{1 + i % 2}.0.{10 + i} (two subnets, for
segments), given to ownership when a line "go"
comes on stdin (so the test can start every instance before any claims). Each 50 ms, and at once when the fence
changes, an instance prints one JSON line: {"t0", "t1": wall times before and after it asked
its fence, "fresh": its lease known fresh, "allows": [nodes its fence allows]}. An observer
reads the owner keys each 50 ms and prints {"t0", "t1", "owners": {node: [owner, version]},
"live": [registered instances]} (nothing while etcd does not answer). Log lines go to stderr.

``Process`` runs it for the ownership tests and bench/failover.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from ipaddress import IPv4Address
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerpy.cluster.etcd import Etcd, EtcdUnavailable
from layerpy.cluster.members import Membership
from layerpy.cluster.owners import Owners

if TYPE_CHECKING:
    from etcd import Instance


SCRIPT = str(Path(__file__).resolve())


class Process:
    """This script as a process in an instance namespace of the etcd fixture: ``lines`` is
    what it printed, as it comes; its log goes to ``logs``/NAME.log (appended)."""

    def __init__(self, where: Instance, logs: Path, prefix: str, endpoints: str, *args: str):
        self.ns = where
        self.name = args[0] if args and not args[0].startswith("-") else "observer"
        self.prefix = prefix
        self.stderr = logs / f"{self.name}.log"
        with self.stderr.open("ab") as sink:
            self.proc = where.netns.popen(
                [sys.executable, SCRIPT, prefix, endpoints, *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink,
            )  # fmt: skip
        self.lines: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(json.loads(raw))

    def go(self) -> None:
        """Give the instance its nodes."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # `ip netns exec` execs: this is its pid
        self.proc.wait()

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")


def owners(observer: Process) -> dict[str, str]:
    """node → owner, as the observer last read the owner keys."""
    return (
        {node: owner for node, (owner, _) in observer.lines[-1]["owners"].items()}
        if observer.lines
        else {}
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("endpoints")
    parser.add_argument("name", nargs="?")
    parser.add_argument("nodes", type=int, nargs="?")
    parser.add_argument("--ttl", type=int, default=5)
    parser.add_argument("--segment", default="")
    parser.add_argument("--observe", action="store_true")
    args = parser.parse_args()
    etcd = Etcd(args.endpoints.split(","), timeout=1.0)
    for attempt in range(30):  # as serve does: a busy machine's etcd may answer late at first
        try:
            await etcd.open()
            break
        except EtcdUnavailable:
            if attempt == 29:
                raise
            await asyncio.sleep(1)
    if args.observe:
        await observe(etcd, args.prefix)
    members = Membership(etcd, prefix=args.prefix, name=args.name,
                         url=f"http://{args.name}:8080", segment=args.segment,
                         ttl=args.ttl)  # fmt: skip
    changed = asyncio.Event()
    owners = Owners(etcd, members, prefix=args.prefix, settle=args.ttl,
                    on_fence_change=changed.set)  # fmt: skip
    addresses = {f"n{i:03}": IPv4Address(f"10.{1 + i % 2}.0.{10 + i}") for i in range(args.nodes)}
    nodes = sorted(addresses)
    await members.start()
    await owners.start()
    loop = asyncio.get_running_loop()
    go = loop.run_in_executor(None, sys.stdin.readline)
    go.add_done_callback(lambda _: owners.set_nodes(addresses))
    while True:
        t0 = time.time()
        fresh = members.clock.fresh(members.now())
        allows = [node for node in nodes if owners.fence.allows(node)]
        line = {"t0": t0, "t1": time.time(), "fresh": fresh, "allows": allows}
        print(json.dumps(line), flush=True)
        changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), 0.05)


async def observe(etcd: Etcd, prefix: str) -> None:
    while True:
        t0 = time.time()
        try:
            kvs, _ = await etcd.range(f"{prefix}/owners/")
            live, _ = await etcd.range(f"{prefix}/instances/")
        except EtcdUnavailable:
            await asyncio.sleep(0.05)
            continue
        start = len(f"{prefix}/owners/")
        owners = {kv.key[start:]: [kv.value.decode(), kv.version] for kv in kvs}
        names = sorted(kv.key.rsplit("/", 1)[1] for kv in live)
        line = {"t0": t0, "t1": time.time(), "owners": owners, "live": names}
        print(json.dumps(line), flush=True)
        await asyncio.sleep(0.05)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    asyncio.run(main())
