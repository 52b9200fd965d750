"""Node ownership with fencing on a real 3-member etcd (docs/ha.md, "Ownership and fencing").

Each instance is a process (tests/cluster_instance.py) in a namespace of its own on the etcd
bridge (tests/etcd.py), with real leases. An observer process reads the owner keys every
50 ms. Every test checks, besides its own point, that no two instances' fences ever allowed
one node at overlapping times (each instance reports what its fence allows every 50 ms and
at once on a change) and that no owner key was ever overwritten (version 1: a claim only
puts an absent key), so one node never has two owners.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from layerpy.cli import cluster_rows
from layerpy.cluster.etcd import Etcd
from layerpy.cluster.members import Membership
from layerpy.cluster.owners import Owners

from cluster_instance import Process, owners
from etcd import EtcdCluster, first_contact
from netns import unique_name

pytestmark = pytest.mark.netns

TTL = 5
NODES = 30
TAKEOVER = 10.0  # seconds (issue 27)


def wait_for(condition: Callable[[], object], timeout: float, what: str, *logs: Process) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            said = "\n".join(f"--- {p.name}:\n{p.log()[-3000:]}" for p in logs)
            raise AssertionError(f"no {what} after {timeout:g} s\n{said}")
        time.sleep(0.05)


@pytest.fixture
def run(etcd_cluster: EtcdCluster, tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """Start instances (run(name)) or the observer (run("--observe")) on a prefix of this
    test's own; afterwards, the cluster is made whole again for the next test."""
    prefix = f"/{unique_name('own')}"
    started: list[Process] = []

    def start(*args: str) -> Process:
        endpoints = ",".join(etcd_cluster.endpoints)
        process = Process(etcd_cluster.add_instance(), tmp_path, prefix, endpoints, *args)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.kill()
    etcd_cluster.heal()


def start(run: Callable[..., Process], *names: str, **segments: str) -> list[Process]:
    """Instances, each registered and following etcd before any has nodes to claim. Node i
    is at 10.{1 + i % 2}.0.{10 + i}; ``segments`` gives instances a segment (default "")."""
    instances = [run(name, str(NODES), "--segment", segments.get(name, "")) for name in names]
    for instance in instances:
        wait_for(lambda i=instance: i.lines and i.lines[-1]["fresh"], 30,
                 f"instance {instance.name} registered", instance)  # fmt: skip
    for instance in instances:
        instance.go()
    return instances


def all_owned(observer: Process, by: set[str] | None = None) -> bool:
    now = owners(observer)
    return len(now) == NODES and (by is None or set(now.values()) <= by)


def check_one_owner(instances: list[Process], observer: Process) -> None:
    """No owner key overwritten; no two fences allowing one node at overlapping times."""
    for line in observer.lines:
        overwritten = {node: v for node, v in line["owners"].items() if v[1] != 1}
        assert not overwritten, f"owner keys overwritten: {overwritten}"
    runs: dict[str, list[tuple[float, float, str]]] = {}  # node → (first t1, last t0, who)
    for process in instances:
        open_at: dict[str, float] = {}
        last: dict[str, float] = {}
        for line in process.lines:
            for node in line["allows"]:
                open_at.setdefault(node, line["t1"])
                last[node] = line["t0"]
            for node in [node for node in open_at if node not in line["allows"]]:
                runs.setdefault(node, []).append((open_at.pop(node), last[node], process.name))
        for node, first in open_at.items():
            runs.setdefault(node, []).append((first, last[node], process.name))
    for node, spans in runs.items():
        for (start, end, who), (other_start, other_end, other) in itertools.combinations(spans, 2):
            if who != other:
                assert end < other_start or other_end < start, (
                    f"{node}: {who} allowed it from {start} to {end}, {other} from "
                    f"{other_start} to {other_end}"
                )


