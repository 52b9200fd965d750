"""The node store: the one writer of observed node state.

Every observation (DHCP, TFTP, HTTP fetches, agent reports, BMC polls, the engine's own
conclusions) arrives here as a method call. The policies (``identity``, ``reports``,
``tokens``, ``liveness``) read the store and return effects (``effects``); ``apply`` alone
assigns node fields, keeps the look-ups and the backend in step, and publishes each change
once on the feed, which the engine and everyone else subscribe to.

Run state moves unknown -> booting (DHCP from boot firmware) -> init (agent hello) ->
ready (agent reporting) -> lost (missed reports).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

from layerpy.config import Config, NodeConfig
from layerpy.logs import Throttle
from layerpy.model import Boot, Busy, ImageState, Node, Phase, PowerState, RunState
from layerpy.nodes import identity, liveness, observed, reports, tokens
from layerpy.nodes.backend import BINDINGS, OBSERVED, TOKENS, Backend, Record
from layerpy.nodes.discovery import DISCOVERY, Discovery
from layerpy.nodes.effects import (
    Bind,
    Effect,
    Event,
    Machine,
    Mark,
    NewBoot,
    Observe,
    Resume,
    Token,
)
from layerpy.nodes.feed import ChangeFeed
from layerpy.nodes.identity import Identities, Location
from layerpy.nodes.reports import Ack, ReportRejected

__all__ = ["DISCOVERY", "Ack", "FileChange", "NodeStore", "ReportRejected", "compare"]

log = logging.getLogger("layerpy.nodes")
quiet = Throttle(log)  # what the boot network can cause at will: a few lines a minute

MAX_XIDS = 8  # DHCP transactions remembered per boot (PXE, then iPXE, then a few more)
FATAL_ON_CONSOLE = {"panic"}  # the console problems after which a node cannot go on
# Events a machine on the boot network can repeat at will (a new MAC each time): their log
# lines are throttled by kind; the events themselves all go on the feed.
REPEATABLE_EVENTS = frozenset({"conflict", "claim", "rebind", "replaced", "moved"})
# The engine's variables, as node fields (the engine concludes values of these itself)
VARIABLE_FIELDS = {"power": "power", "run": "run_state", "busy": "busy", "image": "image_state"}


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
        self,
        config: Config,
        backend: Backend,
        clock: Callable[[], float] = time.time,
        feed: ChangeFeed | None = None,
    ) -> None:
        """``backend``: where the records that outlive a restart are kept, as the wiring
        chose it (the state directory's journals, or a cluster's etcd)."""
        self.config = config
        self.clock = clock
        self.feed = feed or ChangeFeed(clock)
        self.backend = backend
        self.instance = self.backend.instance  # None: a single server
        self._following = False  # applying another instance's record: nothing written back
        self._dirty: set[str] = set()  # nodes whose observed record is to be written
        self._sent: dict[str, Record] = {}  # the observed record last written, per node
        self.nodes = {name: Node(cfg) for name, cfg in config.nodes.items()}
        self._hearing: dict[str, set[str]] = {}  # instance → the nodes whose heard_by it is
        bound = self.backend.load(BINDINGS).items()
        self.identities = Identities(
            {n: r["mac"] for n, r in bound if isinstance(r.get("mac"), str)}
        )
        self.identities.index(self.nodes)
        self.unknown = Discovery()
        self.liveness = liveness.Liveness()
        self.apply(tokens.resume(self.backend.load(TOKENS), self.nodes))
        if self.instance is not None:
            with self._remote():
                for name, record in self.backend.load(OBSERVED).items():
                    self._followed(OBSERVED, name, record)
            self.backend.on_change(self.changed_elsewhere)

    # -- the node file -------------------------------------------------------------------

    def apply_config(self, config: Config) -> tuple[set[str], set[str], set[str]]:
        """Take a new, already validated node file; observed state of kept nodes stays."""
        return self.apply_change(compare(self.config, config))

    def apply_change(self, change: FileChange) -> tuple[set[str], set[str], set[str]]:
        """A node file already compared (the server compares in a worker thread), in one
        step, so nobody sees half a file; its work is the added, removed and changed
        nodes', and, when nodes come or go, one pass that keeps the file's order.

        Returns the names added, removed and changed."""
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
        if self.instance is not None and added:  # what other instances know of them
            with self._remote():
                for name in added:
                    for kind in (TOKENS, BINDINGS, OBSERVED):
                        if (record := self.backend.get(kind, name)) is not None:
                            self._followed(kind, name, record)
        if added or changed:  # a machine that booted unknown may be one of them now
            for mac in [mac for mac in self.unknown if self.by_mac(mac)]:
                self.unknown.forget(mac)
        counts = {"added": len(added), "removed": len(removed), "changed": len(changed)}
        message = f"node file applied: {len(self.nodes)} nodes"  # mirrors re-read the list
        self.feed.publish("", "event", {"event": "reloaded", **counts}, message)
        return change.names()

    # -- the one writer ------------------------------------------------------------------

    def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out effects, in order: the only code that assigns node fields."""
        for effect in effects:
            if isinstance(effect, Machine):
                machine, _ = self.unknown.seen(effect.mac, self.clock())
                for key, value in effect.fields.items():
                    setattr(machine, key, value)
            elif isinstance(effect, Event):
                self._event(effect)
            else:
                self._node_effect(self.nodes[effect.node], effect)
        self._write_observed()

    # -- the other instances of a cluster ------------------------------------------------

    def heard_by_others(self, live: Container[str]) -> list[str]:
        """The nodes last heard by an instance other than this one that is not in ``live``
        (gone): found through an index by hearing instance, so a membership change costs
        what the gone instances heard, not a pass over every node."""
        found = []
        for instance, names in self._hearing.items():
            if instance != self.instance and instance not in live:
                found += [n for n in names if (node := self.nodes.get(n)) and
                          node.heard_by == instance]  # fmt: skip
        return found

    def adopt(self, names: Iterable[str]) -> None:
        """Nodes this instance now owns whose hearing instance is gone (killed, or cut off
        from etcd): their liveness is this instance's from now on, so a node that stays
        silent is found lost after the usual limit and recovered by its new owner."""
        now = self.clock()
        self.apply(Observe(name, {"heard_by": self.instance, "last_report": now},
                           "the instance that heard it is gone") for name in names)  # fmt: skip

    def changed_elsewhere(self, kind: str, key: str, record: Record | None) -> None:
        """A record another instance wrote (the backend's ``on_change``): applied like any
        change and published on the feed, so every instance shows every node; nothing is
        written back (no echo). A deleted record tells nothing the puts around it do not."""
        if record is None or key not in self.nodes:
            return
        with self._remote():
            self._followed(kind, key, record)

    @contextmanager
    def _remote(self) -> Iterator[None]:
        self._following = True
        try:
            yield
        finally:
            self._following = False

    def _followed(self, kind: str, name: str, record: Record) -> None:
        node = self.nodes.get(name)
        if node is None:
            return
        if kind == OBSERVED:
            self.apply(observed.follow(node, record, self.instance))
        elif kind == TOKENS:
            self.apply(tokens.follow(node, record))
        elif (
            kind == BINDINGS
            and isinstance(mac := record.get("mac"), str)
            and self.identities.mac_of(node) != mac
        ):
            self.apply([Bind(name, mac, node.binding or {"mac": mac})])

    def _write_observed(self) -> None:
        """One record per node whose published fields changed (a cluster's backend only:
        a single server rebuilds them from the network). A heartbeat changes none."""
        if self._following or not self._dirty:
            self._dirty.clear()
            return
        for name in self._dirty:
            node = self.nodes.get(name)
            if node is None:
                continue
            record = observed.record(node)
            if self._sent.get(name) != record:
                self._sent[name] = record
                self.backend.put(OBSERVED, name, record)
        self._dirty.clear()

    def _put(self, kind: str, key: str, record: Record) -> None:
        if not self._following:
            self.backend.put(kind, key, record)

    def _node_effect(self, node: Node, effect: Effect) -> None:
        if isinstance(effect, Observe):
            self._observe(node, effect.fields, effect.why, effect.quiet)
        elif isinstance(effect, Mark):
            if node.boot is None:
                self._node_effect(node, NewBoot(node.name))
            assert node.boot is not None
            xids = node.boot.xids
            if effect.xid is not None and effect.xid not in xids and len(xids) < MAX_XIDS:
                node.boot.xids = xids | {effect.xid}
            if effect.phase not in node.boot.phases:
                node.boot.phases[effect.phase] = self.clock()
                self._changed(node)
                log.debug("%s: boot phase %s", node.name, effect.phase)
                self.feed.publish(node.name, "observed", {"phase": effect.phase})
        elif isinstance(effect, NewBoot):
            node.boot = Boot(started=self.clock(), firmware=effect.firmware)  # "boots" says it
            self._changed(node)
            how = effect.why or effect.firmware or "unknown firmware"
            self._observe(node, {"boots": node.boots + 1, "busy": Busy.UNKNOWN,
                                 "console_problem": None, "console_seen": frozenset(),
                                 "last_report": None}, effect.why)  # fmt: skip
            self._observe(node, {"run_state": RunState.BOOTING}, f"boot {node.boots} ({how})")
        elif isinstance(effect, Resume):  # read back at start: published quietly, not news
            resumed = bool(effect.digest and effect.boot_id)
            boot = Boot(
                self.clock(), token_digest=effect.digest, boot_id=effect.boot_id, resumed=resumed
            )
            self._observe(node, {"boot": boot, "boots": effect.boots}, "restarted", quiet=True)
        elif isinstance(effect, Token):
            assert node.boot is not None
            if node.boot.boot_id != effect.boot_id:
                self.feed.publish(node.name, "observed", {"boot_id": effect.boot_id})
            same_token = node.boot.token_digest == effect.digest  # a boot id learned under it
            node.boot.token_digest, node.boot.boot_id = effect.digest, effect.boot_id
            self._keep_token(node, amend=same_token)
        elif isinstance(effect, Bind):
            previous = self.identities.bind(node, effect.mac)
            if previous is not None and not self._following:
                self.backend.delete(BINDINGS, previous.name)
            self._put(BINDINGS, node.name, {"mac": effect.mac})
            self.unknown.forget(effect.mac)
            self._observe(node, {"mac": effect.mac, "conflict": None, "binding": effect.binding,
                                 "rebind_pending": None})  # fmt: skip

    def _observe(
        self, node: Node, fields: Mapping[str, Any], why: str = "", quiet: bool = False
    ) -> None:
        """Assign observed fields and publish what changed, once."""
        changed, before = {}, {}
        for key, value in fields.items():
            old = getattr(node, key)
            if old != value:
                setattr(node, key, value)
                changed[key], before[key] = value, old
        if not changed:
            return
        if "run_state" in changed:
            suffix = f": {why}" if why else ""
            log.info(
                "%s: run_state %s -> %s%s", node.name, before["run_state"], node.run_state, suffix
            )
        if "ip" in changed:
            self.identities.readdress(node, before["ip"])
        if "heard_by" in changed:
            self._heard(node.name, before["heard_by"], node.heard_by)
        if node.last_report is not None and "last_report" in changed:
            self.liveness.heard(node.name, node.last_report)
        if not quiet:
            self._changed(node)
        self.feed.publish(node.name, "observed", changed, why, quiet)

    def _heard(self, name: str, before: str | None, now: str | None) -> None:
        """Keep the index of nodes by hearing instance (heard_by_others)."""
        if before is not None and (names := self._hearing.get(before)) is not None:
            names.discard(name)
            if not names:
                del self._hearing[before]
        if now is not None:
            self._hearing.setdefault(now, set()).add(name)

    def _event(self, event: Event) -> None:
        """Logged too (a few lines a minute of the kinds the boot network can repeat)."""
        node, kind, message = event.node, event.kind, event.message
        level = logging.WARNING if kind in ("conflict", "rebind") else logging.INFO
        if kind in REPEATABLE_EVENTS:
            quiet.log(f"event {kind}", level, "%s: %s", node, message)
        else:
            log.log(level, "%s: %s", node, message)
        self.feed.publish(node, "event", {"event": kind}, message)

    def _changed(self, node: Node) -> None:
        if self.instance is not None:
            self._dirty.add(node.name)

    def _keep_token(self, node: Node, amend: bool = False) -> None:
        """Through the backend before the answer that depends on it is sent; a boot id
        learned under the token (``amend``) never reverts a token another instance issued
        meanwhile."""
        if self._following:
            return
        try:
            if amend:
                self.backend.amend(TOKENS, node.name, tokens.record(node))
            else:
                self.backend.put(TOKENS, node.name, tokens.record(node))
        except OSError as error:
            log.error("cannot save the boot token of %s: %s", node.name, error.strerror)

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
        """The node ``locate()`` will say this MAC is at this port, without binding."""
        return identity.who_is(self, mac, location)

    def alive(self, node: Node) -> bool:
        """Its own machine (the one bound to it) is reporting."""
        return identity.alive(self, node)

    def holds_token(self, name: str, token: str) -> bool:
        """Whether ``token`` is the current boot token of node ``name``."""
        node = self.nodes.get(name)
        return node is not None and tokens.holds(node, token)

    @property
    def lost_limit(self) -> float:
        return liveness.limit(self.config)

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
        self.apply([Observe(node.name, {"mac": mac})])

    def saw_address(self, node: Node, ip: IPv4Address | None, why: str = "") -> None:
        """The address a node uses (from its ProxyDHCP request or its agent); a node the
        file gives no address is found by it from now on."""
        self.apply([Observe(node.name, {"ip": ip}, why)])

    def saw_boot_request(self, node: Node, firmware: str, xid: int | None = None) -> None:
        """A DHCP DISCOVER from boot firmware (PXE or iPXE), of transaction ``xid``.

        It starts a new boot unless the node is still between firmware and script, as
        when UEFI PXE chain-loads iPXE, which asks again, or it is a retransmission of a
        DISCOVER this boot has seen (same xid: late, or answered slowly, after the agent's
        hello it would have replaced the boot and its token)."""
        boot = node.boot
        again = boot is not None and xid is not None and xid in boot.xids
        fresh = boot is None or Phase.SCRIPT in boot.phases or node.run_state != RunState.BOOTING
        new: list[Effect] = [NewBoot(node.name, firmware)] if fresh and not again else []
        self.apply([*new, Mark(node.name, Phase.DHCP_DISCOVER, xid)])

    def mark(self, node: Node, phase: Phase) -> None:
        self.apply([Mark(node.name, phase)])

    def issue_token(self, node: Node) -> str:
        """A fresh secret for this boot, handed out in the node's kernel command line."""
        token, effects = tokens.issue(node)
        self.apply(effects)
        return token

    def discovery_token(self, mac: str) -> str | None:
        """A token for the discovery boot of an unknown machine (None: not known)."""
        return self.unknown.issue_token(mac)

    def locate(
        self, mac: str, location: Location, source: str, chassis: str | None = None
    ) -> Node | None:
        """A machine seen at a switch port: the node it is (``identity.locate``)."""
        node, effects = identity.locate(self, mac, location, source, chassis)
        self.apply(effects)
        return node

    def bind(self, name: str, mac: str, operator: str) -> None:
        """An operator says which machine a node is: confirms a pending LLDP claim, or
        names new hardware where no trustworthy evidence can."""
        self.apply(identity.bind(self, self.nodes[name], mac, operator))

    def report(self, payload: Any) -> Ack:
        """An agent report (parsed JSON); raises ReportRejected saying why it is refused."""
        effects, outcome = reports.admit(self, payload)
        if self.instance is not None and isinstance(outcome, Ack):  # it reports here now
            effects.append(Observe(outcome.node, {"heard_by": self.instance}, "reports here"))
        self.apply(effects)
        if isinstance(outcome, ReportRejected):
            raise outcome
        return outcome

    def beat(self, name: str, seq: int, uptime: float) -> None:
        """A heartbeat that changes nothing (a datagram beat, ``services.beats``): recorded
        as a heartbeat report that changes nothing is."""
        heard = {"last_report": self.clock(), "agent_uptime": uptime, "agent_seq": seq}
        self.apply([Observe(name, heard, quiet=True)])

    # -- power, the console, and the engine's own conclusions ----------------------------

    def saw_power(self, name: str, state: PowerState | None, error: str | None = None) -> None:
        """A BMC poll or power action: the state, or the error that kept it from being read.
        A node removed by a reload while its BMC was being asked is no longer news."""
        node = self.nodes.get(name)
        if node is None:
            return
        if error is not None:
            if node.power_error != error:
                log.error("%s: %s", name, error)
            self.apply([Observe(name, {"power": PowerState.ERROR, "power_error": error}, error)])
            return
        assert state is not None
        if node.power == PowerState.HANG and state == PowerState.ON:
            self.apply([Observe(name, {"power_error": None})])  # "on" does not end a hang
            return
        if state == PowerState.OFF and node.run_state is not RunState.UNKNOWN:
            self.forget(node, "powered off")
        if node.power != state:
            log.info("%s: power %s -> %s", name, node.power, state)
        self.apply([Observe(name, {"power": state, "power_error": None})])

    def conclude(self, name: str, values: Mapping[str, str]) -> None:
        """The engine's own conclusions (a node hangs; a run state is forgotten on a power
        change; an activation failed), recorded like any observation."""
        node = self.nodes.get(name)
        if node is None:
            return
        if values.get("run") == RunState.UNKNOWN:
            self.forget(node, "forgotten on a power change")
        fields: dict[str, Any] = {
            VARIABLE_FIELDS[v]: value for v, value in values.items() if v != "run"
        }
        if "power" in fields:
            fields["power"] = PowerState(fields["power"])
            if fields["power"] != node.power:
                log.info("%s: power %s -> %s (concluded)", name, node.power, fields["power"])
        self.apply([Observe(name, fields, "concluded by the engine")])

    def forget(self, node: Node, why: str) -> None:
        """What can no longer be known after a power change: run state, busy, image."""
        self.apply([Observe(node.name, {"last_report": None, "busy": Busy.UNKNOWN,
                                        "image_state": ImageState.UNKNOWN, "image_digest": None,
                                        "image_error": None}, why),
                    Observe(node.name, {"run_state": RunState.UNKNOWN}, why)])  # fmt: skip

    def saw_console(self, name: str, kind: str, line: str) -> None:
        """A dying kernel's words on the node's console (``consoles.PROBLEMS``): quoted by
        explain; a panic makes a booting or running node lost at once (the engine then
        recovers it) instead of after missed heartbeats."""
        node = self.nodes.get(name)
        if node is None or kind in node.console_seen:  # each kind once a boot: no flood
            return
        said = f"{kind}: {line}"
        effects: list[Effect] = [
            Observe(name, {"console_seen": node.console_seen | {kind}, "console_problem": said},
                    "seen on the console"),
            Event(name, "console", f"console: {said}"),
        ]  # fmt: skip
        if kind in FATAL_ON_CONSOLE and node.run_state in (*liveness.ALIVE, RunState.BOOTING):
            effects.append(
                Observe(name, {"run_state": RunState.LOST}, f"kernel {kind} on the console")
            )
        self.apply(effects)

    def check_lost(self) -> None:
        """Nodes whose agent stopped reporting become lost (only overdue ones are read)."""
        overdue = self.liveness.overdue(self.nodes, self.clock(), self.lost_limit, self.instance)
        self.apply(overdue)
