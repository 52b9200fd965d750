"""What operators watch as it happens: the event stream, nodes' consoles, the dashboard.

Served on the operator listeners only, behind the same authentication as the rest of the
API (``services.api``), except the dashboard's static files, which hold no data: the page
asks for a token and sends it with every call it makes.

The stream is the node store's change feed as server-sent events: every observed change,
every desired one, every action fired and how it ended, every operator call. A client
that lost its connection resumes with ``Last-Event-ID`` from the feed's bounded history;
one that reads too slowly gets an ``event: gap`` (re-read the state) instead of holding
memory. A stream writes what came in STREAM_BATCH at once, each change encoded once for
all streams. Each stream has a byte budget for what is queued and not yet sent (here and
in the connection's buffer); a reader that falls behind past it is dropped, its memory
freed at once, and resumes from the history when it reconnects. Streams end when the
server stops, so a stop never waits for a watcher.

A console WebSocket is opened only from the dashboard's own origin, an origin the node file
lists (``[api] origins``), or by a client that names none (the CLI): a page of another site
that a browser with a token would otherwise let in is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
from collections import OrderedDict
from importlib import resources
from typing import Any

from aiohttp import WSMsgType, hdrs, web

from layerpy import hostlist
from layerpy.auth import Operator, Scope
from layerpy.config import values
from layerpy.consoles import KEYSTROKES, Consoles, Notice
from layerpy.consoles.capture import SEEN_ON_ATTACH
from layerpy.logs import Throttle
from layerpy.nodes import NodeStore
from layerpy.nodes.feed import GAP, Change, Subscription
from layerpy.services.http import OPERATOR, STATS
from layerpy.text import printable
from layerpy.turns import expand_in_turns

log = logging.getLogger("layerpy.api")
quiet = Throttle(log)

KEEPALIVE = 15.0  # seconds between comment lines on an idle stream (proxies close silent ones)
WRITE_TIMEOUT = 30.0  # seconds a stream's reader may take to accept a write before it ends
STREAM_QUEUE = 20_000  # changes queued for one slow stream before it is told of a gap
STREAM_BUDGET = 256 * 1024  # bytes a stream may have queued and not yet sent, then dropped
STREAM_BATCH = 0.05  # seconds a stream gathers changes before it writes them
ENCODED_KEPT = 4096  # changes kept encoded for the streams, the newest
TRIM_AFTER = 2.0  # seconds after a dropped stream before the heap is trimmed (once for many)
TAIL_DEFAULT = 64 * 1024  # bytes of a console log GET .../console answers
TAIL_LIMIT = 4 * 1024 * 1024
SHOWN_EXPANSION = 10_000  # names of an operator's call a filtered stream expands (a few ms)

NODES: web.AppKey[NodeStore] = web.AppKey("nodes", NodeStore)  # the operators' view of the nodes
CONSOLES: web.AppKey[Consoles] = web.AppKey("consoles", Consoles)
ORIGINS: web.AppKey[tuple[str, ...]] = web.AppKey("origins", tuple)
STREAMS: web.AppKey[set[Subscription]] = web.AppKey("streams", set)
ENCODED: web.AppKey[OrderedDict[int, bytes]] = web.AppKey("encoded", OrderedDict)
TRIMMING: web.AppKey[list[asyncio.TimerHandle]] = web.AppKey("trimming", list)  # one planned
DASHBOARD_FILES = {  # served as they are; nothing else of the package is
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
PUBLIC_PATHS = {"/", *(f"/dashboard/{name}" for name in DASHBOARD_FILES)}


def add_live_routes(
    app: web.Application, nodes: NodeStore, consoles: Consoles, origins: tuple[str, ...] = ()
) -> None:
    app[NODES] = nodes
    app[CONSOLES] = consoles
    app[ORIGINS] = origins
    app[STREAMS] = set()
    app[ENCODED] = OrderedDict()
    app[TRIMMING] = []
    app.on_shutdown.append(_end_streams)
    app.add_routes(
        [
            web.get("/api/v1/whoami", whoami),
            web.get("/api/v1/events/stream", event_stream, allow_head=False),  # no end, no HEAD
            web.get("/api/v1/nodes/{name}/console", console_log),
            web.get("/api/v1/nodes/{name}/console/attach", console_attach),
            web.get("/", dashboard_file),
            web.get("/dashboard/{file}", dashboard_file),
        ]
    )


def audit(request: web.Request, what: str, nodes: str = "") -> None:
    """One line and one ``operator`` event per change an operator makes (operator
    listeners only: the request carries who it is)."""
    operator = request[OPERATOR]
    message = f"{operator.name} from {operator.address}: {what}"
    logging.getLogger("layerpy.api").info("%s", message)
    fields = {"event": "operator", "who": operator.name, "from": operator.address}
    request.app[NODES].feed.publish(nodes, "event", fields, message)


async def whoami(request: web.Request) -> web.Response:
    """Who the API takes the caller for, and their scope (the dashboard offers actions
    only to admins)."""
    operator: Operator = request[OPERATOR]
    return web.json_response({"name": operator.name, "scope": str(operator.scope)})


# -- the event stream -----------------------------------------------------------------------


async def event_stream(request: web.Request) -> web.StreamResponse:
    """``GET /api/v1/events/stream[?nodes=HOSTLIST]``, resumable with ``Last-Event-ID``."""
    wanted = await _wanted(request)
    since = _last_event_id(request)
    subscription = request.app[NODES].feed.subscribe(since, STREAM_QUEUE)
    request.app[STREAMS].add(subscription)
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",  # a reverse proxy must pass each event on at once
    })  # fmt: skip
    outbox = _Outbox(request, response, subscription)
    try:
        await response.prepare(request)
        outbox.put(b"retry: 2000\n\n")
        while not outbox.broken:
            try:
                async with asyncio.timeout(KEEPALIVE):
                    first = await anext(subscription)
            except TimeoutError:
                data = b": keepalive\n\n"
            except StopAsyncIteration:
                break
            else:
                await asyncio.sleep(STREAM_BATCH)  # what comes meanwhile goes in one write
                batch = [first, *subscription.pending()]
                data = b"".join(_encoded(request.app, item) for item in batch
                                if _shown(item, wanted))  # fmt: skip
            if data and not outbox.put(data):
                _drop(request, outbox)
                break
    except (ConnectionError, TimeoutError):
        pass  # the watcher went away, or stopped reading
    finally:
        outbox.close()
        subscription.close()
        request.app[STREAMS].discard(subscription)
        if outbox.dropped:
            _give_back_memory(request.app)
    return response


class _Outbox:
    """What one stream has yet to send, sent in order by a task of its own, so that the
    stream's handler goes on taking changes off the feed (and sees a reader fall behind)
    while a write waits for the reader. When a write fails, the stream ends."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, subscription: Subscription
    ) -> None:
        self.request, self.response, self.subscription = request, response, subscription
        self.pending = bytearray()
        self.broken = False  # a write failed: the stream is over
        self.dropped = False  # it fell behind past its budget
        self._more = asyncio.Event()
        self._sender = asyncio.create_task(self._send())

    def queued(self) -> int:
        """Bytes not yet sent: here, and in the connection's buffer."""
        transport = self.request.transport
        return len(self.pending) + (transport.get_write_buffer_size() if transport else 0)

    def put(self, data: bytes) -> bool:
        """Queue `data`; False (and nothing queued) when it would pass the budget."""
        if self.queued() + len(data) > STREAM_BUDGET:
            return False
        self.pending += data
        self._more.set()
        return True

    async def _send(self) -> None:
        try:
            while True:
                await self._more.wait()
                self._more.clear()
                while self.pending:
                    data = bytes(self.pending)
                    self.pending.clear()
                    await _write(self.response, data)
        except (ConnectionError, TimeoutError):  # the watcher went away, or stopped reading
            self.broken = True
            self.subscription.end()  # wakes the stream's handler

    def close(self) -> None:
        self.pending.clear()
        self._sender.cancel()


