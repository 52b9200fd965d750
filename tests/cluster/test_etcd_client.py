"""layerpy's etcd client against real etcd 3.4 members in namespaces (tests/etcd.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import aiohttp
import pytest

from layerpy import logs
from layerpy.cluster.etcd import (
    WATCH_IDLE,
    Compacted,
    Compare,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    Op,
    WatchEvent,
)

from etcd import EtcdCluster, Instance, make_tls, until

pytestmark = pytest.mark.netns


def test_keys_ranges_transactions_and_leases(cluster: EtcdCluster, instance: Instance) -> None:
    async def scenario() -> None:
        etcd = Etcd(cluster.endpoints)
        await etcd.open()
        try:
            revision = await etcd.put("/t1/a", b"\x00\xffvalue")
            got = await etcd.get("/t1/a")
            assert got is not None and (got.value, got.mod_revision) == (b"\x00\xffvalue", revision)
            assert await etcd.get("/t1/none") is None
            # more keys than a page: the range is read in pages at one revision
            await asyncio.gather(*(etcd.put(f"/t1/many/{i:04}", b"x") for i in range(1100)))
            kvs, at = await etcd.range("/t1/many/")
            assert [kv.key for kv in kvs] == [f"/t1/many/{i:04}" for i in range(1100)]
            assert at >= max(kv.mod_revision for kv in kvs)
            assert (await etcd.range("/t1/many"))[0] == kvs  # "/t1/many" < "/t1/many/": same keys
            # create-if-absent: the second loses and sees the winner's value
            won = await etcd.txn([Compare.version("/t1/b", "==", 0)], [Op.put("/t1/b", b"one")])
            lost = await etcd.txn(
                [Compare.version("/t1/b", "==", 0)], [Op.put("/t1/b", b"two")], [Op.get("/t1/b")]
            )
            assert won.succeeded and not lost.succeeded
            assert [kv.value for kv in lost.responses[0]] == [b"one"]
            current = await etcd.get("/t1/b")
            assert current is not None
            swap = [Compare.mod_revision("/t1/b", "==", current.mod_revision)]
            assert (await etcd.txn(swap, [Op.put("/t1/b", b"three")])).succeeded
            assert not (await etcd.txn(swap, [Op.put("/t1/b", b"four")])).succeeded
            assert await etcd.delete("/t1/b") and not await etcd.delete("/t1/b")
            cleared = await etcd.txn([], [Op.delete_prefix("/t1/many/")])
            assert cleared.succeeded and (await etcd.range("/t1/many/"))[0] == []
            # independent transactions in one request: each applies by its own compares
            await etcd.put("/t1/taken", b"other")
            at, took = await etcd.each_txn(
                [([Compare.version(key, "==", 0)], [Op.put(key, b"mine")])
                 for key in ("/t1/free", "/t1/taken")]
            )  # fmt: skip
            assert took == [True, False] and at == (await etcd.get("/t1/free")).mod_revision  # type: ignore[union-attr]
            assert (await etcd.get("/t1/taken")).value == b"other"  # type: ignore[union-attr]
            # a key on a lease goes with the lease
            lease = await etcd.grant(30)
            await etcd.put("/t1/leased", b"x", lease=lease)
            assert 0 < await etcd.keepalive(lease) <= 30
            assert (await etcd.get("/t1/leased")).lease == lease  # type: ignore[union-attr]
            await etcd.revoke(lease)
            assert await etcd.keepalive(lease) == 0
            assert await etcd.get("/t1/leased") is None
            await etcd.revoke(lease)  # already gone: not an error
        finally:
            await etcd.close()

    instance.run(scenario)


def test_a_member_killed_mid_writes_is_invisible(cluster: EtcdCluster, instance: Instance) -> None:
    """kill -9 of the member in use: every put still lands, none raises. The member may be
    the leader: the client's deadline must then outlast an election (2.6 s at worst in
    bench/failover.py; a 2 s one failed in one run)."""

    async def scenario() -> tuple[str, str]:
        etcd = Etcd(cluster.endpoints, timeout=6)
        await etcd.open()
        try:
            first = etcd.endpoint
            for i in range(200):
                if i == 50:
                    await asyncio.to_thread(_member(cluster, first).kill)
                await etcd.put(f"/t2/{i:03}", str(i).encode())
            kvs, _ = await etcd.range("/t2/")
            assert [kv.value for kv in kvs] == [str(i).encode() for i in range(200)]
            return first, etcd.endpoint
        finally:
            await etcd.close()

    killed, survivor = instance.run(scenario)
    assert survivor != killed


def test_a_member_without_a_leader_is_left_at_once(
    cluster: EtcdCluster, instance: Instance
) -> None:
    """A member cut off from its peers (a minority partition) answers "no leader" (the client
    asks for a leader on every request): the client moves on without waiting its timeout."""
    isolated = cluster.members[0]
    isolated.isolate()
    _wait(lambda: cluster.status(isolated).get("Leader") == "0", "member m0 to lose its leader")

    async def scenario() -> tuple[float, str]:
        etcd = Etcd(cluster.endpoints, timeout=5)
        await etcd.open()
        try:
            etcd._current = 0  # the isolated member first
            started = time.monotonic()
            await etcd.put("/t3/a", b"x")
            return time.monotonic() - started, etcd.endpoint
        finally:
            await etcd.close()

    took, endpoint = instance.run(scenario)
    assert endpoint != isolated.url
    assert took < 2, f"a put took {took:.1f} s: the leaderless member was waited for"


def test_no_member_answering_raises_unavailable_naming_each(
    cluster: EtcdCluster, instance: Instance
) -> None:
    async def scenario() -> None:
        etcd = Etcd(cluster.endpoints, timeout=0.5)
        await etcd.open()
        try:
            await asyncio.to_thread(instance.cut)
            started = time.monotonic()
            with pytest.raises(EtcdUnavailable) as raised:
                await etcd.put("/t4/a", b"x")
            assert time.monotonic() - started < 0.5 * 3 + 1
            for url in cluster.endpoints:
                assert f"{url}: no answer within 0.5 s" in str(raised.value)
            await asyncio.to_thread(instance.restore)
            assert await etcd.put("/t4/a", b"x") > 0
        finally:
            await etcd.close()

    instance.run(scenario)


def test_a_watch_survives_its_members_death_in_order(
    cluster: EtcdCluster, instance: Instance
) -> None:
    """Events before, during and after kill -9 of the watch's member: each once, in order."""

    async def scenario() -> None:
        writer, watcher = Etcd(cluster.endpoints), Etcd(cluster.endpoints)
        await writer.open()
        await watcher.open()
        try:
            start = await writer.put("/t5-other", b"") + 1
            watcher._current, writer._current = 0, 1
            seen: list[WatchEvent] = []
            expected = 300 + len(range(0, 300, 7))  # a put each, and a delete every 7th

            async def watch() -> None:
                async for events in watcher.watch("/t5/", start):
                    seen.extend(events)
                    if len(seen) >= expected:
                        return

            watching = asyncio.create_task(watch())
            for i in range(300):
                if i == 100:
                    await asyncio.to_thread(cluster.members[0].kill)
                await writer.put(f"/t5/{i:03}", str(i).encode())
                if i % 7 == 0:
                    await writer.delete(f"/t5/{i:03}")
            await asyncio.wait_for(watching, 30)
            revisions = [event.kv.mod_revision for event in seen]
            assert revisions == sorted(set(revisions)), "an event twice or out of order"
            assert len(seen) == expected
            assert [e.kind for e in seen].count("delete") == len(range(0, 300, 7))
            assert watcher.endpoint != cluster.members[0].url
        finally:
            await writer.close()
            await watcher.close()

    instance.run(scenario)


