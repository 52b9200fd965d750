"""HTTP on the boot network: only what firmware and agents need.

iPXE scripts (each only to its node's address), the minOS kernel and initrd, the agent's
report endpoint, and image files (only to a node the image is assigned to, or an
operator). Everything an operator does goes through `services.api` on other listeners.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter

from layerpy.boot import MINOS_FILES, Booter, Refused, SignedOnly
from layerpy.catalog import Catalog
from layerpy.logs import Throttle
from layerpy.model import Phase
from layerpy.nodes import DISCOVERY, Ack, ReportRejected
from layerpy.proto import beat
from layerpy.proto.agent import (
    FILES_PATH,
    REPORT_PATH,
    Answer,
    FilesSpec,
    Identity,
    ImageSpec,
    encode,
    parse_node_authorization,
)
from layerpy.services.beats import Beats
from layerpy.stats import Stats
from layerpy.text import printable

log = logging.getLogger("layerpy.http")
quiet = Throttle(log)  # lines a client can cause: a few a minute each

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
BODY_TIMEOUT = 10.0  # seconds to send a request body (the idle timeout covers headers)
BODY_LIMIT = 1024 * 1024  # bytes of a request body on the boot network


class PowerControl(Protocol):
    """What the API needs of the lifecycle (kept abstract: services never import power)."""

    def override(self, name: str, power: str | None) -> None: ...
    def override_image(self, name: str, image: str) -> None: ...
    async def cycle(self, name: str) -> None: ...
    def status(self, name: str) -> dict[str, Any]: ...
    def plan(self, name: str) -> dict[str, Any]: ...
    def explain(self, name: str) -> dict[str, Any]: ...
    def image_spec(self, name: str) -> ImageSpec | None: ...
    def files_spec(self, name: str) -> FilesSpec | None: ...
    def file_content(self, name: str, digest: str) -> bytes | None: ...
    def answer_basis(self, name: str) -> tuple[object, ...]: ...


BOOTER: web.AppKey[Booter] = web.AppKey("booter")
STATS: web.AppKey[Stats] = web.AppKey("stats", Stats)
LOG_REQUESTS: web.AppKey[bool] = web.AppKey("log_requests", bool)
TURNS: web.AppKey[asyncio.Semaphore] = web.AppKey("turns", asyncio.Semaphore)
POWER: web.AppKey[PowerControl] = web.AppKey("power")
CATALOG: web.AppKey[Catalog] = web.AppKey("catalog", Catalog)
BEATS: web.AppKey[Beats | None] = web.AppKey("beats")
OPERATOR = "operator"  # request key: the authenticated operator (operator listeners only)
TRANSFERS = 64  # files sent at once; the others wait their turn (a storm queues, not fails)
CHUNK = 256 * 1024  # bytes read at a time where sendfile cannot go (TLS)
IMAGE_FILES = ("rootfs.tar", "rootfs.squashfs", "config.json")
METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))
SCRIPT_ROUTE = "/boot/{name}.ipxe"  # also answered by services.shortcut


def share(
    app: web.Application,
    booter: Booter,
    stats: Stats,
    power: PowerControl,
    catalog: Catalog,
    log_requests: bool,
) -> None:
    """What the handlers of both HTTP apps (boot network, operators) find on their app."""
    app[CATALOG] = catalog
    app[POWER] = power
    app[TURNS] = asyncio.Semaphore(TRANSFERS)
    app[BOOTER] = booter
    app[STATS] = stats
    app[LOG_REQUESTS] = log_requests


def build_app(
    booter: Booter,
    stats: Stats,
    power: PowerControl,
    catalog: Catalog,
    *,
    beats: Beats | None = None,
    log_requests: bool = False,
) -> web.Application:
    """The boot network's app; `beats` hands out beat keys (None: no datagram beats)."""
    app = web.Application(middlewares=[profile], client_max_size=BODY_LIMIT)
    share(app, booter, stats, power, catalog, log_requests)
    app[BEATS] = beats
    app.add_routes(
        [
            web.get(SCRIPT_ROUTE, boot_script),
            web.get("/boot/discover/{mac}.ipxe", discovery_script),
            web.get("/ipxe/{file}", ipxe_file),
            *(web.get(f"/{name}", minos_file) for name in MINOS_FILES),
            web.post(REPORT_PATH, agent_report),
            web.get("/images/{digest}/{file}", image_file),
            web.get(FILES_PATH + "{digest}", node_file),
        ]
    )
    return app