def _drop(request: web.Request, outbox: _Outbox) -> None:
    """A reader too far behind: cut off at once, its buffers freed (an EventSource, and the
    dashboard, reconnect by themselves and resume with Last-Event-ID)."""
    request.app[STATS].count("http", "slow_reader", ok=False)
    operator: Operator = request[OPERATOR]
    quiet.log("slow event stream", logging.WARNING,
              "event stream of %s from %s dropped: %d bytes queued unread (budget %d)",
              operator.name, operator.address, outbox.queued(), STREAM_BUDGET)  # fmt: skip
    outbox.dropped = True
    outbox.close()
    if request.transport is not None:
        request.transport.abort()


_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere


def _give_back_memory(app: web.Application) -> None:
    """After dropped streams, once they have settled: hand the C library's free heap back
    to the system. glibc keeps what the dropped readers' buffers took (measured after 200
    were dropped: 73 MB of RSS stayed without this, 7 MB with it; docs/scale.md)."""
    if _trim is None or app[TRIMMING]:
        return

    def trim() -> None:
        app[TRIMMING].clear()
        _trim(0)

    app[TRIMMING].append(asyncio.get_running_loop().call_later(TRIM_AFTER, trim))


async def _write(response: web.StreamResponse, data: bytes) -> None:
    """A write the reader must take within WRITE_TIMEOUT (one that stops reading would
    hold the handler, and a stop of the server, for as long as it likes)."""
    async with asyncio.timeout(WRITE_TIMEOUT):
        await response.write(data)


