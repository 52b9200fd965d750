"""Service profiling, and what ``/metrics`` exposes.

Per request type (subsystem, kind): counts and service-time percentiles over the last
SAMPLES of each (``GET /api/v1/stats``), and for Prometheus the same counts with a
histogram of the service times per subsystem, in buckets that fit it. Every DHCP packet
and HTTP request passes ``observe``: it only bumps plain numbers, and the Prometheus
families are built from them at scrape time by a prometheus_client collector on a
registry of this Stats' own (one per server, never the process-wide one), beside the
node counts by state (NodeStates, from a count it is handed: it knows no lifecycle) and
the process's metrics. All of it runs on the event
loop's thread, so nothing here takes a lock. docs/metrics.md lists every metric.

Label values come from fixed sets: the callers pass message types, route patterns, driver
and source kinds, never what a client names; and a subsystem's kinds past MAX_KINDS are
counted as ``other``, so even a wrong caller cannot grow the series without bound.
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from layerpy import logs
from layerpy.model import Busy, ImageState, PowerState, RunState

SAMPLES = 2048
MAX_KINDS = 256  # per subsystem; HTTP has about 70 (routes and methods of both apps)
OTHER = "other"


def decades(low: float, high: float) -> tuple[float, ...]:
    """Histogram bounds 1, 2.5 and 5 times each power of ten, from `low` to `high`."""
    exponents = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    bounds = (float(f"{mantissa}e{exponent}") for exponent in exponents
              for mantissa in ("1", "2.5", "5"))  # fmt: skip
    return tuple(bound for bound in bounds if low <= bound <= high)


class Counted(NamedTuple):
    """The counter of a subsystem's outcomes (kinds only counted, never timed)."""

    name: str
    label: str
    help: str
    known: tuple[str, ...]  # exported from the start, at zero until they happen


@dataclass(frozen=True, slots=True)
class Family:
    """How one subsystem's series are named, labelled and bucketed in /metrics: a kind
    timed by ``observe`` is a request (counted, failures counted, its time in a histogram,
    its bytes summed); a kind only counted by ``count`` is an outcome (``counted``)."""

    what: str  # for HELP, plural: "DHCP requests"
    seconds: str | None  # the histogram; None: outcomes only counted (too many to time)
    buckets: tuple[float, ...]
    labels: tuple[str, ...] = ()  # what a timed kind is split into (at its last space)
    requests: str | None = None  # a counter; None: the histogram alone (the loop's lag)
    failures: str | None = None
    sized: str | None = None  # a counter of the bytes observed
    counted: Counted | None = None
    seconds_help: str = ""  # when "Service time of <what>." is not it

    def label_values(self, kind: str) -> tuple[str, ...]:
        """The labels of a kind: `GET /boot/{name}.ipxe` is method and route."""
        if len(self.labels) == 2:
            first, _, second = kind.rpartition(" ")
            return first, second
        return (kind,) if self.labels else ()

    def helps(self) -> dict[str, str]:
        """HELP of each family; a metric's labels are in docs/metrics.md."""
        what = self.what[0].upper() + self.what[1:]
        return {
            "requests": f"{what} handled.",
            "failures": f"{what} that failed or were refused.",
            "bytes": f"Payload bytes of {self.what}.",
            "seconds": self.seconds_help or f"Service time of {self.what}.",
        }


