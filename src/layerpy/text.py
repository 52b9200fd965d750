"""Text from the network made safe for a log line or a terminal."""

from __future__ import annotations

LIMIT = 200


def printable(value: object, limit: int = LIMIT) -> str:
    """``value`` as one printable line: control characters (escape sequences, newlines)
    become ``\\xNN`` escapes, and it is cut to ``limit`` characters."""
    text = str(value)
    cut = text[:limit]
    shown = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in cut)
    return shown + ("…" if len(text) > limit else "")
