"""The node store: run state, boot timelines, identity and the change feed, driven the way
the services drive them."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re

import pytest

from layerpy import digests
from layerpy.config import load
from layerpy.logs import BURST
from layerpy.model import Phase, PowerState, RunState
from layerpy.nodes import GAP, Ack, NodeStore, ReportRejected
from layerpy.nodes.feed import ChangeFeed
from layerpy.nodes.files import StateFiles
from layerpy.proto.agent import PROTOCOL
from layerpy.server import collector_paused

from clock import Clock
from stores import local_store


@pytest.fixture
def inventory(make_config):
    clock = Clock()
    inv = local_store(make_config(), clock=clock)
    inv.test_clock = clock  # type: ignore[attr-defined]
    return inv


def report(inv: NodeStore, token: str, event: str = "heartbeat", boot_id: str = "b1", **extra):
    payload = {
        "node": "cn001",
        "token": token,
        "mac": "52:54:00:99:00:11",
        "ip": "10.99.0.11",
        "boot_id": boot_id,
        "seq": 1,
        "event": event,
        "protocol": PROTOCOL,
        **extra,
    }
    return inv.report(payload)


def boot_to_ready(inv: NodeStore, firmware: str = "ipxe") -> str:
    node = inv.nodes["cn001"]
    inv.saw_boot_request(node, firmware)
    inv.mark(node, Phase.DHCP_ACK)
    token = inv.issue_token(node)
    inv.mark(node, Phase.KERNEL)
    inv.mark(node, Phase.INITRD)
    report(inv, token, "hello")
    report(inv, token)
    return token


def test_full_boot(inventory: NodeStore) -> None:
    node = inventory.nodes["cn001"]
    assert node.run_state is RunState.UNKNOWN
    inventory.saw_boot_request(node, "ipxe")
    assert node.run_state is RunState.BOOTING
    token = inventory.issue_token(node)
    inventory.test_clock.now += 3  # type: ignore[attr-defined]
    assert report(inventory, token, "hello") == Ack("cn001")
    assert node.run_state is RunState.INIT
    report(inventory, token)
    assert node.run_state is RunState.READY
    assert list(node.boot.timeline()) == ["dhcp_discover", "script", "agent_hello", "ready"]
    assert node.boot.timeline()["agent_hello"] == 3.0


def test_lost_after_missed_reports(inventory: NodeStore) -> None:
    boot_to_ready(inventory)
    node = inventory.nodes["cn001"]
    inventory.test_clock.now += 5.9  # type: ignore[attr-defined]
    inventory.check_lost()
    assert node.run_state is RunState.READY
    inventory.test_clock.now += 0.2  # type: ignore[attr-defined]
    inventory.check_lost()
    assert node.run_state is RunState.LOST


def test_reboot_starts_a_new_timeline(inventory: NodeStore) -> None:
    boot_to_ready(inventory)
    node = inventory.nodes["cn001"]
    inventory.saw_boot_request(node, "ipxe")
    assert node.boots == 2
    assert node.run_state is RunState.BOOTING
    assert list(node.boot.timeline()) == ["dhcp_discover"]


def test_uefi_pxe_chain_is_one_boot(inventory: NodeStore) -> None:
    node = inventory.nodes["cn001"]
    inventory.saw_boot_request(node, "uefi")
    inventory.mark(node, Phase.TFTP)
    inventory.saw_boot_request(node, "ipxe")  # the chain-loaded iPXE asks again
    assert node.boots == 1
    assert node.boot.firmware == "uefi"


def test_a_late_retransmission_of_this_boots_discover_starts_no_new_boot(
    inventory: NodeStore,
) -> None:
    """A client retries a DISCOVER with its transaction id: one answered late (a busy
    server, or another instance lagging) arriving after the agent's hello is this boot's,
    and its token stays; a DISCOVER of another transaction is a reboot."""
    node = inventory.nodes["cn001"]
    inventory.saw_boot_request(node, "bios", xid=0x1111)
    inventory.mark(node, Phase.TFTP)
    inventory.saw_boot_request(node, "ipxe", xid=0x2222)  # the chain-loaded iPXE
    token = inventory.issue_token(node)
    report(inventory, token, "hello")
    for xid in (0x2222, 0x1111):  # late copies of both
        inventory.saw_boot_request(node, "ipxe", xid=xid)
    assert node.boots == 1
    assert node.run_state is RunState.INIT
    assert report(inventory, token) == Ack("cn001")
    inventory.saw_boot_request(node, "ipxe", xid=0x3333)
    assert node.boots == 2
    assert node.run_state is RunState.BOOTING


HELLO = {
    "node": "cn001",
    "token": "t",
    "mac": "52:54:00:99:00:11",
    "ip": "10.99.0.11",
    "boot_id": "b",
    "seq": 1,
    "event": "hello",
    "protocol": PROTOCOL,
}


@pytest.mark.parametrize(
    ("payload", "status", "reason"),
    [
        ([], 400, "must be a JSON object"),
        ({"node": "cn001", "protocol": PROTOCOL}, 400, "report.token is missing"),
        ({"node": "cn001"}, 400, f"protocol None, this side {PROTOCOL}"),
        (HELLO | {"node": "nope"}, 404, "no node named 'nope'"),
        (HELLO | {"token": "wrong"}, 403, "wrong boot token"),
    ],
)
def test_rejected_reports(inventory: NodeStore, payload, status: int, reason: str) -> None:
    boot_to_ready(inventory)
    with pytest.raises(ReportRejected) as rejected:
        inventory.report(payload)
    assert rejected.value.status == status
    assert reason in rejected.value.reason


def test_tokens_survive_a_restart(inventory: NodeStore) -> None:
    """A restarted server takes the first heartbeat of a node it booted before for what it
    is: ready (its engine waits for nothing more, and cycles no one); not a new boot."""
    token = boot_to_ready(inventory)
    again = local_store(inventory.config)
    report(again, token)
    assert again.nodes["cn001"].run_state is RunState.READY
    assert again.nodes["cn001"].boots == 1


def test_after_a_restart_a_hello_or_a_new_boot_id_is_a_new_start(inventory: NodeStore) -> None:
    token = boot_to_ready(inventory)
    again = local_store(inventory.config)
    report(again, token, "hello")  # the agent itself restarted: it says hello again
    assert again.nodes["cn001"].run_state is RunState.INIT
    third = local_store(inventory.config)
    report(third, token, boot_id="b2")  # rebooted without a network boot
    assert third.nodes["cn001"].run_state is RunState.INIT
    assert third.nodes["cn001"].boots == 2


def test_new_boot_id_without_dhcp_starts_a_boot(inventory: NodeStore) -> None:
    token = boot_to_ready(inventory)
    report(inventory, token, "hello", boot_id="b2")
    node = inventory.nodes["cn001"]
    assert node.boots == 2 and node.boot.boot_id == "b2"
    assert node.run_state is RunState.INIT


def test_unknown_machine_is_listed_once(inventory: NodeStore) -> None:
    inventory.saw_unknown("52:54:00:00:00:99", "bios", "PXEClient")
    inventory.saw_unknown("52:54:00:00:00:99", "bios", "PXEClient")
    assert inventory.unknown["52:54:00:00:00:99"].requests == 2


def test_apply_keeps_observed_state(inventory: NodeStore, make_config) -> None:
    token = boot_to_ready(inventory)
    inventory.saw_unknown("52:54:00:99:00:77", "bios", None)
    extra = '\n[nodes.cn009]\nip = "10.99.0.19"\nmac = "52:54:00:99:00:77"\n'
    new = make_config(client_mac="52:54:00:99:00:22", more=extra)
    added, removed, changed = inventory.apply_config(new)
    assert (added, removed, changed) == ({"cn009"}, set(), {"cn002"})
    assert inventory.nodes["cn001"].run_state is RunState.READY
    assert inventory.by_mac("52:54:00:99:00:22").name == "cn002"
    assert inventory.by_mac("52:54:00:99:00:12") is None
    assert list(inventory.unknown) == []  # the unknown machine is now known
    report(inventory, token)  # the boot token still holds


def look_ups(store: NodeStore) -> dict[str, dict[object, str]]:
    """The store's indexes by MAC, address and location: key -> node name."""
    ids = store.identities
    tables = {"mac": ids._by_mac, "ip": ids._by_ip, "location": ids._by_location}
    return {kind: {key: node.name for key, node in table.items()} for kind, table in tables.items()}


