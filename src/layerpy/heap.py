"""The cyclic garbage collector, kept to short walks of the heap.

A full collection walks every tracked object that is not frozen, and holds the event loop
(every DHCP answer, every heartbeat) while it does: about 0.5 µs an object, so 100-200 ms
for what ten thousands of booted nodes hold, each time (docs/scale.md). What the node file
makes lives as long as the file, and what a boot makes (a node's boot record, its beat key)
as long as the boot; frozen (`gc.freeze`), they are never walked again. So the heap is
settled (collected, then frozen) at start, after a reload, and whenever what a collection
would walk has grown by SETTLE_AT objects since (`Settler`): every collection then walks
what changed since the last settle, never every node.

Frozen objects are still freed when their last reference goes; only a reference cycle
alive at a settle and dropped later is never collected. Nodes' records hold no cycles,
and requests mostly free theirs by reference counts: at steady state the collector finds
no cyclic garbage at all, and a boot leaves a few dozen objects for a thousand nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator

from layerpy.stats import Stats

SETTLE_AT = 10_000  # objects a full collection may walk before they are frozen (~5 ms)
LOOK_EVERY = 1.0  # seconds between looks at how far the heap has grown


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Build the node file's objects without the cyclic collector: they all live, and its
    passes over a heap growing by 100 000 nodes were a sixth of start-up (0.25 s of 1.6)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def settle() -> None:
    """What lives on out of the collector's way: a full collection walks only what was made
    since the last settle (with 100 000 nodes, the whole heap held the loop for 160 ms),
    then everything left is frozen. Nothing is thawed (10 ms after the operator test's
    requests on 25 000 nodes; thawing too, 70 ms). A node file has no reference cycles:
    the objects of a reloaded one that go, frozen or not, are freed by their counts."""
    gc.collect()
    gc.freeze()


class Settler:
    """Settles the heap whenever what a collection would walk has grown by SETTLE_AT
    objects: a boot storm is then walked in pieces of that size, as it comes."""

    def __init__(self, settle_at: int = SETTLE_AT) -> None:
        self.settle_at = settle_at

    def grown(self) -> bool:
        """Whether the old generation holds settle_at objects not frozen (the young ones
        are few: at most the collector's thresholds)."""
        return len(gc.get_objects(generation=2)) >= self.settle_at

    async def run(self) -> None:
        while True:
            await asyncio.sleep(LOOK_EVERY)
            if self.grown():
                settle()


class CollectorTimer:
    """Each run of the cyclic garbage collector, timed into the stats (``gc``, by
    generation): a run holds the event loop for as long as it walks."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.began = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.began = time.perf_counter()
        else:
            took = time.perf_counter() - self.began
            self.stats.observe("gc", str(info["generation"]), took)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Every collection timed while inside."""
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)
