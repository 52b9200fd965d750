"""Stats and what /metrics makes of them: the JSON stats as before, the Prometheus families
named and bucketed per subsystem, label values bounded whatever a client sends, node
counts read from the store, and the poller's and the catalog's observations.

The real server's /metrics, after real traffic and checked by promtool, is in
tests/proto/test_metrics_promtool.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import time
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from layerpy import census
from layerpy.catalog import Catalog
from layerpy.cluster.metrics import ClusterMetrics
from layerpy.images import ImageStore
from layerpy.lifecycle import Lifecycle
from layerpy.model import PowerState
from layerpy.power import PowerError
from layerpy.power.poller import Poller
from layerpy.services.http import LOG_REQUESTS, STATS, profile
from layerpy.stats import FAMILIES, MAX_KINDS, Stats, decades

from oci import build_image
from stores import local_store

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str | bytes) -> Samples:
    """Every sample of an exposition: (name, labels) -> value."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(found: Samples, name: str, **labels: str) -> float:
    return found[name, frozenset(labels.items())]


def test_the_json_stats_keep_their_counts_and_percentiles() -> None:
    stats = Stats()
    for ms in range(1, 101):
        stats.observe("dhcp", "discover", ms / 1000)
    stats.observe("dhcp", "request", 0.002, ok=False)
    stats.count("dhcp", "ack")
    stats.count("dhcp", "malformed", ok=False)
    stats.observe("tftp", "read", 1.5, size=3000)
    found = stats.as_json()
    assert found["dhcp"]["discover"] == {
        "requests": 100, "failures": 0,
        "mean_ms": 50.5, "median_ms": 51.0, "p99_ms": 100.0, "max_ms": 100.0,
    }  # fmt: skip
    assert found["dhcp"]["request"]["failures"] == 1
    assert found["dhcp"]["ack"] == {"requests": 1, "failures": 0}
    assert found["dhcp"]["malformed"] == {"requests": 1, "failures": 1}
    assert found["tftp"]["read"]["bytes"] == 3000


def test_timed_kinds_are_requests_with_a_histogram_counted_ones_outcomes() -> None:
    stats = Stats()
    for seconds in (0.0001, 0.0003, 0.0005, 0.004, 0.2):  # 0.0005 falls in le="0.0005"
        stats.observe("dhcp", "discover", seconds)
    stats.observe("dhcp", "request", 0.001, ok=False)
    stats.count("dhcp", "offer")
    stats.count("dhcp", "dropped", ok=False)
    found = samples(generate_latest(stats.registry))

    assert value(found, "layerpy_dhcp_requests_total", type="discover") == 5
    assert value(found, "layerpy_dhcp_request_failures_total", type="discover") == 0
    assert value(found, "layerpy_dhcp_request_failures_total", type="request") == 1
    histogram = "layerpy_dhcp_request_duration_seconds"
    buckets = {
        le: value(found, f"{histogram}_bucket", type="discover", le=le)
        for le in ("0.0001", "0.00025", "0.0005", "0.001", "0.005", "0.1", "+Inf")
    }
    assert buckets == {"0.0001": 1, "0.00025": 1, "0.0005": 3, "0.001": 3, "0.005": 4,
                       "0.1": 4, "+Inf": 5}  # fmt: skip
    assert value(found, f"{histogram}_count", type="discover") == 5
    assert abs(value(found, f"{histogram}_sum", type="discover") - 0.2049) < 1e-9
    # answers are outcomes, not requests; the known ones are there from the start
    assert value(found, "layerpy_dhcp_outcomes_total", outcome="offer") == 1
    assert value(found, "layerpy_dhcp_outcomes_total", outcome="dropped") == 1
    assert value(found, "layerpy_dhcp_outcomes_total", outcome="nak") == 0
    assert ("layerpy_dhcp_requests_total", frozenset({("type", "offer")})) not in found


