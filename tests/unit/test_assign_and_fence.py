"""Ownership's sans-I/O parts: rendezvous assignment with grace and stickiness, segments, and
the fence's lease deadline (docs/ha.md, "Ownership and fencing")."""

from __future__ import annotations

import logging
from ipaddress import IPv4Address

import pytest

from layerpy.cluster.assign import Assignment, Decision, Segments, parse_segment, preferred
from layerpy.cluster.fence import Fence, LeaseClock
from layerpy.cluster.members import Instance, serving

from clock import Clock

NODES = {f"n{i:03}": None for i in range(300)}
ALL3 = {"a": "", "b": "", "c": ""}


def test_preferred_splits_evenly_and_moves_only_a_dead_instances_nodes() -> None:
    picks = {node: preferred(node, ALL3) for node in NODES}
    counts = {name: list(picks.values()).count(name) for name in ALL3}
    assert all(70 <= count <= 130 for count in counts.values()), counts
    without_c = {node: preferred(node, ["a", "b"]) for node in NODES}
    assert all(without_c[node] == owner for node, owner in picks.items() if owner != "c")


def joined(name: str, grace: float = 1.0, at: float = 0.0) -> Assignment:
    """An Assignment of an instance that joined at ``at`` (and has claimed nothing)."""
    assignment = Assignment(name, grace)
    assignment.decide(at, ALL3, {}, {})
    return assignment


def test_preferred_instances_claim_disjoint_sets_and_cover_every_node() -> None:
    claims = {name: joined(name).decide(1.0, ALL3, NODES, {}) for name in ALL3}
    sets = [set(decision.claim) for decision in claims.values()]
    assert sum(map(len, sets)) == len(NODES) and set().union(*sets) == set(NODES)
    assert all(decision.wake_at == 2.0 and not decision.release for decision in claims.values())


def test_a_joining_instance_claims_nothing_for_the_grace() -> None:
    a = Assignment("a", grace=1.0)
    alone = {"a": ""}
    assert a.decide(5.0, alone, NODES, {}) == Decision((), (), 6.0)
    assert a.decide(5.9, alone, NODES, {}).claim == ()
    assert a.decide(6.0, alone, NODES, {}).claim == tuple(NODES)
    # b preferred for some nodes, but silent: a takes them a grace after its own settling
    b_first = {node: None for node in NODES if preferred(node, ALL3) == "b"}
    a = Assignment("a", grace=1.0)
    assert a.decide(5.0, ALL3, b_first, {}) == Decision((), (), 7.0)
    assert a.decide(6.5, ALL3, b_first, {}).claim == ()
    assert a.decide(7.0, ALL3, b_first, {}).claim == tuple(b_first)
    a.decide(7.0, {}, NODES, {})  # its lease went: it joins again
    assert a.decide(8.0, alone, NODES, {}) == Decision((), (), 9.0)


def test_a_slow_second_instance_still_gets_its_share_within_the_settling() -> None:
    """Settling longer than the grace (``layerpy serve``: the lease TTL): b registers 3 s
    after a, a has claimed nothing yet, and they split the nodes."""
    a, b = Assignment("a", grace=1.0, settle=5.0), Assignment("b", grace=1.0, settle=5.0)
    pair = {"a": "", "b": ""}
    assert a.decide(0.0, {"a": ""}, NODES, {}) == Decision((), (), 5.0)
    assert a.decide(3.0, pair, NODES, {}).claim == ()  # b is here now
    mine = a.decide(5.0, pair, NODES, {}).claim
    assert set(mine) == {node for node in NODES if preferred(node, pair) == "a"}
    assert b.decide(3.0, pair, NODES, {}).claim == ()
    assert set(b.decide(8.0, pair, NODES, dict.fromkeys(mine, "a")).claim) == set(NODES) - set(mine)


def test_an_unowned_node_is_claimed_by_another_instance_after_the_grace() -> None:
    node = next(n for n in NODES if preferred(n, ALL3) == "c")  # c is preferred but silent
    a = joined("a")
    assert a.decide(10.0, ALL3, {node: None}, {}).claim == ()
    assert a.decide(10.9, ALL3, {node: None}, {}).wake_at == 11.0
    assert a.decide(11.0, ALL3, {node: None}, {}).claim == (node,)
    # owned meanwhile: the grace starts again the next time it is unowned
    assert a.decide(11.5, ALL3, {node: None}, {node: "b"}).claim == ()
    assert a.decide(12.0, ALL3, {node: None}, {}).claim == ()


def test_ownership_is_sticky_when_an_instance_joins() -> None:
    owners = {node: "a" for node in NODES}
    for name in ("a", "b", "c"):
        decision = Assignment(name, grace=0.0).decide(0.0, ALL3, NODES, owners)
        assert decision.claim == () and decision.release == ()


def test_an_owner_releases_nodes_that_left_the_file_or_its_segment() -> None:
    here, there = IPv4Address("10.1.0.5"), IPv4Address("10.2.0.5")
    segments = {"a": "10.1.0.0/24", "b": "10.2.0.0/24"}
    nodes = {"stays": here, "moved": there}
    owners = {"stays": "a", "moved": "a", "removed": "a", "theirs": "b"}
    decision = Assignment("a", grace=0.0).decide(0.0, segments, nodes, owners)
    assert decision.release == ("moved", "removed") and decision.claim == ()


