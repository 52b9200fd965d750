"""The cluster's gauges for ``/metrics`` (docs/metrics.md, "Cluster"): how many nodes each
instance owns, as this instance's mirror of the owner keys says, and whether this
instance's fence is open (its etcd lease known fresh: it acts on the nodes it owns)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ClusterMetrics(Collector):
    """``owners()``: node → owning instance; ``live()``: the live instances' names (each
    gets a series, 0 too, so it does not come and go with its nodes); ``fence_open()``."""

    def __init__(
        self,
        owners: Callable[[], Mapping[str, str]],
        live: Callable[[], Iterable[str]],
        fence_open: Callable[[], bool],
    ) -> None:
        self.owners, self.live, self.fence_open = owners, live, fence_open

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
