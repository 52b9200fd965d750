"""The heap is settled as it grows, so a full garbage collection walks what changed since
the last settle, never the whole heap; each collection is timed into the stats. In a
process of its own: a settle freezes everything its process holds."""

from __future__ import annotations

import subprocess
import sys

GROWN = """
import asyncio, gc, time
from layerpy import heap

heap.LOOK_EVERY = 0.01
heap.settle()
kept = []

async def main():
    settler = asyncio.create_task(heap.Settler(settle_at=5_000).run())
    for _ in range(6):  # nodes booting: what lives on comes in pieces
        kept.extend([i] for i in range(4_000))
        gc.collect(1)  # into the old generation, as time would take them
        deadline = time.monotonic() + 10
        while len(gc.get_objects(generation=2)) >= 5_000:
            assert time.monotonic() < deadline, "a settle of the grown heap"
            await asyncio.sleep(0.01)
    settler.cancel()
    assert gc.get_freeze_count() >= 20_000, gc.get_freeze_count()
    assert len(gc.get_objects()) < 5_000 + 2_000, "what a full collection walks"

asyncio.run(main())
"""

TIMED = """
import gc
from prometheus_client import generate_latest
from layerpy.heap import CollectorTimer
from layerpy.stats import Stats

stats = Stats()
with CollectorTimer(stats).timing():
    gc.collect()
    gc.collect(0)
gc.collect()  # no longer timed
said = stats.as_json()["gc"]
assert said["2"]["requests"] == 1 and said["0"]["requests"] == 1, said
assert b'layerpy_gc_pause_seconds_count{generation="2"} 1.0' in generate_latest(stats.registry)
"""


def run(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_a_growing_heap_is_settled_in_pieces() -> None:
    run(GROWN)


def test_each_collection_is_timed_by_generation() -> None:
    run(TIMED)