FAMILIES = {
    "dhcp": Family(
        "DHCP requests",
        "layerpy_dhcp_request_duration_seconds",
        decades(1e-4, 0.1),  # answers take 0.1-5 ms
        ("type",),
        "layerpy_dhcp_requests",
        "layerpy_dhcp_request_failures",
        counted=Counted(
            "layerpy_dhcp_outcomes",
            "outcome",
            "What became of DHCP datagrams: the answer (offer, ack, nak, silent), or dropped "
            "as malformed, ignored (no client's request), relayed but not from a relay the "
            "node file names (untrusted-relay), a reply the kernel refused (dropped), or a "
            "request shed unread past saturation (shed).",
            (
                "offer",
                "ack",
                "nak",
                "silent",
                "malformed",
                "ignored",
                "untrusted-relay",
                "dropped",
                "shed",
            ),
        ),
    ),
    "tftp": Family(
        "TFTP read transfers",
        "layerpy_tftp_transfer_duration_seconds",
        decades(0.01, 50),  # iPXE binaries: tens of ms, up to tens of seconds on a slow link
        requests="layerpy_tftp_transfers",
        failures="layerpy_tftp_transfer_failures",
        sized="layerpy_tftp_transfer_bytes",
        counted=Counted(
            "layerpy_tftp_rejected",
            "reason",
            "TFTP requests denied before any data (no such file, a write, a bad mode), "
            "refused over the transfer budget, and malformed datagrams dropped.",
            ("denied", "refused", "malformed"),
        ),
    ),
    "http": Family(
        "HTTP requests",
        "layerpy_http_request_duration_seconds",
        decades(5e-4, 25),  # scripts and API in ms, kernel, initrd and images in seconds
        ("method", "route"),
        "layerpy_http_requests",
        "layerpy_http_request_failures",
        counted=Counted(
            "layerpy_http_rejected",
            "reason",
            "HTTP connections refused over the connection limit (refused), idle ones "
            "closed to make room for new ones (shed), requests that could not be parsed "
            "(malformed), file transfers dropped because their client took nothing for "
            "send_timeout seconds (stalled), operator tokens refused unread after too many "
            "wrong ones (guessing), console WebSockets from another site (cross_origin), "
            "and event streams dropped for falling behind (slow_reader).",
            ("refused", "shed", "malformed", "stalled", "guessing", "cross_origin", "slow_reader"),
        ),
    ),
    "beat": Family(
        "datagram heartbeats",
        None,
        (),
        counted=Counted(
            "layerpy_beats",
            "outcome",
            "What became of heartbeat datagrams: taken (ok), answered with a request for a "
            "full report (report: something changed), or dropped as malformed, of a node "
            "without a beat key here (unknown: after a restart, or at another instance), "
            "not signed with its key (forged), no newer than the last taken (replayed), or "
            "a reply the kernel refused (dropped).",
            ("ok", "report", "malformed", "unknown", "forged", "replayed", "dropped"),
        ),
    ),
    "bmc": Family(
        "BMC power status polls",
        "layerpy_bmc_poll_duration_seconds",
        decades(0.01, 100),  # a dead BMC takes 10 s and more to time out
        ("driver",),
        "layerpy_bmc_polls",
        "layerpy_bmc_poll_failures",
    ),
    "image": Family(
        "system image pulls",
        "layerpy_image_pull_duration_seconds",
        decades(0.1, 2500),  # a pull and flatten: seconds to tens of minutes
        ("source",),
        "layerpy_image_pulls",
        "layerpy_image_pull_failures",
        sized="layerpy_image_pull_bytes",
    ),
    "gc": Family(
        "garbage collections",
        "layerpy_gc_pause_seconds",
        (*decades(1e-4, 0.01), 0.02, *decades(0.025, 1)),
        ("generation",),
        seconds_help="How long each run of Python's cyclic garbage collector held the event "
        "loop, by generation (2: a full collection, which walks every object not frozen).",
    ),
    "loop": Family(
        "event loop lag",
        "layerpy_event_loop_lag_seconds",
        (*decades(5e-4, 0.01), 0.02, *decades(0.025, 1)),  # 20 ms: the pause allowed (scale.md)
        seconds_help="How late the event loop ran a timer: every DHCP answer waits as long.",
    ),
}


