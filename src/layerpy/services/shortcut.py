"""A node's iPXE script, answered in the boot listener's own protocol.

Every boot fetches its script on a connection of its own, and aiohttp's request handler
(a task per connection, a request object, the app's router and middleware, a response
object and its writer) cost four times what nginx spends on such a request
(bench/http_requests.py, docs/scale.md). The common case is simple: one segment that
holds one whole GET of /boot/NAME.ipxe, no body, from the node's own address. That case
is parsed by aiohttp's own parser (the one its handler would use, with the same limits),
answered with the bytes aiohttp would send, and counted and logged as the ``profile``
middleware would. Anything else (a partial or pipelined request, another method or path,
an Expect or an upgrade, a refusal, a cluster's script that waits for etcd) is declined,
and the connection goes to aiohttp from that segment on, as if it had come in then: the
general path answers it, and it stays the reference (tests/unit/test_shortcut.py
feeds both generated and fuzzed requests and requires the same answers).
"""

from __future__ import annotations

import asyncio
import re
import time

from aiohttp import hdrs
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import (
    SERVER_SOFTWARE,
    HttpProcessingError,
    HttpRequestParser,
    HttpVersion10,
    HttpVersion11,
)
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web import Application

from layerpy.services.http import BOOTER, LOG_REQUESTS, SCRIPT_ROUTE, STATS, log
from layerpy.text import printable

LONGEST = 8192  # bytes of a request taken here; a longer one goes to aiohttp
LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}  # aiohttp's
# the route's names without the characters a URL may encode: here the raw path is the path
TARGET = re.compile(r"/boot/([A-Za-z0-9_.-]+)\.ipxe")
KIND = f"GET {SCRIPT_ROUTE}"  # the metrics' kind, as the profile middleware names it
RESPONSE_HEAD = (
    "HTTP/1.{minor} 200 OK\r\n"
    "Content-Type: text/plain; charset=utf-8\r\n"
    "Content-Length: {length}\r\n"
    "Date: {date}\r\n"
    f"Server: {SERVER_SOFTWARE}\r\n"
    "{connection}\r\n"
)
CONNECTION = {  # (HTTP/1.1, closing): what aiohttp says of the connection
    (False, False): "Connection: keep-alive\r\n",
    (True, True): "Connection: close\r\n",
}


class ScriptShortcut:
    """Called with a connection's segment and its peer's address: the response's bytes
    and whether to close after them, or None (declined: aiohttp's handler takes it)."""

    def __init__(self, app: Application) -> None:
        self.booter, self.stats, self.log_requests = app[BOOTER], app[STATS], app[LOG_REQUESTS]
        self.loop = asyncio.get_running_loop()
        # what the parser calls for a body's or an upgrade's flow control (no transport:
        # nothing to pause; such a request is declined anyway)
        self.unconnected = BaseProtocol(self.loop)

    def __call__(self, data: bytes, remote: str) -> tuple[bytes, bool] | None:
        started = time.perf_counter()
        if (  # one whole GET, nothing after it: its head ends with the segment (no body)
            not data.startswith(b"GET ")
            or len(data) > LONGEST
            or data.find(b"\r\n\r\n") != len(data) - 4
        ):
            return None
        parser = HttpRequestParser(self.unconnected, self.loop, 2**16, **LIMITS)
        try:
            messages, upgraded, tail = parser.feed_data(data)
        except HttpProcessingError:
            return None
        if len(messages) != 1 or upgraded or tail:
            return None
        message, payload = messages[0]
        if (
            message.method != "GET"
            or message.version not in (HttpVersion10, HttpVersion11)
            or payload is not EMPTY_PAYLOAD
            or hdrs.EXPECT in message.headers
            or (target := TARGET.fullmatch(message.path)) is None
        ):
            return None
        script = self.booter.script_now(target[1], remote)
        if script is None:
            return None
        body, close = script.encode(), message.should_close
        connection = CONNECTION.get((message.version == HttpVersion11, close), "")
        head = RESPONSE_HEAD.format(
            minor=message.version.minor,
            length=len(body),
            date=rfc822_formatted_time(),
            connection=connection,
        )
        elapsed = time.perf_counter() - started
        self.stats.observe("http", KIND, elapsed)
        if self.log_requests:
            log.debug("%s GET %s -> 200 in %.1f ms", remote, printable(message.path),
                      elapsed * 1000)  # fmt: skip
        return head.encode() + body, close