def test_a_killed_instances_nodes_are_taken_over_by_the_others(run) -> None:
    observer = run("--observe")
    a, b, c = start(run, "a", "b", "c")
    wait_for(lambda: all_owned(observer), 30, "node owned by an instance each", a, b, c)
    split = owners(observer)
    assert set(split.values()) == {"a", "b", "c"}, f"not split between the three: {split}"
    wait_for(lambda: b.lines and len(b.lines[-1]["allows"]) == list(split.values()).count("b"),
             5, "fence of b allowing its nodes", b)  # fmt: skip
    killed = time.time()
    b.kill()
    wait_for(lambda: all_owned(observer, {"a", "c"}), 20, "take-over of b's nodes", a, c)
    taken = next(
        line["t1"] for line in observer.lines
        if line["t0"] > killed and len(line["owners"]) == NODES
        and "b" not in {owner for owner, _ in line["owners"].values()}
    )  # fmt: skip
    print(f"take-over of {list(split.values()).count('b')} nodes of a killed instance: "
          f"{taken - killed:.2f} s (lease TTL {TTL} s)")  # fmt: skip
    assert taken - killed < TAKEOVER
    moved = {node for node, owner in split.items() if owner == "b"}
    assert {n: o for n, o in owners(observer).items() if n not in moved} == {
        n: o for n, o in split.items() if n not in moved
    }, "nodes of the living instances moved (ownership is sticky)"
    wait_for(lambda: {n for p in (a, c) for n in p.lines[-1]["allows"]} == set(split),
             5, "fences of a and c allowing every node", a, c)  # fmt: skip
    check_one_owner([a, b, c], observer)


def test_a_dead_instances_nodes_go_to_an_instance_of_its_segment(run) -> None:
    observer = run("--observe")
    one, two = "10.1.0.0/24", "10.2.0.0/24"
    a, b, c = start(run, "a", "b", "c", a=one, b=one, c=two)
    wait_for(lambda: all_owned(observer), 30, "node owned by an instance each", a, b, c)
    split = owners(observer)
    assert {n for n, o in split.items() if o == "c"} == {f"n{i:03}" for i in range(1, NODES, 2)}
    assert {o for n, o in split.items() if int(n[1:]) % 2 == 0} == {"a", "b"}
    a.kill()
    wait_for(lambda: "a" not in owners(observer).values() and all_owned(observer), 20,
             "take-over of a's nodes", b, c)  # fmt: skip
    now = owners(observer)
    assert {n for n, o in now.items() if o == "c"} == {n for n, o in split.items() if o == "c"}
    check_one_owner([a, b, c], observer)


def test_an_instance_cut_off_from_etcd_stops_acting_within_its_ttl(run) -> None:
    observer = run("--observe")
    a, b = start(run, "a", "b")
    wait_for(lambda: all_owned(observer) and set(owners(observer).values()) == {"a", "b"}, 30,
             "nodes split between a and b", a, b)  # fmt: skip
    wait_for(lambda: a.lines and a.lines[-1]["allows"], 5, "fence of a open", a)
    cut = time.time()
    a.ns.cut()
    wait_for(lambda: not a.lines[-1]["fresh"], TTL + 1, "fence of a closed", a)
    closed = next(line["t1"] for line in a.lines if line["t0"] > cut and not line["fresh"])
    print(f"fence of the cut instance closed {closed - cut:.2f} s after the cut (TTL {TTL} s)")
    assert closed - cut <= TTL
    wait_for(lambda: all_owned(observer, {"b"}), 2 * TAKEOVER, "take-over by b", a, b)
    taken = next(
        line["t1"] for line in observer.lines
        if line["t0"] > cut and len(line["owners"]) == NODES
        and {owner for owner, _ in line["owners"].values()} == {"b"}
    )  # fmt: skip
    print(f"take-over of the cut instance's nodes: {taken - cut:.2f} s after the cut")
    assert taken - cut < TAKEOVER
    after = [line for line in a.lines if line["t0"] >= closed]
    assert after and not any(line["allows"] for line in after), "a allowed after its deadline"
    a.ns.restore()  # its lease expired: it registers again and claims nothing (all owned)
    wait_for(lambda: a.lines[-1]["fresh"], 20, "fence of a fresh again", a)
    time.sleep(1.0)  # what a would claim, it claims at once (or after the 1 s grace)
    assert set(owners(observer).values()) == {"b"} and not a.lines[-1]["allows"]
    said = a.log()
    assert said.count("lost etcd") == 1 and "is gone: registering a again" in said, said
    assert said.count("fresh: acting") == 2, said  # at the start, and with the new lease
    check_one_owner([a, b], observer)