def test_each_subsystem_has_its_names_labels_and_buckets() -> None:
    stats = Stats()
    stats.observe("tftp", "read", 12.0, size=3000)
    stats.observe("tftp", "read", 0.3, ok=False, size=512)
    stats.count("tftp", "denied", ok=False)
    stats.observe("http", "GET /boot/{name}.ipxe", 0.002)
    stats.observe("http", "POST /api/v1/agent/report", 0.004, ok=False)
    stats.count("http", "refused", ok=False)
    stats.observe("bmc", "ipmi", 11.0, ok=False)
    stats.observe("image", "registry", 42.0, size=10_000_000)
    stats.observe("loop", "lag", 0.003)
    found = samples(generate_latest(stats.registry))

    assert value(found, "layerpy_tftp_transfers_total") == 2
    assert value(found, "layerpy_tftp_transfer_failures_total") == 1
    assert value(found, "layerpy_tftp_transfer_bytes_total") == 3512
    assert value(found, "layerpy_tftp_transfer_duration_seconds_bucket", le="10.0") == 1
    assert value(found, "layerpy_tftp_transfer_duration_seconds_bucket", le="25.0") == 2
    assert value(found, "layerpy_tftp_rejected_total", reason="denied") == 1
    route = {"method": "GET", "route": "/boot/{name}.ipxe"}
    assert value(found, "layerpy_http_requests_total", **route) == 1
    report = {"method": "POST", "route": "/api/v1/agent/report"}
    assert value(found, "layerpy_http_request_failures_total", **report) == 1
    assert value(found, "layerpy_http_rejected_total", reason="refused") == 1
    assert value(found, "layerpy_http_rejected_total", reason="malformed") == 0
    assert value(found, "layerpy_bmc_poll_failures_total", driver="ipmi") == 1
    assert value(found, "layerpy_bmc_poll_duration_seconds_bucket", driver="ipmi", le="10.0") == 0
    assert value(found, "layerpy_bmc_poll_duration_seconds_bucket", driver="ipmi", le="25.0") == 1
    assert value(found, "layerpy_image_pull_bytes_total", source="registry") == 10_000_000
    assert value(found, "layerpy_event_loop_lag_seconds_count") == 1
    assert ("layerpy_loop_requests_total", frozenset()) not in found  # the lag is no request
    assert value(found, "process_resident_memory_bytes") > 0  # the process collectors
    assert any(name == "python_info" for name, _ in found)


def test_label_less_families_are_there_before_anything_happens() -> None:
    found = samples(generate_latest(Stats().registry))
    assert value(found, "layerpy_tftp_transfers_total") == 0
    assert value(found, "layerpy_tftp_transfer_duration_seconds_bucket", le="+Inf") == 0
    assert value(found, "layerpy_event_loop_lag_seconds_count") == 0


def test_bucket_bounds_fit_each_subsystem() -> None:
    assert decades(1e-4, 0.1) == (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                  0.025, 0.05, 0.1)  # fmt: skip
    assert FAMILIES["dhcp"].buckets[0] == 0.0001 and FAMILIES["dhcp"].buckets[-1] == 0.1
    assert FAMILIES["tftp"].buckets[-1] >= 30 and FAMILIES["bmc"].buckets[-1] >= 60
    assert FAMILIES["http"].buckets[0] <= 0.001 and FAMILIES["http"].buckets[-1] >= 10


def test_kinds_past_the_limit_are_other() -> None:
    stats = Stats()
    for number in range(MAX_KINDS + 50):
        stats.observe("http", f"GET /made-up/{number}", 0.001)
    assert len(stats.as_json()["http"]) == MAX_KINDS + 1
    assert stats.as_json()["http"]["other"]["requests"] == 50
    found = samples(generate_latest(stats.registry))
    assert value(found, "layerpy_http_requests_total", method="", route="other") == 50


