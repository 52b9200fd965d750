"""Who may drive the server: operators, by a Unix socket's file permissions or a token.

The operator API answers only operators. On the head node the CLI talks over a Unix
socket in the state directory; who may open it is who may operate (its owner, or a group
the node file names). Anywhere else (another machine, the dashboard, Prometheus) an
operator sends a bearer token. Tokens are named, carry a scope (``read``: look; ``admin``:
also change things) and are kept in ``tokens.json`` (0600) as SHA-256 digests only: the
secret is shown once, when it is made. At first start one admin token is made and left
for the administrator in ``admin.token`` (0600).

This module is the one writer of ``tokens.json`` (``layerpy token`` and the server's first
start both call it); the server re-reads the file when it changes, so a revoked token stops
working at once, without a restart.
"""

from __future__ import annotations

import math
import os
import pwd
import re
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from layerpy.digests import digest, new
from layerpy.nodes.files import StateFiles

TOKENS = "tokens.json"
FIRST_TOKEN = "admin.token"
PREFIX = "lpy_"  # a token is recognisable in a leaked file or a log (and can be grepped for)
NAME = re.compile(r"[a-z][a-z0-9_.-]{0,31}")


class Scope(StrEnum):
    READ = "read"  # GET: look at nodes, plans, events, metrics
    ADMIN = "admin"  # also power, images, reload


class TokenError(Exception):
    """A token command that cannot be carried out; the message says why."""


@dataclass(frozen=True)
class Operator:
    """Who made a request, as the audit log names them, and what they may do."""

    name: str  # "token ops", "uid 0 (root)"
    scope: Scope
    address: str  # where from: an IP address, or "unix socket"

    def may(self, method: str) -> bool:
        return self.scope == Scope.ADMIN or method in ("GET", "HEAD")


@dataclass(frozen=True)
class TokenRecord:
    name: str
    scope: Scope
    created: float
    digest: str  # SHA-256 of the secret, hex


class Tokens:
    """The named tokens of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.files = StateFiles(state_dir)
        self.path = state_dir / TOKENS
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of what was read
        self._by_digest: dict[str, TokenRecord] = {}

    def records(self) -> list[TokenRecord]:
        """Every token, oldest first; unreadable entries are skipped."""
        found = []
        for name, entry in self.files.read(TOKENS).items():
            try:
                found.append(TokenRecord(name, Scope(entry["scope"]), float(entry["created"]),
                                         str(entry["sha256"])))  # fmt: skip
            except (KeyError, TypeError, ValueError):
                continue
        return sorted(found, key=lambda record: record.created)

    def _save(self, records: list[TokenRecord]) -> None:
        entries = {r.name: {"scope": r.scope, "created": r.created, "sha256": r.digest}
                   for r in records}  # fmt: skip
        if not self.files.write(TOKENS, entries):
            raise TokenError(f"cannot write {self.path} (see the error above)")

    def create(self, name: str, scope: Scope) -> str:
        """A new token; returns its secret, which is not kept anywhere."""
        if not NAME.fullmatch(name):
            raise TokenError(
                f"token name {name!r}: use 1-32 of a-z 0-9 _ . - starting with a letter"
            )
        records = self.records()
        if any(record.name == name for record in records):
            raise TokenError(f"a token named {name!r} exists; revoke it first")
        secret = new(PREFIX, 32)
        self._save([*records, TokenRecord(name, scope, time.time(), digest(secret))])
        return secret

    def revoke(self, name: str) -> None:
        records = self.records()
        if not any(record.name == name for record in records):
            known = ", ".join(record.name for record in records) or "none"
            raise TokenError(f"no token named {name!r} (tokens: {known})")
        self._save([record for record in records if record.name != name])

    def first_start(self) -> Path | None:
        """At the very first start (no tokens file): an admin token, its secret left in
        ``admin.token`` (0600) for the administrator. Returns that file's path if made."""
        if self.path.exists():
            return None
        secret = self.create("admin", Scope.ADMIN)
        path = self.path.parent / FIRST_TOKEN
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as out:
            out.write(secret + "\n")
        return path

    def check(self, secret: str) -> TokenRecord | None:
        """The token this secret is, or None (the file is re-read when it changed)."""
        try:
            stat = self.path.stat()
            seen: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            seen = None
        if seen != self._seen:
            self._by_digest = {record.digest: record for record in self.records()}
            self._seen = seen
        # a look-up by digest reveals nothing of the secret (only of a hash of it)
        return self._by_digest.get(digest(secret))


GUESSES = 10  # wrong tokens a source may send at once (typos, a dashboard's stale token)
GUESS_EVERY = 6.0  # seconds to earn one more: 10 a minute, sustained
GUESSERS = 4096  # sources remembered; the least recently heard of are forgotten first


class Guesses:
    """Wrong operator tokens per source address, as a token bucket: GUESSES at once, then
    one every GUESS_EVERY seconds. A source past it has every token refused unread (a
    right one too: answering it would tell a guesser when it is right) until it has
    earned a guess again. Memory is bounded (GUESSERS sources, the least recently heard
    of forgotten first); a source whose bucket is full again is forgotten, as if never
    heard of, which ends its episode."""

    def __init__(
        self,
        burst: int = GUESSES,
        every: float = GUESS_EVERY,
        sources: int = GUESSERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.every, self.sources, self.clock = burst, every, sources, clock
        self._left: OrderedDict[str, tuple[float, float, bool]] = OrderedDict()
        # source -> (guesses left, when counted, told it is refused in this episode)

    def _refilled(self, source: str, now: float) -> tuple[float, bool]:
        left, when, told = self._left.get(source, (self.burst, now, False))
        return min(self.burst, left + (now - when) / self.every), told

    def wait(self, source: str) -> int:
        """Seconds before `source` may present a token again (0: it may now)."""
        if source not in self._left:
            return 0
        left, _ = self._refilled(source, self.clock())
        if left >= self.burst:
            del self._left[source]
        return 0 if left >= 1 else math.ceil((1 - left) * self.every)

    def wrong(self, source: str) -> bool:
        """`source` presented a wrong token; True the first time in an episode that this
        used its last guess (the moment to say so, once)."""
        now = self.clock()
        left, told = self._refilled(source, now)
        self._left.pop(source, None)
        exhausted = left - 1 < 1
        self._left[source] = (left - 1, now, told or exhausted)
        while len(self._left) > self.sources:
            self._left.popitem(last=False)
        return exhausted and not told


def bearer(header: str | None) -> str | None:
    """The secret of an ``Authorization: Bearer …`` header, if it is one."""
    scheme, _, secret = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return secret.strip() or None


def socket_peer(sock: socket.socket) -> str:
    """The user at the other end of a Unix socket, from the kernel (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
