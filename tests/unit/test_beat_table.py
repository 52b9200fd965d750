"""Datagram heartbeats (protocol 1.4): the codec takes any bytes without failing, the
server's table takes a beat only while nothing changed since the node's last full report,
and a beat it takes records exactly what an unchanged heartbeat report records."""

from __future__ import annotations

import asyncio
import gc
import operator
import shutil
from dataclasses import fields
from enum import Enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layerpy.config import Config, load
from layerpy.model import RunState
from layerpy.nodes import ChangeFeed, NodeStore
from layerpy.proto import beat
from layerpy.proto.agent import PROTOCOL, Answer, BeatOffer, ContractError, encode
from layerpy.server import Server, local_backend
from layerpy.services.beats import Beats

from clock import Clock
from stores import local_store

KEY = bytes(range(16))
REPORT = {"node": "cn001", "mac": "52:54:00:99:00:11", "ip": "10.99.0.11", "boot_id": "b1",
          "event": "heartbeat", "protocol": PROTOCOL, "agent_version": "1", "uptime": 5.0,
          "image": {"state": "none"}}  # fmt: skip


# -- the codec ------------------------------------------------------------------------------


def test_a_beat_and_its_reply_round_trip() -> None:
    data = beat.beat(KEY, "cn001", 7, 12.5)
    got = beat.read_beat(data)
    assert got is not None and (got.node, got.seq, got.uptime) == ("cn001", 7, 12.5)
    assert beat.verified(KEY, got) and not beat.verified(bytes(16), got)
    answer = beat.reply(KEY, 7, beat.Verdict.REPORT)
    assert len(answer) < len(data)  # never an amplifier
    assert beat.read_reply(KEY, 7, answer) is beat.Verdict.REPORT
    assert beat.read_reply(KEY, 8, answer) is None  # the reply to another beat
    assert beat.read_reply(bytes(16), 7, answer) is None  # not signed with this key
    assert beat.read_reply(KEY, 7, answer[:-1] + bytes([answer[-1] ^ 1])) is None


@pytest.mark.parametrize(
    "data",
    [b"", b"LPb1", beat.beat(KEY, "cn001", 1, 1.0)[:-1], beat.beat(KEY, "cn001", 1, 1.0) + b"x",
     beat.beat(KEY, "CN001", 1, 1.0), beat.beat(KEY, "-cn", 1, 1.0),
     beat.beat(KEY, "cn001", 1, float("nan")), beat.beat(KEY, "cn001", 1, -1.0),
     b"LPa1" + beat.beat(KEY, "cn001", 1, 1.0)[4:]],
)  # fmt: skip
def test_what_is_not_a_beat_reads_as_none(data: bytes) -> None:
    assert beat.read_beat(data) is None


@given(st.binary(max_size=200))
def test_any_datagram_reads_without_failing(data: bytes) -> None:
    got = beat.read_beat(data)
    assert got is None or beat.read_beat(got.signed + got.mac) == got
    assert beat.read_reply(KEY, 1, data) in (None, *beat.Verdict)


def test_who_speaks_beats() -> None:
    assert [beat.speaks(v) for v in ("1.4", "1.10", "1.3", "2.4", "1.", "1.²", None)] == [
        True, True, False, False, False, False, False]  # fmt: skip


def test_an_answer_carries_a_checked_offer_and_an_older_one_none() -> None:
    answer = Answer("cn001", beat=BeatOffer(8080, "ab" * 16))
    assert Answer.from_json(encode(answer)) == answer
    assert Answer.from_json(encode(Answer("cn001")) | {"protocol": "1.3"}).beat is None
    for offer in ({"port": 0, "key": "ab" * 16}, {"port": 8080, "key": "secret"}):
        with pytest.raises(ContractError) as error:
            Answer.from_json(encode(Answer("cn001")) | {"beat": offer})
        assert "secret" not in str(error.value)  # a key is never echoed


# -- the server's table ---------------------------------------------------------------------


class Rig:
    """A single server's store with cn001 reporting, and its beat table."""

    def __init__(self, config: Config) -> None:
        self.clock = Clock()
        self.store = local_store(config, clock=self.clock, feed=ChangeFeed(self.clock))
        node = self.store.nodes["cn001"]
        self.token = self.store.issue_token(node)
        self.seq = 0
        self.report("hello")
        self.report()
        self.basis = "file one"
        self.outcomes: list[str] = []
        self.beats = Beats(8080, self.store.nodes, lambda name: (self.basis,), self.store.beat,
                           self.outcomes.append)  # fmt: skip
        offer = self.beats.offer("cn001", self.seq)
        assert offer is not None and offer.port == 8080
        self.key = bytes.fromhex(offer.key)

    def report(self, event: str = "heartbeat", store: NodeStore | None = None) -> None:
        self.seq += 1
        self.clock.now += 5
        (store or self.store).report(REPORT | {"token": self.token, "seq": self.seq,
                                               "event": event, "uptime": 5.0 * self.seq})  # fmt: skip

    def beat(self, seq: int | None = None, key: bytes | None = None) -> beat.Verdict | None:
        """Send the next beat (or `seq`); the verdict of its reply, None when unanswered."""
        if seq is None:
            self.seq += 1
            seq = self.seq
        self.clock.now += 5
        reply = self.beats.judge(beat.beat(key or self.key, "cn001", seq, 5.0 * seq))
        return None if reply is None else beat.read_reply(key or self.key, seq, reply)


@pytest.fixture
def rig(make_config) -> Rig:
    return Rig(make_config())


def state(store: NodeStore) -> tuple[object, ...]:
    node = store.nodes["cn001"]
    return node.as_json(), store.feed.seq, dict(store.liveness._reporting)


