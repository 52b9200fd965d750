"""Log lines a flood cannot multiply: the first few of a kind per window, then the rest
only counted, and one line that says how many there were.

A *kind* is a constant the call site chooses (what happened: "untrusted relay", "bad
request"), never a value from the network: 26 000 forged packets that each carry another
address are still one kind, and are written as a few lines and one summary. What was held
back is counted per (subsystem, kind) for ``/metrics`` (``layerpy_log_suppressed_total``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

BURST = 5  # lines per kind and window
WINDOW = 60.0  # seconds
KINDS = 64  # kinds per throttle at once; past this a call site is wrong: "other"
OTHER = "other"
SUMMARY_EVERY = 5.0  # seconds between the server's calls of flush_all()

suppressed: Counter[tuple[str, str]] = Counter()
"""Lines held back since the start, per (subsystem, kind), for /metrics."""
_throttles: weakref.WeakSet[Throttle] = weakref.WeakSet()


@dataclass(slots=True)
class _Window:
    start: float
    level: int
    written: int = 0
    held: int = 0


class Throttle:
    """``log(kind, level, message, *args)`` writes at most `burst` lines of a kind per
    `window` seconds; when a window that held lines back ends (at the kind's next line,
    or at ``flush()``), one line says "… N more like this in the last S s"."""

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
        *,
        burst: int = BURST,
        window: float = WINDOW,
    ) -> None:
        self.logger = logger
        self.clock = clock
        self.burst = burst
        self.window = window
        self.subsystem = logger.name.removeprefix("layerpy.")
        self._windows: dict[str, _Window] = {}
        _throttles.add(self)

    def log(
        self, kind: str, level: int, message: str, *args: object, exc_info: bool = False
    ) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = self.clock()
        window = self._windows.get(kind)
        if window is not None and now - window.start >= self.window:
            self._close(kind, window, now)
            window = None
        if window is None:
            if len(self._windows) >= KINDS and kind not in self._windows:
                kind = OTHER
            window = self._windows.setdefault(kind, _Window(now, level))
        if window.written < self.burst:
            window.written += 1
            self.logger.log(level, message, *args, exc_info=exc_info)
            return
        window.held += 1
        window.level = max(window.level, level)
        suppressed[self.subsystem, kind] += 1

    def flush(self) -> None:
        """Say what each ended window held back."""
        now = self.clock()
        for kind, window in list(self._windows.items()):
            if now - window.start >= self.window:
                self._close(kind, window, now)

    def end(self, kind: str) -> None:
        """The kind's trouble is over (and the caller says how much there was): forget its
        window without a summary, so its next line is written at once (a new outage is
        news)."""
        self._windows.pop(kind, None)

    def _close(self, kind: str, window: _Window, now: float) -> None:
        del self._windows[kind]
        if window.held:
            self.logger.log(window.level, "%s: … %d more like this in the last %.0f s",
                            kind, window.held, now - window.start)  # fmt: skip


class Outage:
    """Something retried while a peer (etcd) is away: one line when it starts, one summary
    a window while it lasts (a throttle that writes none of the retries itself), one line
    when it ends with the count — not a line per retry. ``what`` is a constant of the call
    site (the throttle's kind). ``after``: the failures in a row that make an outage (2 for
    what moves on to another member by itself: one failure is a failover, not news)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        clock: Callable[[], float] = time.monotonic,
        *,
        after: int = 1,
    ) -> None:
        self.logger, self.what, self.clock, self.after = logger, what, clock, after
        self.throttle = Throttle(logger, clock, burst=0)
        self.since: float | None = None  # when the first failure in a row was
        self.retries = 0  # failures in a row

    def failed(self, reason: str, level: int = logging.WARNING) -> None:
        if self.since is None:
            self.since = self.clock()
        self.retries += 1
        if self.retries == self.after:
            self.logger.log(level, "%s: %s; retrying", self.what, reason)
        elif self.retries > self.after:
            self.throttle.log(self.what, level, "%s: %s; retrying", self.what, reason)

    def ok(self) -> None:
        """It worked again (cheap when there was no outage: call it on every success)."""
        if self.since is None:
            return
        if self.retries >= self.after:
            self.throttle.end(self.what)
            self.logger.info("%s: back after %.1f s (%d failed attempts)", self.what,
                             self.clock() - self.since, self.retries)  # fmt: skip
        self.since, self.retries = None, 0


def flush_all() -> None:
    """Every throttle's summaries of ended windows (the server calls this periodically, so
    a flood that stopped is still summed up)."""
    for throttle in list(_throttles):
        throttle.flush()
