"""The node store: the one writer of observed node state.

Every observation (DHCP, TFTP, HTTP fetches, agent reports, BMC polls, the engine's own
conclusions) arrives here as a method call; the store changes the node and publishes the
change once on its feed, which the engine and everyone else subscribe to. Nothing else
assigns an observed field.

Run state moves unknown -> booting (DHCP from boot firmware) -> init (agent hello) ->
ready (agent reporting) -> lost (missed reports). Boot tokens are kept in the state
directory as digests (the token itself is only in the script handed to the node), so a
restarted server still recognises the agents of the nodes it booted, and
takes their next heartbeat for what it is: a node ready since before the restart.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

from layerpy import digests
from layerpy.config import Config, NodeConfig
from layerpy.journal import Journal
from layerpy.logs import Throttle
from layerpy.model import Boot, Busy, ImageState, Node, Phase, PowerState, RunState
from layerpy.nodes.discovery import DISCOVERY, Discovery
from layerpy.nodes.feed import ChangeFeed
from layerpy.nodes.files import StateFiles
from layerpy.nodes.identity import Identities, Location
from layerpy.proto.agent import ContractError, Event, Identity, ProtocolMismatch, Report

log = logging.getLogger("layerpy.nodes")
quiet = Throttle(log)  # what the boot network can cause at will: a few lines a minute

TOKENS = "boots.jsonl"  # a Journal: one line per new boot token (its digest) or boot id
OLD_TOKENS = "boots.json"  # before: the whole table, rewritten at every boot; read once
ALIVE = (RunState.INIT, RunState.READY)
FATAL_ON_CONSOLE = {"panic"}  # the console problems after which a node cannot go on
# Events a machine on the boot network can repeat at will (a new MAC each time): their log
# lines are throttled by kind; the events themselves all go on the feed.
REPEATABLE_EVENTS = frozenset({"conflict", "claim", "rebind", "replaced", "moved"})
# The engine's variables, as node fields (the engine concludes values of these itself)
VARIABLE_FIELDS = {"power": "power", "run": "run_state", "busy": "busy", "image": "image_state"}


class ReportRejected(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Ack:
    """An accepted report: the node the agent is now, and the identity to hand it when
    the machine turned out to be another node (a discovered or moved machine)."""

    node: str
    identity: Identity | None = None


@dataclass(frozen=True)
class FileChange:
    """A node file read anew, and which of its nodes differ from the file in force."""

    config: Config
    added: set[str]
    removed: set[str]
    changed: set[str]
    moved: set[str]  # the changed nodes whose MAC, address or location changed

    def names(self) -> tuple[set[str], set[str], set[str]]:
        """The nodes added, removed and changed."""
        return self.added, self.removed, self.changed


def compare(running: Config, config: Config) -> FileChange:
    """Which nodes `config` adds, removes and changes against the `running` file.

    Reads the two files only, so a worker thread may run it (25 000 node configs take
    about 50 ms). An unchanged node's config in `config` is replaced by the running one:
    its copy is freed at once, nothing new is left for the collector, and the next
    comparison of that node is one of identity."""
    added, changed, moved = set(), set(), set()
    nodes = config.nodes
    for name, node in nodes.items():
        before = running.nodes.get(name)
        if before is None:
            added.add(name)
        elif before is node or before == node:
            nodes[name] = before
        else:
            changed.add(name)
            if _identity(before) != _identity(node):
                moved.add(name)
    removed = set(running.nodes.keys() - nodes.keys())
    return FileChange(config, added, removed, changed, moved)


def _identity(config: NodeConfig) -> tuple[object, ...]:
    """What a node's look-ups are made of in its config (a new image or power: none)."""
    return config.mac, config.ip, config.location


