"""Service profiling: per request type, counts and service-time percentiles.

Kept tiny and allocation-light because every DHCP packet and HTTP request passes here.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

SAMPLES = 2048


@dataclass
class Series:
    requests: int = 0
    failures: int = 0
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))

    def summary(self) -> dict[str, float | int]:
        times = sorted(self.samples)
        if not times:
            return {"requests": self.requests, "failures": self.failures}
        return {
            "requests": self.requests,
            "failures": self.failures,
            "mean_ms": round(statistics.fmean(times) * 1000, 3),
            "median_ms": round(times[len(times) // 2] * 1000, 3),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 3),
        }


class Stats:
    """Counters keyed by (subsystem, kind), e.g. ("dhcp", "discover")."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], Series] = defaultdict(Series)

    def observe(self, subsystem: str, kind: str, seconds: float, ok: bool = True) -> None:
        series = self.series[subsystem, kind]
        series.requests += 1
        series.samples.append(seconds)
        if not ok:
            series.failures += 1

    def count(self, subsystem: str, kind: str, ok: bool = True) -> None:
        series = self.series[subsystem, kind]
        series.requests += 1
        if not ok:
            series.failures += 1

    def as_json(self) -> dict[str, dict[str, dict[str, float | int]]]:
        result: dict[str, dict[str, dict[str, float | int]]] = defaultdict(dict)
        for (subsystem, kind), series in sorted(self.series.items()):
            result[subsystem][kind] = series.summary()
        return dict(result)

    def prometheus(self) -> str:
        lines = []
        for (subsystem, kind), series in sorted(self.series.items()):
            labels = f'subsystem="{subsystem}",kind="{kind}"'
            lines.append(f"layerpy_requests_total{{{labels}}} {series.requests}")
            lines.append(f"layerpy_failures_total{{{labels}}} {series.failures}")
        return "\n".join(lines) + "\n"
