"""``layerpy serve``'s /metrics after real traffic of every kind, read as Prometheus reads
it and checked by Prometheus's own ``promtool check metrics``: a real DHCP client (busybox
udhcpc), TFTP (curl, tftp-hpa), boot-network HTTP and agent reports (curl), an image
pulled from an OCI layout, and a BMC that cannot be reached."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oci import build_image
from test_http import BASE, Host, api, curl, report, serving

PROMTOOL = Path("/usr/bin/promtool")

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not PROMTOOL.exists(), reason="promtool (Debian: prometheus) missing"),
]

MORE = """
[images.a]
source = "oci-layout:layout:latest"

[nodes.cn003]
ip = "10.66.0.13"
image = "a"
bmc = { driver = "qemu", address = "/nonexistent/qmp.sock" }
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(host: Host) -> tuple[str, Samples]:
    code, text = api(host, "/metrics")
    assert code == 200, text
    found = {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return text, found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), -1.0)


def test_metrics_after_real_traffic_pass_promtool(make_config, tmp_path: Path) -> None:
    if shutil.which("udhcpc") is None:
        pytest.skip("busybox udhcpc missing")
    build_image(tmp_path / "layout", "a", "IMAGE-A-MARKER")
    config = make_config(server="10.66.0.1", interface="d0", more=MORE)
    text = config.path.read_text().replace("[server]\n", "[server]\ndhcp_probe = 0.5\n")
    config.path.write_text(text.replace('pool = "', 'discover = true\npool = "'))
    with serving(config, tmp_path) as host:
        # DHCP: a machine no node claims (d1's MAC) gets a pool address, DISCOVER to ACK
        dhcp = host.ns.run("udhcpc", "-i", "d1", "-n", "-q", "-f", "-B", "-t", "10", "-T", "1",
                           "-s", "/bin/true", check=False)  # fmt: skip
        assert dhcp.returncode == 0, dhcp.stdout + dhcp.stderr
        # TFTP: one transfer, one denied request
        host.ns.run("curl", "-sS", "--interface", "10.66.0.11", "-o", "/dev/null",
                    "tftp://10.66.0.1/undionly.kpxe")  # fmt: skip
        host.ns.run("tftp", "10.66.0.1", "-m", "binary", "-c", "get", "nope", "/dev/null")
        # HTTP: the boot script, a node and a path that do not exist, an agent's reports
        script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
        token = re.search(r"layerpy.token=(\S+)", script).group(1)
        assert curl(host, f"{BASE}/boot/52-54-00-de-ad-01.ipxe")[0] == 404
        assert curl(host, "-X", "PROPFIND", f"{BASE}/secret/path-of-a-client")[0] in (404, 405)
        assert report(host, token=token)[0] == 200
        assert report(host, token=token, event="heartbeat", seq=2)[0] == 200
        assert report(host, token="forged", seq=3)[0] == 403

        deadline = time.monotonic() + 30
        while True:  # the pull and a failed BMC poll happen in the background
            text, found = scrape(host)
            if (
                value(found, "layerpy_images", state="ready") == 1
                and value(found, "layerpy_bmc_poll_failures_total", driver="qemu") >= 1
                and value(found, "layerpy_tftp_transfers_total") == 1
            ):
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        stats = json.loads(api(host, "/api/v1/stats")[1])

    checked = subprocess.run([str(PROMTOOL), "check", "metrics"], input=text,
                             capture_output=True, text=True)  # fmt: skip
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, ""), text

    # DHCP, by message type, and what came of it
    for kind in ("discover", "request"):
        assert value(found, "layerpy_dhcp_requests_total", type=kind) >= 1
        count = value(found, "layerpy_dhcp_request_duration_seconds_count", type=kind)
        assert count == value(found, "layerpy_dhcp_requests_total", type=kind)
        assert value(found, "layerpy_dhcp_request_duration_seconds_sum", type=kind) < count * 0.1
    assert value(found, "layerpy_dhcp_outcomes_total", outcome="offer") >= 1
    assert value(found, "layerpy_dhcp_outcomes_total", outcome="ack") >= 1
    assert value(found, "layerpy_dhcp_outcomes_total", outcome="nak") == 0
    assert value(found, "layerpy_unknown_machines") == 1
    # TFTP: the transfer with its bytes and time, the denied request apart
    assert value(found, "layerpy_tftp_transfer_bytes_total") == 3000
    assert value(found, "layerpy_tftp_transfer_failures_total") == 0
    assert value(found, "layerpy_tftp_transfer_duration_seconds_bucket", le="+Inf") == 1
    assert value(found, "layerpy_tftp_rejected_total", reason="denied") == 1
    # HTTP by route pattern; the agent's reports, the forged one failed
    script_route = {"method": "GET", "route": "/boot/{name}.ipxe"}
    assert value(found, "layerpy_http_requests_total", **script_route) == 2
    assert value(found, "layerpy_http_request_failures_total", **script_route) == 1
    reports = {"method": "POST", "route": "/api/v1/agent/report"}
    assert value(found, "layerpy_http_requests_total", **reports) == 3
    assert value(found, "layerpy_http_request_failures_total", **reports) == 1
    assert value(found, "layerpy_http_request_duration_seconds_count", **reports) == 3
    for client_words in ("52-54-00-de-ad-01", "PROPFIND", "secret", "cn001.ipxe", token):
        assert client_words not in text
    # BMC polls, image pulls, nodes, the process
    assert value(found, "layerpy_bmc_polls_total", driver="qemu") >= 1
    assert value(found, "layerpy_image_pulls_total", source="oci-layout") == 1
    assert value(found, "layerpy_image_pull_bytes_total", source="oci-layout") > 1000
    assert value(found, "layerpy_nodes") == 3
    assert value(found, "layerpy_nodes_run", state="ready") == 1  # cn001, after its reports
    assert value(found, "layerpy_nodes_power", state="error") == 1  # cn003's BMC
    assert value(found, "layerpy_nodes_unsettled", variable="power") == 1
    assert value(found, "process_resident_memory_bytes") > 10e6
    assert value(found, "process_open_fds") > 5
    assert value(found, "layerpy_event_loop_lag_seconds_count") >= 1
    # the JSON stats count the same requests
    assert stats["http"]["POST /api/v1/agent/report"]["requests"] == 3
    assert stats["tftp"]["read"]["bytes"] == 3000