def test_two_servers_keep_their_own_registries() -> None:
    first, second = Stats(), Stats()
    first.observe("dhcp", "discover", 0.001)
    found = samples(generate_latest(second.registry))
    assert ("layerpy_dhcp_requests_total", frozenset({("type", "discover")})) not in found
    assert value(samples(generate_latest(first.registry)), "layerpy_dhcp_requests_total",
                 type="discover") == 1  # fmt: skip


def test_an_unknown_subsystem_is_a_mistake() -> None:
    try:
        Stats().observe("ftp", "get", 0.1)
    except ValueError as error:
        assert "ftp" in str(error)
    else:
        raise AssertionError("an unknown subsystem was taken")


def test_a_client_cannot_name_http_label_values() -> None:
    """Routes are their patterns, methods of unmatched requests one of a fixed set: no
    MAC, node name, path or made-up method reaches the stats."""

    async def scenario() -> dict:
        stats = Stats()
        app = web.Application(middlewares=[profile])
        app[STATS], app[LOG_REQUESTS] = stats, False

        async def script(request: web.Request) -> web.Response:
            if request.match_info["name"] != "cn001":
                raise web.HTTPNotFound()
            return web.Response(text="#!ipxe\n")

        app.router.add_get("/boot/{name}.ipxe", script)
        async with TestClient(TestServer(app)) as client:
            for path in ("/boot/cn001.ipxe", "/boot/52-54-00-12-34-56.ipxe", "/etc/passwd"):
                await client.get(path)
            await client.head("/boot/cn001.ipxe")
            await client.request("PROPFIND", "/coffee/pot-1")  # llhttp knows it, we do not
            await client.request("PROPFIND", "/boot/cn001.ipxe")  # 405
            await client.post("/boot/cn001.ipxe")  # 405
        return stats.as_json()["http"]

    http = asyncio.run(scenario())
    assert set(http) == {"GET /boot/{name}.ipxe", "HEAD /boot/{name}.ipxe", "GET unmatched",
                         "other unmatched", "POST unmatched"}  # fmt: skip
    script = http["GET /boot/{name}.ipxe"]
    assert (script["requests"], script["failures"]) == (2, 1)  # a 404 from the route is its own
    assert http["other unmatched"]["requests"] == 2


NODES = '\n[nodes.cn009]\nip = "10.99.0.19"\nbmc = { driver = "none" }\n'


def test_nodes_are_counted_by_state_at_each_scrape(make_config) -> None:
    async def scenario() -> tuple[Samples, Samples]:
        store = local_store(make_config(more=NODES))
        catalog = Catalog(ImageStore(store.config.server.state_dir / "images"), store.feed)
        lifecycle = Lifecycle(store, store.backend, catalog, poll_interval=3600)
        stats = Stats()
        stats.watch_nodes(functools.partial(census.count, lifecycle))
        before = samples(await stats.exposition())
        store.saw_power("cn009", PowerState.ON)
        return before, samples(await stats.exposition())

    before, after = asyncio.run(scenario())
    assert value(before, "layerpy_nodes") == 3
    assert value(before, "layerpy_nodes_power", state="unknown") == 3
    assert value(before, "layerpy_nodes_power", state="on") == 0  # every state, zeros too
    assert value(before, "layerpy_nodes_run", state="unknown") == 3
    assert value(before, "layerpy_nodes_busy", state="unknown") == 3
    # cn009 has power control: the file wants it on and ready; the others want nothing
    assert value(before, "layerpy_nodes_unsettled", variable="power") == 1
    assert value(before, "layerpy_nodes_unsettled", variable="run") == 1
    assert value(after, "layerpy_nodes_power", state="on") == 1
    assert value(after, "layerpy_nodes_unsettled", variable="power") == 0
    assert value(after, "layerpy_nodes_unsettled", variable="run") == 1
    assert value(after, "layerpy_unknown_machines") == 0
    assert value(after, "layerpy_engine_mutation_failures_total") == 0


