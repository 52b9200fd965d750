"""DHCP's fast path: the common requests answered from prepared replies and O(1) tables.

The reference path (``DhcpService.handle``: decode, policy's verdict, the RFC core, apply,
encode) answers every request it is given, and stays the one that decides: this path only
repeats what it did. Each OFFER or ACK the reference path gives a known node, or a client
of the discovery pool, is kept as a template (``proto/prepared.py``) under the request's
shape, the sender (for a relayed request) and, for a node, its MAC. A later DISCOVER or
REQUEST of the same shape is then scanned, not decoded; its answer is the template with the
client's own values patched in, and the same effects go through the same
``BootPolicy.apply`` before it is sent (a lease is journalled before the answer that
promises it). Anything else (another message type, a NAK, a withdrawal, an address the
client may not have, a relay's option 82, a shape not seen yet) is the reference path's.
``tests/fuzz/test_fuzz_dhcp_fast.py`` feeds both paths the same requests and requires the same
bytes and the same effects.

What a template depends on is the node file (all of them are forgotten when it changes),
the machine's node (checked each time: a MAC may be bound to another), and for the pool
the lease table, asked each time. One server only: a cluster's pool is kept in etcd
before an answer, which the reference path does.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address
from socket import inet_ntoa
from typing import Protocol

from layerpy.boot import Booter, Verdict
from layerpy.proto.dhcp import (
    ACK,
    CLIENT_PORT,
    DISCOVER,
    OFFER,
    REQUEST,
    SERVER_PORT,
    DhcpPacket,
    encode,
)
from layerpy.proto.dhcp_server import Action, Decision, Effect
from layerpy.proto.prepared import NOWHERE, Scan, Template, render, scan, template

SHAPES = 1024
"""Pool templates kept at most (one per shape and relay: a few per kind of firmware)."""
PER_NODE = 4
"""Templates kept per node of the file on average (firmware, iPXE, the OS), before all
are forgotten and made again: a flood of odd shapes costs memory in proportion to the file."""
BROADCAST = ("255.255.255.255", CLIENT_PORT)
_ANSWER = {OFFER: "offer", ACK: "ack"}
_NAMES = {DISCOVER: "discover", REQUEST: "request"}


class Service(Protocol):
    """What of the DHCP service (services/dhcp.py) this path uses: the same upkeep, sending,
    counting and failure handling as the reference path."""

    def tick(self) -> None: ...
    def deliver(self, reply: bytes, destination: tuple[str, int]) -> None: ...
    def answered(self, kind: str, mac: str, started: float, answer: str) -> None: ...
    def failed(self, kind: str, mac: str, started: float, error: Exception) -> None: ...


Known = tuple[str, Template, str, "str | None", str, bool, bytes]
"""A known node's prepared answer to one shape of request: the node's name, the template,
its firmware and vendor class, why (for the verdict), whether its DISCOVER is a boot
request (boot firmware, not an OS), and its address, packed. A plain tuple of strings,
bytes and ints, which the garbage collector stops tracking (proto/prepared.py)."""


@dataclass(frozen=True, slots=True)
class Pooled:
    """The discovery pool's prepared answer to one shape of request, but for the address."""

    template: Template
    firmware: str
    vendor: str | None
    why: str
    lease_time: int


