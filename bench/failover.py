"""Failover time: a killed instance's nodes owned by another, beside etcd's own leader
failover and Kea HA's partner-down delay, one run.

A 3-member etcd 3.4 (/usr/bin/etcd), each member in a network namespace of its own on a
bridge (tests/etcd.py), and `--instances` layerpy ownership instances, each a process in a
namespace of its own (tests/cluster_instance.py: membership on an etcd lease, node ownership
by transaction, the fence), with `--nodes` nodes. Per run, on a fresh key prefix: the
instances start, split the nodes, and once every node is owned and the victim's fence
allows its nodes, the bench waits a random time within one lease TTL (so the kill falls at
a random moment of the keepalive cycle) and kills one instance that owns nodes with
SIGKILL. An observer process reads the owner keys every 50 ms; the failover time is from
the kill to the first read in which every node is owned and none by the dead instance.

The same run kills etcd's leader (SIGKILL) `--etcd-runs` times and measures from the kill
to a new leader (each survivor's /v3/maintenance/status, polled every 20 ms) and to the
first write layerpy's etcd client completes (a put every 20 ms, 1 s timeout, all three
members as endpoints); the member is started again between runs.

Reference: Kea HA (the libdhcp_ha hook) declares its partner down `max-response-delay`
after the last successful exchange with it, 60 000 ms by default (heartbeat-delay 10 000 ms;
and then, with max-unacked-clients 10 by default, only once 10 clients went unanswered for
max-ack-delay, 10 000 ms): Kea ARM, "High Availability", hooks-ha.rst. Kea HA is not run
here: the figure is its documented default.

Run as root: `.venv/bin/python bench/failover.py [--runs 10] [--etcd-runs 10] [--nodes 60]
[--instances 2] [--ttl 5]`. Nothing leaves the namespaces it creates.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from cluster_instance import Process, owners  # noqa: E402
from etcd import EtcdCluster, Instance  # noqa: E402
from netns import unique_name  # noqa: E402
from nodefile import BOOT_SECTIONS, write_boot_files  # noqa: E402

LAYERPY = ROOT / ".venv" / "bin" / "layerpy"
KEA_PARTNER_DOWN = 60.0  # s: max-response-delay's default, Kea ARM "High Availability"
KEA_HEARTBEAT = 10.0  # s: heartbeat-delay's default


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            sys.exit(f"no {what} after {timeout:g} s")
        time.sleep(0.02)


def taken(observer: Process, killed: float, nodes: int, victim: str) -> float:
    """Seconds from `killed` to the first read with every node owned, none by `victim`."""

    def first() -> float | None:
        for line in observer.lines:
            now = {owner for owner, _ in line["owners"].values()}
            if line["t0"] > killed and len(line["owners"]) == nodes and victim not in now:
                return line["t1"]
        return None

    wait_for(lambda: first() is not None, 60, f"take-over of {victim}'s nodes")
    return first() - killed  # type: ignore[operator]


def one_failover(
    cluster: EtcdCluster, places: list[Instance], logs: Path, args
) -> tuple[float, int]:
    """One run on a fresh prefix: (seconds from the kill to every node owned by the others,
    how many nodes moved)."""
    prefix, endpoints = f"/{unique_name('fo')}", ",".join(cluster.endpoints)
    observer = Process(places[0], logs, prefix, endpoints, "--observe")
    names = [f"i{k}" for k in range(args.instances)]
    given = (str(args.nodes), "--ttl", str(args.ttl))
    instances = [
        Process(place, logs, prefix, endpoints, name, *given)
        for place, name in zip(places[1:], names, strict=True)
    ]
    try:
        for instance in instances:
            wait_for(
                lambda i=instance: i.lines and i.lines[-1]["fresh"],
                30,
                f"{instance.name} registered",
            )
        for instance in instances:
            instance.go()
        wait_for(lambda: len(owners(observer)) == args.nodes, 30, "node owned by an instance each")
        split = owners(observer)
        victim = random.choice([i for i in instances if i.name in split.values()])
        theirs = [node for node, owner in split.items() if owner == victim.name]
        wait_for(lambda: len(victim.lines[-1]["allows"]) == len(theirs), 10, "victim's fence open")
        time.sleep(random.uniform(0, args.ttl))  # a random moment of the lease cycle
        killed = time.time()
        victim.kill()

        return taken(observer, killed, args.nodes, victim.name), len(theirs)
    finally:
        for process in (observer, *instances):
            process.kill()


class Serve:
    """`layerpy serve` with [cluster] in an instance's namespace (its address on lo: the
    bench needs no boot segment, DHCP is off), on the nodes of a node file of its own."""

    def __init__(self, place: Instance, folder: Path, k: int, endpoints: list[str], prefix: str,
                 args: argparse.Namespace) -> None:  # fmt: skip
        self.place, self.folder, self.name = place, folder, f"head{k}"
        folder.mkdir()
        write_boot_files(folder)
        address = f"10.66.0.{k + 1}"
        place.netns.run("ip", "addr", "add", f"{address}/32", "dev", "lo")
        members = ", ".join(f'"{url}"' for url in endpoints)
        last = f"{0x525400660100 + args.nodes - 1:012x}"
        self.config = folder / "nodes.toml"
        self.config.write_text(
            f'[server]\naddress = "{address}"\nstate_dir = "state"\ndhcp = "off"\n\n'
            f'[cluster]\netcd = [{members}]\nname = "{self.name}"\nprefix = "{prefix}"\n'
            f"lease_ttl = {args.ttl}\n\n"
            f'[network]\nsubnet = "10.66.0.0/16"\n\n{BOOT_SECTIONS}\n'
            f'[groups.fo]\nnodes = "fn[001-{args.nodes:03d}]"\nip = "10.66.1.[1-{args.nodes}]"\n'
            f'mac = "52:54:00:66:01:00-{":".join(last[i : i + 2] for i in range(0, 12, 2))}"\n'
        )  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with (self.folder / "serve.log").open("ab") as log:
            command = [str(LAYERPY), "serve", "-c", str(self.config)]
            self.proc = self.place.netns.popen(command, stdout=log, stderr=log)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # `ip netns exec` execs: layerpy's pid
            self.proc.wait()


def serve_failovers(cluster: EtcdCluster, places: list[Instance], directory: Path,
                    args: argparse.Namespace) -> list[tuple[float, int]]:  # fmt: skip
    """`--runs` kills of the instance owning nodes; after each the victim starts again (and
    owns nothing: ownership is sticky), so the next run kills the other, which owns all."""
    prefix = f"/{unique_name('fo')}/layerpy/v1"
    endpoints = ",".join(cluster.endpoints)
    observer = Process(places[0], directory, prefix, endpoints, "--observe")
    heads = [Serve(place, directory / f"head{k}", k, cluster.endpoints, prefix, args)
             for k, place in enumerate(places[1:])]  # fmt: skip
    results = []
    try:
        for head in heads:
            head.start()
        names = {head.name for head in heads}
        owned = args.nodes + 1  # and the segment's discovery pool, owned like a node
        for run in range(args.runs):
            wait_for(lambda: observer.lines and set(observer.lines[-1]["live"]) == names
                     and len(owners(observer)) == owned, 120,
                     "every instance registered and every node and the pool owned")  # fmt: skip
            split = owners(observer)
            victim = random.choice([h for h in heads if h.name in split.values()])
            moved = sum(owner == victim.name for n, owner in split.items() if n.startswith("fn"))
            time.sleep(random.uniform(0, args.ttl))  # a random moment of the lease cycle
            killed = time.time()
            victim.kill()
            results.append((taken(observer, killed, owned, victim.name), moved))
            print(f"  kill {run + 1} ({victim.name}): {moved} nodes owned by another after "
                  f"{results[-1][0]:.2f} s", flush=True)  # fmt: skip
            victim.start()
        return results
    finally:
        for head in heads:
            head.kill()
        observer.kill()


async def leader_failover(cluster: EtcdCluster) -> tuple[float, float]:
    """Kill etcd's leader: (seconds to a new leader, seconds to layerpy's client's next
    completed write). Run from an instance's namespace."""
    import aiohttp

    from layerpy.cluster.etcd import Etcd, EtcdUnavailable

    etcd = Etcd(cluster.endpoints, timeout=1.0)
    await etcd.open()
    written: list[float] = []

    async def writer() -> None:
        while True:
            try:
                await etcd.put("/bench/probe", b"x")
                written.append(time.time())
            except EtcdUnavailable:
                pass
            await asyncio.sleep(0.02)

    task = asyncio.create_task(writer())
    try:
        await asyncio.sleep(0.5)
        leader = cluster.leader()
        old = cluster.status(leader)["MemberID"]
        survivors = [m for m in cluster.members if m is not leader]
        killed = time.time()
        leader.kill()
        elected = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as http:
            while elected is None:
                for member in survivors:
                    try:
                        async with http.post(
                            f"{member.url}/v3/maintenance/status", json={}
                        ) as answer:
                            status = await answer.json()
                    except (aiohttp.ClientError, TimeoutError):
                        continue
                    now = int(status.get("leader", 0))
                    if now and format(now, "x") != old.lower() and str(now) != old:
                        elected = time.time()
                        break
                await asyncio.sleep(0.02)
        while not any(t > killed for t in written):
            await asyncio.sleep(0.02)
        return elected - killed, min(t for t in written if t > killed) - killed
    finally:
        task.cancel()
        await etcd.close()


