"""Steady state on etcd: etcd writes per second and server CPU with N simulated agents
reporting heartbeats to two `layerpy serve` instances on a 3-member etcd, beside one
instance without etcd (the reference), one run.

Namespaces only: the nodes' namespace holds a bridge (the boot segment) and every node
address (a `local` route); each server (an instance, or the single one) sits in a namespace
of its own joined to that bridge, and the instances also on the etcd bridge of tests/etcd.py
(3 members of etcd 3.4, /usr/bin/etcd). The simulated agents (bench/agents.py, one asyncio
process pinned to CPU 1; the servers pinned to CPU 0) boot every node once (its boot
script from its own address, a hello), node i on instance i % 2, then report a heartbeat per
node every interval. Per size (`--sizes`) and setup:

- start: from the servers' start until every node is owned (the instances' claims), etcd's
  writes; the boots start only then.
- boot: from the first boot to the last, boots a second, server CPU and etcd's writes per
  boot (`--boot-rate` bounds the boots a second; by default 256 boot at once).
- steady: after every node has booted and an interval + `--settle` s have passed (each
  node's first heartbeat, init -> ready, is a change written once), a window of `--window`
  s: etcd's writes (the raft proposals committed, `etcd_server_proposals_committed_total`,
  and the key-value puts, deletes and transactions, `etcd_mvcc_{put,delete,txn}_total`, read
  from a member's /metrics before and after), each server's CPU (/proc/PID/stat), the
  reports answered, and for the single instance the bytes its journals grew.
- change: then 10 % of the nodes boot again (new boot token, new boot id: what a power
  cycle does), and the same figures are taken from the command to the last hello + 1 s.
- stop: SIGTERM to each server while the agents still report; the seconds to its exit
  (killed after STOP_WITHIN, and said).

The heartbeat interval is `--interval` (5 s, the default of `[server] heartbeat`) unless
that would ask more than `--max-rate` reports a second of the one client process: then
nodes / max-rate, and the servers are told that interval (`[server] heartbeat`), so no node
is taken for lost. What is printed says the interval used; CPU per report is printed so
the figure at a 5 s heartbeat can be extrapolated (heartbeats write nothing to etcd at any
rate: that is the point).

Run as root: `.venv/bin/python bench/ha_steady.py [--sizes 1000,10000] [--window 20]`
(`--sizes 100000` for the largest; `--single-only` without etcd, `--etcd-only` without the
single-instance reference).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from segment import ADDRESSES, Client, Segment, Server, load, node_file, node_list, wait_for  # noqa: E402

from etcd import EtcdCluster  # noqa: E402
from netns import Netns  # noqa: E402

METRICS = ("etcd_server_proposals_committed_total", "etcd_mvcc_put_total",
           "etcd_mvcc_delete_total", "etcd_mvcc_txn_total")  # fmt: skip
SHORT = dict(zip(METRICS, ("proposals", "puts", "deletes", "txns"), strict=True))
PREFIX = "/layerpy/v1"  # [cluster] prefix's default


def etcd_counts(cluster: EtcdCluster | None, where: Netns | None) -> dict[str, float]:
    """The write counters of one etcd member (every member applies every write)."""
    if cluster is None or where is None:
        return {}
    text = where.run("curl", "-sS", "--max-time", "5", f"{cluster.members[0].url}/metrics").stdout
    found = {}
    for name in METRICS:
        match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        found[name] = float(match.group(1)) if match else float("nan")
    return found


def owned(cluster: EtcdCluster) -> int:
    """How many owner keys etcd holds (the nodes' and the discovery pool's)."""
    said = cluster.etcdctl(cluster.members[0], "get", "--prefix", "--keys-only", "--limit=1",
                           "--write-out=json", f"{PREFIX}/owners/")  # fmt: skip
    return int(json.loads(said.stdout).get("count", 0)) if said.returncode == 0 else 0


def sample(servers: list[Server], client: Client, cluster, where) -> dict[str, Any]:
    return {"t": time.monotonic(), "cpu": [s.cpu() for s in servers], "client": client.last(),
            "etcd": etcd_counts(cluster, where),
            "journal": sum(s.journal_bytes() for s in servers)}  # fmt: skip


def difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    seconds = after["t"] - before["t"]
    per = {k: (after["etcd"][k] - before["etcd"][k]) / seconds for k in after["etcd"]}
    reports = after["client"]["ok"] - before["client"]["ok"]
    cpu = [(a - b) / seconds for a, b in zip(after["cpu"], before["cpu"], strict=True)]
    total = {k: after["etcd"][k] - before["etcd"][k] for k in after["etcd"]}
    return {"seconds": seconds, "etcd": per, "etcd_total": total, "cpu": cpu,
            "reports": reports / seconds,
            "failed": after["client"]["failed"] - before["client"]["failed"],
            "late": after["client"]["late"] - before["client"]["late"],
            "client_cpu": (after["client"]["cpu"] - before["client"]["cpu"]) / seconds,
            "journal": (after["journal"] - before["journal"]) / seconds,
            "cpu_per_report": sum(cpu) * seconds / max(reports, 1)}  # fmt: skip


def measure(nodes: int, args: argparse.Namespace, directory: Path, clustered: bool) -> dict:
    """One size on one setup: the steady window and the change window."""
    interval = max(args.interval, nodes / args.max_rate)
    segment = Segment()
    cluster = EtcdCluster(directory / "etcd") if clustered else None
    servers: list[Server] = []
    client = None
    try:
        count = 2 if clustered else 1
        places = (
            [cluster.add_instance().netns for _ in range(count)] if cluster else [Netns("lphs")]
        )
        where = places[0] if cluster else None
        unstarted = etcd_counts(cluster, where)
        for k, place in enumerate(places):
            segment.join(place, ADDRESSES[k])
            own = directory / f"server{k}"
            own.mkdir()
            table = ""
            if cluster:
                endpoints = ", ".join(f'"{url}"' for url in cluster.endpoints)
                table = f'[cluster]\netcd = [{endpoints}]\nname = "i{k}"\n'
            servers.append(Server(place, own, node_file(own, nodes, ADDRESSES[k], interval, table)))
        # started together, the instances split the nodes (one started alone takes them all)
        began = time.monotonic()
        wait_for(lambda: all(s.serving() for s in servers), 300, "layerpy serve started", *servers)
        serving = time.monotonic() - began
        if cluster:  # the boots measured are boots, not boots beside the start's claims
            wait_for(lambda: owned(cluster) > nodes, 600, "every node owned", *servers)
        owning = time.monotonic() - began - serving
        started = {k: v - unstarted[k] for k, v in etcd_counts(cluster, where).items()}
        listing = node_list(directory, nodes)
        client = Client(segment, listing, list(ADDRESSES[:count]), interval, args.boot_rate)
        before = sample(servers, client, cluster, where)
        slowest = min(args.boot_rate or 50, 50)  # boots/s
        wait_for(lambda: client.last()["booted"] >= nodes, 120 + nodes / slowest,
                 f"{nodes} nodes booted", *servers)  # fmt: skip
        boot = difference(before, sample(servers, client, cluster, where))
        time.sleep(args.settle + interval)  # a node's first heartbeat makes it ready: a change
        before = sample(servers, client, cluster, where)
        time.sleep(args.window)
        steady = difference(before, sample(servers, client, cluster, where))
        before = sample(servers, client, cluster, where)
        client.tell("reboot 0.1")
        wait_for(lambda: any("rebooted" in line for line in client.lines), 600, "reboots", *servers)
        time.sleep(1.0)
        change = difference(before, sample(servers, client, cluster, where))
        rebooted = next(line["rebooted"] for line in client.lines if "rebooted" in line)
        setup = "2 instances on etcd" if cluster else "1 instance, no etcd"
        row = {"nodes": nodes, "interval": interval, "setup": setup, "steady": steady,
               "change": change, "rebooted": rebooted, "boot": boot, "serving_s": serving,
               "owning_s": owning, "start_etcd": started, "load": load()}  # fmt: skip
        row["stop_s"] = [server.stop() for server in servers]  # the agents still reporting
        return row
    finally:
        if client is not None:
            client.stop()
        for server in servers:
            server.stop()
        if cluster is not None:
            cluster.close()
        segment.netns.close()
        if not cluster and places:
            places[0].close()


def show(rows: list[dict]) -> None:
    print(f"\n{'nodes':>7} {'beat s':>6} {'setup':<20} {'window':<7} {'reports/s':>9} "
          f"{'etcd writes/s':>13} {'puts/s':>7} {'txns/s':>7} {'server CPU %':>14} "
          f"{'CPU ms/report':>13} {'journal B/s':>11}")  # fmt: skip
    for row in rows:
        for window in ("steady", "change"):
            figures = row[window]
            etcd = figures["etcd"]
            writes = etcd.get("etcd_server_proposals_committed_total")
            cpu = "+".join(f"{100 * c:.0f}" for c in figures["cpu"])
            per_report = 1000 * figures["cpu_per_report"]
            print(f"{row['nodes']:>7} {row['interval']:>6g} {row['setup']:<20} {window:<7} "
                  f"{figures['reports']:>9.0f} "
                  f"{'-' if writes is None else f'{writes:.1f}':>13} "
                  f"{etcd.get('etcd_mvcc_put_total', float('nan')):>7.1f} "
                  f"{etcd.get('etcd_mvcc_txn_total', float('nan')):>7.1f} {cpu:>14} "
                  f"{per_report:>13.3f} {figures['journal']:>11.0f}")  # fmt: skip
        boot, total = row["boot"], row["boot"]["etcd_total"]
        per_boot = {SHORT[k]: v / row["nodes"] for k, v in total.items()}
        print(f"        boot: {row['nodes'] / boot['seconds']:.0f} boots/s "
              f"({boot['seconds']:.0f} s), server CPU "
              f"{1000 * sum(boot['cpu']) * boot['seconds'] / row['nodes']:.2f} ms a boot"
              + "".join(f", {v:.3f} {k}" for k, v in per_boot.items()) + " a boot")  # fmt: skip
        stops = ", ".join(f"{s:.1f}" for s in row["stop_s"])
        print(f"        start: serving after {row['serving_s']:.0f} s, every node owned "
              f"{row['owning_s']:.0f} s later"
              + "".join(f", {v:.0f} {SHORT[k]}" for k, v in row["start_etcd"].items())
              + f"; stop after SIGTERM: {stops} s; load {row['load']}")  # fmt: skip
        total = row["change"]["etcd_total"]
        if total:
            print(
                f"        change: {row['rebooted']} nodes rebooted in "
                f"{row['change']['seconds']:.1f} s: "
                + ", ".join(f"{v:.0f} {SHORT[k]}" for k, v in total.items())
            )
        if row["steady"]["failed"] or row["steady"]["late"]:
            print(f"        steady: {row['steady']['failed']} reports failed, "
                  f"{row['steady']['late']} sent over 1 s late; the client's CPU "
                  f"{100 * row['steady']['client_cpu']:.0f} %")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000", help="node counts, comma-separated")
    parser.add_argument("--interval", type=float, default=5.0, help="heartbeat, s")
    parser.add_argument("--max-rate", type=float, default=1000, help="reports/s of the client")
    parser.add_argument("--boot-rate", type=float, default=0, help="boots/s at most (0: any)")
    parser.add_argument("--settle", type=float, default=10.0, help="s after the last boot")
    parser.add_argument("--window", type=float, default=20.0, help="s of steady state measured")
    parser.add_argument("--single-only", action="store_true", help="no etcd, one instance")
    parser.add_argument("--etcd-only", action="store_true", help="no single-instance reference")
    parser.add_argument("--keep", action="store_true", help="keep the logs (the path is said)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="layerpy-steady-"))
    rows = []
    try:
        for nodes in (int(size) for size in args.sizes.split(",")):
            for clustered in (False, True)[args.etcd_only : 1 if args.single_only else 2]:
                here = directory / f"{nodes}-{'etcd' if clustered else 'single'}"
                here.mkdir()
                rows.append(measure(nodes, args, here, clustered))
                show(rows[-1:])
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print("\nall together:")
    show(rows)
    if args.keep:
        print(f"logs in {directory}")


if __name__ == "__main__":
    main()
