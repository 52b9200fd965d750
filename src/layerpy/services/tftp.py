"""TFTP server: asyncio sockets around the sans-I/O `layerpy.proto.tftp`.

One socket listens for requests; each transfer answers from its own ephemeral port (its
TID, RFC 1350) connected to the client, so the kernel drops strangers' packets and turns a
vanished client into ICMP port unreachable, which ends the transfer at once.

Bounded: a transfer reads its file block by block (it holds the packets in flight, not
the file), at most ``PER_CLIENT`` transfers run per client address and ``TOTAL`` in all,
and one that hears nothing gives up after its retries. Refusals are logged a few per
client, then only counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerpy.host import cannot_listen
from layerpy.logs import Throttle
from layerpy.proto import tftp as proto
from layerpy.services.datagrams import deep_buffers
from layerpy.text import printable

log = logging.getLogger("layerpy.tftp")
quiet = Throttle(log)

PER_CLIENT = 32  # transfers at once from one address (a PXE ROM needs one)
TOTAL = 1024  # transfers at once in all (each holds a socket and the file open)
NETASCII_MAX = 1 << 20  # netascii converts the whole file: only small ones


@dataclass
class TftpStats:
    requests: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0  # payload the clients acknowledged
    malformed: int = 0
    denied: int = 0


@dataclass(frozen=True)
class TftpEvent:
    kind: str  # "start", then "done" | "failed"; or "denied"; or "malformed" (one datagram)
    client: str
    port: int
    filename: str
    bytes: int = 0
    seconds: float = 0.0  # since the request arrived
    reason: str = ""


def _socket(
    address: str, port: int, interface: str | None, peer: tuple | None = None
) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if interface:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
        sock.bind((address, port))
        if peer:
            sock.connect(peer)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class FileContent:
    """An open file read block by block (``proto.Content``); one descriptor, no buffer."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, span: slice) -> bytes:
        start, stop, _ = span.indices(self.size)
        return os.pread(self.fd, max(0, stop - start), start)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(root: Path, request: proto.Request) -> FileContent:
    """Runs in a worker thread: the policy checks stat the disk."""
    proto.check_request(request)
    try:
        content = FileContent(proto.safe_path(root, request.filename))
    except OSError as exc:
        raise proto.TftpError(
            proto.ErrorCode.ACCESS_VIOLATION, exc.strerror or "unreadable"
        ) from None
    if request.mode == "netascii" and len(content) > NETASCII_MAX:
        content.close()
        raise proto.TftpError(proto.ErrorCode.ACCESS_VIOLATION, "netascii only up to 1 MiB")
    return content


@dataclass(eq=False)
class _Session(asyncio.DatagramProtocol):
    """One transfer's socket and retransmit timer."""

    server: TftpServer
    transfer: proto.Transfer
    content: FileContent
    client: tuple
    name: str
    t0: float
    transport: asyncio.DatagramTransport | None = None
    timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server._clients[self.client] = self
        self.server._emit("start", self.client, self.name, self.t0)
        self._send(self.transfer.start())

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            packets = self.transfer.receive(data)
        except proto.Malformed as exc:
            self.server._emit("malformed", self.client, self.name, self.t0, reason=str(exc))
            return
        self._send(packets)

    def error_received(self, exc: Exception) -> None:
        self.abort(f"client unreachable: {exc}")

    def abort(self, reason: str) -> None:
        self.transfer.abort(reason)
        self._send([])

    def _expire(self) -> None:
        self._send(self.transfer.expire())

    def _send(self, packets: list[bytes]) -> None:
        """Send, then restart the timer if anything went out, or wrap up a finished transfer."""
        assert self.transport is not None
        if self.transport.is_closing():
            return
        for packet in packets:
            self.transport.sendto(packet)
        if log.isEnabledFor(logging.DEBUG) and packets:
            log.debug("%s:%d sent %d packet(s)", *self.client[:2], len(packets))
        if self.timer and (packets or self.transfer.state != "open"):
            self.timer.cancel()
        if self.transfer.state != "open":
            self.transport.close()
            self.content.close()
            kind = "done" if self.transfer.state == "done" else "failed"
            acked, reason = self.transfer.bytes_acked, self.transfer.reason
            self.server._emit(kind, self.client, self.name, self.t0, acked, reason)
        elif packets:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.transfer.timeout, self._expire)


