"""TFTP server: asyncio sockets around the sans-I/O `layerpy.proto.tftp`.

One socket listens for requests; each transfer answers from its own ephemeral port (its
TID, RFC 1350) connected to the client, so the kernel drops strangers' packets and turns a
vanished client into ICMP port unreachable, which ends the transfer at once.

Bounded: a transfer reads its file block by block (it holds the packets in flight, not
the file), a :class:`TftpBudget` (from the descriptor plan, `layerpy.budget`) caps the
transfers per client address and in all, with a part of them kept for known nodes'
addresses, and one that hears nothing gives up after its retries. Refusals are counted
and logged a few at a time. What ``layerpy serve`` makes of each request's end (its
counts, a node's boot phase) is :func:`accounting`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from layerpy.boot import Booter, Refused, phase_of
from layerpy.host import cannot_listen
from layerpy.logs import Throttle
from layerpy.proto import tftp as proto
from layerpy.services.datagrams import RECEIVE_SIZE, Datagrams, deep_buffers
from layerpy.stats import Stats
from layerpy.text import printable

log = logging.getLogger("layerpy.tftp")
quiet = Throttle(log)

REFUSED = "tftp over budget"  # the log's kind for a request refused over the budget
READ_AHEAD = 16 << 10  # bytes read at once for a transfer (ten blocks of 1468)
NETASCII_MAX = 1 << 20  # netascii converts the whole file: only small ones


@dataclass
class TftpStats:
    requests: int = 0
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0  # payload the clients acknowledged
    malformed: int = 0
    denied: int = 0
    refused: int = 0  # over the budget


@dataclass(frozen=True)
class TftpBudget:
    """Transfers at once (each holds a socket and its file open): in all, per client
    address, and the part of all that only addresses `known` says are nodes' may take,
    so that a crowd of strangers' stalled requests cannot starve the nodes."""

    total: int
    per_address: int
    known_share: int = 0
    known: Callable[[str], bool] = lambda address: False


@dataclass(frozen=True)
class TftpEvent:
    kind: str  # "start", then "done" | "failed"; or "denied" | "refused"; or "malformed"
    client: str
    port: int
    filename: str
    bytes: int = 0
    seconds: float = 0.0  # since the request arrived
    reason: str = ""