def test_with_etcd_quorum_lost_no_instance_acts_and_owners_stay(run, etcd_cluster) -> None:
    observer = run("--observe")
    a, b = start(run, "a", "b")
    wait_for(lambda: all_owned(observer) and set(owners(observer).values()) == {"a", "b"}, 30,
             "nodes split between a and b", a, b)  # fmt: skip
    before = owners(observer)
    lost = time.time()
    for member in etcd_cluster.members[1:]:
        member.kill()
    wait_for(lambda: not a.lines[-1]["fresh"] and not b.lines[-1]["fresh"], TTL + 1,
             "fences of a and b closed", a, b)  # fmt: skip
    time.sleep(TTL)  # longer than the TTL without quorum: nothing may expire meanwhile
    late = [line for p in (a, b) for line in p.lines if line["t0"] > lost + TTL]
    assert late and not any(line["allows"] for line in late), "an instance acted without quorum"
    for member in etcd_cluster.members[1:]:
        member.start()
    etcd_cluster.wait_healthy()
    wait_for(lambda: a.lines[-1]["allows"] and b.lines[-1]["allows"], 20,
             "fences of a and b open again", a, b)  # fmt: skip
    assert owners(observer) == before, "owners changed across the quorum loss"
    for process in (a, b):
        said = process.log()
        assert said.count("lost etcd") == 1 and said.count("fresh: acting") == 2, said
    check_one_owner([a, b], observer)


def test_the_operator_view_shows_each_instance_its_health_and_its_nodes(
    run, etcd_cluster: EtcdCluster
) -> None:
    observer = run("--observe")
    a, b = start(run, "a", "b")
    wait_for(lambda: all_owned(observer), 30, "node owned by an instance each", a, b)
    split = owners(observer)

    async def look() -> tuple[dict[str, Any], dict[str, Any]]:
        """An instance of no nodes (in a namespace of its own), asked before and after b dies."""
        etcd = Etcd(etcd_cluster.endpoints, timeout=1.0)
        await etcd.open()
        members = Membership(etcd, prefix=observer.prefix, name="v", url="http://v:8080")
        view = Owners(etcd, members, prefix=observer.prefix)
        await members.start()
        await view.start()
        try:
            while set(members.live) != {"a", "b", "v"}:
                await asyncio.sleep(0.05)
            before = await view.overview()
            b.kill()
            while "b" in view.owners.values() or len(view.owners) < NODES or "b" in members.live:
                await asyncio.sleep(0.05)
            return before, await view.overview()
        finally:
            await view.stop()
            await members.stop()
            await etcd.close()

    before, after = etcd_cluster.add_instance().run(look, timeout=60)
    entries = {entry["name"]: entry for entry in before["instances"]}
    assert set(entries) == {"a", "b", "v"} and all(e["alive"] for e in entries.values())
    assert {n: name for name, e in entries.items() for n in e["nodes"]} == split
    assert entries["v"]["self"] and 0 < entries["v"]["lease_fresh_for"] <= TTL - 1
    assert entries["a"]["url"] == "http://a:8080" and before["source"] == "etcd"
    entries = {entry["name"]: entry for entry in after["instances"]}
    assert not entries["b"]["alive"] and entries["b"]["nodes"] == []
    assert len(entries["a"]["nodes"]) == NODES
    rows = {row[0]: row for row in cluster_rows(after, time.time())}
    assert rows["b"][1].startswith("gone ") and rows["a"][5].startswith(f"{NODES} n[000-")
    assert rows["v *"][1].startswith("alive, lease fresh")


def test_a_second_instance_of_a_living_name_is_refused(run, etcd_cluster: EtcdCluster) -> None:
    observer = run("--observe")
    (a,) = start(run, "a")

    async def second() -> str:
        etcd = Etcd(etcd_cluster.endpoints, timeout=1.0)
        await etcd.open()
        try:
            twin = Membership(etcd, prefix=observer.prefix, name="a", url="http://twin", ttl=3)
            with pytest.raises(RuntimeError) as refused:
                await twin.start()  # waits a TTL + 1 s for a previous run's record to expire
            record = await etcd.get(f"{observer.prefix}/instances/a")
            assert record is not None and b"http://a:8080" in record.value
            return str(refused.value)
        finally:
            await etcd.close()

    said = etcd_cluster.add_instance().run(second, timeout=30)
    assert said == "another instance named 'a' is alive in etcd"
    assert a.lines[-1]["fresh"]


