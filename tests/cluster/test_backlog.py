"""The store's writes backed up behind etcd (docs/ha.md, "Ownership and fencing"): past the
backend's limit the instance holds (acts on no node, says so once, counts it for /metrics)
while its store goes on answering; nothing is refused or lost, and it acts again once the
queue has drained. A real 3-member etcd; the instance's namespace is cut off from it."""

from __future__ import annotations

import json
import logging

import pytest

from layerpy.cluster.instance import ClusterInstance
from layerpy.config import load
from layerpy.nodes import NodeStore

from etcd import EtcdCluster, Instance, first_contact, until

pytestmark = pytest.mark.netns


def test_backed_up_writes_hold_the_instance_until_they_drain_and_none_is_lost(
    cluster: EtcdCluster, instance: Instance, prefix: str, make_config, caplog
) -> None:
    members = ", ".join(f'"{url}"' for url in cluster.endpoints)
    config = make_config(more=f'[cluster]\netcd = [{members}]\nname = "head1"\n'
                              f'prefix = "{prefix}"\n')  # fmt: skip
    config = load(config.path)
    caplog.set_level(logging.INFO, "layerpy.cluster")

    async def scenario() -> None:
        head = ClusterInstance(config, config.path.read_text())
        await first_contact(head.etcd)
        await head.backend.open()
        head.backend.max_queued = 1  # a tiny limit: two nodes' records back it up
        head.fence.owned = {"cn001": 1}
        head.members.clock.granted(1, head.members.now(), 3600)  # fresh: only the hold shuts
        store = NodeStore(config, backend=head.backend)
        metrics = head.metrics()
        try:
            assert head.fence.allows("cn001")
            instance.cut()
            store.adopt(["cn001", "cn002"])  # two records to write: past the limit
            assert not head.fence.allows("cn001"), "the instance acts with writes backed up"
            assert "holds" in (head.fence.why_not("cn001") or "")
            store.adopt(["cn001", "cn002"])  # still answering, still held, said once
            counted = {m.name: m.samples[0].value for m in metrics.collect() if m.samples}
            assert counted["layerpy_cluster_backlog_holds"] == 1, counted
            assert counted["layerpy_cluster_fence_open"] == 0, counted
            assert counted["layerpy_cluster_writes_queued"] == 2, counted
            instance.restore()
            await until(lambda: head.fence.allows("cn001"), "the hold lifted once drained")
            kvs, _ = await head.etcd.range(f"{prefix}/observed/")
            written = {kv.key.rsplit("/", 1)[1]: json.loads(kv.value)["record"] for kv in kvs}
            assert {name: r.get("heard_by") for name, r in written.items()} == {
                "cn001": "head1", "cn002": "head1"}, written  # fmt: skip
        finally:
            instance.restore(check=False)
            await head.backend.close()
            await head.etcd.close()

    instance.run(scenario)
    said = caplog.text
    assert said.count("holding: more than 1 writes wait") == 1, said
    assert said.count("no longer holding") == 1, said
