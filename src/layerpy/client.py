"""The operator API as the CLI reaches it: the Unix socket on the head node, or HTTPS with
a token from anywhere else.

On the head node nothing needs to be given: the socket is found from the node file
(``[api] socket``, else ``api.sock`` in ``[server] state_dir``) or at the default state
directory, and the kernel tells the server who is asking. A token is read from a file or
``$LAYERPY_TOKEN``, never from the command line, where every user could read it.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_SOCKET = Path("/var/lib/layerpy/api.sock")
TOKEN_VARIABLE = "LAYERPY_TOKEN"
TIMEOUT = 60.0


class ClientError(Exception):
    """The API cannot be reached or refused the call; the message says what to do."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("layerpy", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.path))


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

    def _connection(self) -> http.client.HTTPConnection:
        if not self.where.startswith(("http://", "https://")):
            return _UnixConnection(Path(self.where), TIMEOUT)
        url = urlsplit(self.where)
        if url.scheme == "https":
            context = ssl.create_default_context()  # $SSL_CERT_FILE names a private CA
            return http.client.HTTPSConnection(url.netloc, timeout=TIMEOUT, context=context)
        return http.client.HTTPConnection(url.netloc, timeout=TIMEOUT)

    def call(self, path: str, method: str = "GET", body: Any = None) -> Any:
        """One API call; a JSON error answer is returned like a success, any other error
        answer raises ClientError with the server's words."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        connection = self._connection()
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        except FileNotFoundError:
            raise ClientError(
                f"no layerpy API socket at {self.where}: is layerpy serve running? "
                "(give its node file with -c, or --server)"
            ) from None
        except PermissionError:
            raise ClientError(
                f"{self.where}: permission denied; the socket is for the server's user "
                "(or [api] socket_group)"
            ) from None
        except (OSError, http.client.HTTPException) as error:
            raise ClientError(f"cannot reach the layerpy API at {self.where}: {error}") from None
        finally:
            connection.close()
        if response.getheader("Content-Type", "").startswith("application/json"):
            return json.loads(raw)
        text = raw.decode(errors="replace").strip()
        raise ClientError(f"{self.where}{path}: {response.status} {text}")


def socket_of(config: Path) -> Path:
    """The API socket the node file gives, read leniently: a broken file must still be
    reloadable (and refused by the server, which says why)."""
    try:
        data = tomllib.loads(config.read_text())
        socket_path = data.get("api", {}).get("socket")
        state_dir = data.get("server", {}).get("state_dir", str(DEFAULT_SOCKET.parent))
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return DEFAULT_SOCKET
    base = config.parent
    if isinstance(socket_path, str):
        return base / Path(socket_path).expanduser()
    return base / Path(str(state_dir)).expanduser() / "api.sock"


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