def test_only_instances_of_the_nodes_segment_claim_it() -> None:
    segments = {"a": "10.1.0.0/24", "b": "10.2.0.0/24", "c": ""}
    nodes = {"x": IPv4Address("10.1.0.7"), "y": IPv4Address("10.3.0.1"), "z": None}
    b = Assignment("b", grace=0.0).decide(5.0, segments, nodes, {})  # grace 0: no settling
    assert b.claim == ("z",)  # x is a's segment's (and c's), y is c's only
    c = Assignment("c", grace=0.0).decide(5.0, segments, nodes, {})
    assert c.claim == ("x", "y", "z")


def test_a_node_in_no_live_instances_segment_is_anyones_until_its_segment_is_back() -> None:
    racks = {"a": "10.1.0.0/24", "b": "10.2.0.0/24"}
    relayed = {"r": IPv4Address("10.3.0.1")}  # behind a relay: in no instance's segment
    assert set(Segments(racks).candidates(relayed["r"])) == {"a", "b"}
    x = {"x": IPv4Address("10.1.0.7")}
    b = Assignment("b", grace=0.0)
    assert b.decide(5.0, {"b": racks["b"]}, x, {}).claim == ("x",)  # a is gone: b takes x
    assert b.decide(6.0, racks, x, {"x": "b"}).release == ("x",)  # a is back: x goes to it


def test_no_claim_without_this_instance_registered() -> None:
    decision = Assignment("a", grace=0.0).decide(0.0, {"b": ""}, NODES, {})
    assert decision == Assignment("a", 0.0).decide(0.0, {}, {}, {})
    assert decision.claim == () and decision.release == () and decision.wake_at is None


def test_segments() -> None:
    assert parse_segment("") is None
    assert str(parse_segment("10.1.0.0/24")) == "10.1.0.0/24"
    for bad in ("rack1", "10.1.0.1/24", "10.1.0.0/33"):
        with pytest.raises(ValueError, match="neither empty nor an IPv4 subnet"):
            parse_segment(bad)
    segments = Segments({"a": "10.1.0.0/24", "b": "", "c": "rack1"})  # c: a broken record
    assert segments.candidates(IPv4Address("10.1.0.9")) == ("a", "b")
    assert segments.candidates(IPv4Address("10.1.1.1")) == ("b",)
    assert segments.candidates(None) == ("a", "b")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_the_fence_closes_at_the_local_deadline_without_hearing_from_etcd(clock: Clock) -> None:
    lease = LeaseClock(margin=1.0)
    changes: list[int] = []
    fence = Fence(lease, clock, lambda: changes.append(1), {"n3": "b"}.get)
    lease.granted(7, sent_at=clock.now, ttl=5)
    fence.set_owned({"n1": 7, "n2": 7, "n3": None})
    assert changes == [1]  # once for the batch
    assert fence.allows("n1") and fence.why_not("n1") is None
    assert not fence.allows("n3") and fence.why_not("n3") == "n3 is owned by instance b"
    assert fence.why_not("n4") == "n4 has no owner yet"
    clock.now += 2.0
    lease.renewed(7, sent_at=clock.now - 0.5, ttl=5)  # sent 0.5 s ago: fresh until +3.5
    clock.now += 3.49
    assert fence.allows("n1")
    clock.now += 0.01
    assert not fence.allows("n1") and "lost etcd" in (fence.why_not("n1") or "")


def test_a_key_of_an_earlier_lease_does_not_count(clock: Clock) -> None:
    lease = LeaseClock(margin=1.0)
    fence = Fence(lease, clock, lambda: None)
    lease.granted(7, clock.now, 5)
    fence.set_owned({"n1": 7})
    lease.lost()
    assert not fence.allows("n1")
    lease.granted(8, clock.now, 5)  # re-registered: n1's key went with lease 7
    assert not fence.allows("n1")
    lease.renewed(7, clock.now, 5)  # a late answer for the old lease moves nothing
    fence.set_owned({"n1": 8})
    assert fence.allows("n1")


def test_the_fence_says_once_when_it_closes_and_once_when_it_opens(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    lease = LeaseClock(margin=1.0)
    changes: list[int] = []
    fence = Fence(lease, clock, lambda: changes.append(1))
    lease.granted(7, clock.now, 5)
    with caplog.at_level(logging.INFO, logger="layerpy.cluster"):
        assert fence.check() and not fence.check()
        clock.now += 4.0
        assert fence.check() and not fence.check()
        lease.renewed(7, clock.now, 5)
        assert fence.check()
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3 and "lost etcd" in lines[1] and "fresh" in lines[2], lines
    assert len(changes) == 3


def test_instance_records_are_checked_and_name_the_servers_of_a_node() -> None:
    a = Instance("a", "http://10.1.0.1:8080", "10.1.0.0/24", 1.0, "0.1.0")
    b = Instance("b", "http://10.2.0.1:8080", "10.2.0.0/24", 1.0, "0.1.0")
    c = Instance("c", "http://10.9.0.1:8080", "", 1.0, "0.1.0")
    assert Instance.from_json(a.to_json()) == a
    for bad in (b"[]", b'{"name": "a"}', a.to_json().replace(b"10.1.0.0/24", b"rack1")):
        with pytest.raises(ValueError):
            Instance.from_json(bad)
    assert serving([c, b, a], IPv4Address("10.1.0.7")) == [a, c]
    assert serving([c, b, a], None) == [a, b, c]