def test_apply_ends_as_a_store_built_from_the_file(inventory: NodeStore, make_config) -> None:
    """A reload's work is the nodes it adds, removes and changes: after a few of them the
    look-ups and the nodes' order are a fresh store's; an unchanged node keeps its config
    object (the copy read again is dropped, compare)."""

    def node(name: str, ip: str, mac: str, port: str) -> str:
        return f'\n[nodes.{name}]\nip = "{ip}"\nmac = "{mac}"\nlocation = "sw1:{port}"\n'

    switch = '\n[switches.sw1]\nrelay = "10.99.0.254"\n'
    cn009 = node("cn009", "10.99.0.19", "52:54:00:99:00:77", "swp9")
    cn010 = node("cn010", "10.99.0.20", "52:54:00:99:00:78", "swp10")
    moved = node("cn010", "10.99.0.21", "52:54:00:99:00:77", "swp9")  # where cn009 was
    files = [
        {"more": switch + cn009 + cn010},  # added
        {"client_mac": "52:54:00:99:00:22", "more": switch + moved},  # changed, removed
        {},
    ]
    for keys in files:
        running = dict(inventory.config.nodes)
        config = make_config(**keys)
        inventory.apply_config(config)
        fresh = local_store(config)
        assert list(inventory.nodes) == list(fresh.nodes)
        assert look_ups(inventory) == look_ups(fresh)
        for name, cfg in config.nodes.items():
            assert inventory.nodes[name].config is cfg
            assert cfg is running.get(name) or cfg != running.get(name)


