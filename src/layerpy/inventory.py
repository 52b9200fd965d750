"""The one place for observed node state: services report here, the API reads here.

Run state moves unknown → booting (DHCP from boot firmware) → init (agent hello) →
ready (agent reporting) → lost (missed reports). Boot tokens are kept in the state
directory, so a restarted server still recognises the agents of the nodes it booted.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Any

from layerpy.config import Config
from layerpy.model import Boot, Node, RunState

log = logging.getLogger("layerpy.nodes")

DISCOVERY = "discover"  # the node name a machine no node claims boots under
IMAGE_STATES = ("none", "pulling", "active", "updating", "error")
REPORT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "node": str,
    "token": str,
    "mac": str,
    "ip": str,
    "boot_id": str,
    "seq": int,
    "event": str,
}


@dataclass
class UnknownMachine:
    """A MAC that asked for a boot but matches no node in the file."""

    mac: str
    first_seen: float
    last_seen: float
    requests: int = 1
    firmware: str | None = None
    vendor_class: str | None = None
    conflict: str | None = None
    token: str | None = field(default=None, repr=False)  # its discovery boot's

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "token"}


def _text(value: Any) -> str | None:
    return value[:500] if isinstance(value, str) else None


def _ignore(node: Node) -> None:
    """The default change hook: nobody listens."""


def _nothing(node: Node) -> dict[str, Any]:
    """The default instructions for an agent: none beyond the heartbeat."""
    return {}


class ReportRejected(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class Inventory:
    config: Config
    clock: Callable[[], float] = time.time
    nodes: dict[str, Node] = field(init=False)
    unknown: dict[str, UnknownMachine] = field(default_factory=dict, init=False)
    on_change: Callable[[Node], None] = field(default_factory=lambda: _ignore, init=False)
    instructions: Callable[[Node], dict[str, Any]] = field(
        default_factory=lambda: _nothing, init=False
    )

    def __post_init__(self) -> None:
        self.nodes = {name: Node(cfg) for name, cfg in self.config.nodes.items()}
        self.bindings: dict[str, str] = self._read_state("bindings.json")
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self._index()
        self._load_tokens()

    def _index(self) -> None:
        """MAC, address and location look-ups; a MAC bound by location wins over the file's."""
        self._by_mac = {}
        for node in self.nodes.values():
            mac = self.bindings.get(node.name) or node.config.mac
            if mac:
                self._by_mac[mac] = node
        self._by_ip = {n.config.ip: n for n in self.nodes.values()}
        self._by_location = {n.config.location: n for n in self.nodes.values() if n.config.location}

    def apply(self, config: Config) -> tuple[set[str], set[str], set[str]]:
        """Take a new, already validated node file; observed state of kept nodes stays.

        Returns the names added, removed and changed."""
        old = self.nodes
        added = set(config.nodes) - set(old)
        removed = set(old) - set(config.nodes)
        changed = {n for n in set(old) & set(config.nodes) if old[n].config != config.nodes[n]}
        self.nodes = {}
        for name, node_config in config.nodes.items():
            node = old.get(name) or Node(node_config)
            node.config = node_config
            self.nodes[name] = node
        self.config = config
        self._index()
        for mac in [mac for mac in self.unknown if mac in self._by_mac]:
            del self.unknown[mac]
        return added, removed, changed

    # -- lookups -----------------------------------------------------------------------

    def by_mac(self, mac: str) -> Node | None:
        return self._by_mac.get(mac)

    def mac_of(self, node: Node) -> str | None:
        return self.bindings.get(node.name) or node.config.mac

    def event(self, node: str, kind: str, message: str) -> None:
        """Something an operator should see later (``GET /api/v1/events``), also logged."""
        self.events.append({"time": self.clock(), "node": node, "kind": kind, "message": message})
        log.warning("%s: %s", node, message) if kind == "conflict" else log.info(
            "%s: %s", node, message
        )

    def locate(
        self, mac: str, location: tuple[str, str], source: str, chassis: str | None = None
    ) -> Node | None:
        """A machine seen at a switch port: the node it is, by where it is plugged in.

        A new MAC at a port takes the node over (new or replaced hardware), a MAC seen at
        another port follows the port, but a MAC at a port whose machine is alive and
        reporting is a conflict: neither takes the address from the other."""
        node = self._by_location.get(location)
        where = f"{location[0]}:{location[1]}"
        if node is None:
            return None
        evidence = {"source": source, "switch": location[0], "port": location[1],
                    "chassis": chassis, "mac": mac, "at": self.clock()}  # fmt: skip
        current = self.mac_of(node)
        if current != mac:
            if current and self._alive(node):
                message = f"{mac} claims {where}, where {current} is alive: not bound"
                if node.conflict != message:
                    self.event(node.name, "conflict", message)
                node.conflict, node.conflict_at = message, self.clock()
                self.unknown.setdefault(mac, UnknownMachine(mac, self.clock(), self.clock()))
                self.unknown[mac].conflict = f"{where} belongs to {node.name} ({current}, alive)"
                return None
            previous = self._by_mac.get(mac)
            if previous is not None and previous is not node:
                self.bindings.pop(previous.name, None)
                self.event(
                    previous.name,
                    "moved",
                    f"{mac} moved from {previous.name} to {node.name} ({where})",
                )
            if current:
                self.event(
                    node.name, "replaced", f"hardware replaced at {where}: {current} -> {mac}"
                )
            else:
                self.event(
                    node.name, "bound", f"{mac} is {node.name} by its location {where} ({source})"
                )
            self.bindings[node.name] = mac
            self._write_state("bindings.json", self.bindings)
            self._index()
            node.mac = mac
            self.unknown.pop(mac, None)
            node.conflict = None
        elif node.conflict and self.clock() - (node.conflict_at or 0) > self._lost_limit:
            node.conflict = None  # the other machine stopped claiming the location
        node.location = evidence
        return node

    def _alive(self, node: Node) -> bool:
        return node.run_state in (RunState.INIT, RunState.READY) and node.mac == self.mac_of(node)

    def by_ip(self, ip: IPv4Address | str) -> Node | None:
        try:
            return self._by_ip.get(IPv4Address(ip))
        except ValueError:
            return None

    # -- observations from the boot services -------------------------------------------

    def saw_unknown(self, mac: str, firmware: str | None, vendor_class: str | None) -> None:
        now = self.clock()
        machine = self.unknown.get(mac)
        if machine is None:
            self.unknown[mac] = UnknownMachine(mac, now, now, 1, firmware, vendor_class)
            log.warning("%s: unknown machine asks to boot (%s); it gets no offer", mac, firmware)
            return
        machine.last_seen = now
        machine.requests += 1

    def saw_mac(self, node: Node, mac: str) -> None:
        """The MAC a node's DHCP requests come from."""
        node.mac = mac

    def saw_boot_request(self, node: Node, firmware: str) -> None:
        """A DHCP DISCOVER from boot firmware (PXE or iPXE).

        It starts a new boot unless the node is still between firmware and script, as
        when UEFI PXE chain-loads iPXE, which asks again."""
        boot = node.boot
        if boot is None or "script" in boot.phases or node.run_state != RunState.BOOTING:
            self._start_boot(node, firmware)
        self.mark(node, "dhcp_discover")

    def mark(self, node: Node, phase: str) -> None:
        if node.boot is None:
            self._start_boot(node, None)
        assert node.boot is not None
        if node.boot.mark(phase, self.clock()):
            log.debug("%s: boot phase %s", node.name, phase)

    def issue_token(self, node: Node) -> str:
        """A fresh secret for this boot, handed out in the node's kernel command line."""
        if node.boot is None or "script" in node.boot.phases:
            self._start_boot(node, None)
        assert node.boot is not None
        node.boot.token = secrets.token_urlsafe(18)
        self.mark(node, "script")
        self._save_tokens()
        return node.boot.token

    def report(self, payload: Any) -> dict[str, Any]:
        """An agent report; returns the desired state for the agent or raises ReportRejected."""
        if isinstance(payload, dict) and payload.get("node") == DISCOVERY:
            return self._discovery_report(payload)
        node = self._authenticate(payload)
        located = self._lldp_node(payload)
        if located is not None and located is not node:  # the machine moved to another port
            return self._hand_over(located)
        boot = node.boot
        assert boot is not None
        now = self.clock()
        if boot.boot_id and payload["boot_id"] != boot.boot_id:
            log.info("%s: agent reports a new boot id without a network boot", node.name)
            token = boot.token
            boot = self._start_boot(node, None)
            boot.token = token
        if boot.boot_id is None:
            boot.boot_id = payload["boot_id"]
            self._save_tokens()
        node.last_report = now
        node.mac = payload["mac"].lower()
        node.hostname = (
            payload.get("hostname") if isinstance(payload.get("hostname"), str) else None
        )
        changed = self._agent_facts(node, payload)
        node.agent = {
            k: payload[k]
            for k in ("uptime", "seq", "busy", "agent_version", "timeline")
            if k in payload
        }
        try:
            node.ip = IPv4Address(payload["ip"])
        except ValueError:
            node.ip = None
        before = node.run_state
        if before in (RunState.INIT, RunState.READY, RunState.LOST) and payload["event"] != "hello":
            self.mark(node, "ready")
            self._set_state(node, RunState.READY)
        else:
            self.mark(node, "agent_hello")
            self._set_state(node, RunState.INIT)
        if changed and node.run_state == before:
            self.on_change(node)  # a new run state has told the listeners already
        answer = {"heartbeat": self.config.server.heartbeat, "node": node.name}
        return answer | self.instructions(node)

    def _agent_facts(self, node: Node, payload: dict[str, Any]) -> bool:
        """Busy and image state from a report; True when one of them changed."""
        busy = "busy" if payload.get("busy") is True else "free"
        state = payload.get("image_state")
        image = (
            state if state in IMAGE_STATES else "none",
            _text(payload.get("image_digest")),
            _text(payload.get("image_error")),
        )
        if busy != node.busy:
            log.info("%s: %s", node.name, busy)
        if image != (node.image_state, node.image_digest, node.image_error):
            reason = f": {image[2]}" if image[2] else ""
            log.info("%s: image %s %s%s", node.name, image[0], (image[1] or "-")[:19], reason)
        changed = (busy, *image) != (
            node.busy,
            node.image_state,
            node.image_digest,
            node.image_error,
        )
        node.busy = busy
        node.image_state, node.image_digest, node.image_error = image
        return changed

    def _discovery_report(self, payload: dict[str, Any]) -> dict[str, Any]:
        """A machine booted from the pool: once its LLDP neighbour names a node's port, it
        becomes that node (its agent switches identity and address without a reboot)."""
        for key, kind in REPORT_FIELDS.items():
            if not isinstance(payload.get(key), kind):
                raise ReportRejected(400, f"report field {key!r} is missing or not {kind.__name__}")
        mac = payload["mac"].lower()
        machine = self.unknown.get(mac)
        if (
            machine is None
            or not machine.token
            or not secrets.compare_digest(machine.token, payload["token"])
        ):
            raise ReportRejected(403, f"wrong discovery token for {mac}")
        machine.last_seen = self.clock()
        node = self._lldp_node(payload)
        if node is None:
            return {"heartbeat": self.config.server.heartbeat, "node": DISCOVERY}
        return self._hand_over(node)

    def _lldp_node(self, payload: dict[str, Any]) -> Node | None:
        """The node at the port the agent's LLDP neighbour names, bound to the reporting MAC."""
        lldp = payload.get("lldp")
        if not isinstance(lldp, dict) or not all(
            isinstance(lldp.get(k), str) for k in ("chassis_id", "port_id")
        ):
            return None
        chassis = lldp["chassis_id"].lower()
        switch = next(
            (s.name for s in self.config.switches.values() if s.chassis_id == chassis), None
        )
        if switch is None:
            return None
        return self.locate(payload["mac"].lower(), (switch, lldp["port_id"]), "lldp", chassis)

    def _hand_over(self, node: Node) -> dict[str, Any]:
        """Tell an agent to carry on as `node`: a new boot of that node, with its own token."""
        boot = self._start_boot(node, "identity by location")
        boot.token = secrets.token_urlsafe(18)
        self._save_tokens()
        identity = {"node": node.name, "token": boot.token}
        return {"heartbeat": self.config.server.heartbeat, "node": node.name, "identity": identity}

    def forget(self, node: Node, why: str) -> None:
        """What can no longer be known after a power change: run state, busy, image."""
        node.busy = node.image_state = "unknown"
        node.image_digest = node.image_error = None
        node.last_report = None
        self._set_state(node, RunState.UNKNOWN, why)

    @property
    def _lost_limit(self) -> float:
        return self.config.server.heartbeat * self.config.server.lost_after

    def check_lost(self) -> None:
        """Nodes whose agent stopped reporting become lost."""
        limit = self._lost_limit
        now = self.clock()
        for node in self.nodes.values():
            if node.run_state not in (RunState.INIT, RunState.READY) or node.last_report is None:
                continue
            silence = now - node.last_report
            if silence > limit:
                self._set_state(node, RunState.LOST, f"no report for {silence:.0f} s")

    # -- internals ---------------------------------------------------------------------

    def _authenticate(self, payload: Any) -> Node:
        if not isinstance(payload, dict):
            raise ReportRejected(400, "report must be a JSON object")
        for key, kind in REPORT_FIELDS.items():
            if not isinstance(payload.get(key), kind):
                raise ReportRejected(400, f"report field {key!r} is missing or not {kind.__name__}")
        node = self.nodes.get(payload["node"])
        if node is None:
            raise ReportRejected(404, f"no node named {payload['node']!r} in the node file")
        token = node.boot.token if node.boot else None
        if token is None or not secrets.compare_digest(token, payload["token"]):
            raise ReportRejected(403, f"wrong boot token for {node.name}")
        return node

    def _start_boot(self, node: Node, firmware: str | None) -> Boot:
        node.boot = Boot(started=self.clock(), firmware=firmware)
        node.boots += 1
        node.last_report = None
        node.busy = "unknown"
        self._set_state(
            node, RunState.BOOTING, f"boot {node.boots} ({firmware or 'unknown firmware'})"
        )
        return node.boot

    def _set_state(self, node: Node, state: RunState, why: str = "") -> None:
        if node.run_state == state:
            return
        suffix = f": {why}" if why else ""
        log.info("%s: run_state %s -> %s%s", node.name, node.run_state, state, suffix)
        node.run_state = state
        self.on_change(node)

    def _save_tokens(self) -> None:
        records = {
            n.name: {"token": n.boot.token, "boot_id": n.boot.boot_id, "boots": n.boots}
            for n in self.nodes.values()
            if n.boot and n.boot.token
        }
        self._write_state("boots.json", records)

    def _write_state(self, name: str, records: dict[str, Any]) -> None:
        """Atomically, so a crash leaves the old file or the new one, never half of one."""
        path = self.config.server.state_dir / name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(records, indent=1))
            os.replace(tmp, path)
        except OSError as error:
            log.error("cannot save %s: %s", path, error.strerror)

    def _read_state(self, name: str) -> dict[str, Any]:
        path = self.config.server.state_dir / name
        try:
            records = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            log.error("ignoring unreadable %s: %s", path, error)
            return {}
        return records if isinstance(records, dict) else {}

    def _load_tokens(self) -> None:
        for name, record in self._read_state("boots.json").items():
            node = self.nodes.get(name)
            if node is None or not isinstance(record, dict):
                continue
            node.boot = Boot(
                started=self.clock(), token=record.get("token"), boot_id=record.get("boot_id")
            )
            node.boots = int(record.get("boots", 0))
