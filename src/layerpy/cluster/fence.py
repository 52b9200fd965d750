"""The fence: this instance acts on a node only while it owns the node AND its etcd lease is
known fresh (docs/ha.md, "Ownership and fencing").

Known fresh means: before a local deadline = the time the last successful keepalive was
*sent* + the TTL etcd granted minus a safety margin. etcd counts the lease's TTL from when the
keepalive *arrived*, which is later, so the local deadline passes before etcd can expire the
lease and give the node to another instance — without waiting to hear anything from etcd.
This is client-go's leader election (lease duration, renew deadline) per node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

log = logging.getLogger("layerpy.cluster")


class LeaseClock:
    """Sans-I/O: how long this instance's lease is known fresh, from its keepalives."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.lease = 0  # the lease the deadline is for (0: none yet)
        self.deadline = float("-inf")

    def granted(self, lease: int, sent_at: float, ttl: int) -> None:
        """A new lease (grant sent at ``sent_at``): fresh for ``ttl`` from the send."""
        self.lease = lease
        self.deadline = sent_at + ttl - self.margin

    def renewed(self, lease: int, sent_at: float, ttl: int) -> None:
        """A keepalive sent at ``sent_at`` was answered with ``ttl`` seconds (> 0)."""
        if lease == self.lease:
            self.deadline = max(self.deadline, sent_at + ttl - self.margin)

    def lost(self) -> None:
        """etcd said the lease is gone: not fresh, whatever the clock says."""
        self.deadline = float("-inf")

    def fresh(self, now: float) -> bool:
        return now < self.deadline


class Fence:
    """The lifecycle's gate (``allows``/``why_not``): owned nodes only, fresh lease only.

    ``owned`` is what etcd says this instance owns: node → the lease its owner key is
    attached to; a key of an earlier lease of this instance does not count. ``on_change`` is
    called (no arguments) when the fence may allow something it did not, or the reverse —
    wire it to ``Lifecycle.fence_changed``."""

    def __init__(
        self,
        clock: LeaseClock,
        now: Callable[[], float],
        on_change: Callable[[], None],
        owner_of: Callable[[str], str | None] = lambda node: None,
    ) -> None:
        self._clock = clock
        self._now = now
        self._on_change = on_change
        self._owner_of = owner_of  # the instance etcd names as a node's owner, for why_not
        self.owned: dict[str, int] = {}
        self._open = False  # what was last said (logged and told) about the lease
        self.held: str | None = None  # why this instance holds itself (None: it does not)
        self.holds = 0  # times it held itself, for /metrics

    def allows(self, name: str) -> bool:
        clock = self._clock
        return (
            self.owned.get(name) == clock.lease != 0
            and clock.fresh(self._now())
            and self.held is None
        )

    def why_not(self, name: str) -> str | None:
        """None when allowed, else a sentence for the operator."""
        if not self._clock.fresh(self._now()):
            return "this instance lost etcd (its lease is not known fresh): it acts on no node"
        if self.held is not None:
            return f"this instance holds: {self.held}"
        if self.owned.get(name) != self._clock.lease:
            owner = self._owner_of(name)
            return f"{name} is owned by instance {owner}" if owner else f"{name} has no owner yet"
        return None

    def set_owned(self, changes: Mapping[str, int | None]) -> None:
        """Owner keys changed: node → the lease of its key if the key names this instance,
        None if it does not (or is gone). Tells the lifecycle once if any answer changed."""
        changed = False
        for node, lease in changes.items():
            before = self.allows(node)
            if lease is None:
                self.owned.pop(node, None)
            else:
                self.owned[node] = lease
            changed = changed or self.allows(node) != before
        if changed:
            self._on_change()

    def hold(self, why: str | None) -> None:
        """Act on no node while ``why`` (None: act again), whatever the lease: the instance's
        writes to etcd are backed up, so what it would decide could not be kept. Logs one
        line when the hold begins and one when it ends, and tells the lifecycle."""
        if (why is None) == (self.held is None):
            return
        if why is not None:
            self.holds += 1
            log.warning("holding: %s; acting on no node until then (boots go on)", why)
        else:
            log.info("no longer holding (%s): acting on the nodes this instance owns", self.held)
        self.held = why
        self._on_change()

    def check(self) -> bool:
        """Compare the lease's freshness with what was last said: log one line and tell the
        lifecycle when it changed (and return True). Call it at the deadline and after every
        keepalive."""
        fresh = self._clock.fresh(self._now())
        if fresh == self._open:
            return False
        self._open = fresh
        if fresh:
            log.info(
                "etcd lease %x fresh: acting on the nodes this instance owns", self._clock.lease
            )
        else:
            log.warning(
                "lost etcd (lease %x not renewed in time): acting on no node until it is back",
                self._clock.lease,
            )
        self._on_change()
        return True
