"""A node's iPXE script and its agent's report, answered in the boot listener's own protocol.

Every boot fetches its script on a connection of its own, and an agent of the last release
reports every heartbeat on one; aiohttp's request handler (a task per connection, a
request object, the app's router and middleware, a response object and its writer) cost
four times what nginx spends on such a request (bench/http_requests.py, bench/steady.py,
docs/scale.md). The common cases are simple: one whole GET of /boot/NAME.ipxe from the
node's own address, and one whole POST of a report with its JSON body (urllib sends the
head and the body in two segments: the head is kept until the body follows). They are
parsed by aiohttp's own parser (the one its handler would use, with the same limits),
handled by the same functions as aiohttp's handlers, answered with the bytes aiohttp would
send, and counted and logged as the ``profile`` middleware would. Anything else (a partial
or pipelined request, another method or path, an Expect or an upgrade, a compressed or
chunked body, a body that is not JSON, a refusal of the script, a report whose token is
to be read again from etcd) is declined, and the connection goes to aiohttp from that
segment on, as if it had come in then: the general path answers it, and it stays the
reference (tests/unit/test_shortcut.py feeds both generated and fuzzed requests and
requires the same answers).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from http import HTTPStatus

from aiohttp import hdrs
from aiohttp.base_protocol import BaseProtocol
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import (
    SERVER_SOFTWARE,
    HttpProcessingError,
    HttpRequestParser,
    HttpVersion10,
    HttpVersion11,
    RawRequestMessage,
)
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web import Application

from layerpy.nodes import ReportRejected
from layerpy.proto.agent import REPORT_PATH
from layerpy.services.http import (
    BODY_LIMIT,
    BOOTER,
    LOG_REQUESTS,
    SCRIPT_ROUTE,
    STATS,
    json_body,
    log,
    refusal,
    report_answer,
)
from layerpy.services.listeners import MORE, ShortcutAnswer
from layerpy.text import printable

LONGEST = 65536  # bytes of a request taken here; a longer one goes to aiohttp
LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}  # aiohttp's
# the route's names without the characters a URL may encode: here the raw path is the path
TARGET = re.compile(r"/boot/([A-Za-z0-9_.-]+)\.ipxe")
SCRIPT, REPORT = f"GET {SCRIPT_ROUTE}", f"POST {REPORT_PATH}"  # the metrics' kinds
PLAIN, JSON = "text/plain; charset=utf-8", "application/json; charset=utf-8"
RESPONSE_HEAD = (
    "HTTP/1.{minor} {status} {reason}\r\n"
    "Content-Type: {content_type}\r\n"
    "Content-Length: {length}\r\n"
    "Date: {date}\r\n"
    f"Server: {SERVER_SOFTWARE}\r\n"
    "{connection}\r\n"
)
CONNECTION = {  # (HTTP/1.1, closing): what aiohttp says of the connection
    (False, False): "Connection: keep-alive\r\n",
    (True, True): "Connection: close\r\n",
}


class Shortcut:
    """Called with a connection's bytes and its peer's address: the response's bytes and
    whether to close after them, MORE (a report's head: keep it for its body), or None
    (declined: aiohttp's handler takes them)."""

    def __init__(self, app: Application) -> None:
        self.app = app
        self.booter, self.stats, self.log_requests = app[BOOTER], app[STATS], app[LOG_REQUESTS]
        self.loop = asyncio.get_running_loop()
        # what the parser calls for a body's or an upgrade's flow control (no transport:
        # nothing to pause; only the head is parsed here)
        self.unconnected = BaseProtocol(self.loop)

    def __call__(self, data: bytes, remote: str) -> ShortcutAnswer:
        started = time.perf_counter()
        end = data.find(b"\r\n\r\n") + 4
        if end < 4 or len(data) > LONGEST or not data.startswith((b"GET ", b"POST ")):
            return None
        message = self._head(data[:end])
        if message is None:
            return None
        if message.method == "GET" and end == len(data):  # nothing after it: no body
            return self._script(message, remote, started)
        if message.method == "POST" and message.path == REPORT_PATH:
            return self._report(message, data[end:], remote, started)
        return None

    def _head(self, head: bytes) -> RawRequestMessage | None:
        """One whole request head, as aiohttp's parser reads it, of a kind taken here."""
        parser = HttpRequestParser(self.unconnected, self.loop, 2**16, **LIMITS)
        try:
            messages, upgraded, tail = parser.feed_data(head)
        except HttpProcessingError:
            return None
        if len(messages) != 1 or upgraded or tail:
            return None
        message, payload = messages[0]
        if (
            message.version not in (HttpVersion10, HttpVersion11)
            or hdrs.EXPECT in message.headers
            or message.chunked
            or message.compression is not None
            or (message.method == "GET") != (payload is EMPTY_PAYLOAD)
        ):
            return None
        return message

    def _script(self, message: RawRequestMessage, remote: str, started: float) -> ShortcutAnswer:
        target = TARGET.fullmatch(message.path)
        if target is None:
            return None
        script = self.booter.script_now(target[1], remote)
        if script is None:
            return None
        return self._respond(message, remote, SCRIPT, 200, PLAIN, script.encode(), started)

    def _report(
        self, message: RawRequestMessage, body: bytes, remote: str, started: float
    ) -> ShortcutAnswer:
        said = message.headers.get(hdrs.CONTENT_LENGTH, "")  # (the parser checked it too)
        if not (said.isascii() and said.isdigit()):
            return None
        length = int(said)
        if not 0 < length <= BODY_LIMIT or len(body) > length:
            return None
        if len(body) < length:
            return MORE
        try:
            payload = json_body(body)
        except (ValueError, RecursionError):  # (UnicodeError is a ValueError)
            return None
        try:
            ack = self.booter.report_now(payload)
        except ReportRejected as rejected:
            answer, status = refusal(rejected, remote), rejected.status
        else:
            if ack is None:
                return None
            answer, status = report_answer(self.app, payload, ack), 200
        return self._respond(message, remote, REPORT, status, JSON, json.dumps(answer).encode(),
                             started)  # fmt: skip

    def _respond(
        self,
        message: RawRequestMessage,
        remote: str,
        kind: str,
        status: int,
        content_type: str,
        body: bytes,
        started: float,
    ) -> tuple[bytes, bool]:
        """aiohttp's bytes for the answer, counted and logged as the profile middleware."""
        close = message.should_close
        head = RESPONSE_HEAD.format(
            minor=message.version.minor,
            status=status,
            reason=HTTPStatus(status).phrase,
            content_type=content_type,
            length=len(body),
            date=rfc822_formatted_time(),
            connection=CONNECTION.get((message.version == HttpVersion11, close), ""),
        )
        elapsed = time.perf_counter() - started
        self.stats.observe("http", kind, elapsed, ok=status < 400)
        if self.log_requests:
            log.debug("%s %s %s -> %d in %.1f ms", remote, message.method,
                      printable(message.path), status, elapsed * 1000)  # fmt: skip
        return head.encode() + body, close
