"""HTTP listeners that a crowd of idle or greedy connections cannot take over.

aiohttp closes a connection that sends no complete request within its keep-alive timeout
(also the first one), which ends slow-header and idle connections. What it does not do is
count: 1 100 idle sockets from one machine used to hold every file descriptor of the
process, and 900 from 40 addresses held every slot the boot listener and the operator API
shared. Here each listener has its own :class:`Admission`, sized by the descriptor plan
(`layerpy.budget`): at most ``per_address`` connections from one address and ``total`` in
all. When all are taken, a newcomer takes the place of the oldest idle connection (one
that has no request in progress: it never sent a whole one, or waits between two); a
connection inside a request is never shed. Part of the total is kept for known nodes'
addresses, and an unknown address never sheds a known one's connection, so a crowd of
strangers cannot starve the nodes. What cannot get in is turned away at once, counted,
and logged once per episode, not once per connection.
"""

from __future__ import annotations

import asyncio
import enum
import grp
import logging
import os
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from aiohttp import http_exceptions, web

from layerpy.host import cannot_listen
from layerpy.logs import Throttle
from layerpy.text import printable

log = logging.getLogger("layerpy.http")
quiet = Throttle(log)

IDLE_TIMEOUT = 15.0  # seconds a connection may sit without a complete request
BACKLOG = 4096  # handshakes queued for accept() (the kernel caps it at net.core.somaxconn)
PER_ADDRESS_CAP = "http per-address cap"  # the log's kind for an address over its cap


class More(enum.Enum):
    """A shortcut's word for bytes it would answer once the rest of the request is in."""

    MORE = "more"


MORE = More.MORE
HOLD = 1.0  # seconds the rest of a request may take to come before aiohttp is given it
# answers a connection's bytes at once (response bytes, close after), keeps them for the
# rest of their request (MORE), or declines them (None)
ShortcutAnswer = tuple[bytes, bool] | More | None
Shortcut = Callable[[bytes, str], ShortcutAnswer]


class Held(Protocol):
    """A connection as admission sees it."""

    address: str

    def idle(self) -> bool:
        """No request in progress: it may be shed for a newcomer."""
        ...


@dataclass
class Admission:
    """The connection budget of one listener; the one writer of its counts.

    `admit` decides and says which connection to shed; the caller closes it (no I/O here).
    """

    name: str  # "boot HTTP", "operator API": what the log says
    total: int
    per_address: int
    known_share: int = 0  # of total, only for addresses `known` says are nodes'
    known: Callable[[str], bool] = lambda address: False
    on_refused: Callable[[], None] = lambda: None
    on_shed: Callable[[], None] = lambda: None
    held: dict[Held, bool] = field(default_factory=dict)  # oldest first: known or not
    open: Counter[str] = field(default_factory=Counter)  # by address
    strangers: int = 0  # held connections of unknown addresses
    crowded: set[str] = field(default_factory=set)  # addresses told off in the log
    full: bool = False  # said that the budget is full, until it is half free again

    def admit(self, connection: Held) -> tuple[bool, Held | None]:
        """Whether `connection` gets in, and the idle connection it takes the place of."""
        address = connection.address
        if self.open[address] >= self.per_address:
            self._refuse_address(address)
            return False, None
        known = self.known(address)
        shed = None
        if not self._room(known):
            shed = self._idlest(known)
            if shed is None:
                self._refuse(known)
                return False, None
            self._say_full("shedding idle connections for new ones, the oldest first")
            self.release(shed)
            self.on_shed()
        self.held[connection] = known
        self.open[address] += 1
        self.strangers += not known
        return True, shed

    def release(self, connection: Held) -> None:
        """The connection closed (or was shed): its place is free. Idempotent."""
        known = self.held.pop(connection, None)
        if known is None:
            return
        address = connection.address
        self.strangers -= not known
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]
        if address in self.crowded and self.open[address] < self.per_address // 2:
            self.crowded.discard(address)
        if self.full and len(self.held) < self.total // 2:
            self.full = False
            log.info("%s connections: %d of %d in use again", self.name, len(self.held),
                     self.total)  # fmt: skip

    def _room(self, known: bool) -> bool:
        if len(self.held) >= self.total:
            return False
        return known or self.strangers < self.total - self.known_share

    def _idlest(self, known: bool) -> Held | None:
        """The oldest idle connection a newcomer may shed: a stranger's, or (for a known
        address) anyone's. Busy ones seen on the way go to the back of the line, so
        that the next look does not walk them again."""
        busy: list[Held] = []
        found = None
        for held, held_known in self.held.items():
            if held_known and not known:
                continue
            if held.idle():
                found = held
                break
            busy.append(held)
        for held in busy:
            self.held[held] = self.held.pop(held)
        return found

    def _refuse_address(self, address: str) -> None:
        self.on_refused()
        if address not in self.crowded:
            self.crowded.add(address)
            quiet.log(
                PER_ADDRESS_CAP, logging.WARNING, "refusing %s connections from %s: %d open "
                "from there (limit %d per address)", self.name, address, self.open[address],
                self.per_address,
            )  # fmt: skip

    def _refuse(self, known: bool) -> None:
        self.on_refused()
        whose = "" if known else " (the rest is kept for known nodes)"
        self._say_full(f"every connection is inside a request{whose}: refusing new ones")

    def _say_full(self, what: str) -> None:
        if not self.full:
            self.full = True
            log.warning(
                "%s connections: %d of %d in use, %d from unknown addresses (who may hold "
                "%d); %s", self.name, len(self.held), self.total, self.strangers,
                self.total - self.known_share, what,
            )  # fmt: skip


