"""Declarations: the variables of a node's state and the mutations (edges) between values."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ANY = "*"  # as the "from" of a change: whatever the value is


@dataclass(frozen=True)
class Variable:
    """One dimension of a node's state; a value never set or no longer known is the default."""

    name: str
    values: tuple[str, ...]
    default: str = "unknown"

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if len(set(self.values)) != len(self.values) or ANY in self.values:
            raise ValueError(f"variable {self.name!r}: values must be distinct and not {ANY!r}")
        if self.default not in self.values:
            raise ValueError(f"variable {self.name!r}: default {self.default!r} is not a value")


def _values(value: str | Iterable[str]) -> frozenset[str]:
    return frozenset((value,) if isinstance(value, str) else value)


@dataclass(frozen=True)
class Mutation:
    """One edge, declared as data so that planning, firing and explain() read one table.

    ``changes`` maps a variable to (from, to); ``requires``/``excludes`` guard other
    variables; the change must be observed within ``timeout`` seconds of the action
    starting (or of firing, without an action), else ``fail_to`` is written into dsc.
    """

    name: str
    changes: Mapping[str, tuple[str, str]]
    requires: Mapping[str, frozenset[str]] = field(default_factory=dict)
    excludes: Mapping[str, frozenset[str]] = field(default_factory=dict)
    timeout: float | None = None
    fail_to: Mapping[str, str] = field(default_factory=dict)
    forgets: tuple[str, ...] = ()
    action: str | None = None
    cost: float = 1.0
    doc: str = ""  # what is waited for, when there is no action to name

    def __post_init__(self) -> None:
        # Plain sets, lists or a single value are accepted; stored frozen.
        for guard in ("requires", "excludes"):
            values = {var: _values(v) for var, v in getattr(self, guard).items()}
            object.__setattr__(self, guard, values)
        forgets = (self.forgets,) if isinstance(self.forgets, str) else tuple(self.forgets)
        object.__setattr__(self, "forgets", forgets)
        if not self.changes:
            raise ValueError(f"mutation {self.name!r} changes nothing")
        if self.cost < 0 or (self.timeout is not None and self.timeout <= 0):
            raise ValueError(f"mutation {self.name!r}: cost must be >= 0 and timeout > 0")