def test_a_beat_records_what_an_unchanged_heartbeat_report_records(
    make_config, tmp_path_factory
) -> None:
    """Two stores with one history: a full heartbeat report in one, the same beat in the
    other; every field, the feed and the lost detector's book end equal."""
    config = make_config()
    twin = tmp_path_factory.mktemp("twin")
    shutil.copytree(config.path.parent, twin, dirs_exist_ok=True)  # a state directory each
    reported, beaten = Rig(config), Rig(load(twin / config.path.name))
    quiet = [rig.store.feed.subscribe(quiet=True) for rig in (reported, beaten)]
    for _ in range(3):
        reported.report()
        assert beaten.beat() is beat.Verdict.OK
        assert state(reported.store) == state(beaten.store)
    changes = [[(c.node, c.kind, c.fields, c.quiet) for c in q.pending()] for q in quiet]
    assert changes[0] == changes[1] and len(changes[0]) == 3


def held_objects(rig: Rig) -> set[int]:
    """The objects the collector tracks that cn001's record and beat key hold (the node
    file's own left out: they are frozen at start)."""
    node = rig.store.nodes["cn001"]
    found: set[int] = set()
    todo = [getattr(node, f.name) for f in fields(node) if f.name != "config"]
    todo += [getattr(rig.beats.held["cn001"], name) for name in ("boot", "facts", "basis")]
    while todo:
        item = todo.pop()
        if gc.is_tracked(item) and id(item) not in found and not isinstance(item, Enum):
            found.add(id(item))
            todo += gc.get_referents(item)
    return found


def test_heartbeats_leave_no_new_object_behind(rig: Rig) -> None:
    """A heartbeat, reported in full or by datagram, changes plain numbers only: what the
    node and its beat key hold stay the same objects, so the beats of ten thousand nodes
    give the garbage collector nothing new to walk (docs/scale.md), and the node keeps no
    address object of its own beside the node file's."""
    assert rig.beat() is beat.Verdict.OK
    before = held_objects(rig)
    for _ in range(3):
        rig.report()
        assert rig.beat() is beat.Verdict.OK
    assert held_objects(rig) == before
    node = rig.store.nodes["cn001"]
    assert node.ip is node.config.ip
    agent = node.as_json()["agent"]
    assert (agent["seq"], agent["uptime"], agent["agent_version"]) == (rig.seq, 5.0 * rig.seq, "1")


def test_a_beat_is_taken_once_and_only_with_its_key(rig: Rig) -> None:
    assert rig.beat() is beat.Verdict.OK
    assert rig.beat(rig.seq) is None  # the same datagram again
    assert rig.beat(rig.seq - 1) is None  # an older one
    assert rig.beat(key=bytes(16)) is None
    assert rig.beats.judge(b"\0" * 40) is None
    assert rig.beats.judge(beat.beat(rig.key, "cn002", 99, 1.0)) is None  # no key offered
    assert rig.outcomes == ["ok", "replayed", "replayed", "forged", "malformed", "unknown"]
    heard = rig.store.nodes["cn001"].last_report
    assert rig.beat(rig.seq + 100) is beat.Verdict.OK  # seqs may skip (lost datagrams)
    assert rig.store.nodes["cn001"].last_report > heard


def test_a_changed_answer_or_node_asks_for_a_full_report(rig: Rig) -> None:
    rig.basis = "file two"  # a reload, a new image, another owner
    assert rig.beat() is beat.Verdict.REPORT
    rig.report()
    assert rig.beats.offer("cn001", rig.seq) is not None
    assert rig.beat() is beat.Verdict.OK
    node = rig.store.nodes["cn001"]
    rig.store.forget(node, "powered off")  # what another writer knows better now
    assert rig.beat() is beat.Verdict.REPORT
    heard = node.last_report
    assert rig.beat() is beat.Verdict.REPORT and node.last_report == heard  # not taken
    rig.report()  # after a power change: init, then ready, as the full reports have it
    assert node.run_state is RunState.INIT
    assert rig.beat() is beat.Verdict.REPORT
    rig.report()
    assert node.run_state is RunState.READY
    rig.beats.offer("cn001", rig.seq)
    assert rig.beat() is beat.Verdict.OK
    assert rig.outcomes == ["report", "ok", "report", "report", "report", "ok"]


def test_a_new_boot_gets_a_new_key(rig: Rig) -> None:
    node = rig.store.nodes["cn001"]
    rig.token = rig.store.issue_token(node)  # the node booted again
    rig.seq = 0
    rig.report("hello")
    assert rig.beat() is None  # the old key: forged now, unanswered
    offer = rig.beats.offer("cn001", rig.seq)
    assert offer is not None and bytes.fromhex(offer.key) != rig.key
    rig.key = bytes.fromhex(offer.key)
    assert rig.beat() is beat.Verdict.REPORT  # its run state is not ready yet
    rig.report()
    rig.beats.offer("cn001", rig.seq)
    assert rig.beat() is beat.Verdict.OK


def test_off_offers_nothing_and_a_removed_node_is_forgotten(rig: Rig) -> None:
    assert Beats(0, rig.store.nodes, str, rig.store.beat, print).offer("cn001", 1) is None
    del rig.store.nodes["cn001"]
    assert rig.beat() is None and "cn001" not in rig.beats.held


def test_the_servers_answer_is_made_of_the_same_objects_each_beat(make_config) -> None:
    """What a beat compares of the answer (the node's file, image, files, servers) is the
    same objects while nothing changes: kept as they are, they cost the collector nothing."""
    config = make_config()

    async def scenario() -> None:
        server = Server(config, local_backend(config))
        try:
            first, again = server.beats.basis("cn001"), server.beats.basis("cn001")
            assert first == again and all(map(operator.is_, first, again)), (first, again)
        finally:
            await server.close()

    asyncio.run(scenario())
