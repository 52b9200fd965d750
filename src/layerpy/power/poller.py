"""BMC polls for every node, for ever: healthy BMCs each interval, failing ones with backoff.

A BMC whose last poll is still running is not polled again (a dead one takes seconds to
time out and delays no one else), one that fails is tried again after 1, 2, 4 … up to 60 s
and never given up (a BMC resets for minutes, or comes up after the server), and a success
brings it back to the interval. At most ``limit`` polls run at once, fewer than the IPMI
workers (and the power commands run at once), so that the engine's power actions still
find a worker free; and failing BMCs never take the last quarter of those, so that a
thousand dead BMCs, each holding a worker for seconds, do not keep a live one from being
read on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from layerpy.power.base import MAX_SESSIONS, POLL_TIMEOUT, PowerDriver, PowerError

if TYPE_CHECKING:
    from layerpy.stats import Stats

log = logging.getLogger("layerpy.power")

POLL_SLOTS = MAX_SESSIONS * 3 // 4  # polls at once; the rest of the workers serve actions
BACKOFF = (1.0, 60.0)  # seconds: first retry after a failure, and the longest wait

Report = Callable[[str, str | None, str | None], None]


@dataclass(slots=True)
class _Bmc:
    failures: int = 0
    polling: bool = False
    due: float = 0.0
    entry: int = 0  # the tie of its one live entry in the heap; others are stale


class Poller:
    """Polls ``drivers`` (node name -> driver; read afresh each round, so nodes added to or
    removed from the mapping are followed) and reports each result as ``report(name, state,
    None)`` or ``report(name, None, reason)``."""

    def __init__(
        self,
        drivers: Mapping[str, PowerDriver],
        report: Report,
        interval: float,
        *,
        backoff: tuple[float, float] = BACKOFF,
        limit: int = POLL_SLOTS,
        timeout: float = POLL_TIMEOUT,
        stats: Stats | None = None,
    ) -> None:
        if interval <= 0 or limit < 1:
            raise ValueError("the poll interval must be > 0 and the limit >= 1")
        self.drivers, self.report, self.interval = drivers, report, interval
        self.backoff, self.limit, self.timeout = backoff, limit, timeout
        self._bmcs: dict[str, _Bmc] = {}
        # (when, tie, name): one live entry per BMC, healthy and failing ones apart
        self._healthy: list[tuple[float, int, str]] = []
        self._failing: list[tuple[float, int, str]] = []
        self._failing_slots = limit - max(1, limit // 4) if limit > 1 else 1
        self._failing_now = 0  # polls of failing BMCs in flight
        self._tie = itertools.count()
        self._next_look = 0.0  # when _follow next compares the mapping's names with ours
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.stats = stats  # hears each poll's time and outcome (the server's)

    def failures(self, name: str) -> int:
        """Polls failed in a row (0 once one succeeds)."""
        bmc = self._bmcs.get(name)
        return bmc.failures if bmc else 0

    def retry_in(self, name: str) -> float | None:
        """Seconds until a failing BMC is polled again, None while it is healthy or polled."""
        bmc = self._bmcs.get(name)
        if bmc is None or not bmc.failures or bmc.polling:
            return None
        return max(0.0, bmc.due - time.monotonic())

    def in_flight(self) -> int:
        return len(self._tasks)

    async def run(self) -> None:
        """Poll until cancelled; polls in flight are cancelled with it."""
        try:
            while True:
                self._wake.clear()
                now = time.monotonic()
                self._follow(now)
                self._start_due(now)
                wait = self.interval  # new nodes are noticed within an interval
                for due, free in self._queues():
                    if due and free():
                        wait = min(wait, max(0.0, due[0][0] - now))
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that
                # arrives as the event is set, and the poller then runs on for ever
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
        finally:
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks)

    def _follow(self, now: float) -> None:
        """New names are due now; names gone from the mapping are forgotten. A full look
        once an interval, or when the count changed: not at every poll's end."""
        drivers = self.drivers
        if len(self._bmcs) == len(drivers) and now < self._next_look:
            return
        self._next_look = now + self.interval
        for name in drivers:
            if name not in self._bmcs:
                self._bmcs[name] = bmc = _Bmc()
                self._schedule(name, bmc, now)
        for name in [name for name in self._bmcs if name not in drivers]:
            del self._bmcs[name]  # its heap entry is dropped when it comes up

    def _queues(self) -> list[tuple[list[tuple[float, int, str]], Callable[[], bool]]]:
        """Healthy BMCs first, each queue with its test for a free slot."""
        return [(self._healthy, self._room), (self._failing, self._room_for_failing)]

    def _room(self) -> bool:
        return len(self._tasks) < self.limit

    def _room_for_failing(self) -> bool:
        return self._room() and self._failing_now < self._failing_slots

    def _start_due(self, now: float) -> None:
        for due, free in self._queues():
            while due and due[0][0] <= now and free():
                _, tie, name = heapq.heappop(due)
                bmc = self._bmcs.get(name)
                driver = self.drivers.get(name)
                if bmc is None or driver is None or bmc.entry != tie or bmc.polling:
                    continue
                bmc.polling = True
                failing = bmc.failures > 0
                self._failing_now += failing
                task = asyncio.create_task(self._poll(name, bmc, driver, now))
                self._tasks.add(task)
                task.add_done_callback(functools.partial(self._done, failing))

    def _done(self, failing: bool, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._failing_now -= failing
        self._wake.set()

    def _schedule(self, name: str, bmc: _Bmc, when: float) -> None:
        bmc.due, bmc.entry = when, next(self._tie)
        heapq.heappush(self._failing if bmc.failures else self._healthy, (when, bmc.entry, name))
        self._wake.set()

    async def _poll(self, name: str, bmc: _Bmc, driver: PowerDriver, started: float) -> None:
        state = error = None
        begun = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                state = await driver.status()
        except TimeoutError:
            error = f"{name}: power status: no answer from the driver in {self.timeout:g} s"
        except PowerError as failure:
            error = str(failure)
        except Exception as failure:  # any driver failure is this node's error, not ours
            error = f"{name}: power status: {type(failure).__name__}: {failure}"
        if self.stats is not None:
            self.stats.observe("bmc", driver_kind(driver), time.perf_counter() - begun,
                               ok=error is None)  # fmt: skip
        now = time.monotonic()
        bmc.polling = False
        if self._bmcs.get(name) is not bmc:
            return  # removed meanwhile: this result is no one's news
        if self.drivers.get(name) is not driver:  # replaced (a reload): ask the new one now
            bmc.failures = 0
            self._schedule(name, bmc, now)
            return
        if error is None:
            bmc.failures = 0
            # the next tick of this BMC's own rhythm that has not passed yet
            ticks = max(1, math.ceil((now - started) / self.interval))
            self._schedule(name, bmc, started + ticks * self.interval)
        else:
            bmc.failures += 1
            first, cap = self.backoff
            self._schedule(name, bmc, now + min(cap, first * 2 ** min(bmc.failures - 1, 32)))
        try:
            self.report(name, state, error)
        except Exception:
            log.exception("%s: reporting a power poll failed", name)


def driver_kind(driver: PowerDriver) -> str:
    """The metrics label of a driver (ipmi, redfish, qemu, command, none): from its class, never
    from its node or address."""
    return type(driver).__name__.removesuffix("Driver").lower()