@web.middleware
async def profile(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Service time per route, and per-request debug lines when asked for."""
    started = time.perf_counter()
    route = request.match_info.route
    if route.resource is not None:
        kind = f"{route.method} {route.resource.canonical}"
    else:  # no route (404, 405): the method is the client's word, from a fixed set
        kind = f"{request.method if request.method in METHODS else 'other'} unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    finally:
        elapsed = time.perf_counter() - started
        request.app[STATS].observe("http", kind, elapsed, ok=status < 400)
        if request.app[LOG_REQUESTS]:
            log.debug(
                "%s %s %s -> %d in %.1f ms",
                request.remote,
                request.method,
                printable(request.path),
                status,
                elapsed * 1000,
            )


async def boot_script(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        script = await request.app[BOOTER].script(name, request.remote or "")
    except Refused as whom:
        quiet.log("boot script refused", logging.WARNING, "%s: refused its boot script to %s", name,
                  request.remote)  # fmt: skip
        raise web.HTTPForbidden(text=f"the boot script of {name} is only for {whom}\n") from None
    except SignedOnly:
        quiet.log("boot script refused", logging.WARNING, "%s: refused an iPXE script to %s: "
                  "secure_boot = true", name, request.remote)  # fmt: skip
        text = f"{name} boots by the signed path only (secure_boot = true): no iPXE script\n"
        raise web.HTTPForbidden(text=text) from None
    if script is None:
        raise web.HTTPNotFound(text=f"no node named {name!r}\n")
    return web.Response(text=script, content_type="text/plain")


async def discovery_script(request: web.Request) -> web.Response:
    """The minOS for a machine no node claims yet, for the address it got from the pool."""
    mac = request.match_info["mac"].lower()
    try:
        script = request.app[BOOTER].discovery_script(mac, request.remote or "")
    except Refused as address:
        refusal = f"the discovery boot of {mac} is only for {address}\n"
        raise web.HTTPForbidden(text=refusal) from None
    if script is None:
        raise web.HTTPNotFound(text=f"no discovery boot for {mac}\n")
    return web.Response(text=script, content_type="text/plain")


async def ipxe_file(request: web.Request) -> QueuedFile:
    """An iPXE binary of the node file, for UEFI HTTP boot (the rest of ipxe.dir is not
    served: TFTP serves that directory, HTTP only the binaries named)."""
    booter = request.app[BOOTER]
    ipxe = booter.config.ipxe
    name = request.match_info["file"]
    if name not in (ipxe.bios, ipxe.uefi, ipxe.arm64):
        raise web.HTTPNotFound(text=f"no iPXE binary {printable(name, 64)} here\n")
    booter.fetched(request.remote or "", Phase.TFTP)
    return QueuedFile(ipxe.directory / name)


async def minos_file(request: web.Request) -> QueuedFile:
    """A minOS's kernel or initramfs (MINOS_FILES: the x86-64 one, or another arch's)."""
    booter = request.app[BOOTER]
    arch, phase = MINOS_FILES[request.path.lstrip("/")]
    files = booter.config.minos.files(arch)
    if files is None:
        raise web.HTTPNotFound(text=f"no {arch} minOS here (minos/build.sh --arch {arch})\n")
    booter.fetched(request.remote or "", phase)
    return QueuedFile(files[phase is Phase.INITRD])


async def agent_report(request: web.Request) -> web.Response:
    payload = await read_json(request)
    try:
        ack = await request.app[BOOTER].report(payload)
    except ReportRejected as rejected:
        return web.json_response(refusal(rejected, request.remote), status=rejected.status)
    return web.json_response(report_answer(request.app, payload, ack))


def refusal(rejected: ReportRejected, remote: str | None) -> dict[str, str]:
    """A refused report's answer (its status is the refusal's); logged a few a minute."""
    quiet.log("report rejected", logging.WARNING, "rejected an agent report from %s: %s",
              remote or "?", rejected.reason)  # fmt: skip
    return {"error": rejected.reason}


def report_answer(app: web.Application, payload: Any, ack: Ack) -> dict[str, Any]:
    """The answer to an admitted report (services.shortcut answers with it too)."""
    booter, power = app[BOOTER], app[POWER]
    heartbeat = booter.config.server.heartbeat
    servers = booter.servers_of(ack.node)  # alone, it says nothing: agents keep theirs
    servers = servers if len(servers) > 1 else None
    if ack.node == DISCOVERY:
        return encode(Answer(ack.node, heartbeat, identity=ack.identity, servers=servers))
    image, files = power.image_spec(ack.node), power.files_spec(ack.node)
    beats = app[BEATS]
    offer = None
    if beats is not None and ack.identity is None and beat.speaks(payload["protocol"]):
        offer = beats.offer(ack.node, payload["seq"])
    return encode(Answer(ack.node, heartbeat, image, files, ack.identity, servers, offer))


async def image_file(request: web.Request) -> web.StreamResponse:
    """A flattened image (tar or squashfs, with Range) or its config, by manifest digest:
    to an operator, or to a node the image is assigned to (it may be private)."""
    digest, name = request.match_info["digest"], request.match_info["file"]
    if OPERATOR not in request:
        _check_entitled(request, digest)
    image = request.app[CATALOG].store.get(digest)
    if image is None or name not in IMAGE_FILES:
        raise web.HTTPNotFound(text=f"no {printable(name, 40)} for image {printable(digest, 80)}\n")
    if name == "config.json":
        return web.json_response(image.config)
    path = image.rootfs if name == "rootfs.tar" else image.squashfs
    if path is None:
        raise web.HTTPNotFound(text=f"image {digest} has no squashfs (tar2sqfs missing)\n")
    return QueuedFile(path)


class QueuedFile(web.StreamResponse):
    """A file sent in its turn: at most TRANSFERS at once per app. A thousand nodes
    fetching 16 MB each at once held 16 GB of socket buffers against the kernel's TCP
    memory limit, and a few transfers stalled for a minute (bench/storm.py); in turns,
    each goes at full speed and the whole is no slower. The turn covers the headers too,
    so a waiting client sees a slow server, never an error.

    Not aiohttp's FileResponse: that stats, opens and closes the file in the thread pool,
    three round trips that cost more CPU than the rest of the request (bench/http_files.py,
    docs/scale.md). Boot files and images are local, so this opens and stats them here;
    the open descriptor pins the file for the whole transfer, so a file replaced on disk
    (renamed over) is sent whole, old or new, never a mix. With GET, HEAD, a single Range
    (If-Range), If-None-Match and If-Modified-Since, as FileResponse answered them."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        async with request.app[TURNS]:
            try:
                file = open(self.path, "rb")  # noqa: SIM115 (closed below, after the send)
            except OSError:
                self.set_status(404)
                return await super().prepare(request)
            with file:
                return await self._send(request, file)

    async def _send(self, request: web.BaseRequest, file: BinaryIO) -> AbstractStreamWriter | None:
        stat = os.fstat(file.fileno())
        size, etag = stat.st_size, f"{stat.st_mtime_ns:x}-{stat.st_size:x}"
        self.etag, self.last_modified = etag, stat.st_mtime
        self.headers[hdrs.ACCEPT_RANGES] = "bytes"
        self.content_type = "application/octet-stream"
        if _not_modified(request, etag, stat.st_mtime):
            self.set_status(304)
            return await super().prepare(request)
        try:
            span = request.http_range if _same(request, etag, stat.st_mtime) else slice(None)
        except ValueError:
            span = slice(size, None)  # unreadable: 416
        start, end = span.start, span.stop
        if start is not None:
            if start < 0 and end is None:  # the last -start bytes
                start = max(0, size + start)
            end = size if end is None else min(end, size)
            if start >= size or start >= end:
                self.headers[hdrs.CONTENT_RANGE] = f"bytes */{size}"
                self.set_status(416)
                return await super().prepare(request)
            self.set_status(206)
            self.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{end - 1}/{size}"
        start, end = start or 0, size if end is None else end
        self.content_length = end - start
        writer = await super().prepare(request)
        assert writer is not None
        if request.method != "HEAD" and end > start:
            await _send_file(request, writer, file, start, end - start)
        await self.write_eof()
        return writer


