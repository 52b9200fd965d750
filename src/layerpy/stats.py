"""Service profiling: per request type, counts and service-time percentiles (over the
last SAMPLES of each).

Kept tiny and allocation-light because every DHCP packet and HTTP request passes here.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

SAMPLES = 2048


@dataclass
class Series:
    requests: int = 0
    failures: int = 0
    bytes: int = 0  # payload served, where the subsystem counts it (TFTP)
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))

    def summary(self) -> dict[str, float | int]:
        counts = {"requests": self.requests, "failures": self.failures}
        if self.bytes:
            counts["bytes"] = self.bytes
        times = sorted(self.samples)
        if not times:
            return counts
        return {
            **counts,
            "mean_ms": round(statistics.fmean(times) * 1000, 3),
            "median_ms": round(times[len(times) // 2] * 1000, 3),
            "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))] * 1000, 3),
            "max_ms": round(times[-1] * 1000, 3),
        }


class Stats:
    """Counters keyed by (subsystem, kind), e.g. ("dhcp", "discover")."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], Series] = defaultdict(Series)

    def observe(
        self, subsystem: str, kind: str, seconds: float, ok: bool = True, size: int = 0
    ) -> None:
        series = self.series[subsystem, kind]
        series.requests += 1
        series.bytes += size
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
        """Text exposition format 0.0.4: each metric one group, with its HELP and TYPE."""
        series = sorted(self.series.items())
        lines = []
        for metric, what, value in _METRICS:
            lines += [f"# HELP {metric} {what}", f"# TYPE {metric} counter"]
            for (subsystem, kind), one in series:
                if metric != "layerpy_bytes_total" or one.bytes:
                    labels = f'subsystem="{_label(subsystem)}",kind="{_label(kind)}"'
                    lines.append(f"{metric}{{{labels}}} {value(one)}")
        return "\n".join(lines) + "\n"


_METRICS: list[tuple[str, str, Callable[[Series], int]]] = [
    ("layerpy_requests_total", "Requests handled, per subsystem and kind.", lambda s: s.requests),
    ("layerpy_failures_total", "Requests that failed or were refused.", lambda s: s.failures),
    ("layerpy_bytes_total", "Payload bytes served (TFTP: acknowledged).", lambda s: s.bytes),
]


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
