"""EtcdBackend (BACKEND.md) against a real 3-member etcd cluster (tests/etcd.py)."""

from __future__ import annotations

import asyncio

import pytest

from layerpy.cluster.backend import EtcdBackend
from layerpy.cluster.etcd import Etcd
from layerpy.nodes.backend import Unreachable

from etcd import EtcdCluster, Instance, backend, first_contact

pytestmark = pytest.mark.netns


async def until(condition, what: str, timeout: float = 20) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"waited {timeout} s for {what}") from None


def test_records_round_trip(cluster: EtcdCluster, instance: Instance, prefix: str) -> None:
    async def scenario() -> None:
        async with backend(cluster, "a", prefix) as a:
            a.put("tokens", "cn001", {"sha256": "ab", "boot_id": "x", "boots": 1})
            a.put("leases", "10.0.0.5", {"mac": "52:54:00:00:00:05"})
            a.put("leases", "10.0.0.6", {"mac": "52:54:00:00:00:06"})
            a.delete("leases", "10.0.0.6")
            a.put("observed", "cn/with/slash", {"state": "up"})
            assert a.load("leases") == {"10.0.0.5": {"mac": "52:54:00:00:00:05"}}  # at once
            await a.flush()
        async with backend(cluster, "b", prefix) as b:
            assert b.load("tokens") == {"cn001": {"sha256": "ab", "boot_id": "x", "boots": 1}}
            assert b.load("leases") == {"10.0.0.5": {"mac": "52:54:00:00:00:05"}}
            assert b.load("observed") == {"cn/with/slash": {"state": "up"}}
            assert b.load("bindings") == {}

    instance.run(scenario)