async def _send_file(
    request: web.BaseRequest, writer: AbstractStreamWriter, file: BinaryIO, at: int, count: int
) -> None:
    """`count` bytes of `file` from `at` on the request's connection, by sendfile(2) on a
    duplicate of its socket: uvloop has no loop.sendfile (aiohttp then reads the file into
    Python in the thread pool), and asyncio's costs an epoll change per wake-up. Through
    TLS (operators' image downloads) the bytes go through the transport instead.

    A client that takes no byte for ``send_timeout`` seconds is dropped, so that it cannot
    keep its turn. One timer per transfer watches for that: each send moves the time of
    the last progress, and the timer, when it fires, waits on from there. (Through TLS
    each 256 KiB chunk has that long to leave.)"""
    transport = request.transport
    if transport is None:
        raise ConnectionResetError("connection lost")
    loop = asyncio.get_running_loop()
    timeout = request.app[BOOTER].config.server.send_timeout
    if transport.get_extra_info("sslcontext") is not None:
        while count > 0:
            chunk = await loop.run_in_executor(None, os.pread, file.fileno(), CHUNK, at)
            if not chunk:
                raise ConnectionResetError(f"{file.name} shrank while sent")
            try:
                async with asyncio.timeout(timeout):  # a chunk: 256 KiB, a few wake-ups
                    await writer.write(chunk[:count])
            except TimeoutError:
                raise _stalled(request, file.name, timeout) from None
            at, count = at + len(chunk), count - len(chunk)
        return
    while transport.get_write_buffer_size():  # the headers first (a full socket buffer)
        await asyncio.sleep(0.001)
    socket = os.dup(transport.get_extra_info("socket").fileno())
    wake: asyncio.Future[None] = loop.create_future()
    progress = loop.time()

    def writable() -> None:
        if not wake.done():
            wake.set_result(None)

    def watch() -> None:
        nonlocal timer
        if loop.time() - progress >= timeout and not wake.done():
            wake.set_exception(TimeoutError())
        else:
            timer = loop.call_at(progress + timeout, watch)

    timer = loop.call_at(progress + timeout, watch)
    loop.add_writer(socket, writable)  # for the whole transfer: one epoll change, not many
    try:
        while count > 0:
            try:
                sent = os.sendfile(socket, file.fileno(), at, count)
            except BlockingIOError:
                sent = -1
            if sent == 0:
                raise ConnectionResetError(f"{file.name} shrank while sent")
            if sent > 0:
                at, count, progress = at + sent, count - sent, loop.time()
            if count > 0:  # the socket's buffer is full: wait for room
                wake = loop.create_future()
                try:
                    await wake
                except TimeoutError:
                    raise _stalled(request, file.name, timeout) from None
    finally:
        timer.cancel()
        loop.remove_writer(socket)
        os.close(socket)


