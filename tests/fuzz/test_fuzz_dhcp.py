"""Fuzzing the DHCP codec and the two protocol cores (authoritative and ProxyDHCP): any
datagram decodes or raises DhcpError, and whatever decodes gets a decision that keeps the
protocol's promises, with and without a grant from policy."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.proto import dhcp, proxy_dhcp
from layerpy.proto.dhcp_server import Action, Grant, ServerIdentity, decide, screen

from fuzzing import FUZZ, SERVER, addresses, any_datagram, clients

IDENTITY = ServerIdentity(IPv4Address(SERVER), IPv4Network("10.99.0.0/24"))

offers = st.builds(
    dhcp.Offer,
    address=clients.map(IPv4Address),
    server_id=st.just(IPv4Address(SERVER)),
    subnet_mask=st.just(IPv4Address("255.255.255.0")),
    lease_time=st.integers(0, 2**32 - 1),
    router=st.one_of(st.none(), addresses.map(IPv4Address)),
    dns=st.lists(addresses.map(IPv4Address), max_size=3).map(tuple),
    domain=st.one_of(st.none(), st.text(max_size=80)),
    hostname=st.one_of(st.none(), st.sampled_from(["cn001", "discover"]), st.text(max_size=70)),
    next_server=st.one_of(st.none(), st.just(IPv4Address(SERVER))),
    bootfile=st.one_of(st.none(), st.sampled_from(["undionly.kpxe", "http://10.99.0.1:8080/boot/cn001.ipxe"]),
                       st.text(max_size=300)),
    ipxe_no_pxedhcp=st.booleans(),
)  # fmt: skip
grants = st.one_of(st.builds(Grant, offers, pooled=st.booleans()), st.none())


def decoded(data: bytes) -> dhcp.DhcpPacket | None:
    """The packet, or None for a datagram the codec refuses (with DhcpError, nothing else)."""
    try:
        packet = dhcp.decode(data)
    except dhcp.DhcpError:
        return None
    # every derived field a layer above reads must be readable
    for name in ("mac", "message_type", "client_arch", "is_ipxe", "is_pxe_client",
                 "is_http_client", "requested_ip", "server_id", "hostname", "relay_agent",
                 "broadcast"):  # fmt: skip
        getattr(packet, name)
    return packet


@FUZZ
@given(any_datagram)
def test_decode_raises_only_dhcp_error(data: bytes) -> None:
    packet = decoded(data)
    event("decoded" if packet is not None else "refused")
    if packet is None or dhcp.OPT_OVERLOAD in packet.options:
        return  # overloaded: encode() keeps sname and file as they are, not a round trip
    again = dhcp.decode(dhcp.encode(packet))
    assert again.options == packet.options
    assert (again.mac, again.xid, again.giaddr) == (packet.mac, packet.xid, packet.giaddr)


def check_reply(request: dhcp.DhcpPacket, decision) -> None:
    """A reply goes somewhere, encodes, decodes back, and answers this client."""
    assert (decision.reply is None) == (decision.destination is None), decision
    if decision.reply is None:
        assert decision.answer == "silent"
        return
    reply = dhcp.decode(dhcp.encode(decision.reply))
    assert reply.op == 2
    assert (reply.xid, reply.chaddr, reply.giaddr) == (request.xid, request.chaddr, request.giaddr)
    assert reply.message_type in (dhcp.OFFER, dhcp.ACK, dhcp.NAK)


@FUZZ
@given(any_datagram, grants)
def test_authoritative_decisions(data: bytes, grant: Grant | None) -> None:
    request = decoded(data)
    if request is None:
        return
    decision = decide(request, IDENTITY, grant)
    event(f"{decision.answer}, {len(decision.effects)} effects")
    check_reply(request, decision)
    if screen(request) is not None:
        assert decision.reply is None and not decision.effects
    if grant is None:  # nothing but a NAK for a client policy does not know
        assert not decision.effects
        assert decision.answer in ("silent", "nak")
        return
    for effect in decision.effects:
        assert effect.client == request.mac and effect.address == grant.address
        assert effect.pooled == grant.pooled
        if effect.action in (Action.HOLD, Action.COMMIT):
            assert grant.pooled
    if decision.answer in ("offer", "ack") and request.message_type != dhcp.INFORM:
        assert decision.reply.yiaddr == grant.address
    if decision.answer == "ack":
        assert any(e.action is Action.ACKED for e in decision.effects) == (
            request.message_type == dhcp.REQUEST
        )


senders = st.tuples(clients, st.sampled_from([67, 68, 4011, 1, 65535]))


@FUZZ
@given(any_datagram, grants, st.sampled_from([67, proxy_dhcp.BOOT_SERVER_PORT]), senders)
def test_proxy_decisions(
    data: bytes, grant: Grant | None, port: int, sender: tuple[str, int]
) -> None:
    request = decoded(data)
    if request is None:
        return
    decision = proxy_dhcp.decide(request, IDENTITY, grant, port, sender)
    event(f"port {port}: {decision.answer}")
    check_reply(request, decision)
    if decision.reply is None:
        assert not decision.effects
        return
    assert grant is not None
    assert decision.reply.yiaddr == dhcp.ANY  # an address is never the proxy's to give
    assert dhcp.OPT_LEASE_TIME not in decision.reply.options
    if port == proxy_dhcp.BOOT_SERVER_PORT:
        # answered only to the address it came from, which is the client's own
        assert decision.destination == sender and sender[0] == str(request.ciaddr)
        assert IDENTITY.covers(request.ciaddr)
    else:
        offered = [e.action for e in decision.effects]
        assert request.message_type == dhcp.DISCOVER and offered == [Action.OFFERED]
