"""DHCP service: moves datagrams between a socket, the protocol core and the boot policy.

Per datagram: decode, tick the booter (lapsed leases), ask it what the client deserves,
let the core answer (:mod:`layerpy.proto.dhcp_server` when authoritative,
:mod:`layerpy.proto.proxy_dhcp` beside the site's server), apply the effects, send the
reply, count. Every decision lives in ``proto/``; what a machine gets lives in ``boot.py``.
Beside it, :class:`Neighbours` looks for other DHCP servers on the segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address

from layerpy.boot import Booter, Verdict
from layerpy.config import ServerConfig
from layerpy.host import StartRefused, cannot_listen
from layerpy.logs import Throttle
from layerpy.proto import dhcp, proxy_dhcp
from layerpy.proto.dhcp_server import (
    Action,
    Decision,
    ServerIdentity,
    decide,
    offering_server,
    probe,
    screen,
)
from layerpy.proto.leases import BOUND
from layerpy.services.datagrams import Datagrams, deep_buffers
from layerpy.services.dhcp_fast import FastPath
from layerpy.stats import Stats

log = logging.getLogger("layerpy.dhcp")
quiet = Throttle(log)

MESSAGE_NAMES = {
    dhcp.DISCOVER: "discover",
    dhcp.REQUEST: "request",
    dhcp.DECLINE: "decline",
    dhcp.RELEASE: "release",
    dhcp.INFORM: "inform",
}
NEIGHBOUR_CHECK = 600.0  # seconds between looks for another DHCP server while serving
PEERS_AGAIN = 0.25  # seconds between reads of the cluster's instances while one may register
REMEMBERED = 4096
"""Clients whose last logged outcome is kept, so a repeating one is logged once."""
DISCOVER_WAIT = 0.1
"""Seconds a DISCOVER may have waited in the socket and still be answered: a room of a
thousand machines asking at once is answered within ~30 ms; past saturation the excess
goes here, before it costs a decode, so that the exchanges begun complete."""
REQUEST_WAIT = 2.0  # seconds any other request may have waited (its client has moved on)
_DISCOVER = bytes((dhcp.OPT_MESSAGE_TYPE, 1, dhcp.DISCOVER))  # as clients put it: first


Send = Callable[[bytes, tuple[str, int]], bool]
"""Hands a reply to the kernel at once; False when it could not (the reply is dropped)."""


class DhcpService:
    """DHCP for the machines in the node file on one socket: authoritative (port 67, with
    the discovery pool), or ProxyDHCP on port 67 or 4011 (`proxy`). Without `send` it
    decides and applies but sends nothing (as in the unit tests)."""

    def __init__(
        self,
        booter: Booter,
        server_address: IPv4Address,
        stats: Stats,
        log_requests: bool,
        *,
        port: int = dhcp.SERVER_PORT,
        proxy: bool = False,
        send: Send | None = None,
        prepared: bool = True,
    ) -> None:
        """``prepared``: answer the common requests from prepared replies where they can be
        (services/dhcp_fast.py); False: every request by the reference path."""
        self.booter = booter
        self.server_address = server_address
        self.stats = stats
        self.log_requests = log_requests
        self.port = port
        self.proxy = proxy
        self.send = send
        self._logged: OrderedDict[str, str] = OrderedDict()  # MAC -> last outcome logged
        self._keeping: set[asyncio.Task[None]] = set()  # replies waiting for etcd (a cluster)
        self._identity = ServerIdentity(server_address, booter.config.network.subnet)
        # prepared replies: one authoritative server that sends, and logs no line a packet
        self.fast = (
            FastPath(self, booter)
            if prepared and booter.solo and not proxy and not log_requests and send is not None
            else None
        )

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        started = time.perf_counter()
        fast = self.fast
        if fast is not None and fast.answer(data, addr, started):
            return
        try:
            request = dhcp.decode(data)
        except dhcp.DhcpError as error:
            self.stats.count("dhcp", "malformed", ok=False)
            quiet.log("malformed", logging.DEBUG, "dropped malformed packet from %s: %s",
                      addr[0], error)  # fmt: skip
            return
        refused = screen(request)
        if refused is not None:
            self.stats.count("dhcp", "ignored")
            quiet.log("ignored", logging.DEBUG, "%s: ignored a datagram from %s: %s",
                      request.mac, addr[0], refused)  # fmt: skip
            return
        kind = MESSAGE_NAMES[request.message_type or 0]
        try:
            verdict, decision = self.handle(request, addr)
        except Exception as error:
            self.failed(kind, request.mac, started, error)
            return
        self.stats.observe("dhcp", kind, time.perf_counter() - started)
        if verdict.untrusted:
            self.stats.count("dhcp", "untrusted-relay", ok=False)
            quiet.log("untrusted relay", logging.WARNING, "%s: dropped a relayed %s from %s: %s",
                      request.mac, kind, addr[0], verdict.why)  # fmt: skip
            return
        answer = decision.answer
        self.stats.count("dhcp", answer)
        self._log(request.mac, kind, addr[0], verdict, decision, answer)
        if fast is not None:
            fast.learn(data, addr, request, verdict, decision)

    def shed(self, data: bytes, waited: float) -> bool:
        """Whether a datagram that waited `waited` seconds in the socket is dropped unread
        (counted): past saturation a request waits longer and longer, and answering stale
        ones leaves no time for fresh ones, so that fewer and fewer exchanges complete. A
        DISCOVER goes first (its client asks again; dropping it costs no exchange begun),
        then anything the client has surely given up on."""
        if waited < DISCOVER_WAIT or (waited < REQUEST_WAIT and data[240:243] != _DISCOVER):
            return False
        self.stats.count("dhcp", "shed", ok=False)
        return True

    def failed(self, kind: str, mac: str, started: float, error: Exception) -> None:
        """A request not answered for an error (called in its except clause)."""
        self.stats.observe("dhcp", kind, time.perf_counter() - started, ok=False)
        if isinstance(error, OSError):  # the lease journal cannot be written: promise nothing
            quiet.log("journal", logging.ERROR, "not answering DHCP: leases cannot be kept: %s",
                      error)  # fmt: skip
        else:
            quiet.log("failed", logging.ERROR, "%s: failed to answer a DHCP %s", mac, kind,
                      exc_info=True)  # fmt: skip

    def answered(self, kind: str, mac: str, started: float, answer: str) -> None:
        """Count an OFFER or ACK sent from a prepared reply, as _log would (an ACK is no news)."""
        self.stats.observe("dhcp", kind, time.perf_counter() - started)
        self.stats.count("dhcp", answer)
        if answer == "ack":
            self._logged.pop(mac, None)

    def tick(self) -> None:
        """The booter's upkeep before a request is decided: lapsed leases, logged."""
        for lease in self.booter.tick():
            level = logging.INFO if lease.state == BOUND else logging.DEBUG
            whose = lease.client or "nobody's"
            quiet.log("lease lapsed", level, "%s lease %s lapsed (%s)", lease.state,
                      lease.address, whose)  # fmt: skip

    def deliver(self, reply: bytes, destination: tuple[str, int]) -> None:
        """Hand a reply to the kernel; unicast replies wait there for ARP, and when they
        fill the socket's buffer a reply is dropped (its client asks again), never queued
        without bound."""
        assert self.send is not None
        if not self.send(reply, destination):
            self.stats.count("dhcp", "dropped", ok=False)

    def handle(
        self, request: dhcp.DhcpPacket, sender: tuple[str, int] = ("0.0.0.0", dhcp.CLIENT_PORT)
    ) -> tuple[Verdict, Decision]:
        """Ask, decide, apply, then send: nothing is written before the decision is made,
        and a lease is journalled before the ACK that promises it goes out."""
        self.tick()
        verdict = self.booter.verdict(request, sender[0])
        if verdict.untrusted:  # a forged relay's word: nothing answered, nothing written
            return verdict, Decision(None, None, verdict.why)
        server, subnet = self._identity, self.booter.config.network.subnet
        if server.subnet is not subnet:  # a reload changed the node file
            server = self._identity = ServerIdentity(self.server_address, subnet)
        if self.proxy:
            decision = proxy_dhcp.decide(request, server, verdict.grant, self.port, sender)
        else:
            decision = decide(request, server, verdict.grant)
        self.booter.apply(verdict, decision.effects)  # kept before it is promised
        reply, destination = decision.reply, decision.destination
        keeping = self.booter.keeping()  # a cluster's pool: a transaction before the reply
        if keeping is not None:
            send = None if reply is None or destination is None else (reply, destination)
            task = asyncio.get_running_loop().create_task(self._send_kept(keeping, send))
            self._keeping.add(task)
            task.add_done_callback(self._keeping.discard)
            return verdict, decision
        if reply is not None and destination is not None and self.send is not None:
            self.deliver(dhcp.encode(reply), destination)
        return verdict, decision

    async def _send_kept(
        self, keeping: Awaitable[bool], send: tuple[dhcp.DhcpPacket, tuple[str, int]] | None
    ) -> None:
        """The reply once the pool's transaction is kept; nothing when another instance
        got there first (the client asks again)."""
        if not await keeping:
            self.stats.count("dhcp", "not-kept", ok=False)
        elif send is not None and self.send is not None:
            self.deliver(dhcp.encode(send[0]), send[1])

    def _log(
        self, mac: str, kind: str, source: str, verdict: Verdict, decision: Decision, answer: str
    ) -> None:
        """One debug line per packet when asked for (log_requests); an info line per event
        (a NAK, a release, a decline, silence towards a client we serve), once per client
        until it changes, and a few per kind a minute (a flood of made-up MACs is a
        flood of "changes")."""
        if self.log_requests:
            log.debug(
                "%s: %s from %s (%s) -> %s (%s)",
                mac, kind, source, verdict.why, answer, decision.reason,
            )  # fmt: skip
        if answer == "ack":
            self._logged.pop(mac, None)  # the client is fine again: its next trouble is news
            return
        notable = answer == "nak" or (
            answer == "silent" and verdict.grant is not None and not decision.routine
        )
        if not notable or self._logged.get(mac) == decision.reason:
            return
        self._logged[mac] = decision.reason
        self._logged.move_to_end(mac)
        if len(self._logged) > REMEMBERED:
            self._logged.popitem(last=False)
        declined = any(effect.action is Action.DECLINE for effect in decision.effects)
        level = logging.WARNING if declined else logging.INFO
        quiet.log(f"{kind} {answer}", level, "%s: %s -> %s (%s)", mac, kind, answer,
                  decision.reason)  # fmt: skip