def test_each_backend_hears_the_others_changes_not_its_own(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    async def scenario() -> None:
        async with backend(cluster, "a", prefix) as a, backend(cluster, "b", prefix) as b:
            heard: dict[str, list] = {"a": [], "b": []}
            a.on_change(lambda *change: heard["a"].append(change))
            b.on_change(lambda *change: heard["b"].append(change))
            a.put("bindings", "cn001", {"mac": "m1"})
            await a.flush()
            assert await a.create("leases", "10.0.0.7", {"mac": "m7"})
            await until(lambda: len(heard["b"]) == 2, "b to hear a's put and create")
            b.put("bindings", "cn002", {"mac": "m2"})
            b.delete("bindings", "cn001")
            await b.flush()
            # a last write of each: once the other hears it, it has had every echo before
            a.put("bindings", "end-a", {})
            b.put("bindings", "end-b", {})
            await until(lambda: ("bindings", "end-b", {}) in heard["a"], "a to hear end-b")
            await until(lambda: ("bindings", "end-a", {}) in heard["b"], "b to hear end-a")
            assert heard["a"] == [
                ("bindings", "cn002", {"mac": "m2"}),
                ("bindings", "cn001", None),
                ("bindings", "end-b", {}),
            ]
            assert heard["b"] == [
                ("bindings", "cn001", {"mac": "m1"}),
                ("leases", "10.0.0.7", {"mac": "m7"}),
                ("bindings", "end-a", {}),
            ]
            assert a.load("bindings") == b.load("bindings")
            assert a.load("bindings") == {"cn002": {"mac": "m2"}, "end-a": {}, "end-b": {}}

    instance.run(scenario)


def test_create_and_replace_races_have_exactly_one_winner(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    async def scenario() -> None:
        async with backend(cluster, "a", prefix) as a, backend(cluster, "b", prefix) as b:
            for round in range(40):
                key = f"10.1.0.{round}"
                won = await asyncio.gather(
                    a.create("leases", key, {"mac": "a"}), b.create("leases", key, {"mac": "b"})
                )
                assert sorted(won) == [False, True], f"round {round}: create {won}"
                winner = {"mac": "a" if won[0] else "b"}
                await until(
                    lambda key=key, winner=winner: (
                        a.load("leases").get(key) == winner and b.load("leases").get(key) == winner
                    ),
                    "both to see the winner",
                )
                swapped = await asyncio.gather(
                    a.replace("leases", key, {"mac": "a2"}, winner),
                    b.replace("leases", key, {"mac": "b2"}, winner),
                )
                assert sorted(swapped) == [False, True], f"round {round}: replace {swapped}"
                loser = b if swapped[0] else a
                final = {"mac": "a2" if swapped[0] else "b2"}
                await until(lambda key=key, final=final, loser=loser: loser.load("leases").get(key) == final,
                            "the loser to see the new record")  # fmt: skip
                assert not await loser.replace("leases", key, {"mac": "x"}, winner)  # stale
                assert await loser.replace("leases", key, {"mac": "x"}, final)

    instance.run(scenario)


def test_a_member_killed_mid_writes_loses_nothing(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    async def scenario() -> None:
        async with backend(cluster, "a", prefix) as a:
            in_use = next(m for m in cluster.members if m.url == a._etcd.endpoint)
            for i in range(600):
                a.put("observed", f"n{i:03}", {"i": i})
                if i == 200:
                    await asyncio.sleep(0)  # let the writer start
                    await asyncio.to_thread(in_use.kill)
                if i % 50 == 0:
                    await asyncio.sleep(0.01)
            await a.flush()
        async with backend(cluster, "b", prefix) as b:
            assert b.load("observed") == {f"n{i:03}": {"i": i} for i in range(600)}

    instance.run(scenario)


def test_writes_queued_while_quorum_is_lost_land_in_order(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    async def scenario() -> None:
        async with backend(cluster, "a", prefix) as a:
            start = await a._etcd.put(f"{prefix}/marker", b"")
            await asyncio.to_thread(cluster.members[1].kill)
            await asyncio.to_thread(cluster.members[2].kill)
            for i in range(100):
                a.put("leases", f"10.2.0.{i}", {"i": i})
            a.delete("leases", "10.2.0.50")
            assert len(a.load("leases")) == 99  # served from the mirror meanwhile
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(a.flush()), 3)
            await asyncio.to_thread(cluster.heal)
            await asyncio.wait_for(a.flush(), 30)
            landed: list[str] = []
            watch = a._etcd.watch(f"{prefix}/leases/", start)
            try:
                async with asyncio.timeout(20):
                    async for events in watch:
                        landed += [event.kv.key for event in events]
                        if len(landed) >= 99:
                            break
            except TimeoutError:
                raise AssertionError(f"{len(landed)} of 99 queued writes landed") from None
            finally:
                await watch.aclose()
            assert landed == [f"{prefix}/leases/10.2.0.{i}" for i in range(100) if i != 50]

    instance.run(scenario)


def test_a_fresh_read_brings_the_others_record_or_says_etcd_is_unreachable(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    """What a refused boot token is read again with: the newest record at once, or (no
    quorum) Unreachable, the one error a caller outside the cluster package catches."""

    async def scenario() -> None:
        async with backend(cluster, "a", prefix) as a, backend(cluster, "b", prefix) as b:
            b.put("tokens", "cn001", {"sha256": "cd"})
            await b.written("tokens", "cn001")
            await a.fresh("tokens", "cn001")
            assert a.get("tokens", "cn001") == {"sha256": "cd"}  # when fresh returns
            await asyncio.to_thread(cluster.members[1].kill)
            await asyncio.to_thread(cluster.members[2].kill)
            with pytest.raises(Unreachable, match="no etcd member answered"):
                await asyncio.wait_for(a.fresh("tokens", "cn001"), 60)

    instance.run(scenario)


def test_an_amend_never_reverts_a_newer_record_another_instance_wrote(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    """How a hello's boot id is kept: an instance whose write waited (its etcd member away)
    while another issued the node a new token does not put the old token back; it reads
    the new one back instead (a plain put did: the node's reports were then refused)."""

    async def scenario() -> None:
        etcd = Etcd(cluster.endpoints[:1])  # a's member: stopped below
        await first_contact(etcd)
        a = EtcdBackend(etcd, "a", prefix)
        await a.open()
        heard: list[tuple] = []
        a.on_change(lambda *change: heard.append(change))
        newest = {"sha256": "t2", "boot_id": None}
        try:
            async with backend(cluster, "b", prefix) as b:
                a.put("tokens", "cn001", {"sha256": "t1", "boot_id": None})
                await a.flush()
                await until(lambda: b.get("tokens", "cn001") is not None, "b to hear t1")
                await asyncio.to_thread(cluster.members[0].stop)
                a.amend("tokens", "cn001", {"sha256": "t1", "boot_id": "b1"})  # it waits
                b.put("tokens", "cn001", newest)
                await asyncio.wait_for(b.flush(), 30)
                await asyncio.to_thread(cluster.members[0].start)
                await asyncio.wait_for(a.flush(), 60)
                await until(lambda: a.get("tokens", "cn001") == newest, "a to read t2 back")
                assert ("tokens", "cn001", newest) in heard  # the store follows it
                await b.fresh("tokens", "cn001")
                assert b.get("tokens", "cn001") == newest  # what etcd has
        finally:
            await a.close()
            await etcd.close()

    instance.run(scenario)


def test_a_watch_that_lost_its_history_reads_everything_again(
    cluster: EtcdCluster, instance: Instance, prefix: str
) -> None:
    """a watches through m0 only; while m0 is down b changes records and the history is
    compacted: a's watch comes back to Compacted, reads every record again and tells the
    differences."""
    m0, m1 = cluster.members[0], cluster.members[1]

    async def scenario() -> None:
        etcd_a, etcd_b = Etcd([m0.url]), Etcd([m1.url, cluster.members[2].url])
        await etcd_a.open()
        await etcd_b.open()
        a, b = EtcdBackend(etcd_a, "a", prefix), EtcdBackend(etcd_b, "b", prefix)
        await a.open()
        await b.open()
        try:
            heard: list[tuple] = []
            a.on_change(lambda *change: heard.append(change))
            b.put("tokens", "gone", {"v": 1})
            b.put("tokens", "kept", {"v": 1})
            await b.flush()
            await until(lambda: len(a.load("tokens")) == 2, "a to see b's first records")
            await asyncio.to_thread(m0.stop)
            b.delete("tokens", "gone")
            b.put("tokens", "kept", {"v": 2})
            b.put("tokens", "new", {"v": 1})
            await b.flush()
            now = await etcd_b.put(f"{prefix}/marker", b"")
            compacted = await asyncio.to_thread(cluster.etcdctl, m1, "compact", str(now))
            assert compacted.returncode == 0, compacted.stderr
            await asyncio.to_thread(m0.start)
            final = {"kept": {"v": 2}, "new": {"v": 1}}
            await until(lambda: a.load("tokens") == final, "a to read every record again", 60)
            assert sorted(heard[2:], key=repr) == sorted(
                [
                    ("tokens", "gone", None),
                    ("tokens", "kept", {"v": 2}),
                    ("tokens", "new", {"v": 1}),
                ],
                key=repr,
            )
        finally:
            for opened in (a, b):
                await opened.close()
            await etcd_a.close()
            await etcd_b.close()

    instance.run(scenario)