def _stalled(request: web.BaseRequest, name: str, timeout: float) -> ConnectionResetError:
    """Reset a client that took nothing for `timeout` seconds; counted, and said once in a
    while (a client may stall on purpose). Returns the error to raise."""
    if request.transport is not None:
        request.transport.abort()
    remote = request.remote or "?"
    request.app[STATS].count("http", "stalled", ok=False)
    quiet.log("stalled", logging.WARNING, "dropped the transfer of %s to %s: it took nothing in "
              "%g s (send_timeout)", Path(name).name, remote, timeout)  # fmt: skip
    return ConnectionResetError(f"no room to send for {timeout:g} s")


def _not_modified(request: web.BaseRequest, etag: str, mtime: float) -> bool:
    """304: the client's copy (named by ETag, else by date) is this file."""
    if (tags := request.if_none_match) is not None:
        return any(tag.value in (etag, "*") for tag in tags)
    since = request.if_modified_since
    return since is not None and int(mtime) <= since.timestamp()


def _same(request: web.BaseRequest, etag: str, mtime: float) -> bool:
    """A Range applies: no If-Range, or it names this very file (else the whole file)."""
    if (tag := request.headers.get(hdrs.IF_RANGE)) is None:
        return True
    since = request.if_range
    return tag.strip('"') == etag if since is None else int(mtime) <= since.timestamp()


