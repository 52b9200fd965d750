"""The DHCP server's RFC 2131 rules, sans I/O: one decoded request in, one Decision out.

Policy says what a client deserves (a :class:`Grant`, or None for nobody we serve); this
module says what the protocol makes of it: OFFER, ACK, NAK or silence (with the reason),
where the reply goes, and which effects the caller must apply afterwards (hold or commit
a pool lease, withdraw, release, decline, note the ACK). Deciding writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network

from layerpy.proto.dhcp import (
    ACK,
    ANY,
    BROADCAST_FLAG,
    DECLINE,
    DISCOVER,
    INFORM,
    NAK,
    OFFER,
    OPT_MESSAGE_TYPE,
    RELEASE,
    REQUEST,
    DhcpPacket,
    Offer,
    build_nak,
    build_reply,
    reply_destination,
)

BOOTREQUEST = 1


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    """Who answers: the server identifier it sends, and the one subnet it hands out."""

    address: IPv4Address
    subnet: IPv4Network
    _mask: int = field(init=False, repr=False, compare=False)
    _network: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_mask", int(self.subnet.netmask))
        object.__setattr__(self, "_network", int(self.subnet.network_address))

    def covers(self, address: IPv4Address) -> bool:
        """`address in subnet` in ints: IPv4Network's own test runs in Python, twice a DORA."""
        return int(address) & self._mask == self._network


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
# 3.5x the cost, and DHCP makes one of these per packet
@dataclass(slots=True)
class Grant:
    """Policy's answer for one client: its address and options, and whether the address
    is a pool lease (held, committed, released, declined) rather than a fixed one."""

    offer: Offer
    pooled: bool = False

    @property
    def address(self) -> IPv4Address:
        return self.offer.address


class Action(StrEnum):
    OFFERED = "offered"  # an OFFER went out (boot firmware's: a boot of the node starts)
    HOLD = "hold"  # pool: keep the offered address for this client until its REQUEST
    COMMIT = "commit"  # pool: the client took the address for lease_time seconds
    WITHDRAW = "withdraw"  # pool: the client chose another server; free the held offer
    RELEASE = "release"  # the client gave the address back
    DECLINE = "decline"  # the client found the address in use by another host
    ACKED = "acked"  # an ACK for a lease went out (the boot timeline notes it)
    LEARNED = "learned"  # proxy: the client showed the address the site's server gave it


@dataclass(slots=True)
class Effect:
    """A write the caller owes once the reply (if any) is sent."""

    action: Action
    client: str
    address: IPv4Address
    pooled: bool
    lease_time: int = 0


_ANSWERS = {OFFER: "offer", ACK: "ack", NAK: "nak"}


@dataclass(slots=True)
class Decision:
    """The reply and where it goes (both None when silent), why, and what to apply."""

    reply: DhcpPacket | None
    destination: tuple[str, int] | None
    reason: str
    effects: tuple[Effect, ...] = ()
    routine: bool = False  # a silence that is the protocol's normal course, not news

    @property
    def answer(self) -> str:
        """``offer``, ``ack``, ``nak``, or ``silent`` (also for a RELEASE or DECLINE taken)."""
        kind = self.reply.message_type if self.reply is not None else None
        return _ANSWERS.get(kind or 0, "silent")


def screen(request: DhcpPacket) -> str | None:
    """Why a datagram is no client's message to a server, or None when it is one: asked
    before policy, so that stray replies and plain BOOTP are not taken for machines."""
    if request.op != BOOTREQUEST:
        return "not a BOOTREQUEST"
    if request.message_type not in _HANDLERS:
        return f"DHCP message type {request.message_type} is not for a server"
    return None


def decide(request: DhcpPacket, server: ServerIdentity, grant: Grant | None) -> Decision:
    """What RFC 2131 section 4.3 makes of this request, given what policy grants."""
    refused = screen(request)
    if refused is not None:
        return _silent(refused)
    if not request.giaddr.is_unspecified and not server.covers(request.giaddr):
        return _silent(f"relayed by {request.giaddr}, outside {server.subnet}")
    return _HANDLERS[request.message_type or 0](request, server, grant)


def _discover(request: DhcpPacket, server: ServerIdentity, grant: Grant | None) -> Decision:
    if grant is None:
        return _silent("no address for this client")
    effects = (_effect(Action.OFFERED, request, grant),)
    if grant.pooled:
        effects = (*effects, _effect(Action.HOLD, request, grant))
    return _reply(request, build_reply(request, grant.offer), f"offer {grant.address}", effects)


def _request(request: DhcpPacket, server: ServerIdentity, grant: Grant | None) -> Decision:
    """SELECTING names a server; INIT-REBOOT names only the address it wants; RENEWING
    (unicast) and REBINDING (broadcast) carry it in ciaddr and get the same treatment."""
    chosen, requested = request.server_id, request.requested_ip
    if chosen is not None:
        if chosen != server.address:
            withdraw = (_effect(Action.WITHDRAW, request, grant),) if grant and grant.pooled else ()
            return _silent(f"selecting {chosen}'s offer", withdraw)
        if requested is None:
            return _silent("selecting without a requested address (option 50)")
        return _confirm(request, server, grant, requested, "selecting")
    if not request.ciaddr.is_unspecified:
        return _confirm(request, server, grant, request.ciaddr, "renewing/rebinding")
    if requested is not None:
        return _confirm(request, server, grant, requested, "init-reboot")
    return _silent("REQUEST names no address (no ciaddr, no option 50)")


