"""The datagram heartbeat (agent protocol 1.4): an unchanged beat in one UDP datagram each way.

A heartbeat over HTTP costs the server a connection, a request and a report to decode;
most say only "still here". An agent whose observations have not changed since the server
last accepted its full report sends this instead, to the UDP port the server's answer
offered, signed with the per-boot key that answer carried (HMAC-SHA256, cut to 16 bytes):

    beat:  b"LPb1" | seq (u64) | uptime (f64) | len(node) (u8) | node | mac
    reply: b"LPa1" | seq (u64) | verdict (u8) | mac

The reply says ``OK`` (nothing to tell) or ``REPORT`` (send a full report: the answer or
what the server knows of the node changed). The server replies only to a beat that
verifies and is newer than the last it took (no reflection, no replay); the reply is
smaller than the beat (no amplification). An agent that hears nothing reports over HTTP,
which stays the whole contract. Standard library only: it runs in the minOS.
"""

from __future__ import annotations

import hmac
import re
import struct
from dataclasses import dataclass
from enum import IntEnum

BEAT_MAGIC = b"LPb1"
REPLY_MAGIC = b"LPa1"
MAC_SIZE = 16
KEY_SIZE = 16  # bytes of a beat key (hex in the answer)
_HEAD = struct.Struct("!4sQdB")  # magic, seq, uptime, len(node)
_REPLY = struct.Struct("!4sQB")  # magic, seq, verdict
MAX_BEAT = _HEAD.size + 63 + MAC_SIZE  # a node name is at most 63 characters
_NAME = re.compile(rb"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_KEY = re.compile(r"[0-9a-f]{32}")


class Verdict(IntEnum):
    OK = 0
    REPORT = 1  # send a full report now


@dataclass(frozen=True, slots=True)
class Beat:
    """A beat as read off the wire; ``signed`` and ``mac`` are for :func:`verified`."""

    node: str
    seq: int
    uptime: float
    signed: bytes
    mac: bytes


def speaks(protocol: object) -> bool:
    """Whether an agent of that protocol version sends beats (1.4 and later)."""
    major, _, minor = str(protocol).partition(".")
    return major == "1" and minor.isascii() and minor.isdigit() and int(minor) >= 4


def is_key(value: object) -> bool:
    return isinstance(value, str) and bool(_KEY.fullmatch(value))


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, "sha256")[:MAC_SIZE]


def beat(key: bytes, node: str, seq: int, uptime: float) -> bytes:
    """The datagram of one beat."""
    name = node.encode()
    signed = _HEAD.pack(BEAT_MAGIC, seq, uptime, len(name)) + name
    return signed + _mac(key, signed)


def read_beat(data: bytes) -> Beat | None:
    """The beat in a datagram, unverified; None for anything that is not one."""
    if not _HEAD.size + 1 + MAC_SIZE <= len(data) <= MAX_BEAT:
        return None
    magic, seq, uptime, size = _HEAD.unpack_from(data)
    name = data[_HEAD.size : -MAC_SIZE]
    if magic != BEAT_MAGIC or size != len(name) or not _NAME.fullmatch(name):
        return None
    if not 0 <= uptime < 1e9:  # also NaN
        return None
    return Beat(name.decode(), seq, uptime, data[:-MAC_SIZE], data[-MAC_SIZE:])


def verified(key: bytes, beat: Beat) -> bool:
    return hmac.compare_digest(_mac(key, beat.signed), beat.mac)


def reply(key: bytes, seq: int, verdict: Verdict) -> bytes:
    signed = _REPLY.pack(REPLY_MAGIC, seq, verdict)
    return signed + _mac(key, signed)


def read_reply(key: bytes, seq: int, data: bytes) -> Verdict | None:
    """The verdict on beat ``seq``; None for anything else (a forgery, an older reply)."""
    if len(data) != _REPLY.size + MAC_SIZE:
        return None
    magic, their_seq, verdict = _REPLY.unpack_from(data)
    if magic != REPLY_MAGIC or their_seq != seq or verdict not in Verdict._value2member_map_:
        return None
    if not hmac.compare_digest(_mac(key, data[: _REPLY.size]), data[_REPLY.size :]):
        return None
    return Verdict(verdict)