class TftpServer(asyncio.DatagramProtocol):
    """The listen socket; `close()` is synchronous, idempotent, and aborts open transfers."""

    def __init__(
        self,
        root: Path,
        address: str,
        interface: str | None,
        on_event: Callable[[TftpEvent], None] | None,
        **options: float,
    ) -> None:
        self.root, self.address, self.interface, self.on_event = root, address, interface, on_event
        self.options = options  # for Transfer: timeout, retries
        self.stats = TftpStats()
        self._listen: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task] = set()
        self._clients: dict[tuple, _Session | None] = {}  # by client: loading (None) or open
        self._open_from: Counter[str] = Counter()  # transfers per client address

    def connection_made(self, transport) -> None:
        self._listen = transport

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            request = proto.parse_request(data)
        except proto.Malformed as exc:
            self._emit("malformed", addr, "", time.monotonic(), reason=str(exc))
            return
        self.stats.requests += 1
        if addr in self._clients:  # a retransmitted RRQ: answering twice would be a TID clash
            log.debug("%s:%d duplicate request", *addr[:2])
            return
        crowded = self._open_from[addr[0]] >= PER_CLIENT or len(self._clients) >= TOTAL
        if crowded and self._listen:
            refusal = proto.TftpError(proto.ErrorCode.NOT_DEFINED, "too many transfers, retry")
            self._listen.sendto(refusal.packet(), addr)
            self._emit("denied", addr, request.filename, time.monotonic(), reason=refusal.message)
            return
        self._clients[addr] = None
        self._open_from[addr[0]] += 1
        task = asyncio.get_running_loop().create_task(self._serve(request, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, request: proto.Request, client: tuple) -> None:
        t0 = time.monotonic()
        try:
            content = await asyncio.to_thread(_open, self.root, request)
        except proto.TftpError as exc:
            if self._listen:
                self._listen.sendto(exc.packet(), client)
            self._emit("denied", client, request.filename, t0, reason=exc.message)
            return
        transfer = proto.Transfer(request, content, **self.options)
        loop = asyncio.get_running_loop()
        try:
            sock = _socket(self.address, 0, self.interface, client)
            await loop.create_datagram_endpoint(
                lambda: _Session(self, transfer, content, client, request.filename, t0),
                sock=sock,
            )
        except OSError as exc:
            content.close()
            self._emit("failed", client, request.filename, t0, reason=str(exc))

    def _emit(self, kind: str, client: tuple, name: str, t0: float, size=0, reason="") -> None:
        """Count, log and report the start or the end of one request, or a dropped datagram."""
        if kind in ("done", "failed", "denied") and client in self._clients:
            del self._clients[client]  # (a refusal for crowding never got in)
            self._open_from[client[0]] -= 1
            if not self._open_from[client[0]]:
                del self._open_from[client[0]]
        self.stats.transfers_ok += kind == "done"
        self.stats.transfers_failed += kind == "failed"
        self.stats.denied += kind == "denied"
        self.stats.malformed += kind == "malformed"
        self.stats.bytes_sent += size
        event = TftpEvent(kind, client[0], client[1], name, size, time.monotonic() - t0, reason)
        line = f"{kind} {client[0]}:{client[1]} {printable(name)} {size} bytes "
        line += f"{event.seconds:.3f} s {printable(reason)}"
        if kind in ("start", "malformed"):
            log.debug("%s", line.rstrip())
        elif kind == "done":
            log.info("%s", line.rstrip())
        else:  # failures and refusals: a flood of them must not flood the log
            quiet.log(client[0], logging.INFO, "%s", line.rstrip())
        if self.on_event:
            try:
                self.on_event(event)
            except Exception:
                log.exception("on_event handler failed")

    def close(self) -> None:
        if self._listen:
            self._listen.close()
        for task in self._tasks:
            task.cancel()
        for session in list(self._clients.values()):
            if session:
                session.abort("server closed")


async def start_tftp(
    root: Path,
    address: str,
    port: int = 69,
    *,
    interface: str | None = None,
    on_event: Callable[[TftpEvent], None] | None = None,
    timeout: float = 1.0,
    retries: int = 5,
) -> TftpServer:
    """Serve files under `root` read-only on address:port (bound to `interface` if given)."""
    server = TftpServer(root, address, interface, on_event, timeout=timeout, retries=retries)
    try:
        sock = _socket(address, port, interface)
    except OSError as error:
        raise cannot_listen(
            "TFTP", error, port, address=address, interface=interface or ""
        ) from None
    deep_buffers(sock)
    await asyncio.get_running_loop().create_datagram_endpoint(lambda: server, sock=sock)
    return server
