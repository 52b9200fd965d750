"""The nodes counted by state for ``/metrics``, from the lifecycle: what the engine plans
from, and what is desired. Stats is handed this count and knows no lifecycle."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

from layerpy.lifecycle import Lifecycle
from layerpy.stats import Census

SECURE_BOOT = {True: "on", False: "off", None: "unknown"}  # a node's report, as a label
SLICE = 0.002  # seconds of counting for a scrape before the event loop runs others
LOOK = 100  # nodes counted between looks at the clock


async def count(lifecycle: Lifecycle) -> Census:
    """Count the nodes, SLICE seconds at a time: 100 000 take about 0.4 s, and held at once
    that would delay every DHCP answer as long. (Slices of 2 000 nodes held the loop for
    20-23 ms each at 100 000 nodes: a node's count costs more than it did.)"""
    observed: defaultdict[str, Counter[str]] = defaultdict(Counter)
    unsettled: Counter[str] = Counter()
    secure: Counter[str] = Counter()  # Secure Boot as the agents report it; "missing": off
    counted = 0
    nodes = lifecycle.store.nodes
    began = time.perf_counter()
    for index, name in enumerate(list(nodes)):
        if index % LOOK == 0 and time.perf_counter() - began > SLICE:
            await asyncio.sleep(0)
            nodes = lifecycle.store.nodes  # a reload may have replaced it meanwhile
            began = time.perf_counter()
        node = nodes.get(name)
        if node is None:
            continue
        counted += 1
        dsc = lifecycle.dsc(node)  # what the engine plans from
        for variable, value in dsc.items():
            observed[variable][value] += 1
        for variable, wanted in lifecycle.desired_of(name).items():
            if wanted is not None and dsc[variable] != wanted:
                unsettled[variable] += 1
        secure[SECURE_BOOT[node.secure_boot]] += 1
        secure["missing"] += node.config.secure_boot and node.secure_boot is False
    return Census(
        counted,
        observed,
        unsettled,
        lifecycle.engine.stats(),
        len(lifecycle.store.unknown.machines),
        Counter(entry.state for entry in lifecycle.catalog.all_entries()),  # every platform's
        secure,
    )