def in_request(handler: asyncio.Protocol) -> bool:
    """Whether an aiohttp connection is inside a request. Idle is aiohttp's own test
    before it closes a keep-alive connection (``RequestHandler._process_keepalive``):
    its loop waits for the next request and none has arrived whole. A handler that has
    not started waiting yet (just connected) counts as busy."""
    waiter = getattr(handler, "_waiter", None)
    return waiter is None or waiter.done()


class _Admitted(asyncio.Protocol):
    """Stands in front of aiohttp's protocol: turns away a connection over the limits,
    and closes an idle one its admission sheds.

    aiohttp's handler is made at the connection's first byte: a crowd that connects and
    sends nothing, shed and refilled thousands of times a second, then costs a socket
    and a timer each, not a handler and its task (that work, under such a crowd, held
    a node's answer for most of a second). The timer closes a connection that sends
    nothing within IDLE_TIMEOUT, as aiohttp's keep-alive timeout would have.

    With a `shortcut` (services.shortcut), segments it answers never reach aiohttp: the
    handler is made at the first one it declines, which it then gets as a first byte.
    A segment that begins a request it would answer (a report's head, its body on the
    way) is kept for the next: with it, the shortcut answers or declines both; when no
    next comes within HOLD, aiohttp is given it. Until then the timer closes the
    connection IDLE_TIMEOUT after its last answer, and a client that takes no answers
    (the transport's buffer full) is not read from."""

    def __init__(
        self,
        make_handler: Callable[[], asyncio.Protocol],
        admission: Admission,
        shortcut: Shortcut | None = None,
    ) -> None:
        self.make_handler = make_handler
        self.admission = admission
        self.shortcut = shortcut
        self.address = ""
        self.transport: asyncio.Transport | None = None  # once admitted, until lost
        self.inner: asyncio.Protocol | None = None  # aiohttp's handler, from the first byte
        self.timer: asyncio.TimerHandle | None = None
        self.answered = 0.0  # loop time of the last shortcut answer (or the connection)
        self.held = b""  # the start of a request the shortcut waits to see whole
        self.holding: asyncio.TimerHandle | None = None  # gives it to aiohttp after HOLD

    def idle(self) -> bool:
        if self.inner is None:
            return not self.held
        return not in_request(self.inner)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = peer[0] if isinstance(peer, tuple) else ""
        admitted, shed = self.admission.admit(self)
        if isinstance(shed, _Admitted):
            shed.shed()
        if not admitted:
            transport.abort()
            return
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        loop = asyncio.get_running_loop()
        self.answered = loop.time()
        self.timer = loop.call_later(IDLE_TIMEOUT, self._expire)

    def shed(self) -> None:
        """Close at once: the descriptor is free on the loop's next turn."""
        if self.transport is not None:
            self.transport.abort()

    def _expire(self) -> None:
        """IDLE_TIMEOUT without a request since the connection or the last answer (not
        while a request's start is kept: its hand-over to aiohttp comes first)."""
        loop = asyncio.get_running_loop()
        left = self.answered + IDLE_TIMEOUT - loop.time()
        if left > 0 or self.held:
            self.timer = loop.call_later(max(left, HOLD) if self.held else left, self._expire)
        else:
            self.shed()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            if self.transport is None:
                return
            held, self.held = self.held, b""
            if self.holding is not None:
                self.holding.cancel()
                self.holding = None
            if self.shortcut is not None and self._answer(self.transport, held + data, bool(held)):
                return
            self._hand_over()
            assert self.inner is not None
            if held:  # the segments as they came: aiohttp's parser may tell them apart
                self.inner.data_received(held)
        assert self.inner is not None
        self.inner.data_received(data)

    def _hand_over(self) -> None:
        """aiohttp's handler takes the connection from here on."""
        if self.timer is not None:
            self.timer.cancel()
        self.inner = self.make_handler()
        self.inner.connection_made(self.transport)

    def _give_held(self) -> None:
        """aiohttp waits for the rest of a kept request: it did not come within HOLD, or
        the client ended its side."""
        if self.holding is not None:
            self.holding.cancel()
            self.holding = None
        held, self.held = self.held, b""
        self._hand_over()
        assert self.inner is not None
        self.inner.data_received(held)

    def _answer(self, transport: asyncio.Transport, data: bytes, was_held: bool) -> bool:
        """Whether the shortcut answered `data` or keeps it (else aiohttp is to have it);
        bytes are kept once, for one more segment."""
        assert self.shortcut is not None
        answer = self.shortcut(data, self.address)
        if answer is MORE and not was_held:
            self.held = data
            self.holding = asyncio.get_running_loop().call_later(HOLD, self._give_held)
            return True
        if answer is None or answer is MORE:
            return False
        response, close = answer
        transport.write(response)
        if close:
            transport.close()
        else:
            self.answered = asyncio.get_running_loop().time()
        return True

    def eof_received(self) -> bool | None:
        if self.held:  # the rest will never come: as aiohttp would have met the end
            self._give_held()
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is None:
            return
        if self.held:  # as aiohttp would have met it: a request begun, then the end
            self._give_held()
        self.admission.release(self)
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
        if self.holding is not None:
            self.holding.cancel()
        if self.inner is not None:
            self.inner.connection_lost(exc)
            self.inner = None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()
        elif self.transport is not None:  # the shortcut's answers pile up: no more requests
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
        elif self.transport is not None:
            self.transport.resume_reading()