def test_an_instance_registered_again_still_fences_when_quorum_is_lost(
    run, etcd_cluster: EtcdCluster
) -> None:
    """The failure matrix's order: cut off (its lease expires), back with a new lease, one
    member (the leader) lost and back, then quorum lost: the fence closes within the TTL
    and says so again (a flake once saw no second ``lost etcd``)."""
    observer = run("--observe")
    (a,) = start(run, "a")
    a.ns.cut()
    wait_for(lambda: not a.lines[-1]["fresh"], TTL + 1, "fence of a closed by the cut", a)
    wait_for(lambda: observer.lines and "a" not in observer.lines[-1]["live"], 2 * TTL,
             "a's lease expired in etcd", a)  # fmt: skip
    a.ns.restore()
    wait_for(lambda: "is gone" in a.log() and "registered in etcd" in a.log().split("is gone")[-1],
             30, "a registered again with a new lease", a)  # fmt: skip
    wait_for(lambda: a.lines[-1]["fresh"], 10, "fence of a fresh again", a)
    leader = etcd_cluster.leader()
    leader.kill()
    leader.start()
    etcd_cluster.wait_healthy()
    wait_for(lambda: a.lines[-1]["fresh"], 10, "fence of a fresh with the leader back", a)
    lost = time.time()
    for member in etcd_cluster.members[:2]:
        member.kill()
    wait_for(lambda: not a.lines[-1]["fresh"], TTL + 1, "fence of a closed without quorum", a)
    closed = next(line["t1"] for line in a.lines if line["t0"] > lost and not line["fresh"])
    assert closed - lost <= TTL, f"closed {closed - lost:.1f} s after quorum was lost"
    wait_for(lambda: a.log().count("lost etcd") == 2, 2, "a saying `lost etcd` again", a)
    said = a.log()
    assert said.count("is gone") == 1, f"a keepalive without quorum taken for a lost lease:\n{said}"


def test_a_failing_fence_listener_stops_neither_the_keepalives_nor_the_deadline(
    etcd_cluster: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Every fence change raises in its listener (the lifecycle's, in serve): the lease is
    still kept alive for several TTLs, and a cut still closes the fence and says so."""
    namespace = etcd_cluster.add_instance()
    prefix = f"/{unique_name('own')}"
    caplog.set_level(logging.INFO, "layerpy.cluster")

    def fails() -> None:
        raise RuntimeError("a listener's bug")

    async def scenario() -> None:
        etcd = Etcd(etcd_cluster.endpoints, timeout=1.0)
        await first_contact(etcd)
        members = Membership(etcd, prefix=prefix, name="a", url="http://a:8080", ttl=3)
        Owners(etcd, members, prefix=prefix, on_fence_change=fails)
        await members.start()
        try:
            start = members.now()
            while members.now() - start < 3 * members.ttl:  # several keepalive periods
                assert members.clock.fresh(members.now()), "the keepalives stopped"
                await asyncio.sleep(0.1)
            await asyncio.to_thread(namespace.cut)
            async with asyncio.timeout(members.ttl + 2):
                while "lost etcd" not in caplog.text:
                    await asyncio.sleep(0.05)
        finally:
            await asyncio.to_thread(namespace.restore, False)
            await members.stop()
            await etcd.close()

    try:
        namespace.run(scenario)
    finally:
        etcd_cluster.heal()
    assert "telling of a change of the etcd lease failed" in caplog.text


def test_a_leader_without_quorum_renews_no_lease_that_the_fence_counts(
    etcd_cluster: EtcdCluster,
) -> None:
    """etcd 3.4's leader renews leases by itself, without quorum, until it steps down (up
    to two election timeouts): a keepalive it answers then must not count, or the fence
    stays open past the TTL after quorum is lost. The two followers are killed."""
    namespace = etcd_cluster.add_instance()
    prefix = f"/{unique_name('own')}"

    async def scenario() -> tuple[float, float]:
        etcd = Etcd([etcd_cluster.leader().url], timeout=1.0)  # the member that stays
        await first_contact(etcd)
        members = Membership(etcd, prefix=prefix, name="a", url="http://a:8080", ttl=3)
        await members.start()
        try:
            leader = etcd_cluster.leader()
            followers = [m for m in etcd_cluster.members if m is not leader]
            await asyncio.to_thread(lambda: [m.kill() for m in followers])
            killed = members.now()
            async with asyncio.timeout(members.ttl + 2):  # closes within the TTL, not later
                while members.clock.fresh(members.now()):
                    await asyncio.sleep(0.05)
            return killed, members.clock.deadline
        finally:
            await members.stop()
            await etcd.close()

    try:
        killed, deadline = namespace.run(scenario)
    finally:
        etcd_cluster.heal()
    assert deadline <= killed + 3 - 1.0, (  # sent before the kill + TTL - margin
        f"a keepalive sent {deadline - 2.0 - killed:.2f} s after quorum was lost counted"
    )