async def start_dhcp(
    booter: Booter,
    interface: str,
    server_address: IPv4Address,
    stats: Stats,
    *,
    proxy: bool = False,
    log_requests: bool = False,
) -> list[Datagrams]:
    """Listen for DHCP on one interface only (never on every interface of the host): port
    67, and with `proxy` also the PXE boot server port 4011."""
    ports = (dhcp.SERVER_PORT, proxy_dhcp.BOOT_SERVER_PORT) if proxy else (dhcp.SERVER_PORT,)
    endpoints: list[Datagrams] = []
    try:
        for port in ports:
            endpoint = Datagrams(_listening_socket(interface, port))
            endpoints.append(endpoint)
            service = DhcpService(
                booter, server_address, stats, log_requests,
                port=port, proxy=proxy, send=endpoint.send,
            )  # fmt: skip
            endpoint.listen(service.datagram_received, shed=service.shed)
    except BaseException:
        for endpoint in endpoints:
            endpoint.close()
        raise
    mode = "ProxyDHCP" if proxy else "authoritative"
    log.info("listening on %s port %s (%s)", interface, " and ".join(map(str, ports)), mode)
    return endpoints


def _listening_socket(interface: str, port: int) -> socket.socket:
    """A non-blocking UDP socket on `port` of `interface` alone, allowed to broadcast."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        sock.bind(("0.0.0.0", port))
        sock.setblocking(False)
    except OSError as error:
        sock.close()
        raise cannot_listen("DHCP", error, port, interface=interface) from None
    deep_buffers(sock)
    return sock


async def other_servers(interface: str, own: IPv4Address, seconds: float) -> list[IPv4Address]:
    """The DHCP servers that answer a new client's DISCOVER on `interface` (ourselves left
    out). Raises OSError when it cannot listen (port 68 taken by a DHCP client here)."""
    xid = int.from_bytes(os.urandom(4))
    request = dhcp.encode(probe(xid, bytes([0x02]) + os.urandom(5)))  # a local MAC
    found: set[IPv4Address] = set()

    def heard(data: bytes, _sender: tuple[str, int]) -> None:
        with contextlib.suppress(dhcp.DhcpError):
            server = offering_server(dhcp.decode(data), xid, own)
            if server is not None:
                found.add(server)

    channel = Datagrams(_listening_socket(interface, dhcp.CLIENT_PORT))
    try:
        channel.listen(heard)
        for listen in (seconds / 3, seconds * 2 / 3):  # sent twice: one lost is no verdict
            channel.send(request, ("255.255.255.255", 67))
            await asyncio.sleep(listen)
    finally:
        channel.close()
    return sorted(found)


class Neighbours:
    """Other DHCP servers answering on the segment. Authoritative: one would hand out
    addresses against ours, so at start it refuses the start (unless the node file expects
    it); later it is logged once per server found. Proxy: the site's server is needed, and
    its absence is logged (the nodes cannot get addresses without it)."""

    def __init__(
        self,
        server: ServerConfig,
        peers: Callable[[], Awaitable[set[IPv4Address]]] | None = None,
        settle: float = 0.0,
    ) -> None:
        """``peers``: the addresses of the other instances of a cluster, whose answers are
        the cluster's own; one that starts answering just before it registers is looked
        for among them again and again, for up to ``settle`` seconds."""
        assert server.interface is not None
        self.server, self.interface = server, server.interface
        self.peers, self.settle = peers, settle
        self.found: set[IPv4Address] = set()

    async def _others(self) -> set[IPv4Address]:
        """The DHCP servers answering on the segment that are not instances of ours."""
        server = self.server
        found = set(await other_servers(self.interface, server.address, server.dhcp_probe))
        if self.peers is None or not found:
            return found
        return await self.not_peers(found)

    async def not_peers(self, found: set[IPv4Address]) -> set[IPv4Address]:
        """Of the servers ``found``, those that are not instances of the cluster: read
        again every PEERS_AGAIN seconds, for up to ``settle``, so a peer that answered
        just before it registered is known as soon as it has (not one TTL later), and
        only a server that is none of ours waits the whole ``settle``."""
        assert self.peers is not None
        found = found - await self.peers()
        give_up = asyncio.get_running_loop().time() + self.settle
        while found and asyncio.get_running_loop().time() < give_up:
            await asyncio.sleep(PEERS_AGAIN)
            found -= await self.peers()
        return found

    async def look(self, *, starting: bool = False) -> None:
        """Look once (for ``dhcp_probe`` seconds); StartRefused when `starting` finds
        another authoritative server that the node file does not expect."""
        server = self.server
        try:
            found = await self._others()
        except OSError as error:
            log.warning("cannot look for other DHCP servers on %s: %s", self.interface,
                        error.strerror or error)  # fmt: skip
            return
        new, gone = found - self.found, self.found - found
        self.found = found
        names = ", ".join(str(address) for address in sorted(new))
        if server.dhcp == "proxy":
            if new:
                log.info("the site's DHCP server answers on %s: %s", self.interface, names)
            if not found and (starting or gone):
                log.warning(
                    'no DHCP server answers on %s: with dhcp = "proxy" the site\'s server '
                    "gives the nodes their addresses, and they cannot boot until one answers",
                    self.interface,
                )
            return
        if not new:
            return
        message = f"another DHCP server answers on {self.interface}: {names}"
        if starting and server.other_dhcp == "refuse":
            raise StartRefused(
                f"{message}; two servers would hand out conflicting addresses. Stop it, set "
                '[server] dhcp = "proxy" to boot nodes beside it, or set [server] other_dhcp = '
                '"expected" in the node file if it is meant to be'
            )
        log.warning("%s", message)

    async def watch(self) -> None:
        """Look again every NEIGHBOUR_CHECK seconds, for as long as the server serves."""
        while True:
            await asyncio.sleep(NEIGHBOUR_CHECK)
            await self.look()
