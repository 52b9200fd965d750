"""The node file shared through a real 3-member etcd (tests/etcd.py): the first instance
publishes it, one with the same rest joins, one with another rest is refused with the key
named; a reload all accept is committed and applied everywhere in one revision, one that
one instance refuses nowhere, and of two at once exactly one wins."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from layerpy.cluster.etcd import Etcd
from layerpy.cluster.file import Committed, FileRefused, SharedFile
from layerpy.config import Config, ConfigError, ReloadRefused, load, parse_shared

from etcd import EtcdCluster, Instance, make_tls
from nodefile import BOOT_SECTIONS, InstanceFile, instance_file

pytestmark = pytest.mark.netns

WAIT = 30.0  # seconds for anything to show on every instance

REST = (
    """
[network]
subnet = "10.99.0.0/24"

"""
    + BOOT_SECTIONS
    + """
[groups.compute]
nodes = "cn[001-002]"
ip = "10.99.0.[11-12]"
image = "base"

[images.base]
source = "oci-layout:base"

[images.other]
source = "oci-layout:other"
"""
)


def own_server(index: int) -> str:
    """Instance ``index``'s [server] table (a port of its own, so they differ)."""
    return (f'interface = "br0"\naddress = "10.99.0.{index + 1}"\nhttp_port = {8080 + index}\n'
            f'state_dir = "state"\n')  # fmt: skip


class Head:
    """One instance as the server wires it: its own node file in a folder of its own, and
    a SharedFile whose check runs the cluster's file with its own settings and local files
    (parse_shared), and whose apply records each revision it ran."""

    def __init__(self, cluster: EtcdCluster, file: InstanceFile, prefix: str,
                 answer_within: float = 10.0) -> None:  # fmt: skip
        self.file = file
        self.name, self.folder, self.path = file.folder.name, file.folder, file.path
        self.own = self.path.read_text()  # the file as it is on this instance's host
        self.config: Config = load(self.path)
        self.applied: list[int] = []
        self.etcd = Etcd(cluster.endpoints)
        self.shared: SharedFile[int] = SharedFile(
            self.etcd, self.name, prefix, self.own, check=self.check, apply=self.apply,
            answer_within=answer_within,
        )  # fmt: skip
        self.task: asyncio.Task[None] | None = None
        self.hold: asyncio.Barrier | None = None  # the next check waits for the others' too
        self.before_apply: Callable[[], None] | None = None

    async def check(self, text: str) -> Config:
        if self.hold is not None:
            hold, self.hold = self.hold, None
            await hold.wait()
        try:
            return await asyncio.to_thread(parse_shared, text, self.own, self.path)
        except ConfigError as error:
            raise ReloadRefused(error.render().splitlines()) from None

    async def apply(self, committed: Committed) -> int:
        if self.before_apply is not None:
            self.before_apply()
        self.config = await self.check(committed.text)
        self.applied.append(committed.revision)
        return committed.revision

    def text(self, rest: str) -> str:
        """This instance's node file with another rest (what an operator edits here)."""
        return self.file.text(rest)


@asynccontextmanager
async def heads(cluster: EtcdCluster, files: Callable[..., InstanceFile], prefix: str, count: int,
                started: bool = True, **options: object) -> AsyncIterator[list[Head]]:  # fmt: skip
    """`count` instances on the test's prefix, each registered as live (as the membership
    does, on a lease) and, when ``started``, following the file (run loop)."""
    made = [Head(cluster, files(f"head{i + 1}", own_server(i), REST), prefix, **options)  # type: ignore[arg-type]
            for i in range(count)]  # fmt: skip
    for head in made:
        await head.etcd.open()
    lease = await made[0].etcd.grant(120)
    try:
        for head in made:
            await head.etcd.put(f"{prefix}/instances/{head.name}", b"{}", lease=lease)
        if started:
            for head in made:
                await start(head)
        yield made
    finally:
        for head in made:
            if head.task is not None:
                head.task.cancel()
        await made[0].etcd.revoke(lease)
        for head in made:
            await head.etcd.close()


