"""Hostlist expressions: ``cn[001-004]``, ``10.99.0.[11-14]``, ``sw1:swp[1-4]``, ``a,b[1-2]``.

One syntax for names, addresses and switch ports, so a group's ``nodes``, ``ip`` and
``location`` ranges line up element by element. Zero padding is kept (``[001-004]`` gives
``001``); several bracket groups expand as a product, leftmost slowest.
"""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_EXPANSION = 1_000_000


class HostlistError(ValueError):
    """A hostlist expression that cannot be expanded; the message says where."""


def expand(expression: str) -> list[str]:
    """Expand a hostlist expression into its names, in order."""
    names: list[str] = []
    for part in _split_top_level(expression):
        names.extend(_expand_one(part, expression))
        if len(names) > MAX_EXPANSION:
            raise HostlistError(f"{expression!r} expands to more than {MAX_EXPANSION} names")
    return names


def _split_top_level(expression: str) -> list[str]:
    """Split at commas that are outside brackets."""
    parts, depth, current = [], 0, []
    for char in expression:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"{expression!r}: ']' without '['")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise HostlistError(f"{expression!r}: '[' is never closed")
    parts.append("".join(current))
    for part in parts:
        if not part.strip():
            raise HostlistError(f"{expression!r}: empty name in list")
    return [part.strip() for part in parts]


def _expand_one(pattern: str, expression: str) -> list[str]:
    pieces = re.split(r"\[([^\[\]]*)\]", pattern)
    if any("[" in literal or "]" in literal for literal in pieces[::2]):
        raise HostlistError(f"{expression!r}: nested brackets are not supported")
    choices: list[list[str]] = []
    for index, piece in enumerate(pieces):
        choices.append(_expand_bracket(piece, expression) if index % 2 else [piece])
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_bracket(body: str, expression: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HostlistError(
                f"{expression!r}: [{body}] must hold numbers or ranges like 1-4 or 001-032"
            )
        first, last = match.group(1), match.group(2) or match.group(1)
        low, high = int(first), int(last)
        if high < low:
            raise HostlistError(f"{expression!r}: range {item.strip()} runs backwards")
        if high - low >= MAX_EXPANSION:
            raise HostlistError(f"{expression!r}: range {item.strip()} is too large")
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
    return values
