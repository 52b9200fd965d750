"""A distribution (v2) registry client on aiohttp: manifests and blobs, anonymous, token
(`WWW-Authenticate: Bearer`) and basic auth. HTTPS unless the source says insecure."""

from __future__ import annotations

import base64
import contextlib
import os
import re
from collections.abc import AsyncIterator
from ipaddress import ip_address

import aiohttp
from yarl import URL

from layerpy.images.source import MANIFEST_TYPES, ImageError, ImageSource, is_digest

CHUNK = 1 << 20
MAX_MANIFEST = 4 << 20
# A registry that accepts no connection within 5 s, or stalls a transfer for 30 s, is down.
TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=30)
_PARAM = re.compile(r'(\w+)="([^"]*)"')


class RegistryFetcher:
    def __init__(self, source: ImageSource) -> None:
        host, _, self.repo = source.location.partition("/")
        self.base = URL(f"{'http' if source.insecure else 'https'}://{host}")
        self.where = f"registry {host}"
        self.source = source
        self.http = aiohttp.ClientSession(timeout=TIMEOUT)
        self.authorization: str | None = None

    async def manifest(self, reference: str) -> bytes:
        what = f"manifest {self.repo}{'@' if is_digest(reference) else ':'}{reference}"
        async with self._get(
            f"manifests/{reference}", what, Accept=", ".join(MANIFEST_TYPES)
        ) as got:
            data = bytearray()
            async for chunk in got.content.iter_chunked(CHUNK):
                data += chunk
                if len(data) > MAX_MANIFEST:
                    raise ImageError(f"{self.where}: {what} is larger than {MAX_MANIFEST} bytes")
            return bytes(data)

    async def blob(self, digest: str, size: int) -> AsyncIterator[bytes]:
        async with self._get(f"blobs/{digest}", f"blob {digest}") as got:
            async for chunk in got.content.iter_chunked(CHUNK):
                yield chunk

    async def close(self) -> None:
        await self.http.close()

    @contextlib.asynccontextmanager
    async def _get(
        self, path: str, what: str, **headers: str
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """GET /v2/<repo>/<path>, logging in once if the registry asks; errors, including
        those while the caller reads the body, become ImageErrors."""
        url = self.base.with_path(f"/v2/{self.repo}/{path}")
        try:
            response = await self._request(url, headers)
            if response.status == 401:
                response.release()
                if await self._login(response.headers.get("WWW-Authenticate", "")):
                    response = await self._request(url, headers)
            async with response:
                if response.status >= 400:
                    raise ImageError(await self._failure(response, what))
                yield response
        except aiohttp.ClientSSLError as error:
            hint = "" if self.source.insecure else "; is it plain HTTP (then mark it insecure)?"
            raise ImageError(
                f"{self.where}: TLS failed ({error.__class__.__name__}){hint}"
            ) from None
        except aiohttp.ClientConnectorError as error:
            cause = error.os_error  # asyncio words it "Connect call failed (...)": use errno's
            reason = os.strerror(cause.errno) if (cause.errno or 0) > 0 else str(cause)
            raise ImageError(f"{self.where}: unreachable ({reason})") from None
        except TimeoutError:
            raise ImageError(f"{self.where}: {what}: timed out") from None
        except aiohttp.ClientError as error:
            raise ImageError(f"{self.where}: {what}: {error!r}") from None

    async def _request(self, url: URL, headers: dict[str, str]) -> aiohttp.ClientResponse:
        if self.authorization:
            headers = {**headers, "Authorization": self.authorization}
        return await self.http.get(url, headers=headers)

    async def _login(self, challenge: str) -> bool:
        """Answers a 401's challenge: basic auth with the source's credentials, or a bearer
        token from the realm the registry names (sending the credentials, if any)."""
        scheme, _, rest = challenge.partition(" ")
        params = dict(_PARAM.findall(rest))
        user, password = self.source.user, self.source.password or ""
        basic = (
            "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode() if user else None
        )
        if scheme.lower() == "basic":
            if basic:
                self.authorization = basic
            return basic is not None
        if scheme.lower() != "bearer" or "realm" not in params:
            return False
        realm = params["realm"]
        scope = params.get("scope", f"repository:{self.repo}:pull")
        query = {"service": params.get("service", ""), "scope": scope}
        withheld = credentials_withheld(realm, self.base, self.source) if basic else None
        headers = {"Authorization": basic} if basic and withheld is None else {}
        async with self.http.get(realm, params=query, headers=headers) as got:
            if got.status != 200:
                why = f"; {withheld}" if withheld else ""
                raise ImageError(f"{self.where}: token service {realm} refused ({got.status}){why}")
            try:
                answer = await got.json(content_type=None)
            except ValueError:
                answer = None
        token = isinstance(answer, dict) and (answer.get("token") or answer.get("access_token"))
        if not isinstance(token, str):
            raise ImageError(f"{self.where}: token service {realm} gave no token")
        self.authorization = f"Bearer {token}"
        return True

    async def _failure(self, response: aiohttp.ClientResponse, what: str) -> str:
        """The user's view of an error status: what was asked, why it failed, the code."""
        status = response.status
        if status == 404:
            return f"{self.where}: {what} not found (404)"
        if status in (401, 403):
            word = "unauthorized" if status == 401 else "denied"
            why = "credentials refused" if self.source.user else "needs a user and password"
            return f"{self.where}: {what}: {word} ({status}, {why})"
        try:  # the registry's own words: {"errors": [{"code": ..., "message": ...}]}
            message = (await response.json(content_type=None))["errors"][0]["message"]
        except (ValueError, LookupError, TypeError, aiohttp.ClientError):
            message = response.reason or ""
        return f"{self.where}: {what}: HTTP {status} {message}".rstrip()


def credentials_withheld(realm: str, registry: URL, source: ImageSource) -> str | None:
    """Why the registry's credentials must not go to the token service at ``realm`` (a
    registry names it, and a hostile one would name its own), or None when they may:
    over TLS (or loopback, which never leaves this machine), to the registry's own host or
    one the node file lists in credentials_to."""
    try:
        url = URL(realm)
    except ValueError:
        return f"credentials not sent to {realm!r}: not a URL"
    if url.scheme != "https" and not is_loopback(url.host):
        return f"credentials not sent to {url.host}: only over TLS (https)"
    if url.host != registry.host and url.host not in source.credentials_to:
        return (
            f"credentials not sent to {url.host}, not the registry's host: list it in the "
            "image's credentials_to if it is the registry's token service"
        )
    return None


def is_loopback(host: str | None) -> bool:
    try:
        return ip_address(host or "").is_loopback
    except ValueError:
        return host == "localhost"