@pytest.fixture
def run_heads(cluster: EtcdCluster, instance: Instance, instance_files: Callable[..., InstanceFile],
              prefix: str) -> Callable[..., None]:  # fmt: skip
    """``run(count, scenario, started=True, **options)``: ``scenario(heads)`` awaited in the
    first instance namespace, with ``heads(…)`` of the test's prefix."""

    def run(count: int, scenario: Callable[[list[Head]], Awaitable[None]], started: bool = True,
            **options: object) -> None:  # fmt: skip
        async def within() -> None:
            async with heads(cluster, instance_files, prefix, count, started, **options) as made:
                await scenario(made)

        instance.run(within)

    return run


async def start(head: Head) -> Committed:
    committed = await head.shared.start()
    head.task = asyncio.create_task(head.shared.run())
    return committed


async def until(condition: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while True:
        result = condition()
        if result if isinstance(result, bool) else await result:
            return
        assert time.monotonic() < deadline, f"waited {WAIT:g} s for {what}"
        await asyncio.sleep(0.05)


async def in_etcd(head: Head, key: str) -> dict[str, object] | None:
    kv = await head.etcd.get(key)
    return None if kv is None else json.loads(kv.value)


def test_first_publishes_same_rest_joins_other_rest_is_refused(
    run_heads: Callable[..., None],
    prefix: str,
    cluster: EtcdCluster,
    instance_files: Callable[..., InstanceFile],
) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, head2 = made
        first = await start(head1)
        assert (first.revision, first.by) == (1, "head1")
        assert await in_etcd(head1, f"{prefix}/file") == {
            "revision": 1, "text": head1.own, "by": "head1"
        }  # fmt: skip
        joined = await start(head2)  # its own [server] and [cluster] differ: it joins
        assert (joined.revision, joined.by, head2.shared.revision) == (1, "head1", 1)
        other = REST.replace('image = "base"', 'image = "other"')
        head3 = Head(cluster, instance_files("head3", own_server(2), other), prefix)
        await head3.etcd.open()
        try:
            with pytest.raises(FileRefused) as refused:
                await head3.shared.start()
        finally:
            await head3.etcd.close()
        assert str(refused.value).startswith(
            "groups.compute.image differs: 'other' here, 'base' in the cluster's file "
            "(revision 1). Outside its own settings ([server], [api], [cluster]) an "
            "instance's node file must be the cluster's: to change the cluster's, edit it "
            "on a running instance and run `layerpy reload` there"
        )
        assert head3.shared.revision == 0
        assert (await in_etcd(head1, f"{prefix}/file") or {})["revision"] == 1

    run_heads(2, scenario, started=False)


def test_two_first_instances_one_publishes(run_heads: Callable[..., None], prefix: str) -> None:
    async def scenario(made: list[Head]) -> None:
        started = await asyncio.gather(*(head.shared.start() for head in made))
        assert {(c.revision, c.by) for c in started} == {(1, started[0].by)}
        published = await in_etcd(made[0], f"{prefix}/file")
        assert published is not None and published["by"] == started[0].by

    run_heads(3, scenario, started=False)


def test_a_reload_all_accept_is_applied_everywhere_in_one_revision(
    run_heads: Callable[..., None], prefix: str
) -> None:
    async def scenario(made: list[Head]) -> None:
        head2 = made[1]
        new = head2.text(REST.replace('image = "base"', 'image = "other"'))
        assert await head2.shared.propose(new) == 2  # what apply returned there
        await until(lambda: all(h.applied == [2] for h in made), "revision 2 everywhere")
        assert [h.config.nodes["cn001"].image for h in made] == ["other"] * 3
        # each runs it with its own settings
        assert [h.config.server.http_port for h in made] == [8080, 8081, 8082]
        assert [h.config.cluster.name for h in made] == ["head1", "head2", "head3"]  # type: ignore[union-attr]
        file = await in_etcd(head2, f"{prefix}/file")
        assert file == {"revision": 2, "text": new, "by": "head2"}
        left, _ = await head2.etcd.range(f"{prefix}/file/")
        assert left == []  # the proposal and the verdicts went with it

    run_heads(3, scenario)


def test_a_reload_one_instance_refuses_is_committed_nowhere(
    run_heads: Callable[..., None], prefix: str
) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, _, head3 = made
        for head in made[:2]:  # the new kernel is on head1 and head2, not head3
            (head.folder / "vmlinuz2").write_bytes(b"k")
        new = head1.text(REST.replace('kernel = "vmlinuz"', 'kernel = "vmlinuz2"'))
        with pytest.raises(ReloadRefused) as refused:
            await head1.shared.propose(new)
        line = new.splitlines().index('kernel = "vmlinuz2"') + 1
        assert refused.value.problems == [
            f"head3 refused it: {head3.path}:{line}: minos.kernel: {head3.folder}/vmlinuz2 "
            "does not exist (build the minOS with minos/build.sh)"
        ]
        file = await in_etcd(head1, f"{prefix}/file")
        assert file is not None and file["revision"] == 1
        assert [h.applied for h in made] == [[], [], []]
        assert [h.config.minos.kernel.name for h in made] == ["vmlinuz"] * 3
        assert (await head1.etcd.range(f"{prefix}/file/"))[0] == []
        # a file the proposer itself refuses is not even proposed
        broken = head1.text(REST.replace('image = "base"', 'image = "none"'))
        with pytest.raises(ReloadRefused) as own:
            await head1.shared.propose(broken)
        assert "no image named 'none'" in own.value.problems[0]

    run_heads(3, scenario)


def test_a_file_the_proposer_cannot_apply_after_all_is_said_to_be_committed(
    run_heads: Callable[..., None],
) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, head2 = made
        for head in made:
            (head.folder / "vmlinuz2").write_bytes(b"k")
        head1.before_apply = (head1.folder / "vmlinuz2").unlink  # gone after its check
        new = head1.text(REST.replace('kernel = "vmlinuz"', 'kernel = "vmlinuz2"'))
        with pytest.raises(ReloadRefused) as refused:
            await head1.shared.propose(new)
        assert refused.value.problems[0] == (
            "committed as revision 2 for the cluster, but this instance could not apply "
            "it (it runs the one before):"
        )
        assert "vmlinuz2 does not exist" in refused.value.problems[1]
        assert (head1.applied, head1.shared.revision) == ([], 1)
        await until(lambda: head2.applied == [2], "revision 2 on head2")

    run_heads(2, scenario)


def test_two_reloads_at_once_exactly_one_wins(run_heads: Callable[..., None], prefix: str) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, head2, _ = made
        texts = [
            head1.text(REST.replace('image = "base"', 'image = "other"')),
            head2.text(REST.replace('nodes = "cn[001-002]"\nip = "10.99.0.[11-12]"',
                                    'nodes = "cn[001-003]"\nip = "10.99.0.[11-13]"')),
        ]  # fmt: skip
        head1.hold = head2.hold = asyncio.Barrier(2)  # both proposals checked, then both go
        outcomes = await asyncio.gather(
            head1.shared.propose(texts[0]), head2.shared.propose(texts[1]),
            return_exceptions=True,
        )  # fmt: skip
        won = [i for i, outcome in enumerate(outcomes) if outcome == 2]
        lost = [o for o in outcomes if isinstance(o, ReloadRefused)]
        assert len(won) == 1 and len(lost) == 1, outcomes
        assert "run layerpy reload again" in lost[0].problems[0]
        await until(lambda: all(h.applied == [2] for h in made), "revision 2 everywhere")
        file = await in_etcd(head1, f"{prefix}/file")
        assert file is not None and file["text"] == texts[won[0]]
        assert (await head1.etcd.range(f"{prefix}/file/"))[0] == []

    run_heads(3, scenario)


def test_a_live_but_silent_instance_is_named_and_a_dead_proposal_goes(
    run_heads: Callable[..., None], prefix: str
) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, head2 = made
        await start(head1)
        await head2.shared.start()  # live in etcd, but following nothing
        new = head1.text(REST.replace('image = "base"', 'image = "other"'))
        with pytest.raises(ReloadRefused) as refused:
            await head1.shared.propose(new)
        assert refused.value.problems == [
            "no verdict from head2 within 2 s (alive in etcd but silent: see its log), so "
            "nothing changed anywhere"
        ]
        assert (await in_etcd(head1, f"{prefix}/file") or {})["revision"] == 1
        # a proposer that died: its proposal blocks reloads until its lease expires
        head2.task = asyncio.create_task(head2.shared.run())
        lease = await head1.etcd.grant(2)
        await head1.etcd.put(f"{prefix}/file/proposed", json.dumps(
            {"text": new, "by": "ghost", "base": 1}).encode(), lease=lease)  # fmt: skip
        with pytest.raises(ReloadRefused) as blocked:
            await head1.shared.propose(new)
        assert blocked.value.problems == [
            "another reload is under way (proposed by ghost): run layerpy reload again after it"
        ]
        await until(lambda: _gone(head1, f"{prefix}/file/proposed"), "the ghost's lease")
        assert await head1.shared.propose(new) == 2
        await until(lambda: head2.applied == [2], "revision 2 on head2")

    run_heads(2, scenario, started=False, answer_within=2.0)


async def _gone(head: Head, key: str) -> bool:
    return await head.etcd.get(key) is None


def test_an_instance_behind_compacted_history_catches_up(
    run_heads: Callable[..., None], prefix: str, cluster: EtcdCluster
) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, head2 = made
        assert head2.task is not None
        head2.task.cancel()  # it stops following (and leaves the live ones)
        await head1.etcd.delete(f"{prefix}/instances/head2")
        new = head1.text(REST.replace('image = "base"', 'image = "other"'))
        assert await head1.shared.propose(new) == 2
        now = await head1.etcd.put(f"{prefix}/unrelated", b"x")
        compact = cluster.etcdctl(cluster.members[0], "compact", str(now))
        assert compact.returncode == 0, compact.stderr
        head2.task = asyncio.create_task(head2.shared.run())  # from its old revision
        await until(lambda: head2.applied == [2], "head2 to read revision 2 again")
        assert head2.config.nodes["cn001"].image == "other"

    run_heads(2, scenario)


def test_a_proposal_made_before_an_instance_followed_is_judged_by_it(
    run_heads: Callable[..., None], prefix: str
) -> None:
    async def scenario(made: list[Head]) -> None:
        head1, head2 = made
        await start(head1)  # head2 is live in etcd already, but not started
        new = head1.text(REST.replace('image = "base"', 'image = "other"'))
        proposing = asyncio.create_task(head1.shared.propose(new))
        await until(lambda: _there(head1, f"{prefix}/file/proposed"), "the proposal")
        await start(head2)  # reads the file after the proposal was made
        assert await proposing == 2
        await until(lambda: head2.applied == [2], "revision 2 on head2")

    run_heads(2, scenario, started=False)


async def _there(head: Head, key: str) -> bool:
    return await head.etcd.get(key) is not None


def test_the_cluster_table_reaches_etcd_over_tls_with_a_client_certificate(tmp_path: Path) -> None:
    """[cluster] ca, cert and key as the file names them, relative to it, are what the client
    needs to reach members that want a client certificate."""
    tls = make_tls(tmp_path / "tls", ["10.79.0.11"])
    tls.client_key.chmod(0o600)
    cluster = EtcdCluster(tmp_path / "etcd", size=1, tls=tls)
    try:
        instance = cluster.add_instance()
        client = 'ca = "tls/ca.crt"\ncert = "tls/client.crt"\nkey = "tls/client.key"\n'
        path = instance_file(tmp_path, "head1", own_server(0), cluster.endpoints, "/layerpy/v1",
                             REST, cluster=client).path  # fmt: skip
        settings = load(path).cluster
        assert settings is not None and settings.etcd == ("https://10.79.0.11:2379",)

        async def scenario() -> Committed:
            etcd = Etcd(settings.etcd, ca=settings.ca, cert=settings.cert, key=settings.key,
                        user=settings.user, password=settings.password)  # fmt: skip
            await etcd.open()
            try:
                own = path.read_text()
                shared: SharedFile[None] = SharedFile(
                    etcd, settings.name, settings.prefix, own, check=_accept, apply=_accept
                )
                return await shared.start()
            finally:
                await etcd.close()

        assert instance.run(scenario).revision == 1
    finally:
        cluster.close()


async def _accept(_: object) -> None:
    return None
