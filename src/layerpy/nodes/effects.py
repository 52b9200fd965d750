"""What the node store's policies decide, as data: the store applies these, and only it.

The policies (identity, reports, tokens, liveness) read the store and return a list of
these; ``NodeStore.apply`` assigns the fields, keeps the look-ups and the backend in step,
and publishes each change once on the feed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from layerpy.config import Config
from layerpy.model import Node, Phase
from layerpy.nodes.discovery import Discovery

Location = tuple[str, str]  # (switch, port)


class Store(Protocol):
    """What the policies read of the node store (``NodeStore``); they write nothing."""

    config: Config
    nodes: dict[str, Node]
    unknown: Discovery
    clock: Callable[[], float]

    @property
    def lost_limit(self) -> float: ...

    def at(self, location: Location) -> Node | None: ...

    def by_mac(self, mac: str) -> Node | None: ...

    def mac_of(self, node: Node) -> str | None: ...


@dataclass(frozen=True, slots=True)
class Observe:
    """Observed fields of a node; ``quiet`` for a heartbeat's (last_report, the agent's
    uptime and seq): on the feed, but only for subscribers that ask for quiet changes."""

    node: str
    fields: Mapping[str, Any]
    why: str = ""
    quiet: bool = False


@dataclass(frozen=True, slots=True)
class NewBoot:
    """A new boot of a node: a fresh timeline, run state booting."""

    node: str
    firmware: str | None = None
    why: str = ""


@dataclass(frozen=True, slots=True)
class Mark:
    """A boot phase seen (the first time only counts); ``xid``: the DHCP transaction that
    showed it, remembered as the boot's."""

    node: str
    phase: Phase
    xid: int | None = None


@dataclass(frozen=True, slots=True)
class Token:
    """The current boot's token digest and boot id, kept through the backend before the
    answer that depends on them."""

    node: str
    digest: str | None
    boot_id: str | None


@dataclass(frozen=True, slots=True)
class Resume:
    """A boot from before a restart (its token and boot id), read from the backend."""

    node: str
    digest: str | None
    boot_id: str | None
    boots: int


@dataclass(frozen=True, slots=True)
class Bind:
    """``mac`` is the node's machine from now on (``binding`` says how)."""

    node: str
    mac: str
    binding: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Machine:
    """What is shown of an unknown machine (``GET /api/v1/unknown``)."""

    mac: str
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Event:
    """Something an operator should see later (``GET /api/v1/events``), also logged."""

    node: str
    kind: str
    message: str


Effect = Observe | NewBoot | Mark | Token | Resume | Bind | Machine | Event