def test_a_node_file_leaves_no_garbage_for_the_collector(make_config) -> None:
    """The server never thaws a reloaded file's frozen objects (server._settle_heap): they
    must go by their reference counts alone, so a node file holds no reference cycle."""
    extra = LOCATED + '\n[nodes.cn009]\nip = "10.99.0.19"\nbmc = { driver = "none" }\n'
    gc.collect()
    with collector_paused():
        make_config(more=extra)
        assert gc.collect() == 0


LOCATED = '\n[switches.sw1]\nrelay = "10.99.0.254"\n\n[nodes.cn003]\nip = "10.99.0.13"\nlocation = "sw1:swp3"\n'
PORT = ("sw1", "swp3")


def bound_and_alive(inv: NodeStore):
    """A machine bound at sw1:swp3 that boots and says hello: cn003, alive."""
    node = inv.locate("52:54:00:aa:00:01", PORT, "lldp")
    inv.saw_boot_request(node, "ipxe")
    token = inv.issue_token(node)
    inv.report(
        {
            "node": "cn003",
            "token": token,
            "mac": "52:54:00:aa:00:01",
            "ip": "10.99.0.13",
            "boot_id": "b",
            "seq": 1,
            "event": "hello",
            "protocol": PROTOCOL,
        }
    )
    return node


def test_location_binds_replaces_moves_and_conflicts(make_config) -> None:
    clock = Clock()
    inv = local_store(make_config(more=LOCATED), clock=clock)
    node = bound_and_alive(inv)
    assert node.name == "cn003" and inv.by_mac("52:54:00:aa:00:01") is node
    assert inv.feed.events()[-1]["kind"] == "bound"
    assert node.location["port"] == "swp3" and node.location["source"] == "lldp"
    assert inv.locate("52:54:00:aa:00:02", PORT, "lldp") is None
    assert "52:54:00:aa:00:02 claims sw1:swp3, where 52:54:00:aa:00:01 is alive" in node.conflict
    assert "belongs to cn003" in inv.unknown["52:54:00:aa:00:02"].conflict
    assert inv.by_mac("52:54:00:aa:00:01") is node  # nobody stole the address
    # the first machine dies (lost): the newcomer is replacement hardware
    clock.now += 100
    inv.check_lost()
    assert inv.locate("52:54:00:aa:00:02", PORT, "dhcp-option-82") is node
    assert (
        inv.feed.events()[-1]["message"]
        == "hardware replaced at sw1:swp3 (dhcp-option-82): 52:54:00:aa:00:01 -> 52:54:00:aa:00:02"
    )
    assert node.conflict is None and inv.by_mac("52:54:00:aa:00:01") is None
    assert node.binding == {"mac": "52:54:00:aa:00:02", "previous": "52:54:00:aa:00:01",
                            "how": "at sw1:swp3 (dhcp-option-82)", "at": clock.now}  # fmt: skip
    # bindings survive a restart
    assert local_store(inv.config).by_mac("52:54:00:aa:00:02").name == "cn003"


