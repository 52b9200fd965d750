"""State engine at scale: 10 000 and 100 000 nodes planned and converged on one loop.

No reference implementation exists, so this reports layerpy's own figures: loading a node
file of that size (groups of 250 nodes with MACs and BMCs), building the real lifecycle
graph, adding every node, a cfg change touching every node, planning them all, and
running to convergence (power on and boot, then power off again) with a fake act that
completes at once by observing the change, as a fast BMC and agent would. The engine reads
every node's observed values from node records (``layerpy.model.Node``, as the lifecycle
reads the store's) and concludes into them. Each size runs in a fresh process so that its
peak RSS is its own.

Run: `.venv/bin/python bench/engine.py [--nodes 10000 100000]`.
"""

import argparse
import asyncio
import functools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from layerpy.config import load
from layerpy.engine import Engine, Graph
from layerpy.lifecycle import VARIABLES, mutations
from layerpy.model import Node
from layerpy.nodes.store import VARIABLE_FIELDS


def node_file(directory: Path, count: int) -> Path:
    """A node file with `count` nodes in groups of 250, each with a MAC and a BMC."""
    (directory / "vmlinuz").write_bytes(b"k")
    (directory / "initrd").write_bytes(b"i")
    (directory / "bmc.pass").write_text("secret")
    text = [
        '[server]\ninterface = "br0"\naddress = "10.0.0.1"\n',
        '[network]\nsubnet = "10.0.0.0/14"\n',
        '[minos]\nkernel = "vmlinuz"\ninitrd = "initrd"\n',
    ]
    for group in range(count // 250):
        third = f"{1 + group // 256}.{group % 256}"
        macs = ", ".join(
            f'"52:54:{group >> 8:02x}:{group & 255:02x}:00:{i:02x}"' for i in range(250)
        )
        text.append(
            f'[groups.g{group}]\nnodes = "n{group:04}x[001-250]"\nip = "10.{third}.[1-250]"\n'
            f"mac = [{macs}]\n"
            f'bmc = {{ driver = "ipmi", address = "172.16.{third}.[1-250]", user = "admin",'
            ' password_file = "bmc.pass" }\n'
        )
    path = directory / "nodes.toml"
    path.write_text("\n".join(text))
    return path


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def converge(engine: Engine, count: int) -> None:
    while engine.stats()["converged"] < count:
        await asyncio.sleep(0.005)


async def measure(count: int) -> dict[str, float]:
    """Timings in seconds for one size, and peak memory."""
    loop = asyncio.get_running_loop()

    async def act(node: str, action: str) -> None:
        if action == "power_on":
            observe(node, power="on")
            loop.call_soon(functools.partial(observe, node, run="ready"))  # agent hello
        elif action == "power_off":
            observe(node, power="off")

    def observe(node: str, **values: str) -> None:
        """An observer writes to the store; its feed tells the engine."""
        conclude(node, values)
        engine.news(node)

    def observed(name: str) -> dict[str, str]:
        node = records[name]
        return {var: getattr(node, field) for var, field in VARIABLE_FIELDS.items()}

    def conclude(name: str, values: dict[str, str]) -> None:
        node = records[name]
        for var, value in values.items():
            setattr(node, VARIABLE_FIELDS[var], value)

    base = rss_mb()
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = node_file(Path(tmp), count)
        start = time.perf_counter()
        config = load(path)
        times["load"] = time.perf_counter() - start
    assert len(config.nodes) == count
    start = time.perf_counter()
    graph = Graph(VARIABLES, mutations())
    times["graph"] = time.perf_counter() - start

    engine = Engine(graph, act, observed=observed, conclude=conclude)
    nodes = list(config.nodes)
    records = {name: Node(cfg) for name, cfg in config.nodes.items()}
    for name in nodes:
        conclude(name, {"power": "off", "run": "unknown", "busy": "free"})
    start = time.perf_counter()
    for node in nodes:
        engine.add_node(node, {"power": "off"})
    times["add"] = time.perf_counter() - start

    start = time.perf_counter()
    for node in nodes:
        engine.set_cfg(node, power="on", run="ready")
    times["cfg"] = time.perf_counter() - start

    start = time.perf_counter()
    for node in nodes:
        engine.plan(node)
    times["plan"] = time.perf_counter() - start

    runner = asyncio.create_task(engine.run())
    start = time.perf_counter()
    await converge(engine, count)
    times["boot"] = time.perf_counter() - start

    start = time.perf_counter()
    for node in nodes:
        engine.set_cfg(node, power="off", run=None)
    await converge(engine, count)
    times["off"] = time.perf_counter() - start
    runner.cancel()

    stats = engine.stats()
    assert stats["failures"] == 0 and stats["in_flight"] == 0, stats
    times["rss"] = rss_mb()
    times["per_node_kb"] = (times["rss"] - base) * 1024 / count
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # one size, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(measure(args.one))))
        return
    print(
        f"{'nodes':>8} {'load file':>9} {'graph':>8} {'add':>7} {'cfg all':>8} {'plan all':>9}"
        f" {'on+boot':>8} {'nodes/s':>8} {'off':>7} {'peak RSS':>9} {'per node':>9}"
    )
    for count in args.nodes:
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(count)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        r = json.loads(out)
        print(
            f"{count:>8} {r['load']:>8.2f}s {r['graph'] * 1e3:>6.2f}ms"
            f" {r['add']:>6.2f}s {r['cfg']:>7.2f}s"
            f" {r['plan']:>8.3f}s {r['boot']:>7.2f}s {count / r['boot']:>8.0f}"
            f" {r['off']:>6.2f}s {r['rss']:>7.0f}MB {r['per_node_kb']:>7.2f}KB"
        )


if __name__ == "__main__":
    main()
