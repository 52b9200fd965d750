"""The operator API as the CLI reaches it: the Unix socket on the head node, or HTTPS with
a token from anywhere else.

On the head node nothing needs to be given: the socket is found from the node file
(``[api] socket``, else ``api.sock`` in ``[server] state_dir``) or at the default state
directory, and the kernel tells the server who is asking. A token is read from a file or
``$LAYERPY_TOKEN``, never from the command line, where every user could read it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import tomllib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from aiohttp import ClientWebSocketResponse

DEFAULT_SOCKET = Path("/var/lib/layerpy/api.sock")
TOKEN_VARIABLE = "LAYERPY_TOKEN"
TIMEOUT = 60.0
STREAM_TIMEOUT = 60.0  # the event stream sends a keepalive every 15 s
LINE_LIMIT = 1024 * 1024
HEARTBEAT = 30.0  # a WebSocket ping, so that a vanished server is noticed


class ClientError(Exception):
    """The API cannot be reached or refused the call; the message says what to do.
    ``status`` is the HTTP status of a refusal, None when the server was not reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("layerpy", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


@dataclass(frozen=True)
class ServerEvent:
    """One server-sent event: its ``id:``, ``event:`` (the kind) and ``data:``."""

    id: str | None
    event: str
    data: str


class EventParser:
    """Server-sent events from the lines of a stream (the WHATWG format, minus ``retry``):
    fields until a blank line, ``:`` comments (keepalives) ignored."""

    def __init__(self) -> None:
        self.last_id: str | None = None
        self._event = ""
        self._data: list[str] = []

    def feed(self, line: str) -> ServerEvent | None:
        """Take one line (without its end); the event a blank line completes, if any."""
        if not line:
            data, event = self._data, self._event or "message"
            self._data, self._event = [], ""
            return ServerEvent(self.last_id, event, "\n".join(data)) if data else None
        name, colon, value = line.partition(":")
        if not name:
            return None  # a comment
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_id = value
        return None


@dataclass(frozen=True)
class Client:
    where: str  # a socket path or an http(s) URL
    token: str | None = None

    @classmethod
    def find(cls, config: Path | None, server: str | None, token_file: Path | None) -> Client:
        """The API to call: --server, else the node file's socket, else the default one."""
        if server and server.startswith(("http://", "https://")):
            return cls(server.rstrip("/"), _token(token_file))
        if server:
            return cls(server)
        return cls(str(socket_of(config) if config else DEFAULT_SOCKET))

    @property
    def over_socket(self) -> bool:
        return not self.where.startswith(("http://", "https://"))

    def _connection(self, timeout: float = TIMEOUT) -> http.client.HTTPConnection:
        if self.over_socket:
            return _UnixConnection(Path(self.where), timeout)
        url = urlsplit(self.where)
        if url.scheme == "https":
            context = ssl.create_default_context()  # $SSL_CERT_FILE names a private CA
            return http.client.HTTPSConnection(url.netloc, timeout=timeout, context=context)
        return http.client.HTTPConnection(url.netloc, timeout=timeout)

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _unreachable(self, error: BaseException) -> ClientError:
        """What a failure to talk to the API means, and what to do about it."""
        if isinstance(error, FileNotFoundError):
            return ClientError(
                f"no layerpy API socket at {self.where}: is layerpy serve running? "
                "(give its node file with -c, or --server)"
            )
        if isinstance(error, PermissionError):
            return ClientError(
                f"{self.where}: permission denied; the socket is for the server's user "
                "(or [api] socket_group)"
            )
        return ClientError(f"cannot reach the layerpy API at {self.where}: {error}")

    def _exchange(
        self, path: str, method: str = "GET", body: Any = None
    ) -> tuple[http.client.HTTPResponse, bytes]:
        headers = self._headers({"Content-Type": "application/json"})
        data = None if body is None else json.dumps(body).encode()
        connection = self._connection()
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            return response, response.read()
        except (OSError, http.client.HTTPException) as error:
            raise self._unreachable(error) from None
        finally:
            connection.close()

    def _refused(self, path: str, response: http.client.HTTPResponse, raw: bytes) -> ClientError:
        text = raw.decode(errors="replace").strip()
        return ClientError(f"{self.where}{path}: {response.status} {text}", response.status)

    def call(self, path: str, method: str = "GET", body: Any = None) -> Any:
        """One API call; a JSON error answer is returned like a success, any other error
        answer raises ClientError with the server's words."""
        response, raw = self._exchange(path, method, body)
        if response.getheader("Content-Type", "").startswith("application/json"):
            return json.loads(raw)
        raise self._refused(path, response, raw)

    def fetch(self, path: str) -> bytes:
        """The body of a successful GET as it is (a console log); an error answer raises
        ClientError with the server's words."""
        response, raw = self._exchange(path)
        if response.status != 200:
            raise self._refused(path, response, raw)
        return raw

    def stream(self, path: str, headers: dict[str, str] | None = None) -> Iterator[str]:
        """The lines of a streamed answer as they come, without their ends. Silence for
        STREAM_TIMEOUT (several keepalives) or the end of the stream raise ClientError:
        either way the server is gone."""
        connection = self._connection(STREAM_TIMEOUT)
        try:
            try:
                connection.request("GET", path, headers=self._headers(headers))
                response = connection.getresponse()
                if response.status != 200:
                    raise self._refused(path, response, response.read(LINE_LIMIT))
                while line := response.readline(LINE_LIMIT):
                    if not line.endswith(b"\n") and len(line) >= LINE_LIMIT:
                        raise ClientError(f"{self.where}{path}: a line longer than {LINE_LIMIT}")
                    yield line.decode(errors="replace").rstrip("\r\n")
            except TimeoutError:
                raise ClientError(
                    f"nothing from {self.where} for {STREAM_TIMEOUT:.0f} s: the connection is lost"
                ) from None
            except (OSError, http.client.HTTPException) as error:
                raise self._unreachable(error) from None
            raise ClientError(f"{self.where} closed the stream: the server stopped")
        finally:
            connection.close()

    def events(self, path: str, last_id: str | None = None) -> Iterator[ServerEvent]:
        """The server-sent events of ``path``; with ``last_id``, from the one after it
        (the server sends a ``gap`` first if some of them are gone)."""
        headers = {"Accept": "text/event-stream"}
        if last_id is not None:
            headers["Last-Event-ID"] = last_id
        parser = EventParser()
        for line in self.stream(path, headers):
            if (event := parser.feed(line)) is not None:
                yield event

    @contextlib.asynccontextmanager
    async def websocket(self, path: str) -> AsyncIterator[ClientWebSocketResponse]:
        """A WebSocket to ``path`` (a console), over the socket or http(s) with the token."""
        import aiohttp

        if self.over_socket:
            connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=self.where)
            base = "http://layerpy"
        else:
            context = ssl.create_default_context() if self.where.startswith("https") else None
            connector, base = aiohttp.TCPConnector(ssl=context or False), self.where
        async with aiohttp.ClientSession(connector=connector) as session:
            try:
                socket_ = await session.ws_connect(
                    base + path, headers=self._headers(), heartbeat=HEARTBEAT
                )
            except aiohttp.WSServerHandshakeError as error:
                raise ClientError(
                    f"{self.where}{path}: {error.status} {error.message}", error.status
                ) from None
            except aiohttp.ClientConnectorError as error:
                raise self._unreachable(error.os_error) from None
            except (OSError, aiohttp.ClientError) as error:
                raise self._unreachable(error) from None
            async with socket_:
                yield socket_


