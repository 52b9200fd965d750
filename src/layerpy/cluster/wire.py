"""etcd's v3 JSON gateway, sans I/O: requests as dicts, answers read back into typed values.

The gateway speaks the gRPC messages as JSON: keys and values in base64, 64-bit integers as
strings, fields at their zero value left out. Everything read here came over the network, so
every field is checked for its type and a malformed answer raises `EtcdError` rather than
passing on a half-read value.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

# gRPC status codes etcd answers with (google.golang.org/grpc/codes)
CANCELLED = 1  # "grpc: the client connection is closing": the member is stopping
DEADLINE_EXCEEDED = 4
UNAVAILABLE = 14  # "no leader", "request timed out", "leader changed"
UNAUTHENTICATED = 16  # "invalid auth token": the token expired or this member never issued it
RETRY_CODES = frozenset({CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE})  # the next member may serve


class EtcdError(Exception):
    """etcd answered, and refused (bad argument, permission, malformed answer)."""


class Compacted(EtcdError):
    """The history asked for is gone: re-read the keys, then watch from the new revision."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"etcd history compacted up to revision {revision}")
        self.revision = revision


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue  # kv.value is b"" on delete


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[list[KeyValue]]  # per Op of the branch taken: what a get returned, [] else


_OPERATORS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction; build it with the class methods."""

    key: str
    target: Literal["VERSION", "CREATE", "MOD", "VALUE"]
    operator: str
    operand: int | bytes

    @classmethod
    def version(cls, key: str, operator: str, version: int) -> Compare:
        return cls._make(key, "VERSION", operator, version)

    @classmethod
    def mod_revision(cls, key: str, operator: str, revision: int) -> Compare:
        return cls._make(key, "MOD", operator, revision)

    @classmethod
    def create_revision(cls, key: str, operator: str, revision: int) -> Compare:
        return cls._make(key, "CREATE", operator, revision)

    @classmethod
    def value(cls, key: str, operator: str, value: bytes) -> Compare:
        return cls._make(key, "VALUE", operator, value)

    @classmethod
    def _make(cls, key: str, target: Any, operator: str, operand: int | bytes) -> Compare:
        if operator not in _OPERATORS:
            raise ValueError(f"operator {operator!r}: one of {', '.join(_OPERATORS)}")
        return cls(key, target, operator, operand)

    def to_json(self) -> dict[str, Any]:
        field = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision"}
        out: dict[str, Any] = {
            "key": b64key(self.key),
            "target": self.target,
            "result": _OPERATORS[self.operator],
        }
        if isinstance(self.operand, bytes):
            out["value"] = b64(self.operand)
        else:
            out[field[self.target]] = str(self.operand)
        return out


@dataclass(frozen=True)
class Op:
    """One operation of a transaction; build it with the class methods."""

    kind: Literal["put", "delete", "get"]
    key: str
    value: bytes = b""
    lease: int = 0
    prefix: bool = False

    @classmethod
    def put(cls, key: str, value: bytes, lease: int = 0) -> Op:
        return cls("put", key, value, lease)

    @classmethod
    def delete(cls, key: str) -> Op:
        return cls("delete", key)

    @classmethod
    def get(cls, key: str) -> Op:
        return cls("get", key)

    @classmethod
    def delete_prefix(cls, prefix: str) -> Op:
        return cls("delete", prefix, prefix=True)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "put":
            put: dict[str, Any] = {"key": b64key(self.key), "value": b64(self.value)}
            if self.lease:
                put["lease"] = str(self.lease)
            return {"request_put": put}
        request = {"key": b64key(self.key)}
        if self.prefix:
            request["range_end"] = b64(prefix_end(self.key))
        return {"request_delete_range" if self.kind == "delete" else "request_range": request}


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def b64key(key: str) -> str:
    return b64(encode_key(key))


def encode_key(key: str) -> bytes:
    """Keys are str; bytes that are not UTF-8 (written by someone else) round-trip unchanged."""
    return key.encode("utf-8", "surrogateescape")


def prefix_end(prefix: str) -> bytes:
    """The first key after every key starting with prefix (etcd's range_end for a prefix)."""
    raw = bytearray(encode_key(prefix))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"  # every key
    raw[-1] += 1
    return bytes(raw)


def range_request(key: str, *, prefix: bool, revision: int = 0, limit: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64key(key)}
    if prefix:
        body["range_end"] = b64(prefix_end(key))
    if revision:
        body["revision"] = str(revision)
    if limit:
        body["limit"] = str(limit)
    return body


def txn_request(compares: Any, success: Any, failure: Any) -> dict[str, Any]:
    return {
        "compare": [compare.to_json() for compare in compares],
        "success": [op.to_json() for op in success],
        "failure": [op.to_json() for op in failure],
    }


def each_txn_request(parts: Any) -> dict[str, Any]:
    """Independent transactions in one request: each (compares, ops) a nested transaction of
    its own that applies or not by its own compares (etcd >= 3.3; keys must not repeat)."""
    return {"success": [{"request_txn": txn_request(compares, ops, ())} for compares, ops in parts]}


def watch_request(prefix: str, start_revision: int) -> dict[str, Any]:
    request = range_request(prefix, prefix=True)
    return {"create_request": {**request, "start_revision": str(start_revision)}}


# --- reading answers --------------------------------------------------------------------


def _int(message: dict[str, Any], name: str) -> int:
    """An int64 field: a decimal string (or a number) in JSON, absent when zero."""
    value = message.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise EtcdError(f"etcd answered {name}={value!r}: not an integer")
    try:
        return int(value)
    except ValueError:
        raise EtcdError(f"etcd answered {name}={value!r}: not an integer") from None


def _bytes(message: dict[str, Any], name: str) -> bytes:
    value = message.get(name, "")
    if not isinstance(value, str):
        raise EtcdError(f"etcd answered {name} of type {type(value).__name__}: not base64")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise EtcdError(f"etcd answered {name}: not base64") from None


def _dict(message: Any, name: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise EtcdError(f"etcd answered a {type(message).__name__} for {name}: not an object")
    return message


def _list(message: dict[str, Any], name: str) -> list[Any]:
    value = message.get(name, [])
    if not isinstance(value, list):
        raise EtcdError(f"etcd answered {name} of type {type(value).__name__}: not a list")
    return value


def revision(answer: dict[str, Any]) -> int:
    """The store's revision when the answer was made (its header)."""
    return _int(_dict(answer.get("header", {}), "header"), "revision")


def key_value(message: Any) -> KeyValue:
    message = _dict(message, "kv")
    return KeyValue(
        key=_bytes(message, "key").decode("utf-8", "surrogateescape"),
        value=_bytes(message, "value"),
        mod_revision=_int(message, "mod_revision"),
        create_revision=_int(message, "create_revision"),
        version=_int(message, "version"),
        lease=_int(message, "lease"),
    )


def key_values(answer: dict[str, Any]) -> list[KeyValue]:
    return [key_value(kv) for kv in _list(answer, "kvs")]


def more(answer: dict[str, Any]) -> bool:
    return answer.get("more") is True


def deleted(answer: dict[str, Any]) -> int:
    return _int(answer, "deleted")


def txn_result(answer: dict[str, Any]) -> TxnResult:
    responses = []
    for response in _list(answer, "responses"):
        ranged = _dict(response, "response").get("response_range")
        responses.append(key_values(_dict(ranged, "response_range")) if ranged else [])
    return TxnResult(answer.get("succeeded") is True, revision(answer), responses)


def each_txn_result(answer: dict[str, Any], count: int) -> tuple[int, list[bool]]:
    """The revision of an each_txn_request's answer and, per part, whether it applied."""
    responses = _list(answer, "responses")
    if len(responses) != count:
        raise EtcdError(f"etcd answered {len(responses)} results for {count} transactions")
    took = []
    for response in responses:
        nested = _dict(_dict(response, "response").get("response_txn"), "response_txn")
        took.append(nested.get("succeeded") is True)
    return revision(answer), took


def lease_id(answer: dict[str, Any]) -> int:
    if answer.get("error"):
        raise EtcdError(f"etcd refused the lease: {answer['error']}")
    return _int(answer, "ID")


def lease_ttl(answer: dict[str, Any]) -> int:
    """Seconds left of a lease kept alive; 0 when the lease is gone (TTL left out)."""
    return _int(_dict(answer.get("result", {}), "result"), "TTL")


def error(answer: Any) -> tuple[int, str]:
    """The gRPC code and message of an error answer: {"code", "message"} for a request,
    {"grpc_code", "message"} inside a stream."""
    if not isinstance(answer, dict):
        return 0, "malformed error"
    code = answer.get("code", answer.get("grpc_code", 0))
    message = answer.get("message", answer.get("error", ""))
    return (code if isinstance(code, int) else 0), str(message)[:500]


@dataclass(frozen=True)
class WatchMessage:
    created: bool
    canceled: bool
    compact_revision: int
    events: list[WatchEvent]
    error: tuple[int, str] | None  # the stream failed: (gRPC code, message)


def watch_message(answer: Any) -> WatchMessage:
    answer = _dict(answer, "watch answer")
    if "error" in answer:
        return WatchMessage(False, True, 0, [], error(answer["error"]))
    result = _dict(answer.get("result", {}), "result")
    events = []
    for event in _list(result, "events"):
        event = _dict(event, "event")
        kind = event.get("type", "PUT")
        if kind not in ("PUT", "DELETE"):
            raise EtcdError(f"etcd answered an event of type {kind!r}")
        kv = key_value(event.get("kv", {}))
        events.append(WatchEvent("put" if kind == "PUT" else "delete", kv))
    return WatchMessage(
        created=result.get("created") is True,
        canceled=result.get("canceled") is True,
        compact_revision=_int(result, "compact_revision"),
        events=events,
        error=None,
    )