def _confirm(
    request: DhcpPacket,
    server: ServerIdentity,
    grant: Grant | None,
    wanted: IPv4Address,
    state: str,
) -> Decision:
    """ACK the address the client wants if it is the one it should have, else NAK; a client
    we have no record of gets silence, unless it is answering our own offer."""
    if grant is None:
        if state == "selecting":
            return _nak(request, server, f"{state}: no lease for this client any more")
        return _silent(f"{state}: no record of this client")
    if not server.covers(wanted):
        return _nak(request, server, f"{state}: {wanted} is not on {server.subnet}")
    if wanted != grant.address:
        return _nak(request, server, f"{state}: {wanted} is not its address, {grant.address} is")
    effects = (_effect(Action.ACKED, request, grant),)
    if grant.pooled:
        effects = (_effect(Action.COMMIT, request, grant, grant.offer.lease_time), *effects)
    return _reply(request, build_reply(request, grant.offer), f"{state}: ack {wanted}", effects)


def _decline(request: DhcpPacket, server: ServerIdentity, grant: Grant | None) -> Decision:
    """The client saw another host answer ARP for its address (no reply is sent)."""
    if request.server_id not in (None, server.address):
        return _silent(f"declines {request.server_id}'s lease")
    address = request.requested_ip
    if grant is None or address != grant.address:
        return _silent(f"declines {address}, which is not its address here")
    return _silent(
        f"{address} is in use by another host", (_effect(Action.DECLINE, request, grant),)
    )


def _release(request: DhcpPacket, server: ServerIdentity, grant: Grant | None) -> Decision:
    """The client gives ciaddr back (no reply is sent); a fixed address stays reserved."""
    if request.server_id not in (None, server.address):
        return _silent(f"releases {request.server_id}'s lease")
    if grant is None or request.ciaddr != grant.address:
        return _silent(f"releases {request.ciaddr}, which is not its address here")
    return _silent(f"released {request.ciaddr}", (_effect(Action.RELEASE, request, grant),))


def _inform(request: DhcpPacket, server: ServerIdentity, grant: Grant | None) -> Decision:
    """A client with an address of its own asks for options: an ACK without yiaddr or lease."""
    if request.ciaddr.is_unspecified:
        return _silent("INFORM without ciaddr")
    if not server.covers(request.ciaddr):
        return _silent(f"INFORM from {request.ciaddr}, outside {server.subnet}")
    if grant is None:
        return _silent("no options for this client")
    if request.ciaddr != grant.address:  # else anyone could aim replies at any address
        return _silent(f"INFORM from {request.ciaddr}, which is not its address here")
    return _reply(request, build_reply(request, grant.offer), "inform: options only")


_Handler = Callable[[DhcpPacket, ServerIdentity, Grant | None], Decision]
_HANDLERS: dict[int, _Handler] = {
    DISCOVER: _discover,
    REQUEST: _request,
    DECLINE: _decline,
    RELEASE: _release,
    INFORM: _inform,
}


def _effect(action: Action, request: DhcpPacket, grant: Grant, lease_time: int = 0) -> Effect:
    return Effect(action, request.mac, grant.address, grant.pooled, lease_time)


def _reply(
    request: DhcpPacket, reply: DhcpPacket, reason: str, effects: tuple[Effect, ...] = ()
) -> Decision:
    return Decision(reply, reply_destination(request, reply), reason, effects)


def _nak(request: DhcpPacket, server: ServerIdentity, reason: str) -> Decision:
    return _reply(request, build_nak(request, server.address, reason), reason)


def _silent(reason: str, effects: tuple[Effect, ...] = ()) -> Decision:
    return Decision(None, None, reason, effects)


# -- looking for another server on the segment ----------------------------------------------


def probe(xid: int, chaddr: bytes) -> DhcpPacket:
    """A DISCOVER as a new client would send it (broadcast flag set, so any server's
    OFFER comes back as a broadcast): whoever answers it is a DHCP server on this segment."""
    return DhcpPacket(
        op=1, htype=1, hlen=6, hops=0, xid=xid, secs=0, flags=BROADCAST_FLAG,
        ciaddr=ANY, yiaddr=ANY, siaddr=ANY, giaddr=ANY,
        chaddr=chaddr.ljust(16, b"\0"), sname=bytes(64), file=bytes(128),
        options={OPT_MESSAGE_TYPE: bytes((DISCOVER,))},
    )  # fmt: skip


def offering_server(reply: DhcpPacket, xid: int, own: IPv4Address) -> IPv4Address | None:
    """The server that sent this OFFER to our probe, unless it is ourselves."""
    if reply.op != 2 or reply.xid != xid or reply.message_type != OFFER:
        return None
    server_id = reply.server_id
    return None if server_id is None or server_id == own else server_id
