"""ProxyDHCP (PXE 2.1, section 2.2), sans I/O: what to boot, never an address.

Beside a site's DHCP server that hands out the addresses, a PXE client's broadcast
DISCOVER on port 67 gets an OFFER without yiaddr that names what to boot; a client that has
its address already asks on port 4011 (unicast, its address in ciaddr) and gets an ACK with
the same. Everything else on port 67 (REQUEST, RELEASE, DECLINE, INFORM) is the site
server's business and gets silence here.
"""

from __future__ import annotations

from dataclasses import replace

from layerpy.proto.dhcp import (
    ANY,
    DISCOVER,
    REQUEST,
    DhcpPacket,
    build_reply,
    reply_destination,
)
from layerpy.proto.dhcp_server import (
    Action,
    Decision,
    Effect,
    Grant,
    ServerIdentity,
    screen,
)

BOOT_SERVER_PORT = 4011


def decide(
    request: DhcpPacket,
    server: ServerIdentity,
    grant: Grant | None,
    port: int,
    sender: tuple[str, int],
) -> Decision:
    """The answer to a request that came in on `port` (67 or 4011) from `sender`.

    The grant's address, when specified, is the one the node file expects the site's
    server to give; a node that shows another one at port 4011 is not booted."""
    refused = screen(request)
    if refused is not None:
        return _silent(refused)
    if grant is None:
        return _silent("nothing to boot for this client")
    if not (request.is_pxe_client or request.is_http_client):
        return _silent("not a PXE or HTTP boot client (option 60)", routine=True)
    if port == BOOT_SERVER_PORT:
        return _boot_request(request, server, grant, sender)
    if request.message_type != DISCOVER:
        return _silent("for the site's DHCP server", routine=True)
    reply = build_reply(request, grant.offer, proxy=True)
    if request.is_ipxe:  # no boot server named: iPXE then asks on 4011, from its address
        reply = replace(reply, siaddr=ANY)
    offered = (Effect(Action.OFFERED, request.mac, grant.address, pooled=False),)
    return Decision(reply, reply_destination(request, reply), "proxy offer", offered)


def _boot_request(
    request: DhcpPacket, server: ServerIdentity, grant: Grant, sender: tuple[str, int]
) -> Decision:
    """A REQUEST to port 4011 from the address the site's server gave the client."""
    if request.message_type != REQUEST:
        return _silent(f"port {BOOT_SERVER_PORT} answers only REQUESTs")
    if request.server_id not in (None, server.address):
        return _silent(f"asks boot server {request.server_id}")
    address = request.ciaddr
    if address.is_unspecified:
        return _silent("a boot request without its address (ciaddr)")
    if str(address) != sender[0]:  # else anyone could aim our replies at any host
        return _silent(f"ciaddr {address} is not the sender's address {sender[0]}")
    if not server.covers(address):
        return _silent(f"{address} is outside {server.subnet}")
    expected = grant.address
    if not expected.is_unspecified and address != expected:
        return _silent(f"has {address} from the site's server, the node file says {expected}")
    effects = (
        Effect(Action.LEARNED, request.mac, address, pooled=False),
        Effect(Action.ACKED, request.mac, address, pooled=False),
    )
    reply = build_reply(request, grant.offer, proxy=True)
    return Decision(reply, sender, f"boot server ack to {address}", effects)


def _silent(reason: str, *, routine: bool = False) -> Decision:
    return Decision(None, None, reason, routine=routine)
