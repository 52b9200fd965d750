"""The nodes an instance that left had heard, found through an index by hearing instance
(``NodeStore.heard_by_others``): a membership change costs what the gone instance heard,
not a pass over every node."""

from __future__ import annotations

from layerpy.nodes.effects import Observe

from stores import local_store


def test_the_nodes_a_gone_instance_heard_and_only_those(make_config) -> None:
    store = local_store(make_config())
    assert store.heard_by_others(set()) == []
    store.apply([Observe("cn001", {"heard_by": "a"}), Observe("cn002", {"heard_by": "b"})])
    assert store.heard_by_others({"a", "b"}) == []
    assert store.heard_by_others({"a"}) == ["cn002"]
    store.apply([Observe("cn002", {"heard_by": "a"})])  # its agent moved to a
    assert sorted(store.heard_by_others(set())) == ["cn001", "cn002"]
    assert store.heard_by_others({"a"}) == []
    assert set(store._hearing) == {"a"}, "an instance that hears nothing is not kept"
    store.apply([Observe("cn001", {"heard_by": None})])
    assert store.heard_by_others(set()) == ["cn002"]