async def _wanted(request: web.Request) -> set[str] | None:
    expression = request.query.get("nodes")
    if not expression:
        return None
    try:
        return set(await expand_in_turns(expression))
    except hostlist.HostlistError as error:
        raise web.HTTPBadRequest(text=f"nodes: {printable(error)}\n") from None


def _last_event_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID") or request.query.get("since")
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise web.HTTPBadRequest(text="Last-Event-ID must be an event's number\n")
    return int(raw)


def _shown(item: Change | object, wanted: set[str] | None) -> bool:
    """Whether a stream filtered to `wanted` nodes carries this change: a gap always; an
    operator's call when it names one of them (as a hostlist), or more nodes than are
    worth expanding for each stream (SHOWN_EXPANSION)."""
    if wanted is None or not isinstance(item, Change):
        return True
    if item.node in wanted:
        return True
    if item.kind == "event" and item.fields.get("event") == "operator" and item.node:
        try:
            return not wanted.isdisjoint(hostlist.expand(item.node, SHOWN_EXPANSION))
        except hostlist.HostlistError:
            return True  # validated when the call was made: only too large here
    return False


def _encoded(app: web.Application, item: Change | object) -> bytes:
    """A change as an event of the stream, encoded once for all the streams: a stream's
    own copies would be as many small objects as readers, scattered between the ones the
    feed keeps, and the heap they took would stay taken after the readers went."""
    if item is GAP or not isinstance(item, Change):
        return b"event: gap\ndata: {}\n\n"
    kept = app[ENCODED]
    event = kept.get(item.seq)
    if event is None:
        data = json.dumps(item.as_json(), separators=(",", ":"), default=str)
        event = kept[item.seq] = f"id: {item.seq}\nevent: {item.kind}\ndata: {data}\n\n".encode()
        if len(kept) > ENCODED_KEPT:
            kept.popitem(last=False)
    return event


async def _end_streams(app: web.Application) -> None:
    for subscription in list(app[STREAMS]):
        subscription.end()


# -- consoles -----------------------------------------------------------------------------


def _console_of(request: web.Request) -> str:
    name = request.match_info["name"]
    if name not in request.app[NODES].nodes:
        raise web.HTTPNotFound(text=f"no node named {printable(name, 64)}\n")
    consoles = request.app[CONSOLES]
    if not consoles.has(name):
        if (elsewhere := consoles.elsewhere(name)) is not None:
            raise web.HTTPConflict(text=elsewhere + "\n")
        raise web.HTTPConflict(
            text=f'{name} has no console: give its bmc a console ("sol", or the path of '
            "its serial socket) in the node file\n"
        )
    return name