def test_under_rebind_confirm_new_hardware_waits_for_layerpy_bind(make_config) -> None:
    """A new machine at a node's port is not the node (no identity, so no token or files)
    until an operator binds it; a node without any machine yet is bound by its port."""
    clock = Clock()
    config = make_config(more=LOCATED)
    config.path.write_text(
        config.path.read_text().replace("[server]\n", '[server]\nrebind = "confirm"\n')
    )
    inv = local_store(load(config.path), clock=clock)
    node = bound_and_alive(inv)  # the first machine: bound by its location
    assert inv.by_mac("52:54:00:aa:00:01") is node
    clock.now += 100
    inv.check_lost()
    new = "52:54:00:aa:00:02"
    for _ in range(3):  # a PXE ROM asks again and again: one event
        assert inv.who_is(new, PORT) is None
        assert inv.locate(new, PORT, "dhcp-option-82") is None
    assert inv.by_mac(new) is None and inv.mac_of(node) == "52:54:00:aa:00:01"
    waiting = [e["message"] for e in inv.feed.events() if e["kind"] == "rebind"]
    assert waiting == [
        f"{new} at sw1:swp3 (dhcp-option-82) would replace 52:54:00:aa:00:01: not bound "
        f'until `layerpy bind cn003 {new}` (rebind = "confirm")'
    ]
    assert node.rebind_pending == {"mac": new, "where": "sw1:swp3", "source": "dhcp-option-82",
                                   "at": clock.now}  # fmt: skip
    assert inv.unknown[new].claim == waiting[0]
    inv.bind("cn003", new, "uid 0 (root)")
    assert inv.by_mac(new) is node and node.rebind_pending is None
    assert inv.who_is(new, PORT) is node and inv.locate(new, PORT, "dhcp-option-82") is node
    assert inv.feed.events()[-1]["message"] == (
        f"hardware replaced by uid 0 (root): 52:54:00:aa:00:01 -> {new}"
    )


def test_conflict_stays_while_claimed_and_ends_when_the_claims_stop(make_config) -> None:
    clock = Clock()
    inv = local_store(make_config(more=LOCATED), clock=clock)
    node = bound_and_alive(inv)
    assert inv.locate("52:54:00:aa:00:02", PORT, "lldp") is None
    clock.now += 2
    assert inv.locate("52:54:00:aa:00:01", PORT, "lldp") is node  # the rightful machine reports
    assert node.conflict is not None  # ...but the other one still claims the port
    clock.now += 7  # more than heartbeat x lost_after without a claim
    inv.locate("52:54:00:aa:00:01", PORT, "lldp")
    assert node.conflict is None


def test_a_machine_that_moves_follows_the_port(make_config) -> None:
    extra = '\n[nodes.cn004]\nip = "10.99.0.14"\nlocation = "sw1:swp4"\n'
    inv = local_store(make_config(more=LOCATED + extra))
    first = inv.locate("52:54:00:aa:00:01", PORT, "lldp")
    moved = inv.locate("52:54:00:aa:00:01", ("sw1", "swp4"), "lldp")
    assert (first.name, moved.name) == ("cn003", "cn004")
    assert inv.by_mac("52:54:00:aa:00:01") is moved and inv.mac_of(first) is None
    assert [e["kind"] for e in inv.feed.events()] == ["bound", "moved", "bound"]
    assert (
        inv.feed.events()[1]["message"] == "52:54:00:aa:00:01 moved from cn003 to cn004 (sw1:swp4)"
    )


# -- a node is only itself: what may bind a machine to a node -----------------------------

SWITCH = '\n[switches.sw1]\nchassis_id = "02:00:00:00:0a:01"\nrelay = "10.99.0.254"\n'
STRANGER = "52:54:00:aa:00:07"


