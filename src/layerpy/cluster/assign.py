"""Which instance owns which node: the sans-I/O core of ownership (docs/ha.md, "Ownership and
fencing").

Facts in (the live instances and their segments, the current owners, the nodes and their
addresses, the time), decisions out (claim these, release those, decide again at). The I/O
shell (``owners.py``) applies the decisions with etcd transactions, so two instances that
decide the same claim at once still end with one owner.

Rules:
- An instance serves a node when its segment is ``""`` (every node) or the node's address
  lies in the segment's subnet; a node in no live instance's segment, or with no known
  address, is served by every instance (``Segments``).
- Among the live instances that serve an unowned node, rendezvous (highest-random-weight)
  hashing names the preferred one: it claims at once; any other claims after ``grace``
  seconds, so a node never stays unowned because its preferred instance is gone.
- An instance that has just joined (or joined again) claims nothing for ``settle`` seconds
  (the lease TTL in ``layerpy serve``): instances started together, one of them slowly,
  see each other before the first takes every node; and it claims nodes it is not
  preferred for only a grace after that.
- Ownership is sticky: an owned node stays with its owner while the owner lives, also when
  an instance joins (no rebalancing; the newcomer takes unowned nodes only). Moving live
  nodes would open a gap in which nobody acts, for no gain in safety.
- An owner releases a node that left the file or that it no longer serves (an instance of
  the node's own segment is back).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

EVERY_NODE = ""  # the default segment: the instance serves every node


def parse_segment(text: str) -> IPv4Network | None:
    """An instance's ``[cluster] segment``: "" (every node) or an IPv4 subnet in CIDR form.
    Raises ValueError naming the value otherwise (for the config's checks)."""
    if text == EVERY_NODE:
        return None
    try:
        return IPv4Network(text, strict=True)
    except ValueError as error:
        message = f"segment {text!r} is neither empty nor an IPv4 subnet ({error})"
        raise ValueError(message) from None


class Segments:
    """Which live instances may own a node: those whose segment holds its address (or is
    ""); every instance when none does (a node behind a relay, or one whose segment's
    instances are all gone: it is better owned than not) or its address is unknown.
    Answers are remembered per address: one Segments lives as long as the live set."""

    def __init__(self, instances: Mapping[str, str]) -> None:
        self.instances = dict(instances)
        self._masks: list[tuple[str, int, int]] = []  # name, network as int, netmask as int
        for name, text in instances.items():
            try:
                network = parse_segment(text)
            except ValueError:
                continue  # a record from a newer or broken peer: it owns nothing
            if network is None:
                self._masks.append((name, 0, 0))
            else:
                self._masks.append((name, int(network.network_address), int(network.netmask)))
        self._every = tuple(name for name, _, _ in self._masks)
        self._known: dict[IPv4Address, tuple[str, ...]] = {}

    def candidates(self, address: IPv4Address | None) -> tuple[str, ...]:
        if address is None:
            return self._every
        if (known := self._known.get(address)) is not None:
            return known
        number = int(address)
        inside = tuple(name for name, net, mask in self._masks if number & mask == net)
        self._known[address] = found = inside or self._every
        return found


def weight(instance: str, node: str) -> int:
    """The rendezvous weight of ``instance`` for ``node``: stable across processes and hosts."""
    digest = hashlib.blake2b(f"{instance}\0{node}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred(node: str, candidates: Iterable[str]) -> str | None:
    """The candidate of highest weight for ``node`` (ties, improbable, go to the lower name)."""
    return max(candidates, key=lambda name: (weight(name, node), name), default=None)


@dataclass(frozen=True)
class Decision:
    claim: tuple[str, ...]  # nodes to claim now (put if absent, with this instance's lease)
    release: tuple[str, ...]  # nodes this instance owns and must give up
    wake_at: float | None  # when a grace ends: decide again then (None: only on a change)


class Assignment:
    """Decides this instance's claims and releases. Keeps only when each unowned node was
    first seen unowned (for the grace); everything else comes in as facts on each call."""

    def __init__(self, me: str, grace: float, settle: float | None = None) -> None:
        """``settle``: how long a newly joined instance claims nothing (default ``grace``)."""
        self.me = me
        self.grace = grace
        self.settle = grace if settle is None else settle
        self._unowned_since: dict[str, float] = {}
        self._joined_at: float | None = None  # when this instance was first seen live
        self._segments = Segments({})

    def decide(
        self,
        now: float,
        instances: Mapping[str, str],
        nodes: Mapping[str, IPv4Address | None],
        owners: Mapping[str, str],
    ) -> Decision:
        """``instances``: live instance name → segment (this one included while its lease is
        alive); ``nodes``: node name → address; ``owners``: node name → owning instance."""
        if self.me not in instances:  # no lease, no claim: wait to be registered again
            self._unowned_since.clear()
            self._joined_at = None
            return Decision((), (), None)
        if self._joined_at is None:
            self._joined_at = now
        settled = self._joined_at + self.settle
        if self._segments.instances != instances:
            self._segments = Segments(instances)
        segments = self._segments
        release = tuple(
            sorted(
                node
                for node, owner in owners.items()
                if owner == self.me
                and (node not in nodes or self.me not in segments.candidates(nodes[node]))
            )
        )
        claim: list[str] = []
        wake_at: float | None = None
        since = self._unowned_since
        for node in [node for node in since if node not in nodes]:
            del since[node]
        for node, address in nodes.items():
            candidates = () if node in owners else segments.candidates(address)
            if self.me not in candidates:
                since.pop(node, None)
                continue
            first = since.setdefault(node, now)
            if preferred(node, candidates) == self.me:
                ready = settled
            else:  # the preferred one's own settling may just be ending: a grace after ours
                ready = max(first, settled) + self.grace
            if now >= ready:
                claim.append(node)
            else:
                wake_at = ready if wake_at is None else min(wake_at, ready)
        return Decision(tuple(claim), release, wake_at)
