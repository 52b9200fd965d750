"""HTTP listeners that a crowd of idle or greedy connections cannot take over.

aiohttp closes a connection that sends no complete request within its keep-alive timeout
(also the first one), which ends slow-header and idle connections. What it does not do is
count: 1 100 idle sockets from one machine used to hold every file descriptor of the
process, and then HTTP and TFTP failed for everyone. Here each listener admits at most
``per_client`` connections from one address and ``total`` in all, and turns the rest away
at once (counted, and logged once per episode, not once per connection).
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import resource
import ssl
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import http_exceptions, web

from layerpy.host import cannot_listen
from layerpy.logs import Throttle
from layerpy.text import printable

log = logging.getLogger("layerpy.http")
quiet = Throttle(log)

IDLE_TIMEOUT = 15.0  # seconds a connection may sit without a complete request
PER_CLIENT = 64  # connections one address may hold (iPXE and agents use one or two)
BACKLOG = 1024  # handshakes queued for accept(): a rack of nodes fetching at once
SPARE_FDS = 256  # descriptors kept for TFTP transfers, BMC sessions and files


def raise_fd_limit() -> int:
    """Lift the soft descriptor limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


@dataclass
class Admission:
    """Connection counts shared by the listeners of one process."""

    per_client: int = PER_CLIENT
    total: int = 1024
    on_refused: Callable[[], None] = lambda: None
    open: Counter[str] = field(default_factory=Counter)
    crowded: set[str] = field(default_factory=set)  # addresses told off in the log

    def admit(self, address: str) -> bool:
        if self.open[address] >= self.per_client or self.open.total() >= self.total:
            self.on_refused()
            if address not in self.crowded:
                self.crowded.add(address)
                log.warning(
                    "refusing HTTP connections from %s: %d open from there, %d in all "
                    "(limits %d per client, %d in all)", address, self.open[address],
                    self.open.total(), self.per_client, self.total,
                )  # fmt: skip
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]
        if address in self.crowded and self.open[address] < self.per_client // 2:
            self.crowded.discard(address)
            log.info("accepting HTTP connections from %s again", address)


class _Admitted(asyncio.Protocol):
    """Stands in front of aiohttp's protocol: turns away a connection over the limits."""

    def __init__(self, inner: asyncio.Protocol, admission: Admission) -> None:
        self.inner: asyncio.Protocol | None = inner
        self.admission = admission
        self.address = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.address = peer[0] if isinstance(peer, tuple) else ""
        if not self.admission.admit(self.address):
            self.inner = None
            transport.abort()
            return
        assert self.inner is not None
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None:
            self.admission.release(self.address)
            self.inner.connection_lost(exc)
            self.inner = None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


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
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self.host, self.port, self.admission = host, port, admission
        self.service = service  # what a failed bind says could not listen

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        handlers = self._runner.server
        assert handlers is not None
        try:
            self._server = await asyncio.get_running_loop().create_server(
                lambda: _Admitted(handlers(), self.admission),
                self.host,
                self.port,
                ssl=self._ssl_context,
                reuse_address=True,
                backlog=BACKLOG,
            )
        except OSError as error:
            raise cannot_listen(self.service, error, self.port, address=self.host) from None


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
