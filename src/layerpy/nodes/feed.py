"""The change feed: every change of a node, published once, heard by every subscriber.

The node store publishes what it observed, the lifecycle what is desired and what it did,
the catalog when an image has a new digest. The engine, and later the event stream, the
dashboard and metrics, subscribe. A subscriber reads at its own pace from a bounded queue;
one that falls behind is told so (``Gap``) once and should re-read the state it mirrors.
History is kept (bounded) so a subscriber can resume after a sequence number.

A *quiet* change is a heartbeat's (when a node last reported, its agent's uptime): it goes
only to the subscribers that ask for quiet changes, never into the history, and takes no
number of its own (it carries the last real change's). A heartbeat of every node wakes
neither the engine nor the event stream, cannot push real changes out of the history, and
leaves the real changes' numbers consecutive, as resuming clients expect.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

HISTORY = 20_000
QUEUE = 100_000


@dataclass(frozen=True, slots=True)
class Change:
    """One change. ``kind``: observed (dsc fields), event (identity: bound, moved,
    replaced, conflict), desired (cfg), action, image (a name has a new digest)."""

    seq: int
    at: float
    node: str
    kind: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    message: str = ""
    quiet: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "time": self.at, "node": self.node, "kind": self.kind,
                "fields": dict(self.fields), "message": self.message}  # fmt: skip


class Gap:
    """Marks where a subscriber lost changes: re-read what you mirror."""


GAP = Gap()


class Subscription:
    """An async iterator of changes (and ``GAP`` after an overflow)."""

    def __init__(self, feed: ChangeFeed, limit: int, quiet: bool = False) -> None:
        self._feed = feed
        self.quiet = quiet
        self._queue: deque[Change | Gap] = deque()
        self._limit = limit
        self._ready = asyncio.Event()
        self._ended = False

    def _put(self, change: Change) -> None:
        if len(self._queue) >= self._limit:
            self._queue.clear()
            self._queue.append(GAP)
        self._queue.append(change)
        self._ready.set()

    def pending(self) -> list[Change | Gap]:
        """Everything queued, without waiting."""
        items = list(self._queue)
        self._queue.clear()
        return items

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Change | Gap:
        while not self._queue:
            if self._ended:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()

    def end(self) -> None:
        """No more changes: the iteration stops once the queued ones are read (a stream
        whose server is shutting down)."""
        self.close()
        self._ended = True
        self._ready.set()

    def close(self) -> None:
        self._feed._subscribers.discard(self)


class ChangeFeed:
    def __init__(self, clock: Callable[[], float] = time.time, history: int = HISTORY) -> None:
        self.clock = clock
        # Numbers go on rising across restarts (a thousand a millisecond of the start
        # time): an event number from before a restart is older than every new one, so a
        # client resuming with it is told of the gap instead of being sent strangers' news.
        self.seq = int(clock() * 1000) * 1000
        self.history: deque[Change] = deque(maxlen=history)
        self._subscribers: set[Subscription] = set()

    def publish(
        self,
        node: str,
        kind: str,
        fields: Mapping[str, Any] | None = None,
        message: str = "",
        quiet: bool = False,
    ) -> Change:
        if not quiet:  # a quiet change takes no number: real ones stay consecutive
            self.seq += 1
        change = Change(self.seq, self.clock(), node, kind, dict(fields or {}), message, quiet)
        if not quiet:
            self.history.append(change)
        for subscription in self._subscribers:
            if subscription.quiet or not quiet:
                subscription._put(change)
        return change

    def subscribe(
        self, since: int | None = None, limit: int = QUEUE, quiet: bool = False
    ) -> Subscription:
        """Changes from now on (with ``quiet``, heartbeats too); with ``since``, first
        those after it still in the history (a ``GAP`` first when some of them are gone)."""
        subscription = Subscription(self, limit, quiet)
        if since is not None:
            oldest = self.history[0].seq if self.history else self.seq + 1
            if oldest > since + 1 or since > self.seq:  # lost, or another server's number
                subscription._queue.append(GAP)
            for change in self.history:
                if change.seq > since:
                    subscription._put(change)
        self._subscribers.add(subscription)
        return subscription

    def events(self, limit: int = 1000) -> list[dict[str, Any]]:
        """The recent identity events, oldest first (``GET /api/v1/events``)."""
        found = [c for c in reversed(self.history) if c.kind == "event"][:limit]
        return [
            {"time": c.at, "node": c.node, "kind": c.fields.get("event"), "message": c.message}
            for c in reversed(found)
        ]