def _check_entitled(request: web.Request, digest: str) -> None:
    """403 unless the request carries the boot token of a node assigned this image."""
    claimed = _node(request, "image files are for the nodes that run them")
    spec = request.app[POWER].image_spec(claimed.node)
    if spec is None or spec.digest != digest:
        quiet.log("image refused", logging.WARNING, "%s: refused image %s, not assigned to it",
                  claimed.node, printable(digest, 80))  # fmt: skip
        raise web.HTTPForbidden(text=f"image {printable(digest, 80)} is not {claimed.node}'s\n")


async def node_file(request: web.Request) -> web.Response:
    """One of a node's own files (a rendered template or a secret), by digest: only to that
    node, by its boot token, and only while the node file gives it that file."""
    claimed = _node(request, "a node's files are for that node only")
    digest = request.match_info["digest"]
    content = request.app[POWER].file_content(claimed.node, digest)
    if content is None:
        quiet.log("file refused", logging.WARNING, "%s: refused file %s, not one of its files",
                  claimed.node, printable(digest, 80))  # fmt: skip
        raise web.HTTPForbidden(text=f"{printable(digest, 80)} is no file of {claimed.node}\n")
    headers = {"Cache-Control": "no-store"}
    return web.Response(body=content, content_type="application/octet-stream", headers=headers)


def _node(request: web.Request, refusal: str) -> Identity:
    """The node whose boot token the request carries; 403 with `refusal` otherwise."""
    claimed = parse_node_authorization(request.headers.get("Authorization"))
    if claimed is None or not request.app[BOOTER].holds_token(claimed.node, claimed.token):
        raise web.HTTPForbidden(text=refusal + "\n")
    return claimed


async def read_json(request: web.Request) -> Any:
    """The request's JSON body: 413 when it is larger than the app's ``client_max_size``
    (told by its length before any is read, else as soon as it is read past it); 400
    (never 500) when it is slow, not JSON, nested too deep, or holds text that is not
    Unicode (a lone surrogate)."""
    if (request.content_length or 0) > request.client_max_size:
        raise _too_large(request)
    try:
        async with asyncio.timeout(BODY_TIMEOUT):
            raw = await request.read()
        body = json_body(raw)
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(request) from None
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the body took over {BODY_TIMEOUT:g} s\n") from None
    except RecursionError:
        raise web.HTTPBadRequest(text="the body is nested too deep\n") from None
    except UnicodeError:
        raise web.HTTPBadRequest(text="the body is not valid Unicode text\n") from None
    except ValueError:
        raise web.HTTPBadRequest(text="the body must be JSON\n") from None
    return body


def json_body(raw: bytes) -> Any:
    """JSON as a body holds it; raises ValueError (not JSON), RecursionError (nested too
    deep) or UnicodeError (a lone surrogate, which json.loads lets through). UTF-8 in
    ASCII without a \\u escape cannot hold one (UTF-16 and -32 hold NULs): only other text
    is encoded again to find out."""
    body = json.loads(raw)
    if not raw.isascii() or b"\\u" in raw or b"\0" in raw:
        json.dumps(body, ensure_ascii=False).encode()  # lone surrogates fail here
    return body


def _too_large(request: web.Request) -> web.HTTPRequestEntityTooLarge:
    limit = request.client_max_size
    return web.HTTPRequestEntityTooLarge(
        limit, request.content_length or 0, text=f"the body is over {limit} bytes, the limit\n"
    )
