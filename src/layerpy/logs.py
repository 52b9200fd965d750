"""Log lines a flood cannot multiply: the first few per source, then one that says the rest
are being counted instead."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

BURST = 5  # lines per source and window
WINDOW = 60.0  # seconds
SOURCES = 1024  # sources remembered (the oldest are forgotten)


class Throttle:
    """``log(source, level, message)`` writes at most BURST lines per source per WINDOW."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.clock = clock
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()  # start, lines

    def log(self, source: str, level: int, message: str, *args: object) -> None:
        now = self.clock()
        start, lines = self._seen.pop(source, (now, 0))
        if now - start > WINDOW:
            start, lines = now, 0
        self._seen[source] = (start, lines + 1)
        while len(self._seen) > SOURCES:
            self._seen.popitem(last=False)
        if lines < BURST:
            self.logger.log(level, message, *args)
        elif lines == BURST:
            self.logger.log(level, "%s: more like this in the next %.0f s are only counted",
                            source, WINDOW - (now - start))  # fmt: skip
