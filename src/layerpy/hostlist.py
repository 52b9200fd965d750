"""Hostlist expressions: ``cn[001-004]``, ``10.99.0.[11-14]``, ``sw1:swp[1-4]``, ``a,b[1-2]``.

One syntax for names, addresses and switch ports, so a group's ``nodes``, ``ip`` and
``location`` ranges line up element by element. Zero padding is kept (``[001-004]`` gives
``001``); several bracket groups expand as a product, leftmost slowest.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator

_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
MAX_EXPANSION = 100_000
"""The most names one expression may stand for; counted before anything is built."""
MAX_LENGTH = 65_536
"""The longest expression, in characters."""
MAX_TERMS = 10_000
"""The most terms in one expression: names between commas, and numbers or ranges in brackets."""
MAX_BRACKETS = 8
"""The most bracket groups in one name (``r[1-4]c[1-8]n[1-4]`` has 3)."""
MAX_DIGITS = 18
"""The longest number in brackets, in digits."""
SHOWN = 40  # characters of an expression an error message quotes


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
    return list(names(expression, limit))


def names(expression: str, limit: int = MAX_EXPANSION) -> Iterator[str]:
    """The names of an expression one at a time, for a caller that takes them in turns.

    Every limit is checked and the names are counted here, before the first is made:
    a HostlistError comes from this call, never from the iteration. The checks cost
    time in proportion to the expression's length (at most MAX_LENGTH) and no more.
    """
    patterns = _parse(expression)
    total = sum(_size(pattern) for pattern in patterns)
    if total > limit:
        raise HostlistError(
            f"{_quote(expression)} is too large: {_count(total)} names, the limit is {limit}"
        )
    return itertools.chain.from_iterable(_expand_one(pattern) for pattern in patterns)


def _count(total: int) -> str:
    """A count of names for a message, in digits up to a trillion's (the limits keep it
    under 200 digits, so making the digits costs nothing)."""
    digits = str(total)
    return digits if len(digits) <= 13 else f"about 1e{len(digits) - 1}"


def _quote(expression: str) -> str:
    """The expression for an error message: its start only when it is long."""
    if len(expression) <= SHOWN:
        return repr(expression)
    return f"{expression[:SHOWN]!r}… ({len(expression)} characters)"


def _parse(expression: str) -> list[_Pattern]:
    """The patterns of an expression, checked against every limit: length and terms
    first (counted by the C string methods), then brackets and digits as they come."""
    if len(expression) > MAX_LENGTH:
        raise HostlistError(
            f"{_quote(expression)} is too long: the limit is {MAX_LENGTH} characters"
        )
    terms = expression.count(",") + expression.count("[") + 1
    if terms > MAX_TERMS:
        raise HostlistError(
            f"{_quote(expression)} has too many terms: {terms}, the limit is {MAX_TERMS} "
            "(names, and numbers or ranges in brackets)"
        )
    return [_parse_one(part, expression) for part in _split_top_level(expression)]


def _split_top_level(expression: str) -> list[str]:
    """Split at commas that are outside brackets."""
    parts, depth, current = [], 0, []
    for char in expression:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"{_quote(expression)}: ']' without '['")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise HostlistError(f"{_quote(expression)}: '[' is never closed")
    parts.append("".join(current))
    for part in parts:
        if not part.strip():
            raise HostlistError(f"{_quote(expression)}: empty name in list")
    return [part.strip() for part in parts]


def _parse_one(pattern: str, expression: str) -> _Pattern:
    pieces: _Pattern = []
    if pattern.count("[") > MAX_BRACKETS:
        raise HostlistError(
            f"{_quote(pattern)} has {pattern.count('[')} bracket groups, "
            f"the limit is {MAX_BRACKETS} in one name"
        )
    for index, piece in enumerate(re.split(r"\[([^\[\]]*)\]", pattern)):
        if index % 2:
            pieces.append(_parse_bracket(piece, expression))
        elif "[" in piece or "]" in piece:
            raise HostlistError(f"{_quote(expression)}: nested brackets are not supported")
        else:
            pieces.append(piece)
    return pieces


def _parse_bracket(body: str, expression: str) -> list[_Range]:
    ranges: list[_Range] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if not match:
            raise HostlistError(
                f"{_quote(expression)}: [{body[:SHOWN]}] must hold numbers or ranges "
                "like 1-4 or 001-032"
            )
        first, last = match.group(1), match.group(2) or match.group(1)
        if max(len(first), len(last)) > MAX_DIGITS:
            raise HostlistError(
                f"{_quote(expression)}: a number in brackets has over {MAX_DIGITS} digits"
            )
        low, high = int(first), int(last)
        if high < low:
            raise HostlistError(f"{_quote(expression)}: range {item.strip()} runs backwards")
        width = len(first) if first.startswith("0") and len(first) > 1 else 0
        ranges.append((low, high, width))
    return ranges


def _size(pattern: _Pattern) -> int:
    """The names a pattern stands for: a product of at most MAX_BRACKETS sums of numbers
    of at most MAX_DIGITS digits, so the count stays a small integer however it is made."""
    total = 1
    for piece in pattern[1::2]:
        assert isinstance(piece, list)
        total *= sum(high - low + 1 for low, high, _ in piece)
    return total


def _expand_one(pattern: _Pattern) -> Iterator[str]:
    choices: list[list[str]] = []
    for piece in pattern:
        if isinstance(piece, str):
            choices.append([piece])
        else:
            choices.append(
                [str(n).zfill(width) for low, high, width in piece for n in range(low, high + 1)]
            )
    return ("".join(combo) for combo in itertools.product(*choices))


def fold(names: Iterable[str]) -> str:
    """The hostlist of these names as Slurm and ClusterShell write it: numbered names with
    one prefix become ranges (cn001 cn002 cn003 cn007 -> ``cn[001-003,007]``); expand()
    gives the names back, sorted by prefix and number (when the result is within expand's
    limits). Time grows with the names' total length, whatever they hold: a name ending
    in more than MAX_DIGITS digits is kept as it is."""
    padded: dict[tuple[str, int], set[int]] = {}  # (prefix, width): numbers like 007
    natural: dict[str, set[str]] = {}  # prefix: digits without a leading zero
    plain: set[str] = set()
    for name in names:
        prefix = name.rstrip("0123456789")
        digits = name[len(prefix) :]
        if not digits or len(digits) > MAX_DIGITS:
            plain.add(name)
        elif digits[0] == "0" and len(digits) > 1:
            padded.setdefault((prefix, len(digits)), set()).add(int(digits))
        else:
            natural.setdefault(prefix, set()).add(digits)
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