def accounting(stats: Stats, booter: Booter) -> Callable[[TftpEvent], None]:
    """The server's `on_event`. Each request is counted once, when it ends: "read" (a
    transfer, with its service time and acknowledged bytes; failed ones are failures),
    "denied" (refused before any data: no such file, a write, a bad mode), "refused" (over
    the transfer budget); "malformed" counts dropped datagrams. A transfer done is the
    TFTP phase of the boot of the node at that address (the kernel or initrd phase for
    the minOS's, which the signed GRUB loads by TFTP)."""

    def account(event: TftpEvent) -> None:
        if event.kind in ("done", "failed"):
            ok = event.kind == "done"
            stats.observe("tftp", "read", event.seconds, ok=ok, size=event.bytes)
        elif event.kind in ("denied", "refused", "malformed"):
            stats.count("tftp", event.kind, ok=False)
        if event.kind == "done":
            booter.fetched(event.client, phase_of(event.filename))

    return account


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
    """An open file read block by block (``proto.Content``): one descriptor, and the
    ``READ_AHEAD`` bytes last read, so that a transfer costs one read per several blocks
    yet holds little of its file."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self._chunk, self._at = b"", 0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, span: slice) -> bytes:
        """The bytes from span.start to span.stop (both given, as Transfer gives them)."""
        start, stop = span.start - self._at, span.stop - self._at
        if start < 0 or (stop > len(self._chunk) and self._at + len(self._chunk) < self.size):
            self._at, start, stop = span.start, 0, span.stop - span.start
            self._chunk = os.pread(self.fd, max(stop, READ_AHEAD), span.start)
        return self._chunk[start:stop]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Rendered(bytes):
    """A file made for one request (a node's GRUB config, a Raspberry Pi's cmdline.txt): its
    bytes, nothing to close."""

    def close(self) -> None:
        pass


# A file the booter serves by name beside the root's (the signed path's, a Raspberry Pi's):
# a file's path, or bytes made for the asking address; None: not one of its names. Raises
# Refused, or FileNotFoundError for a name of its own that it has no file for.
Lookup = Callable[[str, str], Awaitable[bytes | Path | None]]


def _open(root: Path, request: proto.Request, path: Path | None = None) -> FileContent:
    """Runs in a worker thread: the policy checks stat the disk. `path`: the file the
    booter named, else the one under `root` that the request names."""
    try:
        content = FileContent(path or proto.safe_path(root, request.filename))
    except OSError as exc:
        raise proto.TftpError(
            proto.ErrorCode.ACCESS_VIOLATION, exc.strerror or "unreadable"
        ) from None
    if request.mode == "netascii" and len(content) > NETASCII_MAX:
        content.close()
        raise proto.TftpError(proto.ErrorCode.ACCESS_VIOLATION, "netascii only up to 1 MiB")
    return content


class _Session:
    """One transfer: its connected socket, read by the loop directly, and its retransmit
    deadline.

    Lock-step TFTP is one round trip per block, so whatever the server spends per block
    adds up: the socket is read without a transport or protocol object in between, and
    the deadline moves with every block sent while its timer is only re-armed when it
    fires (at most once a timeout), not cancelled and made anew per block.
    """

    def __init__(
        self, server: TftpServer, transfer: proto.Transfer, content: FileContent | Rendered,
        sock: socket.socket, client: tuple, name: str, t0: float,
    ) -> None:  # fmt: skip
        self.server, self.transfer, self.content, self.sock = server, transfer, content, sock
        self.client, self.name, self.t0 = client, name, t0
        self.loop = asyncio.get_running_loop()
        self.deadline = 0.0
        self.open = True
        self.timer: asyncio.TimerHandle | None = None
        server._clients[client] = self
        server._emit("start", client, name, t0)
        self.loop.add_reader(sock.fileno(), self._readable)
        self._send(transfer.start())
        if self.open:
            self.timer = self.loop.call_at(self.deadline, self._tick)

    def _readable(self) -> None:
        """One datagram a wakeup: lock-step brings one ACK at a time, and a second read
        that finds nothing costs more than the loop's next pass when one is there."""
        try:
            data = self.sock.recv(RECEIVE_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # ICMP port unreachable: the client has gone
            self.abort(f"client unreachable: {exc.strerror or exc}")
            return
        try:
            packets = self.transfer.receive(data)
        except proto.Malformed as exc:
            self.server._emit("malformed", self.client, self.name, self.t0, reason=str(exc))
            return
        self._send(packets)

    def _tick(self) -> None:
        """The deadline's timer: fire if it passed, else wait for where it moved to."""
        if not self.open:
            return
        if self.loop.time() >= self.deadline:
            self._send(self.transfer.expire())
        if self.open:
            self.timer = self.loop.call_at(self.deadline, self._tick)

    def abort(self, reason: str) -> None:
        self.transfer.abort(reason)
        self._send([])

    def _send(self, packets: list[bytes]) -> None:
        """Send, move the deadline if anything went out, or wrap up a finished transfer.

        A datagram the kernel will not take now (a full send buffer) is left to the
        retransmission, as a lost one would be."""
        for packet in packets:
            try:
                self.sock.send(packet)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.transfer.abort(f"cannot send: {exc.strerror or exc}")
                break
        if packets:
            self.deadline = self.loop.time() + self.transfer.timeout
        if self.transfer.state != "open" and self.open:
            self.open = False
            if self.timer:
                self.timer.cancel()
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.content.close()
            kind = "failed" if self.transfer.state == "failed" else "done"  # or "sized"
            acked, reason = self.transfer.bytes_acked, self.transfer.reason
            self.server._emit(kind, self.client, self.name, self.t0, acked, reason)


class TftpServer:
    """The listen socket; `close()` is synchronous, idempotent, and aborts open transfers."""

    def __init__(
        self,
        root: Path,
        address: str,
        interface: str | None,
        on_event: Callable[[TftpEvent], None] | None,
        budget: TftpBudget,
        lookup: Lookup | None = None,
        **options: float,
    ) -> None:
        self.root, self.address, self.interface, self.on_event = root, address, interface, on_event
        self.lookup = lookup
        self.budget = budget
        self.options = options  # for Transfer: timeout, retries
        self.stats = TftpStats()
        self._listen: Datagrams | None = None
        self._tasks: set[asyncio.Task] = set()
        self._clients: dict[tuple, _Session | None] = {}  # by client: loading (None) or open
        self._open_from: Counter[str] = Counter()  # transfers per client address
        self._strangers: set[tuple] = set()  # clients of addresses not known as nodes'

    def listen(self, sock: socket.socket) -> None:
        self._listen = Datagrams(sock)
        self._listen.listen(self._request)

    def _request(self, data: bytes, addr: tuple) -> None:
        try:
            request = proto.parse_request(data)
        except proto.Malformed as exc:
            self._emit("malformed", addr, "", time.monotonic(), reason=str(exc))
            return
        self.stats.requests += 1
        if addr in self._clients:  # a retransmitted RRQ: answering twice would be a TID clash
            quiet.log("duplicate", logging.DEBUG, "%s:%d duplicate request", *addr[:2])
            return
        known = self._room(addr[0])
        if known is None:
            refusal = proto.TftpError(proto.ErrorCode.NOT_DEFINED, "too many transfers, retry")
            if self._listen:
                self._listen.send(refusal.packet(), addr)
            self._emit("refused", addr, request.filename, time.monotonic(), reason=refusal.message)
            return
        self._clients[addr] = None
        self._open_from[addr[0]] += 1
        if not known:
            self._strangers.add(addr)
        task = asyncio.get_running_loop().create_task(self._serve(request, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _room(self, address: str) -> bool | None:
        """Whether the budget has room for one more transfer from `address`: None if not,
        else whether the address is a known node's."""
        budget = self.budget
        if self._open_from[address] >= budget.per_address or len(self._clients) >= budget.total:
            return None
        known = budget.known(address)
        if not known and len(self._strangers) >= budget.total - budget.known_share:
            return None
        return known

    async def _serve(self, request: proto.Request, client: tuple) -> None:
        t0 = time.monotonic()
        try:
            content = await self._content(request, client[0])
        except proto.TftpError as exc:
            if self._listen:
                self._listen.send(exc.packet(), client)
            self._emit("denied", client, request.filename, t0, reason=exc.message)
            return
        except Exception:  # a bug must not leave the client waiting for its retries
            log.exception("TFTP request for %s", printable(request.filename))
            refusal = proto.TftpError(proto.ErrorCode.NOT_DEFINED, "server error")
            if self._listen:
                self._listen.send(refusal.packet(), client)
            self._emit("denied", client, request.filename, t0, reason=refusal.message)
            return
        transfer = proto.Transfer(request, content, **self.options)
        try:
            sock = _socket(self.address, 0, self.interface, client)
        except OSError as exc:
            content.close()
            self._emit("failed", client, request.filename, t0, reason=str(exc))
            return
        _Session(self, transfer, content, sock, client, request.filename, t0)

    async def _content(self, request: proto.Request, address: str) -> FileContent | Rendered:
        """What the request names: a file of the booter's (its lookup), else one under the
        root. Raises TftpError, for a request it cannot serve before anything is looked up
        (a lookup may act: issue a boot token, mark a boot phase)."""
        proto.check_request(request)
        found = None
        if self.lookup is not None:
            try:
                found = await self.lookup(request.filename, address)
            except Refused as why:
                raise proto.TftpError(proto.ErrorCode.ACCESS_VIOLATION, str(why)) from None
            except FileNotFoundError:
                raise proto.TftpError(proto.ErrorCode.FILE_NOT_FOUND, "file not found") from None
        if isinstance(found, bytes):
            return Rendered(found)
        return await asyncio.to_thread(_open, self.root, request, found)

    def _emit(self, kind: str, client: tuple, name: str, t0: float, size=0, reason="") -> None:
        """Count, log and report the start or the end of one request, or a dropped datagram."""
        if kind in ("done", "failed", "denied") and client in self._clients:
            del self._clients[client]  # (a refusal for crowding never got in)
            self._open_from[client[0]] -= 1
            if not self._open_from[client[0]]:
                del self._open_from[client[0]]
            self._strangers.discard(client)
        self.stats.transfers_ok += kind == "done"
        self.stats.transfers_failed += kind == "failed"
        self.stats.denied += kind == "denied"
        self.stats.refused += kind == "refused"
        self.stats.malformed += kind == "malformed"
        self.stats.bytes_sent += size
        event = TftpEvent(kind, client[0], client[1], name, size, time.monotonic() - t0, reason)
        line = f"{kind} {client[0]}:{client[1]} {printable(name)} {size} bytes "
        line += f"{event.seconds:.3f} s {printable(reason)}"
        if kind == "start":
            log.debug("%s", line.rstrip())
        elif kind == "done":
            log.info("%s", line.rstrip())
        elif kind == "refused":  # a crowd from many addresses: a few lines, then a count
            quiet.log(REFUSED, logging.INFO, "%s", line.rstrip())
        else:  # failures and refusals: a flood of them must not flood the log
            quiet.log(kind, logging.INFO, "%s", line.rstrip())
        if self.on_event:
            try:
                self.on_event(event)
            except Exception:
                log.exception("on_event handler failed")

    def close(self) -> None:
        if self._listen:
            self._listen.close()
            self._listen = None
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
    budget: TftpBudget,
    lookup: Lookup | None = None,
    timeout: float = 1.0,
    retries: int = 5,
) -> TftpServer:
    """Serve files under `root`, and those `lookup` names, read-only on address:port (bound
    to `interface` if given), at most `budget`'s transfers at once."""
    server = TftpServer(root, address, interface, on_event, budget, lookup, timeout=timeout,
                        retries=retries)  # fmt: skip
    try:
        sock = _socket(address, port, interface)
    except OSError as error:
        raise cannot_listen(
            "TFTP", error, port, address=address, interface=interface or ""
        ) from None
    deep_buffers(sock)
    server.listen(sock)
    return server