def with_identity(make_config, identity: str, clock: Clock | None = None) -> NodeStore:
    config = make_config(more=LOCATED.replace('\n[switches.sw1]\nrelay = "10.99.0.254"\n', SWITCH))
    text = config.path.read_text().replace("[server]\n", f'[server]\nidentity = "{identity}"\n')
    text = text.replace('state_dir = "state"', f'state_dir = "state-{identity}"')  # own bindings
    config.path.write_text(text)
    return local_store(load(config.path), clock=clock or Clock())


def lldp_report(inv: NodeStore, node: str, token: str, mac: str, port: str = "swp3") -> Ack:
    return inv.report(
        {"node": node, "token": token, "mac": mac, "ip": "10.99.0.200", "boot_id": "b",
         "seq": 1, "event": "hello", "protocol": PROTOCOL,
         "lldp": {"chassis_id": "02:00:00:00:0a:01", "port_id": port}}
    )  # fmt: skip


def discovery_report(inv: NodeStore, mac: str = STRANGER) -> Ack:
    inv.saw_unknown(mac, "ipxe", None)
    return lldp_report(inv, "discover", inv.discovery_token(mac), mac)


def test_an_lldp_claim_alone_binds_only_where_agents_are_trusted(make_config) -> None:
    trusting = with_identity(make_config, "location-trusted")
    assert discovery_report(trusting).node == "cn003"
    assert trusting.by_mac(STRANGER).name == "cn003"
    for identity in ("location", "mac"):
        careful = with_identity(make_config, identity)
        assert discovery_report(careful) == Ack("discover"), identity
        assert careful.by_mac(STRANGER) is None and careful.identities.bindings == {}
    claims = [e for e in careful.feed.events() if e["kind"] == "claim"]
    assert claims == []  # identity = "mac": a location says nothing at all


def test_an_operator_confirms_an_lldp_claim(make_config) -> None:
    inv = with_identity(make_config, "location")
    assert discovery_report(inv) == Ack("discover")
    claim = inv.unknown[STRANGER].claim
    assert claim == (
        f"{STRANGER} says it is at sw1:swp3 (LLDP), unconfirmed: a relay's option 82 or "
        f"`layerpy bind cn003 {STRANGER}` binds it"
    )
    assert [e["kind"] for e in inv.feed.events()] == ["claim"]
    assert discovery_report(inv) == Ack("discover")  # told once, not once per report
    assert [e["kind"] for e in inv.feed.events()] == ["claim"]
    inv.bind("cn003", STRANGER, "uid 0 (root)")
    assert inv.feed.events()[-1]["message"] == f"{STRANGER} is cn003 by uid 0 (root)"
    answer = discovery_report(inv)  # now the claim matches what is bound: it carries on
    assert answer.node == "cn003" and answer.identity is not None


def test_a_node_cannot_claim_another_nodes_mac_or_port(make_config) -> None:
    """cn003 (bound, with a valid token) reports cn001's MAC, then another port: neither
    hands it cn001's identity or rebinds anything."""
    inv = with_identity(make_config, "location-trusted")
    node = inv.locate("52:54:00:aa:00:01", PORT, "lldp")
    inv.saw_boot_request(node, "ipxe")
    token = inv.issue_token(node)
    assert lldp_report(inv, "cn003", token, "52:54:00:aa:00:01") == Ack("cn003")
    bindings = dict(inv.identities.bindings)
    assert lldp_report(inv, "cn003", token, "52:54:00:99:00:11") == Ack("cn003")
    assert node.problem == (
        "reports MAC 52:54:00:99:00:11, but cn003 is 52:54:00:aa:00:01: ignored "
        "(layerpy bind changes a node's machine)"
    )
    assert inv.identities.bindings == bindings
    assert inv.by_mac("52:54:00:99:00:11").name == "cn001"
    assert node.mac == "52:54:00:aa:00:01"
    assert inv.holds_token("cn003", token)  # no fresh token was handed out


# -- one writer, one feed ------------------------------------------------------------------