class FastPath:
    """Prepared answers of one DHCP service (authoritative, one server)."""

    def __init__(self, service: Service, policy: Booter) -> None:
        self.service, self.policy = service, policy
        self._config: object = None  # the node file the templates were made from
        self._known: dict[tuple[bytes, str, str], Known] = {}  # (shape, relay, MAC)
        self._pooled: dict[tuple[bytes, str], Pooled] = {}  # (shape, relay)
        # one copy of each shape and template part, however many nodes share it: a 100 000
        # node file's templates are mostly the same but for a few bytes
        self._interned: dict[bytes, bytes] = {}
        self._server = b""  # our server identifier, packed
        self._mask = self._network = 0  # the subnet, as ints
        self.hits = 0  # requests answered here

    def _follow(self) -> None:
        """Forget every template when the node file changed (a reload)."""
        config = self.policy.config
        if config is self._config:
            return
        self._config = config
        self._known.clear()
        self._pooled.clear()
        self._interned.clear()
        self._server = config.server.address.packed
        subnet = config.network.subnet
        self._mask, self._network = int(subnet.netmask), int(subnet.network_address)

    def answer(self, data: bytes, sender: tuple[str, int], started: float) -> bool:
        """Answer the datagram from a template, applied, sent and counted as the reference
        path would; False (nothing done but the booter's upkeep) when it has none."""
        found = scan(data)
        if found is None:
            return False
        service, policy = self.service, self.policy
        self._follow()
        service.tick()
        mac, relay = found.mac, sender[0] if found.relayed else ""
        node = policy.machine(mac)
        if node is not None:
            known = self._known.get((found.shape, relay, mac))
            if known is None or known[0] != node.name:
                return False  # not prepared, or the MAC is another node's now
            made, firmware, vendor, why, boots, packed = known[1:]
            address, lease_time = IPv4Address(packed), 0
        else:
            pooled, table = self._pooled.get((found.shape, relay)), policy.leases
            if pooled is None or table is None:
                return False
            asked = found.requested or (found.ciaddr if found.ciaddr != NOWHERE else None)
            candidate = table.candidate(mac, IPv4Address(asked) if asked else None)
            if candidate is None:
                return False
            made, firmware, vendor, why = (pooled.template, pooled.firmware, pooled.vendor,
                                           pooled.why)  # fmt: skip
            address, packed, boots = candidate, candidate.packed, False
            lease_time = pooled.lease_time
        kind = found.kind
        if kind == REQUEST and self._confirmed(found) != packed:
            return False  # a NAK, a withdrawal or silence: the reference path's
        reply_kind = ACK if kind == REQUEST else OFFER
        xid = data[4:8]
        reply = render(made, reply_kind, xid, found.ciaddr, packed, data[28:44], found.echo)
        if reply is None:
            return False
        from_pool = node is None
        if kind == DISCOVER:
            effects = (Effect(Action.OFFERED, mac, address, from_pool),)
            if from_pool:
                effects = (*effects, Effect(Action.HOLD, mac, address, True))
        else:
            effects = (Effect(Action.ACKED, mac, address, from_pool),)
            if from_pool:
                effects = (Effect(Action.COMMIT, mac, address, True, lease_time), *effects)
        # what the request showed, for apply(), which reads nothing else: the grant is
        # not made again (the template is its answer, the effects carry its address)
        verdict = Verdict(mac, firmware, vendor, node, None, boots and kind == DISCOVER, None,
                          why, xid=int.from_bytes(xid))  # fmt: skip
        name = _NAMES[kind]
        try:
            policy.apply(verdict, effects)  # kept before it is promised
        except Exception as error:
            service.failed(name, mac, started, error)
            return True
        if found.relayed:
            destination: tuple[str, int] = (inet_ntoa(data[24:28]), SERVER_PORT)
        elif found.ciaddr != NOWHERE:
            destination = (inet_ntoa(found.ciaddr), CLIENT_PORT)
        else:
            destination = BROADCAST
        self.hits += 1
        service.deliver(reply, destination)
        service.answered(name, mac, started, _ANSWER[reply_kind])
        return True

    def _confirmed(self, found: Scan) -> bytes | None:
        """The address a REQUEST asks to be confirmed in, as dhcp_server decides it (None:
        it is not to be ACKed from a template: not ours, or off the subnet)."""
        if found.server_id is not None:
            if found.server_id != self._server:
                return None
            wanted = found.requested
        elif found.ciaddr != NOWHERE:
            wanted = found.ciaddr
        else:
            wanted = found.requested
        if wanted is None or int.from_bytes(wanted) & self._mask != self._network:
            return None
        return wanted

    def learn(
        self,
        data: bytes,
        sender: tuple[str, int],
        request: DhcpPacket,
        verdict: Verdict,
        decision: Decision,
    ) -> None:
        """Keep the reference path's answer to `request` as a template, if it is an OFFER
        or ACK that every request of its shape gets, and the template gives the very bytes
        that were sent."""
        reply, grant = decision.reply, verdict.grant
        if reply is None or grant is None or reply.message_type not in _ANSWER:
            return
        if not self.policy.lasting(verdict):
            return
        found = scan(data)
        if found is None:
            return
        self._follow()
        made = template(request, reply, grant.offer)
        if made is None:
            return
        keep = self._interned.setdefault
        head, flags, yiaddr, middle, body, options, size, limit = made
        made = (keep(head, head), keep(flags, flags), yiaddr, keep(middle, middle),
                keep(body, body), options, size, limit)  # fmt: skip
        proof = render(made, reply.message_type, data[4:8], found.ciaddr, reply.yiaddr.packed,
                       data[28:44], found.echo)  # fmt: skip
        if proof != encode(reply):
            return
        relay, mac = sender[0] if found.relayed else "", found.mac
        shape = keep(found.shape, found.shape)
        if grant.pooled:
            if len(self._pooled) >= SHAPES:
                self._pooled.clear()
                self._interned.clear()
            self._pooled[shape, relay] = Pooled(
                made, verdict.firmware, verdict.vendor_class, verdict.why, grant.offer.lease_time
            )
            return
        node = verdict.node
        assert node is not None  # a grant that is not the pool's is a node's
        if len(self._known) >= PER_NODE * len(self.policy.config.nodes) + SHAPES:
            self._known.clear()
            self._interned.clear()
        self._known[shape, relay, mac] = (
            node.name, made, verdict.firmware, verdict.vendor_class, verdict.why,
            verdict.firmware != "os", grant.address.packed,
        )  # fmt: skip
