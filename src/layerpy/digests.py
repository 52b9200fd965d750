"""Secrets kept only as digests: operator tokens and boot tokens alike.

The state directory never holds a token itself, only its SHA-256: a leaked or backed-up
file hands out nothing that works. Tokens are random (144 bits and more), so a plain hash
is enough (a slow one guards guessable passwords, which these are not). A presented secret
is hashed and compared with the kept digest in constant time.
"""

from __future__ import annotations

import hashlib
import secrets


def new(prefix: str = "", size: int = 18) -> str:
    """A fresh random secret of `size` bytes, URL-safe."""
    return prefix + secrets.token_urlsafe(size)


def digest(secret: str) -> str:
    """SHA-256 of the secret, hex: what is kept instead of it."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(kept: str | None, secret: str) -> bool:
    """Whether `secret` is the one whose digest was kept (constant time on the digests)."""
    return kept is not None and secrets.compare_digest(kept, digest(secret))