class FlakyDriver:
    """A BMC that answers "on", or fails while `failing`."""

    def __init__(self) -> None:
        self.failing = False

    async def status(self) -> str:
        if self.failing:
            raise PowerError("cn1: BMC unreachable")
        return "on"

    async def close(self) -> None: ...


def test_bmc_polls_are_timed_per_driver_kind() -> None:
    async def scenario() -> dict:
        stats, driver = Stats(), FlakyDriver()
        drivers = {"cn1": driver}
        poller = Poller(drivers, lambda *report: None, 0.01, backoff=(0.01, 0.01))  # type: ignore[arg-type]
        poller.stats = stats

        def polls() -> dict:
            return stats.as_json().get("bmc", {}).get("flaky", {"requests": 0, "failures": 0})

        task = asyncio.create_task(poller.run())
        try:
            await until(lambda: polls()["requests"] >= 2)
            driver.failing = True
            await until(lambda: polls()["failures"] >= 1)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return stats.as_json()["bmc"]

    bmc = asyncio.run(scenario())
    assert set(bmc) == {"flaky"}  # the class, never the node's name or address


def test_image_pulls_count_their_bytes_and_failures(make_config, tmp_path: Path) -> None:
    build_image(tmp_path / "layout", "a", "IMAGE-A-MARKER")
    (tmp_path / "gone").mkdir()
    config = make_config(
        more='\n[images.a]\nsource = "oci-layout:layout:latest"\n'
        '\n[images.b]\nsource = "oci-layout:gone:latest"\n'
    )

    async def scenario() -> Samples:
        store = local_store(config)
        stats = Stats()
        catalog = Catalog(ImageStore(tmp_path / "images"), store.feed, stats)
        catalog.sync(config)
        await until(lambda: all(e.state != "pulling" for e in catalog.entries.values()))
        return samples(generate_latest(stats.registry))

    found = asyncio.run(scenario())
    assert value(found, "layerpy_image_pulls_total", source="oci-layout") == 2
    assert value(found, "layerpy_image_pull_failures_total", source="oci-layout") == 1
    layout_bytes = sum(p.stat().st_size for p in (tmp_path / "layout" / "blobs").rglob("*"))
    pulled = value(found, "layerpy_image_pull_bytes_total", source="oci-layout")
    assert 0 < pulled < layout_bytes  # its config and layers, not the manifest or index


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        await asyncio.sleep(0.005)


ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_list_every_metric_and_the_dashboard_uses_no_other(make_config) -> None:
    async def exposed() -> dict[str, str]:
        store = local_store(make_config())
        catalog = Catalog(ImageStore(store.config.server.state_dir / "images"), store.feed)
        stats = Stats()
        stats.watch_nodes(
            functools.partial(
                census.count, Lifecycle(store, store.backend, catalog, poll_interval=3600)
            )
        )
        stats.registry.register(ClusterMetrics(dict, list, bool))  # with [cluster] only
        text = (await stats.exposition()).decode()
        return {
            family.name + ("_total" if family.type == "counter" else ""): family.type
            for family in text_string_to_metric_families(text)
        }

    metrics = asyncio.run(exposed())
    assert len(metrics) > 40
    documented = set(
        re.findall(r"`((?:layerpy|process|python)_\w+)`", (ROOT / "docs/metrics.md").read_text())
    )
    assert set(metrics) <= documented, set(metrics) - documented
    assert documented <= set(metrics), documented - set(metrics)  # nothing stale

    dashboard = json.loads((ROOT / "docs/grafana-dashboard.json").read_text())
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    histograms = {name for name, kind in metrics.items() if kind == "histogram"}
    known = set(metrics) | {
        f"{name}{end}" for name in histograms for end in ("_bucket", "_sum", "_count")
    }
    used = {
        name for expr in exprs for name in re.findall(r"\b(?:layerpy|process|python)_\w+", expr)
    }
    assert used <= known, used - known
    assert {"layerpy_dhcp_requests_total", "layerpy_nodes_power"} <= used
