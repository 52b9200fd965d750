"""DHCP service: moves datagrams between a socket and the sans-I/O codec and policy."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from ipaddress import IPv4Address

from layerpy.boot import BootPolicy
from layerpy.proto import dhcp
from layerpy.stats import Stats

log = logging.getLogger("layerpy.dhcp")

MESSAGE_NAMES = {
    dhcp.DISCOVER: "discover",
    dhcp.REQUEST: "request",
    dhcp.DECLINE: "decline",
    dhcp.RELEASE: "release",
    dhcp.INFORM: "inform",
}


class DhcpService(asyncio.DatagramProtocol):
    """Authoritative DHCP for the machines in the node file."""

    def __init__(
        self, policy: BootPolicy, server_address: IPv4Address, stats: Stats, log_requests: bool
    ) -> None:
        self.policy = policy
        self.server_address = server_address
        self.stats = stats
        self.log_requests = log_requests
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        started = time.perf_counter()
        try:
            request = dhcp.decode(data)
        except dhcp.DhcpError as error:
            self.stats.count("dhcp", "malformed", ok=False)
            log.debug("dropped malformed packet from %s: %s", addr[0], error)
            return
        kind = MESSAGE_NAMES.get(request.message_type or 0)
        if request.op != 1 or kind is None:
            self.stats.count("dhcp", "ignored")
            return
        try:
            reply = self.answer(request)
        except Exception:
            self.stats.observe("dhcp", kind, time.perf_counter() - started, ok=False)
            log.exception("%s: failed to answer a DHCP %s", request.mac, kind)
            return
        if reply is not None and self.transport is not None:
            self.transport.sendto(dhcp.encode(reply), dhcp.reply_destination(request, reply))
        if self.log_requests:
            answer = "no answer" if reply is None else f"{reply.yiaddr} ({reply.message_type})"
            log.debug("%s: %s from %s -> %s", request.mac, kind, addr[0], answer)
        self.stats.observe("dhcp", kind, time.perf_counter() - started)

    def answer(self, request: dhcp.DhcpPacket) -> dhcp.DhcpPacket | None:
        """The reply to one request, or None to stay silent."""
        message = request.message_type
        if message in (dhcp.RELEASE, dhcp.DECLINE):
            log.info("%s: client sent %s", request.mac, MESSAGE_NAMES[message])
            return None
        if message == dhcp.REQUEST and request.server_id not in (None, self.server_address):
            return None  # the client took another server's offer
        offer = self.policy.offer(request)
        if offer is None:
            return None
        if message == dhcp.REQUEST:
            wanted = request.requested_ip or request.ciaddr
            if wanted != offer.address:
                log.info("%s: NAK for %s, its address is %s", request.mac, wanted, offer.address)
                return dhcp.build_nak(request, self.server_address, f"use {offer.address}")
            self.policy.acknowledged(request)
        return dhcp.build_reply(request, offer)


async def start_dhcp(
    policy: BootPolicy,
    interface: str,
    server_address: IPv4Address,
    stats: Stats,
    *,
    port: int = 67,
    log_requests: bool = False,
) -> asyncio.DatagramTransport:
    """Listen for DHCP on one interface only (never on every interface of the host)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        sock.bind(("0.0.0.0", port))
        sock.setblocking(False)
    except OSError as error:
        sock.close()
        raise OSError(
            f"cannot listen for DHCP on {interface} port {port}: {error.strerror} "
            "(check server.interface, and run as root)"
        ) from None
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        lambda: DhcpService(policy, server_address, stats, log_requests), sock=sock
    )
    log.info("listening on %s:%d (authoritative)", interface, port)
    return transport