class NodeStore:
    def __init__(
        self, config: Config, clock: Callable[[], float] = time.time, feed: ChangeFeed | None = None
    ) -> None:
        self.config = config
        self.clock = clock
        self.feed = feed or ChangeFeed(clock)
        self.files = StateFiles(config.server.state_dir)
        self.nodes = {name: Node(cfg) for name, cfg in config.nodes.items()}
        self.identities = Identities(self.files)
        self.identities.index(self.nodes)
        self.unknown = Discovery()
        self._reporting: OrderedDict[str, float] = OrderedDict()  # oldest report first
        self._resumed: set[str] = set()  # boots from before a restart, not heard from since
        self._tokens = Journal(config.server.state_dir / TOKENS, key="node")
        self._load_tokens()

    def apply(self, config: Config) -> tuple[set[str], set[str], set[str]]:
        """Take a new, already validated node file; observed state of kept nodes stays.

        Returns the names added, removed and changed."""
        return self.apply_change(compare(self.config, config))

    def apply_change(self, change: FileChange) -> tuple[set[str], set[str], set[str]]:
        """`apply` of a file already compared (the server compares in a worker thread).

        One step, so nobody sees half a file; its work is the added, removed and changed
        nodes', and, when nodes come or go, one pass that keeps the file's order."""
        config, (added, removed, changed), moved = change.config, change.names(), change.moved
        for name in removed | moved:
            self.identities.drop(self.nodes[name])  # by what the file in force says
        for name in changed:
            self.nodes[name].config = config.nodes[name]
        if added or removed:
            kept = self.nodes
            self.nodes = {name: kept.get(name) or Node(cfg) for name, cfg in config.nodes.items()}
        for name in added | moved:
            self.identities.add(self.nodes[name])
        self.config = config
        if added or changed:  # a machine that booted unknown may be one of them now
            for mac in [mac for mac in self.unknown if self.by_mac(mac)]:
                self.unknown.forget(mac)
        counts = {"added": len(added), "removed": len(removed), "changed": len(changed)}
        message = f"node file applied: {len(self.nodes)} nodes"  # mirrors re-read the list
        self.feed.publish("", "event", {"event": "reloaded", **counts}, message)
        return change.names()

    # -- look-ups ------------------------------------------------------------------------

    def by_mac(self, mac: str) -> Node | None:
        return self.identities.by_mac(mac)

    def by_ip(self, ip: IPv4Address | str) -> Node | None:
        return self.identities.by_ip(ip)

    def at(self, location: Location) -> Node | None:
        return self.identities.at(location)

    def mac_of(self, node: Node) -> str | None:
        return self.identities.mac_of(node)

    def who_is(self, mac: str, location: Location) -> Node | None:
        """The node ``locate()`` will say this MAC is at this port, without binding: the
        node configured there, unless another machine of its is alive there, or the new
        machine waits for an operator's confirmation (rebind = "confirm")."""
        node = self.at(location)
        if node is None or self._held_by_another(node, mac) or self._awaits_bind(node, mac):
            return None
        return node

    def _held_by_another(self, node: Node, mac: str) -> bool:
        current = self.mac_of(node)
        return current not in (None, mac) and self.alive(node)

    def _awaits_bind(self, node: Node, mac: str) -> bool:
        """Under rebind = "confirm", a new machine where the node has one already is not
        the node until ``layerpy bind`` says so (a node without any machine yet is bound
        by its location, as under "auto")."""
        current = self.mac_of(node)
        return self.config.server.rebind == "confirm" and current not in (None, mac)

    # -- writing (the only code that assigns observed fields) ----------------------------

    def _set(self, node: Node, why: str = "", **values: Any) -> None:
        """Assign observed fields and publish what changed, once."""
        changed = {}
        for key, value in values.items():
            if getattr(node, key) != value:
                setattr(node, key, value)
                changed[key] = value
        if changed:
            self.feed.publish(node.name, "observed", changed, why)

    def _event(self, node: str, kind: str, message: str) -> None:
        """Something an operator should see later (``GET /api/v1/events``), also logged
        (a few lines a minute of the kinds the boot network can repeat at will)."""
        level = logging.WARNING if kind in ("conflict", "rebind") else logging.INFO
        if kind in REPEATABLE_EVENTS:
            quiet.log(f"event {kind}", level, "%s: %s", node, message)
        else:
            log.log(level, "%s: %s", node, message)
        self.feed.publish(node, "event", {"event": kind}, message)

    def _set_state(self, node: Node, state: RunState, why: str = "") -> None:
        if node.run_state != state:
            suffix = f": {why}" if why else ""
            log.info("%s: run_state %s -> %s%s", node.name, node.run_state, state, suffix)
        self._set(node, why, run_state=state)

    # -- observations from the boot services ---------------------------------------------

    def saw_unknown(self, mac: str, firmware: str | None, vendor_class: str | None) -> None:
        machine, new = self.unknown.seen(mac, self.clock())
        machine.requests += 1
        if new:
            machine.firmware, machine.vendor_class = firmware, vendor_class
            # one budget for all: a thousand made-up MACs are a few lines, not a thousand
            # (GET /api/v1/unknown lists every one)
            quiet.log("unknown machines", logging.INFO, "%s: unknown machine asks to boot (%s)",
                      mac, firmware)  # fmt: skip

    def saw_mac(self, node: Node, mac: str) -> None:
        self._set(node, mac=mac)

    def saw_address(self, node: Node, ip: IPv4Address | None, why: str = "") -> None:
        """The address a node uses (from its ProxyDHCP request or its agent); a node the
        file gives no address is found by it from now on."""
        old = node.ip
        self._set(node, why, ip=ip)
        if old != ip:
            self.identities.readdress(node, old)

    def saw_boot_request(self, node: Node, firmware: str) -> None:
        """A DHCP DISCOVER from boot firmware (PXE or iPXE).

        It starts a new boot unless the node is still between firmware and script, as
        when UEFI PXE chain-loads iPXE, which asks again."""
        boot = node.boot
        if boot is None or Phase.SCRIPT in boot.phases or node.run_state != RunState.BOOTING:
            self._start_boot(node, firmware)
        self.mark(node, Phase.DHCP_DISCOVER)

    def mark(self, node: Node, phase: Phase) -> None:
        if node.boot is None:
            self._start_boot(node, None)
        assert node.boot is not None
        if node.boot.mark(phase, self.clock()):
            log.debug("%s: boot phase %s", node.name, phase)
            self.feed.publish(node.name, "observed", {"phase": phase})

    def issue_token(self, node: Node) -> str:
        """A fresh secret for this boot, handed out in the node's kernel command line."""
        if node.boot is None or Phase.SCRIPT in node.boot.phases:
            self._start_boot(node, None)
        assert node.boot is not None
        token = digests.new()
        node.boot.token_digest = digests.digest(token)
        self.mark(node, Phase.SCRIPT)
        self._save_token(node)
        return token

    def discovery_token(self, mac: str) -> str | None:
        """A token for the discovery boot of an unknown machine (None: not known)."""
        return self.unknown.issue_token(mac)

    def locate(
        self, mac: str, location: Location, source: str, chassis: str | None = None
    ) -> Node | None:
        """A machine seen at a switch port: the node it is, by where it is plugged in.

        A new MAC at a port takes the node over (new or replaced hardware), a MAC seen at
        another port follows the port, but a MAC at a port whose machine is alive and
        reporting is a conflict: neither takes the address from the other."""
        node = self.at(location)
        if node is None:
            return None
        where = f"{location[0]}:{location[1]}"
        now = self.clock()
        evidence = {"source": source, "switch": location[0], "port": location[1],
                    "chassis": chassis, "mac": mac, "at": now}  # fmt: skip
        if self.mac_of(node) != mac:
            if self._held_by_another(node, mac):
                current = self.mac_of(node)
                message = f"{mac} claims {where}, where {current} is alive: not bound"
                if node.conflict != message:
                    self._event(node.name, "conflict", message)
                self._set(node, conflict=message, conflict_at=now)
                machine, _ = self.unknown.seen(mac, now)
                machine.conflict = f"{where} belongs to {node.name} ({current}, alive)"
                return None
            if self._awaits_bind(node, mac):
                self._rebind_pending(node, mac, where, source)
                return None
            self._bind(node, mac, source, where)
        elif node.conflict and now - (node.conflict_at or 0) > self._lost_limit:
            self._set(node, conflict=None)  # the other machine stopped claiming the location
        self._set(node, location=evidence)
        return node

    def _rebind_pending(self, node: Node, mac: str, where: str, source: str) -> None:
        """New hardware at a node's location under rebind = "confirm": shown on the node
        (explain), as an event, and on the machine (``/api/v1/unknown``), once per MAC."""
        if node.rebind_pending is not None and node.rebind_pending["mac"] == mac:
            return
        current = self.mac_of(node)
        message = (
            f"{mac} at {where} ({source}) would replace {current}: not bound until "
            f'`layerpy bind {node.name} {mac}` (rebind = "confirm")'
        )
        self._event(node.name, "rebind", message)
        machine, _ = self.unknown.seen(mac, self.clock())
        machine.claim = message
        pending = {"mac": mac, "where": where, "source": source, "at": self.clock()}
        self._set(node, f"{mac} waits for layerpy bind", rebind_pending=pending)

    def bind(self, name: str, mac: str, operator: str) -> None:
        """An operator says which machine a node is: confirms a pending LLDP claim, or
        names new hardware where no trustworthy evidence can."""
        self._bind(self.nodes[name], mac, operator)

    def _bind(self, node: Node, mac: str, source: str, where: str | None = None) -> None:
        """``mac`` is ``node`` from now on (kept in bindings.json); one event says why:
        the switch port it was seen at (``where``) by ``source``, or who said so."""
        current = self.mac_of(node)
        if current == mac:
            return
        previous = self.identities.bind(node, mac)
        if previous is not None:
            moved = f"{mac} moved from {previous.name} to {node.name} ({where or source})"
            self._event(previous.name, "moved", moved)
        if current:
            how = f"at {where} ({source})" if where else f"by {source}"
            self._event(node.name, "replaced", f"hardware replaced {how}: {current} -> {mac}")
        else:
            how = f"by its location {where} ({source})" if where else f"by {source}"
            self._event(node.name, "bound", f"{mac} is {node.name} {how}")
        self.unknown.forget(mac)
        binding = {"mac": mac, "previous": current, "how": how, "at": self.clock()}
        self._set(node, mac=mac, conflict=None, binding=binding, rebind_pending=None)

    def alive(self, node: Node) -> bool:
        """Its own machine (the one bound to it) is reporting."""
        return node.run_state in ALIVE and node.mac == self.mac_of(node)

    # -- agent reports ------------------------------------------------------------------

    def report(self, payload: Any) -> Ack:
        """An agent report (parsed JSON); raises ReportRejected saying why it is refused."""
        try:
            report = Report.from_json(payload)
        except ProtocolMismatch as mismatch:
            self._wrong_protocol(mismatch)
            raise ReportRejected(400, str(mismatch)) from None
        except ContractError as error:
            raise ReportRejected(400, str(error)) from None
        if report.node == DISCOVERY:
            return self._discovery_report(report)
        node = self._authenticate(report)
        bound = self.mac_of(node)
        if bound is not None and report.mac != bound:  # a node may not change its MAC
            self._lied(node, f"reports MAC {report.mac}, but {node.name} is {bound}")
            return Ack(node.name)
        located = self._lldp_node(report)
        if located is not None and located is not node:  # the machine moved to another port
            return self._hand_over(located)
        boot = node.boot
        assert boot is not None
        now = self.clock()
        if boot.boot_id and report.boot_id != boot.boot_id:
            log.info("%s: agent reports a new boot id without a network boot", node.name)
            kept = boot.token_digest
            boot = self._start_boot(node, None)
            boot.token_digest = kept
        if boot.boot_id is None:
            boot.boot_id = report.boot_id
            self._save_token(node)
        self._reporting.pop(node.name, None)
        self._reporting[node.name] = now
        self._agent_facts(node, report, now)
        resumed = node.name in self._resumed  # a new boot id started a new boot above
        self._resumed.discard(node.name)
        if (resumed or node.run_state in (*ALIVE, RunState.LOST)) and report.event != Event.HELLO:
            self.mark(node, Phase.READY)
            self._set_state(node, RunState.READY)
        else:
            self.mark(node, Phase.AGENT_HELLO)
            self._set_state(node, RunState.INIT)
        return Ack(node.name)

    def _agent_facts(self, node: Node, report: Report, now: float) -> None:
        image = report.image
        state = (
            image.state
            if image.state not in (ImageState.UNKNOWN, ImageState.STALE)
            else ImageState.NONE
        )
        busy = Busy.BUSY if report.busy else Busy.FREE
        if busy != node.busy:
            log.info("%s: %s", node.name, busy)
        if (state, image.digest, image.error) != (
            node.image_state,
            node.image_digest,
            node.image_error,
        ):
            reason = f": {image.error}" if image.error else ""
            log.info("%s: image %s %s%s", node.name, state, (image.digest or "-")[:19], reason)
        files = report.files
        if (files.revision, files.error) != (node.files_revision, node.files_error):
            reason = f": {files.error}" if files.error else ""
            log.info("%s: files revision %s%s", node.name, files.revision or "-", reason)
        try:
            ip: IPv4Address | None = IPv4Address(report.ip)
        except ValueError:
            ip = None
        node.last_report = now  # not published: it changes with every heartbeat
        node.agent = {
            "uptime": report.uptime,
            "seq": report.seq,
            "agent_version": report.agent_version,
            "timeline": report.timeline,
            "persist": report.persist,
        }
        self.saw_address(node, ip)
        self._set(
            node,
            mac=report.mac,
            hostname=report.hostname,
            busy=busy,
            image_state=state,
            image_digest=image.digest,
            image_error=image.error,
            files_revision=files.revision,
            files_error=files.error,
            problem=None,
        )

    def _wrong_protocol(self, mismatch: ProtocolMismatch) -> None:
        """An agent of another release: shown on its node, if it holds that node's token."""
        node = self.nodes.get(mismatch.node or "")
        if node is None or mismatch.token is None or not self._token_ok(node, mismatch.token):
            return
        if node.problem != str(mismatch):
            log.error("%s: %s", node.name, mismatch)
        self._set(node, problem=str(mismatch))

    def _discovery_report(self, report: Report) -> Ack:
        """A machine booted from the pool: once its LLDP neighbour names a node's port, it
        becomes that node (its agent switches identity and address without a reboot)."""
        machine = self.unknown.check_token(report.mac, report.token)
        if machine is None:
            raise ReportRejected(403, f"wrong discovery token for {report.mac}")
        machine.last_seen = self.clock()
        node = self._lldp_node(report)
        return Ack(DISCOVERY) if node is None else self._hand_over(node)

    def _lldp_node(self, report: Report) -> Node | None:
        """The node at the port the agent's LLDP neighbour names, bound to the reporting MAC
        where the identity policy lets an agent's word count; otherwise None, and a claim
        that can bind no one yet is shown for an operator to confirm (``layerpy bind``)."""
        policy = self.config.server.identity
        if report.lldp is None or policy == "mac":
            return None
        chassis = report.lldp.chassis_id.lower()
        switch = next(
            (s.name for s in self.config.switches.values() if s.chassis_id == chassis), None
        )
        if switch is None:
            return None
        location = (switch, report.lldp.port_id)
        node = self.at(location)
        if node is None:
            return None
        if policy == "location-trusted" or self.mac_of(node) == report.mac:
            return self.locate(report.mac, location, "lldp", chassis)
        self._claimed(node, report.mac, location)
        return None

    def _claimed(self, node: Node, mac: str, location: Location) -> None:
        """An LLDP claim the policy does not take on the agent's word alone."""
        where = f"{location[0]}:{location[1]}"
        message = (
            f"{mac} says it is at {where} (LLDP), unconfirmed: a relay's option 82 or "
            f"`layerpy bind {node.name} {mac}` binds it"
        )
        machine = self.unknown.get(mac)
        if machine is not None and machine.claim != message:
            machine.claim = message
            self._event(node.name, "claim", message)

    def _lied(self, node: Node, what: str) -> None:
        """A report that would change who a node is: ignored, shown on the node."""
        message = f"{what}: ignored (layerpy bind changes a node's machine)"
        if node.problem != message:
            self._event(node.name, "conflict", message)
        self._set(node, problem=message)

    def _hand_over(self, node: Node) -> Ack:
        """Tell an agent to carry on as `node`: a new boot of that node, with its own token."""
        boot = self._start_boot(node, "identity by location")
        token = digests.new()
        boot.token_digest = digests.digest(token)
        self._save_token(node)
        return Ack(node.name, Identity(node.name, token))

    def _authenticate(self, report: Report) -> Node:
        node = self.nodes.get(report.node)
        if node is None:
            raise ReportRejected(404, f"no node named {report.node!r} in the node file")
        if not self._token_ok(node, report.token):
            raise ReportRejected(403, f"wrong boot token for {node.name}")
        return node

    def holds_token(self, name: str, token: str) -> bool:
        """Whether ``token`` is the current boot token of node ``name``."""
        node = self.nodes.get(name)
        return node is not None and self._token_ok(node, token)

    def _token_ok(self, node: Node, token: str) -> bool:
        return node.boot is not None and digests.matches(node.boot.token_digest, token)

    # -- power, and the engine's own conclusions ------------------------------------------

    def saw_power(self, name: str, state: PowerState | None, error: str | None = None) -> None:
        """A BMC poll or power action: the state, or the error that kept it from being read.
        A node removed by a reload while its BMC was being asked is no longer news."""
        node = self.nodes.get(name)
        if node is None:
            return
        if error is not None:
            if node.power_error != error:
                log.error("%s: %s", name, error)
            self._set(node, error, power=PowerState.ERROR, power_error=error)
            return
        assert state is not None
        if node.power == PowerState.HANG and state == PowerState.ON:
            self._set(node, power_error=None)  # a BMC saying "on" does not end a hang
            return
        if state == PowerState.OFF and node.run_state is not RunState.UNKNOWN:
            self.forget(node, "powered off")
        if node.power != state:
            log.info("%s: power %s -> %s", name, node.power, state)
        self._set(node, power=state, power_error=None)

    def conclude(self, name: str, values: Mapping[str, str]) -> None:
        """The engine's own conclusions (a node hangs; a run state is forgotten on a power
        change; an activation failed), recorded like any observation."""
        node = self.nodes.get(name)
        if node is None:
            return
        if values.get("run") == RunState.UNKNOWN:
            self.forget(node, "forgotten on a power change")
        fields = {VARIABLE_FIELDS[var]: value for var, value in values.items() if var != "run"}
        if "power" in fields:
            fields["power"] = PowerState(fields["power"])
            if fields["power"] != node.power:
                log.info("%s: power %s -> %s (concluded)", name, node.power, fields["power"])
        self._set(node, "concluded by the engine", **fields)

    def forget(self, node: Node, why: str) -> None:
        """What can no longer be known after a power change: run state, busy, image."""
        node.last_report = None
        self._set(node, why, busy=Busy.UNKNOWN, image_state=ImageState.UNKNOWN,
                  image_digest=None, image_error=None)  # fmt: skip
        self._set_state(node, RunState.UNKNOWN, why)

    def saw_console(self, name: str, kind: str, line: str) -> None:
        """A dying kernel's words on the node's console (``consoles.PROBLEMS``): quoted by
        explain; a panic makes a booting or running node lost at once (the engine then
        recovers it) instead of after missed heartbeats."""
        node = self.nodes.get(name)
        if node is None or kind in node.console_seen:  # each kind once a boot: no flood
            return
        node.console_seen |= {kind}
        said = f"{kind}: {line}"
        self._set(node, "seen on the console", console_problem=said)
        self._event(name, "console", f"console: {said}")
        if kind in FATAL_ON_CONSOLE and node.run_state in (*ALIVE, RunState.BOOTING):
            self._set_state(node, RunState.LOST, f"kernel {kind} on the console")

    # -- nodes that stop reporting -------------------------------------------------------

    @property
    def _lost_limit(self) -> float:
        return self.config.server.heartbeat * self.config.server.lost_after

    def check_lost(self) -> None:
        """Nodes whose agent stopped reporting become lost. Reports keep ``_reporting`` in
        order of arrival, so this looks only at the nodes that are overdue."""
        now, limit = self.clock(), self._lost_limit
        while self._reporting:
            name, last = next(iter(self._reporting.items()))
            if now - last <= limit:
                break
            del self._reporting[name]
            node = self.nodes.get(name)
            if node is not None and node.run_state in ALIVE and node.last_report == last:
                self._set_state(node, RunState.LOST, f"no report for {now - last:.0f} s")

    # -- internals -----------------------------------------------------------------------

    def _start_boot(self, node: Node, firmware: str | None) -> Boot:
        self._resumed.discard(node.name)
        node.boot = Boot(started=self.clock(), firmware=firmware)
        node.last_report = None
        self._set(node, boots=node.boots + 1, busy=Busy.UNKNOWN, console_problem=None)
        node.console_seen = frozenset()
        self._set_state(
            node, RunState.BOOTING, f"boot {node.boots} ({firmware or 'unknown firmware'})"
        )
        return node.boot

    def _token_record(self, node: Node) -> dict[str, Any]:
        boot = node.boot
        assert boot is not None
        return {"node": node.name, "sha256": boot.token_digest, "boot_id": boot.boot_id,
                "boots": node.boots}  # fmt: skip

    def _token_records(self) -> list[dict[str, Any]]:
        return [self._token_record(n) for n in self.nodes.values()
                if n.boot and n.boot.token_digest]  # fmt: skip

    def _save_token(self, node: Node) -> None:
        """Journal the node's boot token (its digest) and boot id before the answer that
        depends on them: one line, where rewriting every node's cost a storm of a thousand
        boots seconds."""
        try:
            self._tokens.append([self._token_record(node)])
            if self._tokens.crowded(len(self.nodes)):
                self._tokens.rewrite(self._token_records())
        except OSError as error:
            log.error("cannot save %s: %s", self._tokens.path, error.strerror)

    def _load_tokens(self) -> None:
        """The boots of before a restart. A state directory of an older release kept the
        tokens themselves (``token``): they are hashed as read, and the journal rewritten
        at once with digests only, so a node booted before the upgrade goes on reporting."""
        records = self._tokens.replay()
        old = self.files.read(OLD_TOKENS) if not records else {}
        for name, record in old.items():
            records.append({"node": name} | record if isinstance(record, dict) else {})
        in_clear = False
        for record in records:
            name = record.get("node")
            node = self.nodes.get(name) if isinstance(name, str) else None
            kept, token, boot_id = record.get("sha256"), record.get("token"), record.get("boot_id")
            in_clear = in_clear or token is not None
            if node is None:
                continue
            if not isinstance(kept, str) and isinstance(token, str):
                kept = digests.digest(token)
            node.boot = Boot(
                started=self.clock(),
                token_digest=kept if isinstance(kept, str) else None,
                boot_id=boot_id if isinstance(boot_id, str) else None,
            )
            boots = record.get("boots")
            node.boots = boots if isinstance(boots, int) else 0
            if node.boot.token_digest and node.boot.boot_id:
                self._resumed.add(node.name)
        if old or in_clear:  # into the journal, whole and hashed, once
            try:
                self._tokens.rewrite(self._token_records())
                if old:
                    (self.files.directory / OLD_TOKENS).unlink()
            except OSError as error:
                log.error("cannot rewrite %s with digests only: %s", TOKENS, error.strerror)
