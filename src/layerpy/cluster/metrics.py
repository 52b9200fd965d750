"""The cluster's gauges for ``/metrics`` (docs/metrics.md, "Cluster"): how many nodes each
instance owns, as this instance's mirror of the owner keys says, whether this instance's
fence is open (its etcd lease known fresh and it does not hold: it acts on the nodes it
owns), the store's writes waiting for etcd, and how often the instance held because too
many waited."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ClusterMetrics(Collector):
    """``owners()``: node → owning instance; ``live()``: the live instances' names (each
    gets a series, 0 too, so it does not come and go with its nodes); ``fence_open()``."""

    def __init__(
        self,
        owners: Callable[[], Mapping[str, str]],
        live: Callable[[], Iterable[str]],
        fence_open: Callable[[], bool],
        *,
        queued: Callable[[], int] = lambda: 0,
        holds: Callable[[], int] = lambda: 0,
    ) -> None:
        self.owners, self.live, self.fence_open = owners, live, fence_open
        self.queued, self.holds = queued, holds

    def collect(self) -> Iterator[Metric]:
        owned = Counter(self.owners().values())
        gauge = GaugeMetricFamily("layerpy_cluster_owned_nodes", "Nodes each instance owns.",
                                  labels=["instance"])  # fmt: skip
        for instance in sorted(set(self.live()) | set(owned)):
            gauge.add_metric([instance], owned[instance])
        yield gauge
        yield GaugeMetricFamily(
            "layerpy_cluster_fence_open",
            "1 while this instance's etcd lease is known fresh (it acts on its nodes), else 0.",
            int(self.fence_open()),
        )
        yield GaugeMetricFamily(
            "layerpy_cluster_writes_queued",
            "The node store's writes waiting for etcd (one per key).",
            self.queued(),
        )
        yield CounterMetricFamily(
            "layerpy_cluster_backlog_holds",
            "Times this instance stopped acting because too many writes waited for etcd.",
            self.holds(),
        )