def test_every_observation_is_published_once(inventory: NodeStore) -> None:
    changes = inventory.feed.subscribe()
    token = boot_to_ready(inventory)
    report(inventory, token)  # a heartbeat that changes nothing publishes nothing
    inventory.saw_power("cn001", PowerState.ON)
    inventory.saw_power("cn001", PowerState.ON)
    seen = [(c.node, c.kind, dict(c.fields)) for c in changes.pending()]
    run_states = [f["run_state"] for _, _, f in seen if "run_state" in f]
    assert run_states == ["booting", "init", "ready"]
    phases = [f["phase"] for _, _, f in seen if "phase" in f]
    assert phases == [
        "dhcp_discover",
        "dhcp_ack",
        "script",
        "kernel",
        "initrd",
        "agent_hello",
        "ready",
    ]
    assert [f for _, _, f in seen if "power" in f] == [{"power": "on"}]
    assert {(node, kind) for node, kind, _ in seen} == {("cn001", "observed")}


def test_a_subscriber_that_falls_behind_is_told_so(inventory: NodeStore) -> None:
    slow = inventory.feed.subscribe(limit=2)
    boot_to_ready(inventory)
    first = asyncio.run(anext(slow))
    assert first is GAP  # then the latest change, to carry on from
    assert [dict(c.fields) for c in slow.pending()] == [{"run_state": "ready"}]
    since = inventory.feed.seq - 3
    resumed = inventory.feed.subscribe(since=since)
    assert [c.seq for c in resumed.pending()] == [since + 1, since + 2, since + 3]


def test_an_event_number_from_another_run_means_a_gap() -> None:
    """Numbers rise across restarts: one from before is older than any now, and one from
    the future is nobody's; a client resuming with either re-reads the state."""
    earlier, later = ChangeFeed(clock=lambda: 1000.0), ChangeFeed(clock=lambda: 1001.0)
    earlier.publish("cn001", "observed", {"run_state": "ready"})
    later.publish("cn001", "observed", {"run_state": "booting"})
    assert later.history[0].seq > earlier.seq
    assert later.subscribe(since=earlier.seq).pending()[0] is GAP
    assert later.subscribe(since=later.seq + 5).pending()[0] is GAP
    assert later.subscribe(since=later.seq).pending() == []  # up to date: nothing, no gap


def test_engine_conclusions_are_observations(inventory: NodeStore) -> None:
    boot_to_ready(inventory)
    node = inventory.nodes["cn001"]
    inventory.saw_power("cn001", PowerState.ON)
    inventory.conclude("cn001", {"power": "hang"})
    inventory.saw_power("cn001", PowerState.ON)  # a BMC saying "on" does not end a hang
    assert node.power is PowerState.HANG
    inventory.conclude("cn001", {"run": "unknown", "busy": "unknown", "image": "unknown"})
    assert node.run_state is RunState.UNKNOWN and node.last_report is None
    inventory.saw_power("gone", PowerState.ON)  # a node a reload removed: no KeyError


def test_an_agent_of_another_protocol_is_shown_on_its_node(inventory: NodeStore) -> None:
    token = boot_to_ready(inventory)
    node = inventory.nodes["cn001"]
    with pytest.raises(ReportRejected) as rejected:
        report(inventory, "not-its-token", protocol="2.0")
    assert rejected.value.status == 400 and node.problem is None  # a stranger can't mark it
    with pytest.raises(ReportRejected, match=rf"protocol 2\.0, this side {re.escape(PROTOCOL)}"):
        report(inventory, token, protocol="2.0")
    assert f"protocol 2.0, this side {PROTOCOL}" in node.problem
    report(inventory, token)
    assert node.problem is None


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("mac", "52:54:00:99:00:11\nchain http://evil/x.ipxe", "report.mac is not a MAC"),
        ("ip", "10.99.0.11; reboot", "report.ip is not an IPv4 address"),
        ("seq", True, "report.seq must be an integer"),
        ("busy", "yes", "report.busy must be true or false"),
        ("image", {"state": "gone"}, "report.image.state must be one of"),
        # found by tests/fuzz: a choice that is no string at all was a TypeError (a 500)
        ("event", None, "report.event must be a string, not NoneType"),
        ("image", {"state": 7}, "report.image.state must be a string, not int"),
    ],
)
def test_report_fields_are_validated(inventory: NodeStore, field, value, reason) -> None:
    token = boot_to_ready(inventory)
    with pytest.raises(ReportRejected, match=reason):
        report(inventory, token, **{field: value})
    assert inventory.nodes["cn001"].mac == "52:54:00:99:00:11"


