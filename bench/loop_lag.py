"""Event-loop lag with 100 000 nodes: does any periodic task hold the loop?

Every DHCP answer waits for whatever holds the event loop, so no periodic task may block it
for long. This runs layerpy's continuous work (the lifecycle engine, the BMC poller, the
look for lost nodes, the lag probe) in-process on a node file of 100 000 nodes written as
four groups with MAC and address ranges, and beside it the same with 4 nodes: the
reference, which shows what the machine and asyncio's own timer granularity cost.

Per size: the start (reading the file, building the server, planning every node until
the engine has converged), then 20 s idle measured with a timer every 20 ms: how late it
fires (lag: p50, p99, max) and how much CPU the loop's thread used while it waited (busy:
an upper bound for anything that ran in that window, scheduling noise left out). Last, a
reload of the unchanged file (what `POST /api/v1/reload` and SIGHUP do), measured the same
way: its time, and the worst lag and busy while it ran.

Run: `.venv/bin/python bench/loop_lag.py [--seconds 20]`.
"""

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from layerpy.config import load
from layerpy.server import Server, local_backend

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from nodefile import big_node_file  # noqa: E402

PROBE = 0.02  # seconds between the probe's timers


def node_file(directory: Path, nodes: int) -> Path:
    """`nodes` (4 or a multiple of 25 000) in groups of at most 25 000, a few lines each."""
    return big_node_file(directory, nodes, "bench0")


async def measure(path: Path, seconds: float) -> dict[str, float]:
    started = time.perf_counter()
    config = load(path)
    server = Server(config, local_backend(config))
    work = asyncio.create_task(server.watch())
    engine = server.lifecycle.engine
    while engine.stats()["converged"] < len(config.nodes):
        await asyncio.sleep(0.01)
    start = time.perf_counter() - started
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    busy: list[float] = []
    until = loop.time() + seconds
    await probe(lags, busy, lambda: loop.time() >= until)
    started = time.perf_counter()
    reload = asyncio.create_task(server.reload())
    reload_lags: list[float] = []
    reload_busy: list[float] = []
    await probe(reload_lags, reload_busy, reload.done)
    await reload
    reloaded = time.perf_counter() - started
    work.cancel()
    lags.sort()
    busy.sort()
    n = len(lags)
    return {
        "nodes": len(config.nodes),
        "start_s": start,
        "lag_p50": lags[n // 2] * 1000,
        "lag_p99": lags[int(n * 0.99)] * 1000,
        "lag_max": lags[-1] * 1000,
        "busy_max": busy[-1] * 1000,
        "reload_s": reloaded,
        "reload_lag": max(reload_lags) * 1000,
        "reload_busy": max(reload_busy) * 1000,
    }


async def probe(lags: list[float], busy: list[float], done: Callable[[], bool]) -> None:
    """A timer every PROBE seconds until `done`: how late each fired, and the CPU the
    loop's thread used meanwhile."""
    loop = asyncio.get_running_loop()
    while not done():
        asked, cpu = loop.time(), time.thread_time()
        await asyncio.sleep(PROBE)
        lags.append(loop.time() - asked - PROBE)
        busy.append(time.thread_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    args = parser.parse_args()
    rows = []
    for nodes in (4, 100_000):
        directory = Path(tempfile.mkdtemp(prefix="layerpy-lag-"))
        try:
            rows.append(asyncio.run(measure(node_file(directory, nodes), args.seconds)))
        finally:
            shutil.rmtree(directory)
    print(f"idle {args.seconds:g} s, a timer every {PROBE * 1000:g} ms (all times in ms but start)")
    print(
        f"{'nodes':>8} {'start s':>8} {'lag p50':>8} {'lag p99':>8} {'lag max':>8} {'busy max':>9}"
        f" | {'reload s':>8} {'lag max':>8} {'busy max':>9}"
    )
    for row in rows:
        print(
            f"{row['nodes']:>8} {row['start_s']:>8.2f} {row['lag_p50']:>8.2f} "
            f"{row['lag_p99']:>8.2f} {row['lag_max']:>8.2f} {row['busy_max']:>9.2f}"
            f" | {row['reload_s']:>8.2f} {row['reload_lag']:>8.2f} {row['reload_busy']:>9.2f}"
        )
    small, big = rows
    print(
        f"100 000 nodes vs 4: lag max {big['lag_max'] - small['lag_max']:+.2f} ms, "
        f"busy max {big['busy_max'] - small['busy_max']:+.2f} ms"
    )


if __name__ == "__main__":
    main()