def test_a_watch_from_compacted_history_raises_compacted(
    cluster: EtcdCluster, instance: Instance
) -> None:
    async def scenario() -> int:
        etcd = Etcd(cluster.endpoints)
        await etcd.open()
        try:
            old = await etcd.put("/t6/a", b"1")
            now = await etcd.put("/t6/a", b"2")
            await asyncio.to_thread(cluster.etcdctl, cluster.members[1], "compact", str(now))
            with pytest.raises(Compacted) as raised:
                async for _ in etcd.watch("/t6/", old):
                    pass
            return raised.value.revision
        finally:
            await etcd.close()

    assert instance.run(scenario) > 0


def test_tls_with_a_client_certificate(tmp_path: Path) -> None:
    tls = make_tls(tmp_path / "tls", ["10.79.0.11"])
    cluster = EtcdCluster(tmp_path / "etcd", size=1, tls=tls)
    try:
        instance = cluster.add_instance()

        async def scenario() -> None:
            etcd = Etcd(cluster.endpoints, ca=tls.ca, cert=tls.client_cert, key=tls.client_key)
            await etcd.open()
            assert await etcd.put("/tls", b"x") > 0
            await etcd.close()
            anonymous = Etcd(cluster.endpoints, ca=tls.ca)
            with pytest.raises(EtcdUnavailable, match=r"no etcd member answered: https://10\.79\.0\.11:2379: "):  # fmt: skip
                await anonymous.open()
            stranger = Etcd(cluster.endpoints, ca=tls.server_cert)  # not the CA
            with pytest.raises(EtcdUnavailable, match="certificate verify failed"):
                await stranger.open()

        instance.run(scenario)
    finally:
        cluster.close()