async def console_log(request: web.Request) -> web.Response:
    """``GET /api/v1/nodes/NAME/console?bytes=N``: the tail of what the node printed."""
    name = _console_of(request)
    raw = request.query.get("bytes", str(TAIL_DEFAULT))
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= TAIL_LIMIT:
        raise web.HTTPBadRequest(text=f"bytes must be 1 to {TAIL_LIMIT}\n")
    data = request.app[CONSOLES].tail(name, int(raw))
    return web.Response(body=data, content_type="text/plain", charset="utf-8")


async def console_attach(request: web.Request) -> web.WebSocketResponse:
    """A WebSocket on a node's console: binary messages are its bytes both ways (an
    operator with the read scope only watches), text messages are notices. An admin's
    session is an operator event, begun and ended. Only from the dashboard's own origin,
    a configured one, or a client that names none (the CLI)."""
    _same_site(request)
    name = _console_of(request)
    consoles = request.app[CONSOLES]
    operator: Operator = request[OPERATOR]
    typing = operator.scope == Scope.ADMIN
    socket = web.WebSocketResponse(max_msg_size=KEYSTROKES, heartbeat=30.0)
    await socket.prepare(request)
    queue = consoles.attach(name)
    if typing:
        audit(request, f"console {name} attached", name)
    else:
        log.info("%s: console watched by %s from %s", name, operator.name, operator.address)
    await socket.send_bytes(consoles.tail(name, SEEN_ON_ATTACH))
    if consoles.state(name) != "connected":
        await socket.send_str(f"console of {name}: {consoles.state(name)}")
    if not typing:
        await socket.send_str(f"{operator.name} may only read: watching, keystrokes are dropped")
    sender = asyncio.create_task(_send_console(socket, queue))
    try:
        async for message in socket:
            sent = message.type == WSMsgType.BINARY and typing
            if sent and not await consoles.type(name, message.data):
                await socket.send_str(f"console of {name} is not connected: not sent")
    finally:
        sender.cancel()
        consoles.detach(name, queue)
        if typing:
            audit(request, f"console {name} detached", name)
    return socket


def _same_site(request: web.Request) -> None:
    """403 for a WebSocket a page of another site opens: a browser sends its ``Origin``,
    which must be the one the dashboard was served from (scheme and ``Host`` of this
    request) or one of ``[api] origins``."""
    sent = request.headers.get(hdrs.ORIGIN)
    if sent is None:
        return
    own = f"{request.scheme}://{request.host}"
    allowed = set(request.app[ORIGINS])
    with contextlib.suppress(ValueError):
        allowed.add(values.origin(own))
    with contextlib.suppress(ValueError):
        if values.origin(sent) in allowed:
            return
    request.app[STATS].count("http", "cross_origin", ok=False)
    operator: Operator = request[OPERATOR]
    quiet.log("cross-site console", logging.WARNING,
              "refused a console WebSocket of %s from %s: Origin %s is not %s",
              operator.name, operator.address, printable(sent, 100),
              printable(own, 100))  # fmt: skip
    raise web.HTTPForbidden(
        text=f"a console opened from {printable(sent, 100)} is refused: only from this "
        f"dashboard ({printable(own, 100)}) or an origin of [api] origins in the node file\n"
    )


async def _send_console(socket: web.WebSocketResponse, queue: asyncio.Queue[bytes | None]) -> None:
    with contextlib.suppress(ConnectionError):
        while (item := await queue.get()) is not None:
            if isinstance(item, Notice):
                await socket.send_str(item.decode())
            else:
                await socket.send_bytes(item)
        await socket.close()


# -- the dashboard --------------------------------------------------------------------------


async def dashboard_file(request: web.Request) -> web.Response:
    name = request.match_info.get("file", "index.html")
    if name not in DASHBOARD_FILES:
        raise web.HTTPNotFound()
    body = resources.files("layerpy.dashboard").joinpath(name).read_bytes()
    return web.Response(body=body, content_type=DASHBOARD_FILES[name], headers=_PAGE_HEADERS)


# The page runs only its own script and talks only to its own origin: node-supplied text
# can never become script there, even if some rendering slipped.
_PAGE_HEADERS: dict[str, Any] = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
