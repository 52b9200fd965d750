"""The node store's policies return effects and change nothing themselves; the store's
writer applies them; heartbeats are quiet on the feed; LocalJournal keeps today's files."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import asdict
from typing import Any

import pytest

from layerpy import digests
from layerpy.journal import Journal
from layerpy.model import Node, Phase, RunState
from layerpy.nodes import ChangeFeed, NodeStore, identity, liveness, reports, tokens
from layerpy.nodes.backend import BINDINGS, LEASES, OBSERVED, OVERRIDES, TOKENS, LocalJournal
from layerpy.nodes.effects import Bind, Event, Mark, NewBoot, Observe, Resume, Token
from layerpy.proto.agent import PROTOCOL, Report

from clock import Clock
from stores import local_store

LOCATED = '\n[switches.sw1]\nrelay = "10.99.0.254"\n\n[nodes.cn003]\nip = "10.99.0.13"\nlocation = "sw1:swp3"\n'
HEARTBEAT = {"node": "cn001", "token": "t", "mac": "52:54:00:99:00:11", "ip": "10.99.0.11",
             "boot_id": "b1", "seq": 1, "event": "heartbeat", "protocol": PROTOCOL}  # fmt: skip


@pytest.fixture
def node(make_config) -> Node:
    return Node(make_config().nodes["cn001"])


def test_a_token_is_issued_as_effects(node: Node) -> None:
    token, effects = tokens.issue(node)
    assert effects == [NewBoot("cn001"), Token("cn001", digests.digest(token), None),
                       Mark("cn001", Phase.SCRIPT)]  # fmt: skip
    assert node.boot is None  # nothing written: the store applies


def test_tokens_are_resumed_for_the_nodes_of_the_file_only(node: Node) -> None:
    kept = {"cn001": {"sha256": "d", "boot_id": "b", "boots": 3},
            "gone": {"sha256": "e", "boot_id": "c", "boots": 1},
            "cn002": {"sha256": 7, "boots": "x"}}  # fmt: skip
    nodes = {"cn001": node, "cn002": node}
    assert tokens.resume(kept, nodes) == [Resume("cn001", "d", "b", 3),
                                          Resume("cn002", None, None, 0)]  # fmt: skip


def test_liveness_reads_only_the_overdue_nodes(node: Node) -> None:
    alive = liveness.Liveness()
    node.run_state, node.last_report = RunState.READY, 10.0
    later = Node(node.config)  # heard later: not looked at before its time
    alive.heard("cn001", 10.0)
    alive.heard("later", 50.0)
    nodes = {"cn001": node, "later": later}
    assert alive.overdue(nodes, 15.0, 6.0) == []
    lost = Observe("cn001", {"run_state": RunState.LOST}, "no report for 7 s")
    assert alive.overdue(nodes, 17.0, 6.0) == [lost]
    assert alive.overdue(nodes, 17.0, 6.0) == []  # told once
    assert list(alive._reporting) == ["later"]


def test_a_heartbeat_is_quiet_and_a_new_agent_is_not(node: Node) -> None:
    report = Report.from_json(HEARTBEAT | {"uptime": 5, "agent_version": "1"})
    first = reports.facts(node, report, 100.0)[0]
    node.agent = dict(first.fields["agent"])  # as the store would have applied it
    again = Report.from_json(HEARTBEAT | {"uptime": 9, "seq": 2, "agent_version": "1"})
    assert reports.facts(node, again, 110.0)[0].quiet
    upgraded = Report.from_json(HEARTBEAT | {"agent_version": "2"})
    assert not reports.facts(node, upgraded, 120.0)[0].quiet


def _state(store: NodeStore) -> tuple[object, ...]:
    observed = {name: (repr(n), n.boot and asdict(n.boot)) for name, n in store.nodes.items()}
    return observed, dict(store.identities.bindings), list(store.unknown), store.feed.seq


def test_identity_rules_return_effects_and_write_nothing(make_config) -> None:
    store = local_store(make_config(more=LOCATED), clock=Clock())
    before = _state(store)
    node, effects = identity.locate(store, "52:54:00:aa:00:01", ("sw1", "swp3"), "relay")
    assert node is store.nodes["cn003"] and _state(store) == before
    assert [type(e) for e in effects] == [Event, Bind, Observe]
    store.apply(effects)
    assert store.by_mac("52:54:00:aa:00:01") is node and node.binding["how"].startswith("by its")


def test_reports_are_admitted_as_effects(make_config) -> None:
    store = local_store(make_config(), clock=Clock())
    node = store.nodes["cn001"]
    token = store.issue_token(node)
    before = _state(store)
    effects, ack = reports.admit(store, HEARTBEAT | {"token": token, "event": "hello"})
    assert ack == reports.Ack("cn001") and _state(store) == before
    store.apply(effects)
    assert node.run_state is RunState.INIT and node.boot.boot_id == "b1"
    effects, refused = reports.admit(store, HEARTBEAT | {"token": "wrong"})
    assert effects == [] and isinstance(refused, reports.ReportRejected)


def test_heartbeats_wake_no_subscriber_and_stay_out_of_the_history(make_config) -> None:
    """10 000 heartbeats: the engine's and the event stream's subscriptions get nothing,
    the history keeps its real changes and their numbers; a subscriber asking for quiet
    changes gets them."""
    clock = Clock()
    store = local_store(make_config(), clock=clock, feed=ChangeFeed(clock, history=100))
    node = store.nodes["cn001"]
    token = store.issue_token(node)
    store.report(HEARTBEAT | {"token": token, "event": "hello"})
    store.report(HEARTBEAT | {"token": token})
    real, seq = list(store.feed.history), store.feed.seq
    engine, heartbeats = store.feed.subscribe(), store.feed.subscribe(quiet=True)
    for _ in range(10_000):
        clock.now += 1
        store.report(HEARTBEAT | {"token": token})
    assert engine.pending() == [] and list(store.feed.history) == real
    assert store.feed.seq == seq  # the next real change follows the last one (resuming)
    quiet = heartbeats.pending()
    assert len(quiet) == 10_000 and all(c.quiet and "last_report" in c.fields for c in quiet)
    assert node.last_report == clock.now and node.run_state is RunState.READY


def test_local_journal_keeps_todays_files(tmp_path) -> None:
    journal = LocalJournal(tmp_path)
    for kind in (TOKENS, BINDINGS, LEASES, OVERRIDES, OBSERVED):
        assert journal.load(kind) == {}
    journal.put(TOKENS, "cn001", {"sha256": "d1", "boot_id": "b", "boots": 2})
    journal.put(TOKENS, "cn001", {"sha256": "d2", "boot_id": "b", "boots": 3})
    journal.put(BINDINGS, "cn003", {"mac": "52:54:00:aa:00:01"})
    journal.put(LEASES, "10.99.0.200", {"mac": "52:54:00:00:00:99", "expires": 5.0})
    journal.put(OVERRIDES, "cn002", {"power": "off"})
    journal.put(OBSERVED, "cn001", {"run_state": "ready"})  # a single server keeps none
    lines = (tmp_path / "boots.jsonl").read_text().splitlines()
    assert json.loads(lines[-1]) == {"node": "cn001", "sha256": "d2", "boot_id": "b", "boots": 3}
    assert json.loads((tmp_path / "bindings.json").read_text()) == {"cn003": "52:54:00:aa:00:01"}
    lease = json.loads((tmp_path / "leases.jsonl").read_text())
    assert lease == {"address": "10.99.0.200", "mac": "52:54:00:00:00:99", "expires": 5.0}
    again = LocalJournal(tmp_path)
    assert again.load(TOKENS) == {"cn001": {"sha256": "d2", "boot_id": "b", "boots": 3}}
    assert again.load(BINDINGS) == {"cn003": {"mac": "52:54:00:aa:00:01"}}
    assert again.load(LEASES) == {"10.99.0.200": {"mac": "52:54:00:00:00:99", "expires": 5.0}}
    assert again.load(OVERRIDES) == {"cn002": {"power": "off"}}
    assert again.load(OBSERVED) == {}
    assert journal.get(OBSERVED, "cn001") is None  # not even in memory
    assert {path.name for path in tmp_path.iterdir()} == {
        "boots.jsonl", "bindings.json", "leases.jsonl", "overrides.jsonl"}  # fmt: skip
    again.delete(LEASES, "10.99.0.200")
    again.delete(BINDINGS, "cn003")
    assert LocalJournal(tmp_path).load(LEASES) == {} and LocalJournal(tmp_path).load(BINDINGS) == {}


def test_local_journal_creates_and_replaces_only_as_expected(tmp_path) -> None:
    journal = LocalJournal(tmp_path)
    journal.load(OVERRIDES)

    async def steps() -> list[bool]:
        first = {"power": "off"}
        return [
            await journal.create(OVERRIDES, "cn001", first),
            await journal.create(OVERRIDES, "cn001", {"power": "on"}),  # someone has it
            await journal.replace(OVERRIDES, "cn001", {"power": "on"}, None),  # not absent
            await journal.replace(OVERRIDES, "cn001", {"power": "on"}, first),
        ]

    assert asyncio.run(steps()) == [True, False, False, True]
    assert LocalJournal(tmp_path).load(OVERRIDES) == {"cn001": {"power": "on"}}


def test_a_crowded_journal_is_compacted_beside_the_loop(tmp_path) -> None:
    """Rewriting the whole tokens journal of 50 000 nodes held the loop for 140 ms: with a
    loop running it is written in a worker thread; the records put meanwhile go to the old
    file (which keeps everything until the rename) and follow into the new one."""
    journal = LocalJournal(tmp_path)
    journal.load(TOKENS)
    path = tmp_path / "boots.jsonl"

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        threads: set[str] = set()
        compact = Journal._write_new

        def written(self: Journal, records: Any) -> None:
            threads.add(threading.current_thread().name)
            compact(self, records)

        Journal._write_new = written  # type: ignore[method-assign]
        try:
            for boots in range(1, 9):  # crowded past 4 lines a node and 1024 more
                for i in range(300):
                    journal.put(TOKENS, f"n{i}", {"sha256": "d", "boot_id": "b", "boots": boots})
            journal.put(TOKENS, "n0", {"sha256": "d", "boot_id": "b", "boots": 9})  # meanwhile
            deadline = loop.time() + 10
            while len(path.read_text().splitlines()) > 2000:
                assert loop.time() < deadline, "the journal compacted"
                await asyncio.sleep(0.01)
        finally:
            Journal._write_new = compact  # type: ignore[method-assign]
        assert threads and threading.current_thread().name not in threads

    asyncio.run(scenario())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[-1] == {"node": "n0", "sha256": "d", "boot_id": "b", "boots": 9}
    again = LocalJournal(tmp_path).load(TOKENS)
    assert len(again) == 300 and again["n0"]["boots"] == 9 and again["n299"]["boots"] == 8