def spread(times: list[float]) -> str:
    return f"median {statistics.median(times):.2f} s, worst {max(times):.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="instance kills")
    parser.add_argument("--etcd-runs", type=int, default=10, help="etcd leader kills (0: none)")
    parser.add_argument("--nodes", type=int, default=60, help="at most 240")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--ttl", type=int, default=5, help="the instances' lease TTL, s")
    parser.add_argument("--ownership-only", action="store_true",
                        help="ownership alone: tests/cluster_instance.py processes")  # fmt: skip
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: namespaces")
    directory = Path(tempfile.mkdtemp(prefix="layerpy-failover-"))
    cluster = EtcdCluster(directory / "etcd")
    results: list[tuple[float, int]] = []
    leaders: list[tuple[float, float]] = []
    try:
        places = [cluster.add_instance() for _ in range(args.instances + 1)]
        if args.ownership_only:
            for run in range(args.runs):
                results.append(one_failover(cluster, places, directory, args))
                print(f"  kill {run + 1}: {results[-1][1]} nodes owned by another after "
                      f"{results[-1][0]:.2f} s", flush=True)  # fmt: skip
        else:
            results = serve_failovers(cluster, places, directory, args)
        for run in range(args.etcd_runs):
            leaders.append(places[0].run(lambda: leader_failover(cluster), timeout=60))
            elected, writes = leaders[-1]
            print(f"  etcd leader kill {run + 1}: new leader after {elected:.2f} s, "
                  f"layerpy's client writes again after {writes:.2f} s", flush=True)  # fmt: skip
            for member in cluster.members:
                if not member.running:
                    member.start()
            cluster.wait_healthy()
    finally:
        cluster.close()
    kind = "ownership instances" if args.ownership_only else "layerpy serve instances"
    print(f"\nfailover: kill -9 of one of {args.instances} {kind} ({args.nodes} nodes, lease "
          f"TTL {args.ttl} s) to its nodes owned by another, {len(results)} runs: "
          f"{spread([t for t, _ in results])}")  # fmt: skip
    if leaders:
        print(f"etcd 3.4 (3 members) leader kill -9, {len(leaders)} runs: new leader "
              f"{spread([e for e, _ in leaders])}; layerpy's client writes again "
              f"{spread([w for _, w in leaders])}")  # fmt: skip
    median, worst = statistics.median(t for t, _ in results), max(t for t, _ in results)
    best_kea = KEA_PARTNER_DOWN - KEA_HEARTBEAT
    print(f"reference, Kea HA's defaults (not run; Kea ARM): partner declared down "
          f"{KEA_PARTNER_DOWN:g} s after the last answered heartbeat (heartbeats every "
          f"{KEA_HEARTBEAT:g} s): {best_kea:g} to {KEA_PARTNER_DOWN:g} s "
          f"after the kill; ratio layerpy/Kea: median {median / KEA_PARTNER_DOWN:.3f}, "
          f"worst {worst / best_kea:.3f} (to Kea's best case)")  # fmt: skip
    print(f"logs in {directory}")


if __name__ == "__main__":
    main()
