"""An asyncio etcd v3 client over etcd's JSON gateway (aiohttp), with failover between members.

Why not a gRPC client: docs/ha.md "Why this etcd client". Every request goes to the member in
use; a member that refuses the connection, has no leader (it sends "no leader" at once: every
request carries gRPC's `hasleader` metadata, as etcd's own clientv3 does), or does not answer
within the timeout, is left for the next, so losing one member of three is invisible to
callers. A mutation whose answer was lost may have been applied before it is retried on the
next member (as with any etcd client): transactions' compares make that safe where it matters.

Bounded everywhere: each attempt by the timeout, each answer and each watch message by a size,
a range read in pages; a watch reads the socket only when its consumer asks for more.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from layerpy.logs import Outage

from . import wire
from .wire import (
    Compacted,
    Compare,
    EtcdError,
    KeyValue,
    Op,
    TxnResult,
    WatchEvent,
)

if TYPE_CHECKING:
    from layerpy.config.records import ClusterConfig

__all__ = [
    "Compacted",
    "Compare",
    "Etcd",
    "EtcdError",
    "EtcdUnavailable",
    "KeyValue",
    "Op",
    "TxnResult",
    "WatchEvent",
]

log = logging.getLogger("layerpy.etcd")

MAX_ANSWER = 64 << 20  # bytes of one answer (a range page, a transaction's gets)
MAX_WATCH_MESSAGE = 16 << 20  # bytes of one watch message (one revision's events at most)
RANGE_PAGE = 512  # keys per range request
WATCH_IDLE = 10.0  # seconds of a silent watch before its member is asked whether it is alive


class EtcdUnavailable(Exception):
    """No member answered within the timeout (the message names each and its last error)."""


class _Retry(Exception):
    """This member cannot serve now: try the next."""


class Etcd:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        ca: Path | None = None,
        cert: Path | None = None,
        key: Path | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = 2.0,
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        if (user is None) != (password is None):
            raise ValueError("etcd user and password go together")
        if (cert is None) != (key is None):
            raise ValueError("etcd client cert and key go together")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self._tls = (ca, cert, key)
        self._credentials = (user, password) if user is not None else None
        self.timeout = timeout
        self._current = 0
        self._tokens: dict[str, str] = {}  # a simple token is known only to the member it came from
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_config(cls, cluster: ClusterConfig, timeout: float = 2.0) -> Etcd:
        """The client an instance's ``[cluster]`` table describes."""
        return cls(cluster.etcd, ca=cluster.ca, cert=cluster.cert, key=cluster.key,
                   user=cluster.user, password=cluster.password, timeout=timeout)  # fmt: skip

    @property
    def endpoint(self) -> str:
        """The member in use."""
        return self.endpoints[self._current]

    async def open(self) -> None:
        """First contact: raises EtcdUnavailable (with the TLS error, if that was it) or
        EtcdError (wrong user or password)."""
        ca, cert, key = self._tls
        context: ssl.SSLContext | None = None
        if ca or cert:
            context = ssl.create_default_context(cafile=str(ca) if ca else None)
            if cert and key:
                context.load_cert_chain(str(cert), str(key))
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context if context else False),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        try:
            await self._call("/v3/maintenance/status", {})
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- key-value ------------------------------------------------------------------

    async def get(self, key: str) -> KeyValue | None:
        answer = await self._call("/v3/kv/range", wire.range_request(key, prefix=False))
        kvs = wire.key_values(answer)
        return kvs[0] if kvs else None

    async def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under prefix, at one revision (read in pages), and that revision."""
        kvs: list[KeyValue] = []
        start, revision = prefix, 0
        while True:
            body = wire.range_request(start, prefix=True, revision=revision, limit=RANGE_PAGE)
            body["range_end"] = wire.b64(wire.prefix_end(prefix))
            try:
                answer = await self._call("/v3/kv/range", body)
            except EtcdError as error:
                if revision and "compacted" in str(error):
                    raise Compacted(revision) from error
                raise
            revision = revision or wire.revision(answer)
            page = wire.key_values(answer)
            kvs.extend(page)
            if not wire.more(answer) or not page:
                return kvs, revision
            start = page[-1].key + "\0"

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """The revision the put made."""
        body = Op.put(key, value, lease).to_json()["request_put"]
        return wire.revision(await self._call("/v3/kv/put", body))

    async def delete(self, key: str) -> bool:
        """Whether the key was there."""
        body = wire.range_request(key, prefix=False)
        return wire.deleted(await self._call("/v3/kv/deleterange", body)) > 0

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        return wire.txn_result(
            await self._call("/v3/kv/txn", wire.txn_request(compares, success, failure))
        )

    async def each_txn(
        self, parts: Sequence[tuple[Sequence[Compare], Sequence[Op]]]
    ) -> tuple[int, list[bool]]:
        """Many independent transactions in one round trip and one raft proposal: each part's
        ops apply if its own compares hold. The revision, and per part whether it applied."""
        answer = await self._call("/v3/kv/txn", wire.each_txn_request(parts))
        return wire.each_txn_result(answer, len(parts))

    # --- leases ---------------------------------------------------------------------

    async def grant(self, ttl: int) -> int:
        """A new lease's id."""
        return wire.lease_id(await self._call("/v3/lease/grant", {"TTL": str(ttl)}))

    async def keepalive(self, lease: int) -> int:
        """Seconds left after the refresh; 0 when the lease is gone."""
        return wire.lease_ttl(await self._call("/v3/lease/keepalive", {"ID": str(lease)}))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as error:
            if "lease not found" not in str(error):
                raise

    # --- watch ----------------------------------------------------------------------

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[WatchEvent]]:
        """Every change under prefix from start_revision on, in order, a revision's events
        together. A member's failure is invisible: the watch resumes on the next at the last
        revision seen + 1; while no member answers it keeps trying (the caller cancels it).
        Raises Compacted when the history it needs is gone."""
        next_revision, failed = start_revision, 0
        outage = Outage(log, f"etcd watch of {prefix}", after=2)  # a failover is no news
        while True:
            endpoint = self.endpoint
            try:
                async for events in self._watch_once(endpoint, prefix, next_revision, outage.ok):
                    failed = 0
                    next_revision = events[-1].kv.mod_revision + 1
                    yield events
                raise _Retry("the stream ended")
            except _Retry as error:
                outage.failed(f"{endpoint}: {error}, resuming at {next_revision}", logging.INFO)
                self._next(endpoint)
                failed += 1
                if failed % len(self.endpoints) == 0:
                    await asyncio.sleep(min(self.timeout, 0.1 * failed))

    async def _watch_once(
        self, endpoint: str, prefix: str, start: int, answered: Callable[[], None]
    ) -> AsyncIterator[list[WatchEvent]]:
        """One stream from one member; ``answered`` is called on each message that is not
        an error (the watch works)."""
        session = self._open_session()
        try:
            async with asyncio.timeout(self.timeout):
                headers = await self._headers(endpoint)
                response = await session.post(
                    endpoint + "/v3/watch", json=wire.watch_request(prefix, start), headers=headers
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as error:
            raise _Retry(_describe(error)) from None
        async with response:
            if response.status != 200:
                await self._refused(endpoint, response)
            lines = _Lines(response.content, MAX_WATCH_MESSAGE)
            while True:
                try:
                    async with asyncio.timeout(WATCH_IDLE):  # not wait_for: 3.11's may eat a cancel
                        line = await lines.next()
                except TimeoutError:
                    await self._probe(endpoint)
                    continue
                except (aiohttp.ClientError, OSError) as error:
                    raise _Retry(_describe(error)) from None
                if line is None:
                    return
                try:
                    message = wire.watch_message(json.loads(line))
                except ValueError:
                    raise EtcdError("etcd answered a watch message that is not JSON") from None
                if message.error is not None:
                    code, text = message.error
                    if code in wire.RETRY_CODES or code == wire.UNAUTHENTICATED:
                        self._tokens.pop(endpoint, None)
                        raise _Retry(text)
                    raise EtcdError(f"etcd watch on {endpoint}: {text}")
                if message.compact_revision:
                    raise Compacted(message.compact_revision)
                if message.canceled:
                    raise _Retry("the watch was canceled")
                answered()
                if message.events:
                    yield message.events

    async def _probe(self, endpoint: str) -> None:
        """Raise _Retry unless this member answers and has a leader (a watch on a member cut
        off without a reset would otherwise wait forever)."""
        try:
            async with asyncio.timeout(self.timeout):
                await self._call_one(endpoint, "/v3/maintenance/status", {})
        except TimeoutError:
            raise _Retry(f"no answer within {self.timeout:g} s") from None

    # --- requests -------------------------------------------------------------------

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The request to the member in use, then to each other in turn, round after round
        (an election leaves every member without a leader for a second or so) until each
        has been tried and the timeout has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        errors: dict[str, str] = {}
        pause = 0.05
        for tried in itertools.count(1):
            endpoint = self.endpoint
            try:
                async with asyncio.timeout(self.timeout):
                    return await self._call_one(endpoint, path, body)
            except TimeoutError:
                errors[endpoint] = f"no answer within {self.timeout:g} s"
            except _Retry as error:
                errors[endpoint] = str(error)
            self._next(endpoint)
            if tried % len(self.endpoints) == 0:
                left = deadline - loop.time()
                if left <= 0:
                    break
                await asyncio.sleep(min(pause, left))
                pause *= 2
        tried_all = "; ".join(f"{url}: {error}" for url, error in errors.items())
        raise EtcdUnavailable("no etcd member answered: " + tried_all)

    async def _call_one(self, endpoint: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        session = self._open_session()
        for attempt in range(2):
            try:
                headers = await self._headers(endpoint)
                async with session.post(endpoint + path, json=body, headers=headers) as response:
                    if response.status == 200:
                        return _object(await _read(response.content, MAX_ANSWER))
                    code, text = await self._error(response)
            except (aiohttp.ClientError, OSError) as error:
                raise _Retry(_describe(error)) from None
            if code in wire.RETRY_CODES or response.status in (502, 503, 504):
                raise _Retry(text)
            if code == wire.UNAUTHENTICATED and self._credentials and attempt == 0:
                self._tokens.pop(endpoint, None)  # expired: authenticate again, once
                continue
            raise EtcdError(f"etcd {endpoint}{path}: {text}")
        raise AssertionError("unreachable")

    async def _headers(self, endpoint: str) -> dict[str, str]:
        headers = {"Grpc-Metadata-hasleader": "true"}
        if self._credentials is not None:
            token = self._tokens.get(endpoint)
            if token is None:
                token = await self._authenticate(endpoint)
            headers["Authorization"] = token
        return headers

    async def _authenticate(self, endpoint: str) -> str:
        assert self._credentials is not None
        user, password = self._credentials
        session = self._open_session()
        try:
            async with session.post(
                endpoint + "/v3/auth/authenticate", json={"name": user, "password": password}
            ) as response:
                if response.status != 200:
                    code, text = await self._error(response)
                    if code in wire.RETRY_CODES or response.status >= 500:
                        raise _Retry(text)
                    raise EtcdError(f"etcd {endpoint} refused user {user!r}: {text}")
                token = _object(await _read(response.content, MAX_ANSWER)).get("token")
        except (aiohttp.ClientError, OSError) as error:
            raise _Retry(_describe(error)) from None
        if not isinstance(token, str) or not token:
            raise EtcdError(f"etcd {endpoint} answered no token for user {user!r}")
        self._tokens[endpoint] = token
        return token

    async def _error(self, response: aiohttp.ClientResponse) -> tuple[int, str]:
        raw = await _read(response.content, 64 << 10)
        try:
            code, text = wire.error(json.loads(raw))
        except ValueError:
            code, text = 0, raw[:200].decode("utf-8", "replace")
        return code, text or f"HTTP {response.status}"

    async def _refused(self, endpoint: str, response: aiohttp.ClientResponse) -> None:
        code, text = await self._error(response)
        if code in wire.RETRY_CODES or code == wire.UNAUTHENTICATED or response.status >= 500:
            self._tokens.pop(endpoint, None)
            raise _Retry(text)
        raise EtcdError(f"etcd {endpoint}/v3/watch: {text}")

    def _next(self, failed: str) -> None:
        """Move on from a failed member (unless another task already has)."""
        if self.endpoint == failed:
            self._current = (self._current + 1) % len(self.endpoints)

    def _open_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Etcd.open() first")
        return self._session


class _Lines:
    """Newline-delimited messages of a stream, each at most `limit` bytes."""

    def __init__(self, content: aiohttp.StreamReader, limit: int) -> None:
        self._content, self._limit = content, limit
        self._buffer = bytearray()

    async def next(self) -> bytes | None:
        """The next message, or None at the end of the stream."""
        while (end := self._buffer.find(b"\n")) < 0:
            if len(self._buffer) > self._limit:
                raise EtcdError(f"etcd sent a message over {self._limit} bytes")
            chunk = await self._content.readany()
            if not chunk:
                return None
            self._buffer += chunk
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return line


async def _read(content: aiohttp.StreamReader, limit: int) -> bytes:
    data = bytearray()
    while chunk := await content.readany():
        data += chunk
        if len(data) > limit:
            raise EtcdError(f"etcd answered over {limit} bytes")
    return bytes(data)


def _object(raw: bytes) -> dict[str, Any]:
    """An answer: one JSON object (a stream's single message is {"result": ...})."""
    try:
        answer = json.loads(raw)
    except ValueError:
        raise EtcdError("etcd answered something that is not JSON") from None
    if not isinstance(answer, dict):
        raise EtcdError("etcd answered JSON that is not an object")
    return answer


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
