"""The RFC 2131 server core: every kind of client message, built by dpkt (an independent
encoder), decoded by the project codec, decided without I/O; replies read back by dpkt."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network

import dpkt
import pytest

from layerpy.proto import dhcp
from layerpy.proto.dhcp_server import (
    Action,
    Decision,
    Effect,
    Grant,
    ServerIdentity,
    decide,
    offering_server,
    probe,
    screen,
)

IP = IPv4Address
MAC = "52:54:00:12:34:56"
SERVER = ServerIdentity(IP("10.99.0.1"), IPv4Network("10.99.0.0/24"))
OTHER_SERVER = IP("10.99.0.2")
RELAY = IP("10.99.0.254")
FIXED = Grant(
    dhcp.Offer(
        address=IP("10.99.0.11"),
        server_id=SERVER.address,
        subnet_mask=IP("255.255.255.0"),
        lease_time=3600,
        router=SERVER.address,
        hostname="cn001",
    )
)
POOLED = Grant(replace(FIXED.offer, address=IP("10.99.0.200"), hostname=None, lease_time=300), True)
BROADCAST = ("255.255.255.255", 68)


def client(
    message: int,
    *,
    ciaddr: str = "0.0.0.0",
    giaddr: str = "0.0.0.0",
    requested: str | None = None,
    server_id: IPv4Address | None = None,
    flags: int = 0,
    op: int = dpkt.dhcp.DHCP_OP_REQUEST,
    extra: tuple[tuple[int, bytes], ...] = (),
) -> dhcp.DhcpPacket:
    """A client message as dpkt encodes it, read back by the codec."""
    opts = [(dpkt.dhcp.DHCP_OPT_MSGTYPE, bytes((message,)))] if message else []
    if requested is not None:
        opts.append((dpkt.dhcp.DHCP_OPT_REQ_IP, IP(requested).packed))
    if server_id is not None:
        opts.append((dpkt.dhcp.DHCP_OPT_SERVER_ID, server_id.packed))
    wire = dpkt.dhcp.DHCP(
        op=op,
        xid=0x1234,
        flags=flags,
        ciaddr=int(IP(ciaddr)),
        giaddr=int(IP(giaddr)),
        chaddr=bytes.fromhex(MAC.replace(":", "")).ljust(16, b"\0"),
        opts=[*opts, *extra],
    )
    return dhcp.decode(bytes(wire))


def decided(request: dhcp.DhcpPacket, grant: Grant | None) -> Decision:
    """decide(), checking on the way that it left the request and the grant as they were."""
    before = (replace(request, options=dict(request.options)), grant and replace(grant.offer))
    decision = decide(request, SERVER, grant)
    assert (request, grant and grant.offer) == before
    return decision


def effects(decision: Decision) -> list[tuple[Action, IPv4Address, bool]]:
    return [(e.action, e.address, e.pooled) for e in decision.effects]


def read_back(decision: Decision) -> dpkt.dhcp.DHCP:
    """The reply as it goes on the wire, parsed by dpkt."""
    assert decision.reply is not None
    return dpkt.dhcp.DHCP(dhcp.encode(decision.reply))


def message_type(reply: dpkt.dhcp.DHCP) -> int:
    return dict(reply.opts)[dpkt.dhcp.DHCP_OPT_MSGTYPE][0]


# --- DISCOVER ---------------------------------------------------------------------------


def test_discover_from_a_known_node_gets_its_fixed_address() -> None:
    decision = decided(client(dhcp.DISCOVER), FIXED)
    reply = read_back(decision)
    assert message_type(reply) == dhcp.OFFER and IP(reply.yiaddr) == FIXED.address
    assert dict(reply.opts)[dpkt.dhcp.DHCP_OPT_HOSTNAME] == b"cn001"
    assert decision.destination == BROADCAST and decision.answer == "offer"
    assert decision.effects == (Effect(Action.OFFERED, MAC, FIXED.address, False),)  # never held


def test_discover_for_the_pool_holds_the_offer() -> None:
    decision = decided(client(dhcp.DISCOVER), POOLED)
    assert IP(read_back(decision).yiaddr) == POOLED.address
    assert decision.effects == (
        Effect(Action.OFFERED, MAC, POOLED.address, True),
        Effect(Action.HOLD, MAC, POOLED.address, True),
    )


def test_discover_from_nobody_we_serve_is_silent() -> None:
    decision = decided(client(dhcp.DISCOVER), None)
    assert (decision.reply, decision.destination, decision.effects) == (None, None, ())
    assert decision.answer == "silent" and decision.reason == "no address for this client"


# --- REQUEST, SELECTING (server identifier present) ----------------------------------


@pytest.mark.parametrize("grant", [FIXED, POOLED], ids=["fixed", "pooled"])
def test_selecting_our_offer_is_acked(grant: Grant) -> None:
    request = client(dhcp.REQUEST, requested=str(grant.address), server_id=SERVER.address)
    decision = decided(request, grant)
    reply = read_back(decision)
    assert message_type(reply) == dhcp.ACK and IP(reply.yiaddr) == grant.address
    assert dict(reply.opts)[dpkt.dhcp.DHCP_OPT_LEASE_SEC] == grant.offer.lease_time.to_bytes(4)
    assert decision.destination == BROADCAST
    expected = [(Action.ACKED, grant.address, grant.pooled)]
    if grant.pooled:
        expected.insert(0, (Action.COMMIT, grant.address, True))
        assert decision.effects[0].lease_time == 300
    assert effects(decision) == expected


def test_selecting_another_address_from_us_is_nakked() -> None:
    request = client(dhcp.REQUEST, requested="10.99.0.12", server_id=SERVER.address)
    decision = decided(request, FIXED)
    reply = read_back(decision)
    assert message_type(reply) == dhcp.NAK and reply.yiaddr == 0
    assert dict(reply.opts)[dpkt.dhcp.DHCP_OPT_SERVER_ID] == SERVER.address.packed
    assert decision.destination == BROADCAST and decision.effects == ()


def test_selecting_our_offer_when_policy_no_longer_grants_it_is_nakked() -> None:
    request = client(dhcp.REQUEST, requested="10.99.0.11", server_id=SERVER.address)
    assert decided(request, None).answer == "nak"


def test_selecting_without_a_requested_address_is_ignored() -> None:
    decision = decided(client(dhcp.REQUEST, server_id=SERVER.address), FIXED)
    assert decision.answer == "silent" and "option 50" in decision.reason


@pytest.mark.parametrize(
    ("grant", "expected"),
    [(FIXED, []), (POOLED, [(Action.WITHDRAW, POOLED.address, True)]), (None, [])],
    ids=["fixed", "pooled", "unknown"],
)
def test_selecting_another_server_is_silent_and_frees_our_offer(grant, expected) -> None:
    request = client(dhcp.REQUEST, requested="10.99.0.11", server_id=OTHER_SERVER)
    decision = decided(request, grant)
    assert decision.reply is None and decision.reason == "selecting 10.99.0.2's offer"
    assert effects(decision) == expected


# --- REQUEST, INIT-REBOOT (requested address, no server identifier) ------------------


def test_init_reboot_with_its_address_is_acked() -> None:
    decision = decided(client(dhcp.REQUEST, requested="10.99.0.11"), FIXED)
    assert message_type(read_back(decision)) == dhcp.ACK
    assert effects(decision) == [(Action.ACKED, FIXED.address, False)]


def test_init_reboot_with_an_address_that_is_not_its_own_is_nakked() -> None:
    decision = decided(client(dhcp.REQUEST, requested="10.99.0.99"), FIXED)
    assert decision.answer == "nak"
    assert decision.reason == "init-reboot: 10.99.0.99 is not its address, 10.99.0.11 is"


def test_init_reboot_from_another_network_is_nakked() -> None:
    decision = decided(client(dhcp.REQUEST, requested="192.168.1.7"), FIXED)
    reply = read_back(decision)
    assert message_type(reply) == dhcp.NAK
    assert (
        dict(reply.opts)[dpkt.dhcp.DHCP_OPT_MESSAGE]
        == b"init-reboot: 192.168.1.7 is not on 10.99.0.0/24"
    )


@pytest.mark.parametrize("address", ["10.99.0.11", "192.168.1.7"])
def test_init_reboot_of_a_client_we_do_not_know_is_silent(address: str) -> None:
    decision = decided(client(dhcp.REQUEST, requested=address), None)
    assert decision.reply is None and decision.reason == "init-reboot: no record of this client"


# --- REQUEST, RENEWING (ciaddr, unicast) and REBINDING (ciaddr, broadcast) --------------


def test_renewing_is_acked_to_ciaddr() -> None:
    decision = decided(client(dhcp.REQUEST, ciaddr="10.99.0.11"), FIXED)
    reply = read_back(decision)
    assert message_type(reply) == dhcp.ACK
    assert IP(reply.ciaddr) == IP(reply.yiaddr) == FIXED.address
    assert decision.destination == ("10.99.0.11", 68)


@pytest.mark.parametrize("grant", [FIXED, POOLED], ids=["fixed", "pooled"])
def test_rebinding_broadcast_is_acked(grant: Grant) -> None:
    request = client(dhcp.REQUEST, ciaddr=str(grant.address), flags=dhcp.BROADCAST_FLAG)
    decision = decided(request, grant)
    assert decision.answer == "ack" and decision.destination == (str(grant.address), 68)
    assert (Action.COMMIT in [e.action for e in decision.effects]) == grant.pooled


def test_rebinding_through_a_relay_is_answered_to_the_relay() -> None:
    request = client(dhcp.REQUEST, ciaddr="10.99.0.11", giaddr=str(RELAY))
    decision = decided(request, FIXED)
    assert decision.answer == "ack" and decision.destination == (str(RELAY), 67)


def test_renewing_an_address_that_is_not_its_own_is_nakked_by_broadcast() -> None:
    decision = decided(client(dhcp.REQUEST, ciaddr="10.99.0.12"), FIXED)
    assert decision.answer == "nak" and decision.destination == BROADCAST
    assert read_back(decision).ciaddr == 0


def test_renewing_from_another_subnet_is_nakked() -> None:
    decision = decided(client(dhcp.REQUEST, ciaddr="172.16.0.5"), FIXED)
    assert decision.answer == "nak" and "172.16.0.5 is not on 10.99.0.0/24" in decision.reason


def test_renewing_by_a_client_we_do_not_know_is_silent() -> None:
    assert decided(client(dhcp.REQUEST, ciaddr="10.99.0.11"), None).reply is None


def test_request_naming_no_address_is_ignored() -> None:
    assert decided(client(dhcp.REQUEST), FIXED).reason.startswith("REQUEST names no address")


# --- DECLINE, RELEASE -------------------------------------------------------------------


@pytest.mark.parametrize("grant", [FIXED, POOLED], ids=["fixed", "pooled"])
def test_decline_of_its_address_is_an_effect_without_reply(grant: Grant) -> None:
    request = client(dhcp.DECLINE, requested=str(grant.address), server_id=SERVER.address)
    decision = decided(request, grant)
    assert decision.reply is None and decision.reason.endswith("is in use by another host")
    assert effects(decision) == [(Action.DECLINE, grant.address, grant.pooled)]


@pytest.mark.parametrize(
    ("requested", "server_id"),
    [("10.99.0.201", SERVER.address), (str(POOLED.address), OTHER_SERVER), (None, None)],
    ids=["not its address", "another server's", "no address"],
)
def test_decline_that_is_not_ours_changes_nothing(requested, server_id) -> None:
    request = client(dhcp.DECLINE, requested=requested, server_id=server_id)
    decision = decided(request, POOLED)
    assert (decision.reply, decision.effects) == (None, ())


def test_release_of_a_pool_lease() -> None:
    request = client(dhcp.RELEASE, ciaddr=str(POOLED.address), server_id=SERVER.address)
    decision = decided(request, POOLED)
    assert decision.reply is None
    assert effects(decision) == [(Action.RELEASE, POOLED.address, True)]


@pytest.mark.parametrize(
    ("ciaddr", "server_id", "grant"),
    [
        ("10.99.0.201", SERVER.address, POOLED),
        (str(POOLED.address), OTHER_SERVER, POOLED),
        (str(POOLED.address), SERVER.address, None),
    ],
    ids=["not its address", "another server's", "unknown client"],
)
def test_release_that_is_not_ours_changes_nothing(ciaddr, server_id, grant) -> None:
    decision = decided(client(dhcp.RELEASE, ciaddr=ciaddr, server_id=server_id), grant)
    assert (decision.reply, decision.effects) == (None, ())


# --- INFORM -----------------------------------------------------------------------------


def test_inform_gets_options_without_address_or_lease() -> None:
    decision = decided(client(dhcp.INFORM, ciaddr="10.99.0.11"), FIXED)
    reply = read_back(decision)
    options = dict(reply.opts)
    assert message_type(reply) == dhcp.ACK and reply.yiaddr == 0
    assert dpkt.dhcp.DHCP_OPT_LEASE_SEC not in options
    assert options[dpkt.dhcp.DHCP_OPT_NETMASK] == IP("255.255.255.0").packed
    assert decision.destination == ("10.99.0.11", 68) and decision.effects == ()


@pytest.mark.parametrize(
    ("ciaddr", "grant", "reason"),
    [
        ("0.0.0.0", FIXED, "INFORM without ciaddr"),
        ("172.16.0.5", FIXED, "INFORM from 172.16.0.5, outside 10.99.0.0/24"),
        ("10.99.0.11", None, "no options for this client"),
        # anyone may send INFORM with any ciaddr: a reply would be aimed at that address
        ("10.99.0.77", FIXED, "INFORM from 10.99.0.77, which is not its address here"),
    ],
)
def test_inform_we_cannot_answer_is_silent(ciaddr, grant, reason) -> None:
    decision = decided(client(dhcp.INFORM, ciaddr=ciaddr), grant)
    assert (decision.reply, decision.reason) == (None, reason)


# --- relays, subnets, and what is not a client's message --------------------------------


def test_relayed_discover_is_answered_to_the_relay_port() -> None:
    relay_info = ((dhcp.OPT_RELAY_AGENT, b"\x01\x04swp3"),)
    request = client(dhcp.DISCOVER, giaddr=str(RELAY), extra=relay_info)
    decision = decided(request, FIXED)
    reply = read_back(decision)
    assert decision.destination == (str(RELAY), 67) and IP(reply.giaddr) == RELAY
    assert dict(reply.opts)[dhcp.OPT_RELAY_AGENT] == b"\x01\x04swp3"


def test_relayed_nak_is_broadcast_by_the_relay() -> None:
    request = client(dhcp.REQUEST, requested="10.99.0.99", giaddr=str(RELAY))
    decision = decided(request, FIXED)
    assert decision.answer == "nak" and decision.destination == (str(RELAY), 67)
    assert read_back(decision).flags & dhcp.BROADCAST_FLAG


@pytest.mark.parametrize("message", [dhcp.DISCOVER, dhcp.REQUEST, dhcp.INFORM])
def test_relayed_from_another_subnet_is_ignored(message: int) -> None:
    request = client(message, giaddr="10.50.0.1", requested="10.99.0.11", ciaddr="10.99.0.11")
    decision = decided(request, FIXED)
    assert (decision.reply, decision.reason) == (None, "relayed by 10.50.0.1, outside 10.99.0.0/24")


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (client(dhcp.OFFER, op=dpkt.dhcp.DHCP_OP_REPLY), "not a BOOTREQUEST"),
        (client(dhcp.ACK), "DHCP message type 5 is not for a server"),
        (client(0), "DHCP message type None is not for a server"),  # plain BOOTP
    ],
    ids=["reply", "ack from a client", "bootp"],
)
def test_what_no_client_sends_a_server_is_screened(request_, reason) -> None:
    assert screen(request_) == reason
    assert decided(request_, FIXED).reason == reason
    assert screen(client(dhcp.DISCOVER)) is None


# --- looking for another server -----------------------------------------------------------


def test_a_probe_is_a_new_clients_discover_and_only_others_offers_count() -> None:
    request = dhcp.decode(dhcp.encode(probe(0x1234, bytes.fromhex("02aabbccddee"))))
    assert request.message_type == dhcp.DISCOVER and request.flags & dhcp.BROADCAST_FLAG
    assert request.mac == "02:aa:bb:cc:dd:ee" and screen(request) is None
    offer = FIXED.offer
    theirs = dhcp.build_reply(request, replace(offer, server_id=OTHER_SERVER))
    assert offering_server(theirs, 0x1234, SERVER.address) == OTHER_SERVER
    ours = dhcp.build_reply(request, offer)
    assert offering_server(ours, 0x1234, SERVER.address) is None  # ourselves
    assert offering_server(theirs, 0x9999, SERVER.address) is None  # not our probe
