"""Which node a machine is: by the MAC the file gives, or by where it is plugged in.

A MAC learned from a node's location (LLDP or DHCP option 82) is a *binding*; bindings are
kept in ``bindings.json`` and win over the file's MAC. This module only indexes and
remembers; the node store decides when a binding changes.
"""

from __future__ import annotations

from ipaddress import IPv4Address
from typing import Any

from layerpy.model import Node
from layerpy.nodes.files import StateFiles

BINDINGS = "bindings.json"

Location = tuple[str, str]  # (switch, port)


class Identities:
    def __init__(self, files: StateFiles) -> None:
        self.files = files
        self.bindings: dict[str, str] = {
            node: mac for node, mac in files.read(BINDINGS).items() if isinstance(mac, str)
        }
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
        self.files.write(BINDINGS, self.bindings)
        return previous if previous is not node else None