@dataclass(slots=True)
class Series:
    bounds: tuple[float, ...]  # the family's histogram buckets
    requests: int = 0
    failures: int = 0
    bytes: int = 0  # payload served, where the subsystem counts it (TFTP, image pulls)
    seconds: float = 0.0  # sum of the times observed
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    buckets: list[int] = field(default_factory=list)  # times per bucket, the last +Inf

    def __post_init__(self) -> None:
        self.buckets = [0] * (len(self.bounds) + 1)

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
    """Counters keyed by (subsystem, kind), e.g. ("dhcp", "discover"); the subsystem is
    one of FAMILIES. ``registry`` holds them with the process's own metrics."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], Series] = {}
        self._kinds: Counter[str] = Counter()  # kinds per subsystem
        self.registry = CollectorRegistry()
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.node_states: NodeStates | None = None

    def watch_nodes(self, count: Count) -> None:
        """Count the server's nodes by state at each scrape, with `count`."""
        self.node_states = NodeStates(count)
        self.registry.register(self.node_states)

    async def exposition(self) -> bytes:
        """Everything in the registry, in Prometheus text format 0.0.4."""
        if self.node_states is not None:
            await self.node_states.refresh()
        return generate_latest(self.registry)

    def observe(
        self, subsystem: str, kind: str, seconds: float, ok: bool = True, size: int = 0
    ) -> None:
        series = self.series.get((subsystem, kind)) or self._new(subsystem, kind)
        series.requests += 1
        series.bytes += size
        series.seconds += seconds
        series.samples.append(seconds)
        series.buckets[bisect_left(series.bounds, seconds)] += 1
        if not ok:
            series.failures += 1

    def count(self, subsystem: str, kind: str, ok: bool = True) -> None:
        series = self.series.get((subsystem, kind)) or self._new(subsystem, kind)
        series.requests += 1
        if not ok:
            series.failures += 1

    def _new(self, subsystem: str, kind: str) -> Series:
        family = FAMILIES.get(subsystem)
        if family is None:
            raise ValueError(f"no metrics family for subsystem {subsystem!r}")
        if self._kinds[subsystem] >= MAX_KINDS:
            kind = OTHER
            if (subsystem, kind) in self.series:
                return self.series[subsystem, kind]
        self._kinds[subsystem] += 1
        series = self.series[subsystem, kind] = Series(family.buckets)
        return series

    def as_json(self) -> dict[str, dict[str, dict[str, float | int]]]:
        result: dict[str, dict[str, dict[str, float | int]]] = defaultdict(dict)
        for (subsystem, kind), series in sorted(self.series.items()):
            result[subsystem][kind] = series.summary()
        return dict(result)

    def collect(self) -> Iterator[Metric]:
        """The Prometheus families, built from the counts at each scrape."""
        by_subsystem: dict[str, list[tuple[str, Series]]] = defaultdict(list)
        for (subsystem, kind), series in sorted(self.series.items()):
            by_subsystem[subsystem].append((kind, series))
        for subsystem, family in FAMILIES.items():
            kinds = by_subsystem.get(subsystem, [])
            if family.seconds is not None:
                yield from _timed(family, [(k, s) for k, s in kinds if s.samples])
            if family.counted is not None:
                spec = family.counted
                values = dict.fromkeys(spec.known, 0)
                values.update((kind, s.requests) for kind, s in kinds if not s.samples)
                counted = CounterMetricFamily(spec.name, spec.help, labels=[spec.label])
                for kind, value in values.items():
                    counted.add_metric([kind], value)
                yield counted
        held = CounterMetricFamily(
            "layerpy_log_suppressed",
            "Log lines held back because their kind was logged often in the last minute "
            "(a flood): they are only counted, and summed up in one line.",
            labels=["subsystem", "kind"],
        )
        for (subsystem, kind), value in sorted(logs.suppressed.items()):
            held.add_metric([subsystem, kind], value)
        yield held


def _timed(family: Family, kinds: list[tuple[str, Series]]) -> Iterator[Metric]:
    """The request counters and the histogram of one subsystem; kinds that share label
    values (none but the loop's) are added up."""
    merged: dict[tuple[str, ...], list[Series]] = defaultdict(list)
    if not family.labels:
        merged[()] = []  # one series, there from the start
    for kind, series in kinds:
        merged[family.label_values(kind)].append(series)
    labels, helps = list(family.labels), family.helps()
    counters = [
        (name, attribute)
        for name, attribute in (
            (family.requests, "requests"),
            (family.failures, "failures"),
            (family.sized, "bytes"),
        )
        if name is not None
    ]
    for name, attribute in counters:
        counter = CounterMetricFamily(name, helps[attribute], labels=labels)
        for values, group in merged.items():
            counter.add_metric(values, sum(getattr(series, attribute) for series in group))
        yield counter
    histogram = HistogramMetricFamily(family.seconds, helps["seconds"], labels=labels)
    for values, group in merged.items():
        histogram.add_metric(
            values,
            _cumulative(family.buckets, [series.buckets for series in group]),
            sum(series.seconds for series in group),
        )
    yield histogram


def _cumulative(bounds: tuple[float, ...], groups: Iterable[list[int]]) -> list[tuple[str, int]]:
    totals = [0] * (len(bounds) + 1)
    for group in groups:
        for index, count in enumerate(group):
            totals[index] += count
    running, buckets = 0, []
    for bound, count in zip((*map(floatToGoString, bounds), "+Inf"), totals, strict=True):
        running += count
        buckets.append((bound, running))
    return buckets


