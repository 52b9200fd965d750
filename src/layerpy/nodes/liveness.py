"""Lost nodes: an agent that stops reporting makes its node lost.

The store tells ``Liveness`` of every report as it records it, so the nodes are kept in
order of their last report and a check looks only at the overdue ones, not at every node.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from layerpy.config import Config
from layerpy.model import Node, RunState
from layerpy.nodes.effects import Effect, Observe

ALIVE = (RunState.INIT, RunState.READY)


def limit(config: Config) -> float:
    """Seconds without a report after which a node is lost."""
    return config.server.heartbeat * config.server.lost_after


class Liveness:
    def __init__(self) -> None:
        self._reporting: OrderedDict[str, float] = OrderedDict()  # oldest report first

    def heard(self, name: str, at: float) -> None:
        self._reporting.pop(name, None)
        self._reporting[name] = at

    def overdue(
        self, nodes: Mapping[str, Node], now: float, limit: float, instance: str | None = None
    ) -> list[Effect]:
        """The alive nodes not heard from for ``limit`` seconds, made lost: only those that
        report to this ``instance`` (in a cluster, a node whose agent moved to another
        instance is that one's to judge; a single server's nodes all report to it)."""
        effects: list[Effect] = []
        while self._reporting:
            name, last = next(iter(self._reporting.items()))
            if now - last <= limit:
                break
            del self._reporting[name]
            node = nodes.get(name)
            if node is None or node.heard_by != instance:
                continue
            if node.run_state in ALIVE and node.last_report == last:
                why = f"no report for {now - last:.0f} s"
                effects.append(Observe(name, {"run_state": RunState.LOST}, why))
        return effects