def test_state_files_are_private(inventory: NodeStore) -> None:
    boot_to_ready(inventory)
    path = inventory.config.server.state_dir / "boots.jsonl"
    assert path.stat().st_mode & 0o077 == 0  # it holds boot tokens


def test_root_writes_state_files_as_the_servers_user(tmp_path) -> None:
    """`layerpy token add` run by root for a server that runs as its own user: the tokens
    file must stay readable by that server."""
    if os.geteuid() != 0:
        pytest.skip("needs root to hand a file to another user")
    os.chown(tmp_path, 65534, 65534)
    StateFiles(tmp_path).write("tokens.json", {"ops": {}})
    written = (tmp_path / "tokens.json").stat()
    assert (written.st_uid, written.st_gid, written.st_mode & 0o777) == (65534, 65534, 0o600)


def test_claims_from_many_made_up_macs_are_a_few_log_lines(make_config, caplog) -> None:
    """Issue 26: a fuzz gave 1 498 "claims sw1:swp1" lines in 33 s, one per MAC; each claim
    is still an event on the feed, the log has a few lines of the kind."""
    inv = local_store(make_config(more=LOCATED), clock=Clock())
    bound_and_alive(inv)
    caplog.set_level(logging.INFO, "layerpy.nodes")
    for i in range(500):
        assert inv.locate(f"52:54:00:ee:{i // 256:02x}:{i % 256:02x}", PORT, "lldp") is None
    claims = [r.getMessage() for r in caplog.records if "claims sw1:swp3" in r.getMessage()]
    assert 0 < len(claims) <= BURST, claims
    assert len([e for e in inv.feed.events() if e["kind"] == "conflict"]) == 500


def test_boot_tokens_are_kept_as_digests_only(inventory: NodeStore) -> None:
    """The token is in the script handed to the node, and nowhere the server keeps or shows:
    not the journal, the node's JSON, its events or its repr."""
    token = boot_to_ready(inventory)
    node = inventory.nodes["cn001"]
    journal = (inventory.config.server.state_dir / "boots.jsonl").read_text()
    assert token not in journal and digests.digest(token) in journal
    shown = [repr(node), repr(node.boot), str(node.as_json()), str(inventory.feed.events()),
             *(str(change.as_json()) for change in inventory.feed.history)]  # fmt: skip
    assert not [text for text in shown if token in text]
    with pytest.raises(ReportRejected, match="wrong boot token"):
        report(inventory, digests.digest(token)[:64])  # the digest is no token
    again = local_store(inventory.config)  # read back from the digests
    report(again, token)
    assert again.nodes["cn001"].run_state is RunState.READY


def test_a_discovery_token_is_kept_as_a_digest(inventory: NodeStore) -> None:
    inventory.saw_unknown("52:54:00:aa:00:07", "ipxe", None)
    token = inventory.discovery_token("52:54:00:aa:00:07")
    machine = inventory.unknown["52:54:00:aa:00:07"]
    assert token not in repr(machine) + str(machine.as_json())
    assert machine.token_digest == digests.digest(token)
    assert inventory.unknown.check_token("52:54:00:aa:00:07", token) is machine
    assert inventory.unknown.check_token("52:54:00:aa:00:07", token + "x") is None


@pytest.mark.parametrize("old_file", ["boots.jsonl", "boots.json"])
def test_clear_tokens_of_an_older_release_are_hashed_when_read(make_config, old_file) -> None:
    """A node booted before the upgrade goes on reporting with its token; the state
    directory holds its digest only from the first start on."""
    config = make_config()
    state = config.server.state_dir
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    old = {"token": "older-clear-token", "boot_id": "b1", "boots": 3}
    if old_file == "boots.jsonl":
        (state / old_file).write_text(json.dumps({"node": "cn001"} | old) + "\n")
    else:
        (state / old_file).write_text(json.dumps({"cn001": old}))
    inv = local_store(config)
    kept = (state / "boots.jsonl").read_text()
    assert "older-clear-token" not in kept and digests.digest("older-clear-token") in kept
    assert not (state / "boots.json").exists()
    report(inv, "older-clear-token")
    assert inv.nodes["cn001"].run_state is RunState.READY and inv.nodes["cn001"].boots == 3
    assert "older-clear-token" not in (state / "boots.jsonl").read_text()
