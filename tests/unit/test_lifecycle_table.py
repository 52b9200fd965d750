"""The lifecycle table the engine runs: the docs show it, every action it names exists,
and a BMC answer that arrives after a reload removed its node changes nothing; what a
restarted server tells the nodes it finds running."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

from layerpy.catalog import Catalog
from layerpy.engine import Graph
from layerpy.images import ImageStore
from layerpy.lifecycle import ACTIONS, VARIABLES, Lifecycle, markdown_table, mutations
from layerpy.lifecycle.table import BOOT_TIMEOUT
from layerpy.model import PowerState

from stores import local_store

DOCS = Path(__file__).resolve().parents[2] / "docs" / "lifecycle.md"


def test_docs_show_the_table_the_engine_runs() -> None:
    text = DOCS.read_text()
    shown = re.search(r"^\| mutation \|.*?(?=\n\n)", text, re.S | re.M)
    assert shown, f"{DOCS} has no mutation table"
    real = markdown_table(mutations(), {name: a.does for name, a in ACTIONS.items()})
    assert shown.group(0) == real, f"update the table in {DOCS} to:\n{real}"


def test_the_table_is_valid_and_its_actions_exist() -> None:
    table = mutations()
    Graph(VARIABLES, table)  # validates every value the table names
    assert {m.action for m in table if m.action} <= ACTIONS.keys()


def test_docs_name_every_state_value() -> None:
    text = DOCS.read_text()
    for variable in VARIABLES:
        row = re.search(rf"^\| `{variable.name}` \| ([^|]+) \|", text, re.M)
        assert row, f"{DOCS} does not describe the variable {variable.name}"
        assert row.group(1).strip() == ", ".join(variable.values)


CN009 = '\n[nodes.cn009]\nip = "10.99.0.19"\nbmc = { driver = "none" }\n'


class SlowBmc:
    """A BMC that answers when the test says so (the answer outlives a reload)."""

    def __init__(self) -> None:
        self.answer = asyncio.Event()

    async def status(self) -> str:
        await self.answer.wait()
        return "on"

    async def close(self) -> None:
        pass


def test_a_power_answer_for_a_node_a_reload_removed(make_config) -> None:
    async def scenario() -> None:
        store = local_store(make_config(more=CN009))
        catalog = Catalog(ImageStore(store.config.server.state_dir / "images"), store.feed)
        lifecycle = Lifecycle(store, store.backend, catalog, poll_interval=3600)
        bmc = SlowBmc()
        lifecycle.drivers["cn009"] = bmc  # type: ignore[assignment]
        running = asyncio.create_task(lifecycle.run())
        polled = asyncio.create_task(lifecycle.act("cn009", "power_status"))
        await asyncio.sleep(0)
        new = make_config()  # cn009 is gone
        await lifecycle.applied(new, *store.apply_config(new))
        bmc.answer.set()
        await polled  # before: KeyError in the engine
        assert "cn009" not in store.nodes and not lifecycle.engine.has("cn009")
        assert store.nodes["cn001"].power is PowerState.UNKNOWN
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    asyncio.run(scenario())


def test_a_reload_that_changes_a_node_ends_every_override(make_config) -> None:
    """The overridden node's file did not change, and yet its wish is the file's again
    (told in turns, as the changed nodes'); a reload of the same file keeps it. A changed
    node gets its new wish and a new power driver."""

    async def scenario() -> None:
        lifecycle = lifecycle_of(make_config(more=CN009))
        store, engine = lifecycle.store, lifecycle.engine
        lifecycle.override("cn009", "off")
        same = make_config(more=CN009)
        await lifecycle.applied(same, *store.apply_config(same))
        assert engine.explain("cn009")["cfg"]["power"] == "off"
        other = make_config(client_mac="52:54:00:99:00:22", more=CN009)  # cn002 changed
        assert store.apply_config(other) == (set(), set(), {"cn002"})
        await lifecycle.applied(other, set(), set(), {"cn002"})
        assert lifecycle.overrides == {}
        assert engine.explain("cn009")["cfg"]["power"] == "on"
        driver = lifecycle.drivers["cn009"]
        off = make_config(more=CN009.replace("}", '}\npower = "off"'))  # cn009 changed
        await lifecycle.applied(off, *store.apply_config(off))
        assert engine.explain("cn009")["cfg"]["power"] == "off"
        assert lifecycle.drivers["cn009"] is not driver

    asyncio.run(scenario())


def lifecycle_of(config) -> Lifecycle:
    store = local_store(config)
    return Lifecycle(
        store,
        store.backend,
        Catalog(ImageStore(config.server.state_dir / "images"), store.feed),
        3600,
    )


def test_a_restarted_server_tells_a_node_the_image_it_told_it_before(make_config) -> None:
    """Not "no image", which would stop the container the node kept running meanwhile."""
    config = make_config()
    lifecycle = lifecycle_of(config)
    lifecycle.assign("cn001", ("base", "sha256:" + "a" * 64))
    lifecycle.assign("cn002", ("base", "sha256:" + "b" * 64))
    lifecycle.assign("cn002", None)  # cn002 booted anew: told afresh
    assert lifecycle_of(config).assigned == {"cn001": ("base", "sha256:" + "a" * 64)}


def test_a_node_not_heard_since_a_restart_has_a_heartbeat_before_it_counts_as_hung(
    make_config,
) -> None:
    config = make_config()
    waits = lifecycle_of(config).engine.graph.mutations["boot.wait"]
    assert waits.timeout == BOOT_TIMEOUT  # heartbeat 2 s: the boot's own time is longer
    slow = dataclasses.replace(config, server=dataclasses.replace(config.server, heartbeat=300))
    assert lifecycle_of(slow).engine.graph.mutations["boot.wait"].timeout == 600


def test_assignments_keep_the_file_of_earlier_releases(make_config) -> None:
    """assigned.jsonl through the store's backend: an upgraded state directory is read,
    and new lines are written as before."""
    config = make_config()
    journal = config.server.state_dir / "assigned.jsonl"
    journal.parent.mkdir(parents=True, exist_ok=True)
    old = {"node": "cn001", "image": "base", "digest": "sha256:" + "a" * 64}
    journal.write_text(json.dumps(old) + "\n")
    lifecycle = lifecycle_of(config)
    assert lifecycle.assigned == {"cn001": ("base", "sha256:" + "a" * 64)}
    lifecycle.assign("cn001", None)
    assert json.loads(journal.read_text().splitlines()[-1]) == {
        "node": "cn001", "image": None, "digest": None}  # fmt: skip
    assert lifecycle_of(config).assigned == {}
