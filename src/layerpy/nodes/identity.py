"""Which node a machine is: by the MAC the file gives, or by where it is plugged in.

A MAC learned from a node's location (LLDP or DHCP option 82) is a *binding*; bindings are
kept by the store's backend and win over the file's MAC. ``Identities`` indexes; the rules
below decide who a machine is and return effects, which the store applies.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Any

from layerpy.model import Node, RunState
from layerpy.nodes.effects import Bind, Effect, Event, Location, Machine, Observe, Store
from layerpy.proto.agent import Report

ALIVE = (RunState.INIT, RunState.READY)


class Identities:
    def __init__(self, bindings: dict[str, str]) -> None:
        self.bindings = bindings  # node -> MAC
        self._by_mac: dict[str, Node] = {}
        self._by_ip: dict[int, Node] = {}  # by int: IPv4Address hashes slowly
        self._by_location: dict[Location, Node] = {}

    def index(self, nodes: dict[str, Node]) -> None:
        """Rebuild the look-ups (at start and after a reload)."""
        self._by_mac = {mac: n for n in nodes.values() if (mac := self.mac_of(n))}
        self._by_ip = {int(ip): n for n in nodes.values() if (ip := n.config.ip or n.ip)}
        self._by_location = {n.config.location: n for n in nodes.values() if n.config.location}

    def add(self, node: Node) -> None:
        """A node the file added or changed (its keys win, as a later node's in `index`)."""
        for table, key in self._keys(node):
            table[key] = node

    def drop(self, node: Node) -> None:
        """A node the file removes or changes: out of the look-ups, by its config in force."""
        for table, key in self._keys(node):
            if table.get(key) is node:
                del table[key]

    def _keys(self, node: Node) -> list[tuple[dict[Any, Node], Any]]:
        """Each look-up table with the node's key in it (where it has one)."""
        ip = node.config.ip or node.ip
        keys = [
            (self._by_mac, self.mac_of(node)),
            (self._by_ip, int(ip) if ip else None),
            (self._by_location, node.config.location),
        ]
        return [(table, key) for table, key in keys if key]

    def mac_of(self, node: Node) -> str | None:
        return self.bindings.get(node.name) or node.config.mac

    def by_mac(self, mac: str) -> Node | None:
        return self._by_mac.get(mac)

    def by_ip(self, ip: IPv4Address | str) -> Node | None:
        try:
            return self._by_ip.get(int(IPv4Address(ip)))
        except ValueError:
            return None

    def readdress(self, node: Node, old: IPv4Address | None) -> None:
        """A node without an address in the file (proxy mode) showed a new one: node.ip."""
        if node.config.ip is not None:
            return
        if old is not None and self._by_ip.get(int(old)) is node:
            del self._by_ip[int(old)]
        if node.ip is not None:
            self._by_ip[int(node.ip)] = node

    def at(self, location: Location) -> Node | None:
        return self._by_location.get(location)

    def bind(self, node: Node, mac: str) -> Node | None:
        """``mac`` is ``node`` from now on; returns the node that had it before, if another."""
        previous = self._by_mac.get(mac)
        if previous is not None and previous is not node:
            self.bindings.pop(previous.name, None)
        old = self.mac_of(node)
        if old is not None and self._by_mac.get(old) is node:
            del self._by_mac[old]
        self.bindings[node.name] = mac
        self._by_mac[mac] = node
        return previous if previous is not node else None


# -- the rules -------------------------------------------------------------------------


def alive(store: Store, node: Node) -> bool:
    """Its own machine (the one bound to it) is reporting."""
    return node.run_state in ALIVE and node.mac == store.mac_of(node)


def held_by_another(store: Store, node: Node, mac: str) -> bool:
    current = store.mac_of(node)
    return current not in (None, mac) and alive(store, node)


def awaits_bind(store: Store, node: Node, mac: str) -> bool:
    """Under rebind = "confirm", a new machine where the node has one already is not the
    node until ``layerpy bind`` says so (a node without any machine yet is bound by its
    location, as under "auto")."""
    current = store.mac_of(node)
    return store.config.server.rebind == "confirm" and current not in (None, mac)


def who_is(store: Store, mac: str, location: Location) -> Node | None:
    """The node ``locate`` will say this MAC is at this port, without binding."""
    node = store.at(location)
    if node is None or held_by_another(store, node, mac) or awaits_bind(store, node, mac):
        return None
    return node


def locate(
    store: Store, mac: str, location: Location, source: str, chassis: str | None = None
) -> tuple[Node | None, list[Effect]]:
    """A machine seen at a switch port: the node it is, by where it is plugged in.

    A new MAC at a port takes the node over (new or replaced hardware), a MAC seen at
    another port follows the port, but a MAC at a port whose machine is alive and
    reporting is a conflict: neither takes the address from the other."""
    node = store.at(location)
    if node is None:
        return None, []
    where = f"{location[0]}:{location[1]}"
    now = store.clock()
    evidence = {
        "source": source,
        "switch": location[0],
        "port": location[1],
        "chassis": chassis,
        "mac": mac,
        "at": now,
    }
    effects: list[Effect] = []
    if store.mac_of(node) != mac:
        if held_by_another(store, node, mac):
            current = store.mac_of(node)
            message = f"{mac} claims {where}, where {current} is alive: not bound"
            if node.conflict != message:
                effects.append(Event(node.name, "conflict", message))
            owner = f"{where} belongs to {node.name} ({current}, alive)"
            return None, [
                *effects,
                Observe(node.name, {"conflict": message, "conflict_at": now}),
                Machine(mac, {"conflict": owner}),
            ]
        if awaits_bind(store, node, mac):
            return None, rebind_pending(store, node, mac, where, source)
        effects += bind(store, node, mac, source, where)
    elif node.conflict and now - (node.conflict_at or 0) > store.lost_limit:
        effects.append(Observe(node.name, {"conflict": None}))  # the other stopped claiming
    return node, [*effects, Observe(node.name, {"location": evidence})]


def rebind_pending(store: Store, node: Node, mac: str, where: str, source: str) -> list[Effect]:
    """New hardware at a node's location under rebind = "confirm": shown on the node
    (explain), as an event, and on the machine (``/api/v1/unknown``), once per MAC."""
    if node.rebind_pending is not None and node.rebind_pending["mac"] == mac:
        return []
    message = (
        f"{mac} at {where} ({source}) would replace {store.mac_of(node)}: not bound until "
        f'`layerpy bind {node.name} {mac}` (rebind = "confirm")'
    )
    pending = {"mac": mac, "where": where, "source": source, "at": store.clock()}
    return [
        Event(node.name, "rebind", message),
        Machine(mac, {"claim": message}),
        Observe(node.name, {"rebind_pending": pending}, f"{mac} waits for layerpy bind"),
    ]


def bind(store: Store, node: Node, mac: str, source: str, where: str | None = None) -> list[Effect]:
    """``mac`` is ``node`` from now on; one event says why: the switch port it was seen at
    (``where``) by ``source``, or who said so."""
    current = store.mac_of(node)
    if current == mac:
        return []
    effects: list[Effect] = []
    previous = store.by_mac(mac)
    if previous is not None and previous is not node:
        moved = f"{mac} moved from {previous.name} to {node.name} ({where or source})"
        effects.append(Event(previous.name, "moved", moved))
    if current:
        how = f"at {where} ({source})" if where else f"by {source}"
        effects.append(Event(node.name, "replaced", f"hardware replaced {how}: {current} -> {mac}"))
    else:
        how = f"by its location {where} ({source})" if where else f"by {source}"
        effects.append(Event(node.name, "bound", f"{mac} is {node.name} {how}"))
    binding = {"mac": mac, "previous": current, "how": how, "at": store.clock()}
    return [*effects, Bind(node.name, mac, binding)]


def lldp_node(store: Store, report: Report) -> tuple[Node | None, list[Effect]]:
    """The node at the port the agent's LLDP neighbour names, bound to the reporting MAC
    where the identity policy lets an agent's word count; otherwise None, and a claim that
    can bind no one yet is shown for an operator to confirm (``layerpy bind``)."""
    policy = store.config.server.identity
    if report.lldp is None or policy == "mac":
        return None, []
    chassis = report.lldp.chassis_id.lower()
    switches = store.config.switches.values()
    switch = next((s.name for s in switches if s.chassis_id == chassis), None)
    node = None if switch is None else store.at((switch, report.lldp.port_id))
    if switch is None or node is None:
        return None, []
    location = (switch, report.lldp.port_id)
    if policy == "location-trusted" or store.mac_of(node) == report.mac:
        return locate(store, report.mac, location, "lldp", chassis)
    return None, claimed(store, node, report.mac, location)


def claimed(store: Store, node: Node, mac: str, location: Location) -> list[Effect]:
    """An LLDP claim the policy does not take on the agent's word alone."""
    where = f"{location[0]}:{location[1]}"
    message = (
        f"{mac} says it is at {where} (LLDP), unconfirmed: a relay's option 82 or "
        f"`layerpy bind {node.name} {mac}` binds it"
    )
    machine = store.unknown.get(mac)
    if machine is None or machine.claim == message:
        return []
    return [Machine(mac, {"claim": message}), Event(node.name, "claim", message)]
