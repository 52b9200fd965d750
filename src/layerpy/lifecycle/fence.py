"""The fence: whether this instance may act on a node now (power, image roll).

A single server always may (no fence). Several instances sharing nodes each act only on
the nodes they own: their fence says no for the others, and for all of them once the
instance can no longer prove its ownership (an etcd lease lost), with a reason people read.
"""

from __future__ import annotations

from typing import Protocol


class Fence(Protocol):
    def allows(self, name: str) -> bool:
        """Whether an action on the node may start now; asked right before each one."""
        ...

    def why_not(self, name: str) -> str | None:
        """Why not, for people (``explain``, the event stream); None when it allows."""
        ...


class Fenced(Exception):
    """An action asked of a node the fence holds: not done, and not a failure."""