def socket_of(config: Path) -> Path:
    """The API socket the node file gives, read leniently: a broken file must still be
    reloadable (and refused by the server, which says why)."""
    try:
        data = tomllib.loads(config.read_text(encoding="utf-8"))
        socket_path = data.get("api", {}).get("socket")
        state_dir = data.get("server", {}).get("state_dir", str(DEFAULT_SOCKET.parent))
        if isinstance(socket_path, str):
            return config.parent / Path(socket_path).expanduser()
        return config.parent / Path(str(state_dir)).expanduser() / "api.sock"
    # ValueError: TOML syntax, not UTF-8, or a number past int()'s digits; RuntimeError:
    # ~user of no such user
    except (OSError, ValueError, AttributeError, RuntimeError):
        return DEFAULT_SOCKET


def _token(token_file: Path | None) -> str:
    if token_file is not None:
        try:
            return token_file.read_text().strip()
        except OSError as error:
            raise ClientError(
                f"cannot read the token file {token_file}: {error.strerror}"
            ) from None
    token = os.environ.get(TOKEN_VARIABLE, "").strip()
    if not token:
        raise ClientError(
            f"an https API needs a token: put it in a file for --token-file, or in "
            f"${TOKEN_VARIABLE} (layerpy token add NAME makes one)"
        )
    return token