class AdmittedSite(web.BaseSite):
    """A TCP site whose connections pass an :class:`Admission` first."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        admission: Admission,
        ssl_context: ssl.SSLContext | None = None,
        service: str = "HTTP",
        shortcut: Shortcut | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.admission = host, port, admission
        self.service = service  # what a failed bind says could not listen
        self.shortcut = shortcut  # answers what it can before aiohttp (_Admitted)

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        handlers = self._runner.server
        assert handlers is not None
        # a TLS connection reaches the admission after its handshake: one that never
        # finishes it holds its descriptor uncounted until this timeout
        handshake = {"ssl_handshake_timeout": IDLE_TIMEOUT} if self._ssl_context else {}
        try:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: _Admitted(handlers, self.admission, self.shortcut),
                self.host,
                self.port,
                ssl=self._ssl_context,
                reuse_address=True,
                backlog=BACKLOG,
                **handshake,
            )
        except OSError as error:
            raise cannot_listen(self.service, error, self.port, address=self.host) from None

    async def stop(self) -> None:
        """Stop listening, and close the connections that never sent a byte: aiohttp's
        shutdown closes the others, but it never saw these."""
        await super().stop()
        for connection in list(self.admission.held):
            if isinstance(connection, _Admitted) and connection.inner is None:
                connection.shed()


class BadRequests(logging.Filter):
    """aiohttp logs every unparsable request at ERROR with a traceback: anyone could fill
    the disk with junk. Those become one line each, a few a minute, and a count."""

    def __init__(self, on_bad: Callable[[], None]) -> None:
        super().__init__()
        self.on_bad = on_bad

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, http_exceptions.HttpProcessingError):
            return True
        self.on_bad()
        client = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "?"
        reason = printable(getattr(error, "message", "") or type(error).__name__, 120)
        quiet.log("bad request", logging.INFO, "bad HTTP request from %s: %s", client, reason)
        return False


async def runner(app: web.Application) -> web.AppRunner:
    """An app's runner with the idle timeout of every listener here."""
    started = web.AppRunner(app, access_log=None, keepalive_timeout=IDLE_TIMEOUT)
    await started.setup()
    return started


async def unix_site(runner: web.AppRunner, path: Path, group: str | None) -> None:
    """A Unix socket only its owner (and with `group`, that group) may connect to; a
    directory made for it is as closed."""
    gid = grp.getgrnam(group).gr_gid if group is not None else -1
    if not path.parent.exists():
        path.parent.mkdir(mode=0o750 if group else 0o700, parents=True)
        os.chown(path.parent, -1, gid)
    path.unlink(missing_ok=True)  # left by a server that did not stop cleanly
    umask = os.umask(0o177)  # never reachable by others, not even for an instant
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(umask)
    if group is not None:
        os.chown(path, -1, gid)
        os.chmod(path, 0o660)


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def peer_of(request: web.Request) -> Any:
    """The socket a request came on (for SO_PEERCRED), or None for TCP."""
    transport = request.transport
    if transport is None or transport.get_extra_info("peername") not in ("", None):
        return None
    return transport.get_extra_info("socket")
