"""nodes/observed.py: a node's observed record, and another instance's record as effects."""

from __future__ import annotations

from ipaddress import IPv4Address

from layerpy.config import NodeConfig
from layerpy.model import Boot, Node, Phase, PowerState, RunState
from layerpy.nodes import observed


def node(**fields) -> Node:
    made = Node(NodeConfig(name="cn001", ip=None))
    for key, value in fields.items():
        setattr(made, key, value)
    return made


def fields_of(effects) -> dict:
    (effect,) = effects
    return dict(effect.fields)


def test_a_record_round_trips_and_carries_no_secret_nor_heartbeat() -> None:
    boot = Boot(100.0, {Phase.SCRIPT: 101.0}, token_digest="secret", boot_id="b1")
    there = node(power=PowerState.ON, run_state=RunState.READY, ip=IPv4Address("10.99.0.11"),
                 heard_by="a", boot=boot, boots=3, last_report=5.0)  # fmt: skip
    record = observed.record(there)
    assert "secret" not in str(record) and "last_report" not in record
    assert record["ip"] == "10.99.0.11" and record["heard_by"] == "a"
    here = node(boot=Boot(50.0, token_digest="mine"))
    got = fields_of(observed.follow(here, record, "b"))
    assert got["power"] is PowerState.ON and got["run_state"] is RunState.READY
    assert got["ip"] == IPv4Address("10.99.0.11") and got["boots"] == 3
    assert got["boot"].started == 100.0 and got["boot"].phases == {Phase.SCRIPT: 101.0}
    assert got["boot"].token_digest == "mine"  # the token comes with TOKENS, not here


def test_a_node_heard_here_keeps_what_its_agent_says_here() -> None:
    here = node(run_state=RunState.READY, heard_by="b")
    stale = {"run_state": "lost", "power": "on", "heard_by": "b"}
    assert fields_of(observed.follow(here, stale, "b")) == {"power": PowerState.ON,
                                                            "heard_by": "b"}  # fmt: skip
    moved = {"run_state": "ready", "heard_by": "a"}  # its agent reports to a now
    assert fields_of(observed.follow(here, moved, "b"))["heard_by"] == "a"


def test_fields_that_do_not_parse_are_left_out() -> None:
    record = {"power": "sideways", "ip": "not an address", "run_state": 7, "busy": "busy",
              "boot": {"started": "soon"}, "boots": "many"}  # fmt: skip
    assert set(fields_of(observed.follow(node(), record, "b"))) == {"busy"}


def test_an_older_boot_or_one_with_nothing_new_is_not_taken() -> None:
    here = node(boot=Boot(100.0, {Phase.SCRIPT: 101.0}))
    older = {"boot": {"started": 90.0, "phases": {"script": 91.0}}}
    same = {"boot": {"started": 100.0, "phases": {"script": 101.0}}}
    assert "boot" not in fields_of(observed.follow(here, older, "b"))
    assert "boot" not in fields_of(observed.follow(here, same, "b"))


def test_a_boot_read_back_at_start_takes_the_timeline_of_the_records() -> None:
    here = node(boot=Boot(500.0, token_digest="mine", resumed=True))
    theirs = {"boot": {"started": 100.0, "phases": {"script": 101.0}}}
    boot = fields_of(observed.follow(here, theirs, "b"))["boot"]
    assert boot.started == 100.0 and boot.token_digest == "mine"