@dataclass(frozen=True, slots=True)
class Census:
    """The nodes counted for one scrape, by whoever knows them (``layerpy.census``)."""

    nodes: int = 0
    observed: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # variable: value: n
    unsettled: Mapping[str, int] = field(default_factory=dict)  # variable: nodes not as desired
    engine: Mapping[str, int] = field(default_factory=dict)  # the engine's own counts
    unknown: int = 0  # machines booting that no node claims
    images: Mapping[str, int] = field(default_factory=dict)  # images by pull state
    # Secure Boot as agents report it (on, off, unknown), and "missing": off on a node whose
    # file wants secure_boot
    secure_boot: Mapping[str, int] = field(default_factory=dict)


Count = Callable[[], Awaitable[Census]]


class NodeStates:
    """Nodes by state, counted at each scrape by the `count` it is handed (nothing kept
    twice): per state variable the observed values as the engine plans from them, and how
    many differ from the desired one; beside them the engine's own counts. Label sets are
    the fixed enums, every value exported (zeros too, so a series does not come and go)."""

    VARIABLES = (
        ("power", PowerState, "observed power (from BMC polls; hang: on but not booting)"),
        ("run", RunState, "run state (from the boot services and agent reports)"),
        ("busy", Busy, "busy state (from agent reports)"),
        ("image", ImageState, "system image state (stale: active, not the wanted digest)"),
    )
    DESIRED = ("power", "run", "image")  # busy is never desired

    def __init__(self, count: Count) -> None:
        self.count = count
        self.census = Census()

    async def refresh(self) -> None:
        self.census = await self.count()

    def collect(self) -> Iterator[Metric]:
        """The last count."""
        census = self.census
        yield GaugeMetricFamily("layerpy_nodes", "Nodes in the node file.", census.nodes)
        for variable, values, what in self.VARIABLES:
            gauge = GaugeMetricFamily(f"layerpy_nodes_{variable}", f"Nodes by {what}.",
                                      labels=["state"])  # fmt: skip
            observed = census.observed.get(variable, {})
            for state in values:
                gauge.add_metric([state], observed.get(state, 0))
            yield gauge
        gauge = GaugeMetricFamily(
            "layerpy_nodes_unsettled",
            "Nodes whose observed state differs from the desired one, per state variable.",
            labels=["variable"],
        )
        for variable in self.DESIRED:
            gauge.add_metric([variable], census.unsettled.get(variable, 0))
        yield gauge
        engine = census.engine
        for key, what in (
            ("converged", "Nodes whose observed state is the desired one."),
            ("blocked", "Nodes with no path from their observed state to the desired one."),
            ("gave_up", "Nodes the engine gave up on after repeated failures."),
        ):
            yield GaugeMetricFamily(f"layerpy_nodes_{key}", what, engine.get(key, 0))
        yield GaugeMetricFamily(
            "layerpy_engine_mutations_in_flight", "Mutations fired and not yet ended.",
            engine.get("in_flight", 0),
        )  # fmt: skip
        yield GaugeMetricFamily("layerpy_engine_actions_running", "Actions running now.",
                                engine.get("actions", 0))  # fmt: skip
        yield CounterMetricFamily(
            "layerpy_engine_mutation_failures", "Mutations that failed or timed out.",
            engine.get("failures", 0),
        )  # fmt: skip
        yield GaugeMetricFamily(
            "layerpy_unknown_machines", "Machines booting that no node claims (discovery).",
            census.unknown,
        )  # fmt: skip
        images = GaugeMetricFamily("layerpy_images", "Images of the node file, by pull state.",
                                   labels=["state"])  # fmt: skip
        for state in ("pulling", "ready", "error"):
            images.add_metric([state], census.images.get(state, 0))
        yield images
        secure = GaugeMetricFamily(
            "layerpy_nodes_secure_boot",
            "Nodes by Secure Boot as their agents report it (unknown: not reported).",
            labels=["state"],
        )
        for state in ("on", "off", "unknown"):
            secure.add_metric([state], census.secure_boot.get(state, 0))
        yield secure
        yield GaugeMetricFamily(
            "layerpy_nodes_secure_boot_missing",
            "Nodes the node file gives secure_boot = true whose agent reports it off.",
            census.secure_boot.get("missing", 0),
        )