def test_user_and_password_with_a_token_that_expires(tmp_path: Path) -> None:
    """A token etcd no longer knows (expired, or the member restarted) is replaced by
    authenticating again. etcd forgets a user's simple tokens when the password is set, so the
    test needs no wait for --auth-token-ttl."""
    cluster = EtcdCluster(tmp_path, size=1)
    try:
        member = cluster.members[0]
        setup = [
            ("user", "add", "root:rootpw"),
            ("user", "add", "lp:lppw"),
            ("role", "add", "lp"),
            ("role", "grant-permission", "lp", "--prefix=true", "readwrite", "/lp/"),
            ("user", "grant-role", "lp", "lp"),
            ("auth", "enable"),
        ]
        for args in setup:
            result = cluster.etcdctl(member, *args)
            assert result.returncode == 0, f"etcdctl {args}: {result.stderr}"
        instance = cluster.add_instance()

        def forget_tokens() -> None:
            args = ("--user", "root:rootpw", "user", "passwd", "lp", "--interactive=false")
            result = cluster.etcdctl(member, *args, input="lppw\n")
            assert result.returncode == 0, f"etcdctl user passwd: {result.stderr}"

        async def scenario() -> None:
            etcd = Etcd(cluster.endpoints, user="lp", password="lppw")
            await etcd.open()
            try:
                await etcd.put("/lp/a", b"1")
                token = etcd._tokens[member.url]
                await asyncio.to_thread(forget_tokens)
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        member.url + "/v3/kv/range",
                        json={"key": "L2xwL2E="},
                        headers={"Authorization": token},
                    ) as response,
                ):
                    assert response.status == 401, "the old token still works"
                assert await etcd.put("/lp/a", b"2") > 0  # authenticated again by itself
                assert etcd._tokens[member.url] != token
                with pytest.raises(EtcdError, match="permission denied"):
                    await etcd.put("/other", b"x")
            finally:
                await etcd.close()
            wrong = Etcd(cluster.endpoints, user="lp", password="nope")
            with pytest.raises(EtcdError, match=r"refused user 'lp'.*authentication failed"):
                await wrong.open()

        instance.run(scenario)
    finally:
        cluster.close()


def _member(cluster: EtcdCluster, url: str):
    return next(member for member in cluster.members if member.url == url)


def _wait(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(0.1)


def test_a_watch_leaves_a_member_that_lost_its_leader(
    cluster: EtcdCluster, instance: Instance
) -> None:
    """The watch's member is cut off from its peers: etcd ends the stream (the watch asked
    for a leader) and the watch goes on from another member, well before its idle probe."""

    async def scenario() -> float:
        writer, watcher = Etcd(cluster.endpoints), Etcd(cluster.endpoints)
        await writer.open()
        await watcher.open()
        watch = watcher.watch("/t7/", await writer.put("/t7-start", b"") + 1)
        try:
            watcher._current, writer._current = 0, 1
            first = asyncio.ensure_future(anext(watch))
            await writer.put("/t7/a", b"1")
            assert [e.kv.key for e in await asyncio.wait_for(first, 10)] == ["/t7/a"]
            await asyncio.to_thread(cluster.members[0].isolate)
            started = time.monotonic()
            await writer.put("/t7/b", b"2")
            assert [e.kv.key for e in await asyncio.wait_for(anext(watch), 30)] == ["/t7/b"]
            assert watcher.endpoint != cluster.members[0].url
            return time.monotonic() - started
        finally:
            await watch.aclose()
            await writer.close()
            await watcher.close()

    took = instance.run(scenario)
    assert took < WATCH_IDLE, f"the watch took {took:.1f} s to leave the leaderless member"


def test_a_watch_cut_off_from_etcd_says_so_once_and_once_when_back(
    cluster: EtcdCluster, instance: Instance, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a line per retry while no member answers: one when the outage begins, one when
    the watch works again (the summaries of a long one: tests/unit/test_logs.py)."""
    caplog.set_level(logging.INFO, "layerpy.etcd")
    held = ("etcd", "etcd watch of /t9/")

    async def scenario() -> None:
        writer, watcher = Etcd(cluster.endpoints), Etcd(cluster.endpoints)
        await writer.open()
        await watcher.open()
        seen: list[WatchEvent] = []
        start = await writer.put("/t9-start", b"") + 1  # (an earlier test compacts history)

        async def watch() -> None:
            async for events in watcher.watch("/t9/", start):
                seen.extend(events)

        watching = asyncio.create_task(watch())
        try:
            await writer.put("/t9/a", b"1")
            await until(lambda: len(seen) == 1, "the first event")
            retries = logs.suppressed[held]
            await asyncio.to_thread(instance.cut)
            await until(lambda: logs.suppressed[held] >= retries + 3, "three retries held back")
            await asyncio.to_thread(instance.restore)
            await writer.put("/t9/b", b"2")
            await until(lambda: len(seen) == 2, "the event after the outage")
        finally:
            await asyncio.to_thread(instance.restore, False)
            watching.cancel()
            await writer.close()
            await watcher.close()

    instance.run(scenario)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(held[1])]
    assert len(said) == 2 and "retrying" in said[0] and "back after" in said[1], said
