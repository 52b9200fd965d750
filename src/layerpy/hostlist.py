"""Hostlist expressions: ``cn[001-004]``, ``10.99.0.[11-14]``, ``sw1:swp[1-4]``, ``a,b[1-2]``.

One syntax for names, addresses and switch ports, so a group's ``nodes``, ``ip`` and
``location`` ranges line up element by element. Zero padding is kept (``[001-004]`` gives
``001``); several bracket groups expand as a product, leftmost slowest.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_EXPANSION = 100_000
"""The most names one expression may stand for; counted before anything is built."""


class HostlistError(ValueError):
    """A hostlist expression that cannot be expanded; the message says where."""


# One bracket item: first, last and zero-padding width, e.g. 001-004 -> (1, 4, 3).
_Range = tuple[int, int, int]
# One comma-separated part: literals at even indexes, bracket bodies (ranges) at odd ones.
_Pattern = list[str | list[_Range]]


def expand(expression: str, limit: int = MAX_EXPANSION) -> list[str]:
    """Expand a hostlist expression into its names, in order.

    The number of names is counted from the ranges first, so ``x[0-999][0-999][0-999]``
    fails at once instead of building a billion strings.
    """
    patterns = [_parse_one(part, expression) for part in _split_top_level(expression)]
    total = sum(_size(pattern) for pattern in patterns)
    if total > limit:
        raise HostlistError(f"{expression!r} is too large: {total} names, the limit is {limit}")
    names: list[str] = []
    for pattern in patterns:
        names.extend(_expand_one(pattern))
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


def _parse_one(pattern: str, expression: str) -> _Pattern:
    pieces: _Pattern = []
    for index, piece in enumerate(re.split(r"\[([^\[\]]*)\]", pattern)):
        if index % 2:
            pieces.append(_parse_bracket(piece, expression))
        elif "[" in piece or "]" in piece:
            raise HostlistError(f"{expression!r}: nested brackets are not supported")
        else:
            pieces.append(piece)
    return pieces


def _parse_bracket(body: str, expression: str) -> list[_Range]:
    ranges: list[_Range] = []
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
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        ranges.append((low, high, width))
    return ranges


def _size(pattern: _Pattern) -> int:
    total = 1
    for piece in pattern[1::2]:
        assert isinstance(piece, list)
        total *= sum(high - low + 1 for low, high, _ in piece)
    return total


def _expand_one(pattern: _Pattern) -> list[str]:
    choices: list[list[str]] = []
    for piece in pattern:
        if isinstance(piece, str):
            choices.append([piece])
        else:
            choices.append(
                [str(n).zfill(width) for low, high, width in piece for n in range(low, high + 1)]
            )
    return ["".join(combo) for combo in itertools.product(*choices)]


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def fold(names: Iterable[str]) -> str:
    """The hostlist of these names as Slurm and ClusterShell write it: numbered names with
    one prefix become ranges (cn001 cn002 cn003 cn007 -> ``cn[001-003,007]``); expand()
    gives the names back, sorted by prefix and number."""
    padded: dict[tuple[str, int], set[int]] = {}  # (prefix, width): numbers like 007
    natural: dict[str, set[str]] = {}  # prefix: digits without a leading zero
    plain: set[str] = set()
    for name in names:
        found = _NUMBERED.match(name)
        if found is None:
            plain.add(name)
        elif found.group(2)[0] == "0" and len(found.group(2)) > 1:
            padded.setdefault((found.group(1), len(found.group(2))), set()).add(int(found.group(2)))
        else:
            natural.setdefault(found.group(1), set()).add(found.group(2))
    runs: dict[tuple[str, int], set[int]] = dict(padded)
    for prefix, numbers in natural.items():
        for digits in numbers:  # 100 joins cn[001-099] (same width); else unpadded ranges
            width = len(digits) if (prefix, len(digits)) in padded else 0
            runs.setdefault((prefix, width), set()).add(int(digits))
    parts = [_fold_one(prefix, width, numbers) for (prefix, width), numbers in sorted(runs.items())]
    return ",".join(sorted(plain) + parts)


def _fold_one(prefix: str, width: int, numbers: set[int]) -> str:
    ordered = sorted(numbers)
    spans: list[tuple[int, int]] = []
    for n in ordered:
        if spans and n == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], n)
        else:
            spans.append((n, n))
    text = ",".join(
        str(a).zfill(width) if a == b else f"{str(a).zfill(width)}-{str(b).zfill(width)}"
        for a, b in spans
    )
    return f"{prefix}{text}" if len(ordered) == 1 else f"{prefix}[{text}]"
