"""The HTTP side of ``layerpy serve`` with curl as the peer, in a namespace of its own."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from layerpy.proto.agent import PROTOCOL, Answer, encode

from netns import Netns

LAYERPY = Path(sys.executable).parent / "layerpy"
BASE = "http://10.66.0.1:8080"

pytestmark = pytest.mark.netns


@pytest.fixture
def host(make_config, tmp_path: Path):
    """A namespace whose veth interface holds the server's , both nodes. and a stranger.s addresses."""
    ns = Netns("lph")
    try:
        ns.run("ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        ns.run("ip", "link", "set", "d1", "up")
        for address in ("10.66.0.1/24", "10.66.0.11/24", "10.66.0.12/24", "10.66.0.99/24"):
            ns.run("ip", "addr", "add", address, "dev", "d0")
        ns.run("ip", "link", "set", "d0", "up")
        config = make_config(server="10.66.0.1", interface="d0")
        log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
        ns.popen([str(LAYERPY), "serve", "-c", str(config.path)], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while ns.run("curl", "-sf", f"{BASE}/api/v1/nodes", check=False).returncode:
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        yield ns
    finally:
        ns.close()


def curl(ns: Netns, *args: str, source: str = "10.66.0.99") -> tuple[int, str]:
    result = ns.run("curl", "-s", "--interface", source, "-w", "\n%{http_code}", *args)
    body, _, code = result.stdout.rpartition("\n")
    return int(code), body


def report(ns: Netns, **fields: object) -> tuple[int, dict]:
    body = {
        "node": "cn001",
        "mac": "52:54:00:99:00:11",
        "ip": "10.66.0.11",
        "boot_id": "b1",
        "seq": 1,
        "event": "hello",
        "busy": False,
        "protocol": PROTOCOL,
    } | fields
    code, text = curl(
        ns,
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "--data",
        json.dumps(body),
        f"{BASE}/api/v1/agent/report",
    )
    return code, json.loads(text)


def test_boot_script_only_for_the_node_itself(host: Netns) -> None:
    code, body = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.12")
    assert code == 403 and "only for 10.66.0.11" in body
    code, body = curl(host, f"{BASE}/boot/nope.ipxe")
    assert code == 404
    code, script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")
    assert code == 200
    assert script.startswith("#!ipxe\n")
    kernel = re.search(r"^kernel (\S+) (.*)$", script, re.M)
    assert kernel and kernel.group(1) == f"{BASE}/minos/kernel"
    args = kernel.group(2).split()
    assert args[:2] == ["initrd=minos", "console=ttyS0"]
    assert f"layerpy.server={BASE}" in args and "layerpy.node=cn001" in args
    assert "BOOTIF=01-52-54-00-99-00-11" in args
    assert f"initrd --name minos {BASE}/minos/initrd" in script


def test_kernel_initrd_and_timeline(host: Netns, tmp_path: Path) -> None:
    script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
    token = re.search(r"layerpy.token=(\S+)", script).group(1)
    for name, path in (("kernel", "vmlinuz"), ("initrd", "initrd")):
        code, body = curl(host, f"{BASE}/minos/{name}", source="10.66.0.11")
        assert code == 200 and body == (tmp_path / path).read_text()
    code, partial = curl(host, "-r", "0-6", f"{BASE}/minos/kernel")
    assert code == 206 and partial == "vmlinuz"
    answer = Answer(node="cn001", heartbeat=2.0)
    assert report(host, token=token) == (200, encode(answer))
    assert report(host, token=token, event="heartbeat", seq=2)[0] == 200
    node = json.loads(curl(host, f"{BASE}/api/v1/nodes/cn001")[1])
    assert node["run_state"] == "ready"
    assert list(node["timeline"]) == ["script", "kernel", "initrd", "agent_hello", "ready"]


def test_bad_reports_are_refused_and_counted(host: Netns) -> None:
    curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")
    assert report(host, token="forged") == (403, {"error": "wrong boot token for cn001"})
    code, body = curl(host, "-X", "POST", "--data", "{not json", f"{BASE}/api/v1/agent/report")
    assert code == 400 and "must be JSON" in body
    code, body = curl(host, "-X", "POST", "--data", '{"node": 1}', f"{BASE}/api/v1/agent/report")
    assert code == 400 and "protocol None, this side 1.0" in body
    code, body = report(host, token="forged", mac="52:54:00:99:00:11\nchain //evil/x")
    assert code == 400 and "report.mac is not a MAC address" in body["error"]
    stats = json.loads(curl(host, f"{BASE}/api/v1/stats")[1])["http"]
    assert stats["POST /api/v1/agent/report"]["failures"] == 4
    assert "layerpy_failures_total" in curl(host, f"{BASE}/metrics")[1]
    nodes = json.loads(curl(host, f"{BASE}/api/v1/nodes")[1])
    assert [n["run_state"] for n in nodes] == ["booting", "unknown"]


def test_reload_applies_whole_files_and_refuses_broken_ones(host: Netns, make_config) -> None:
    config = make_config(server="10.66.0.1", interface="d0")
    good = config.path.read_text()
    config.path.write_text(
        good.replace('nodes = "cn[001-002]"', 'nodes = "cn[001-002]"\npower = "off"')
        + '\n[nodes.cn005]\nip = "10.66.0.15"\n'
    )
    result = host.run(str(LAYERPY), "reload", "-c", str(config.path))
    assert result.stdout.split("\n")[:3] == [
        "added    cn005",
        "removed  -",
        "changed  cn001, cn002",
    ]
    config.path.write_text(good.replace('nodes = "cn[001-002]"', 'nodes = "cn[001-003]"'))
    result = host.run(str(LAYERPY), "reload", "-c", str(config.path), check=False)
    assert result.returncode == 2
    assert "groups.compute.ip: has 2 entries for 3 nodes" in result.stderr
    assert "running configuration stays in force" in result.stderr
    nodes = json.loads(curl(host, f"{BASE}/api/v1/nodes")[1])
    assert [n["name"] for n in nodes] == ["cn001", "cn002", "cn005"]


def test_explain_takes_a_node_or_a_hostlist(host: Netns) -> None:
    def explain(expression: str) -> tuple[int, str]:
        return curl(host, "-g", f"{BASE}/api/v1/nodes/{expression}/explain")

    code, body = explain("cn001")
    assert code == 200 and json.loads(body)["name"] == "cn001"
    code, body = explain("cn[001-002]")
    assert code == 200 and [e["name"] for e in json.loads(body)] == ["cn001", "cn002"]
    code, body = explain("cn[002],cn001")
    assert code == 200 and [e["name"] for e in json.loads(body)] == ["cn002", "cn001"]
    assert explain("cn[001-004]") == (404, "not in the node file: cn003, cn004\n")
    code, body = explain("cn[001-100]")
    assert code == 404 and body.endswith(", cn022 and 78 more\n")
    assert explain("cn[2-1]") == (400, "'cn[2-1]': range 2-1 runs backwards\n")
    code, body = explain("x[0-999][0-999][0-999]")  # sized before it is expanded
    assert code == 400 and "too large: 1000000000 names, the limit is 100000" in body
    assert explain("cn002")[0] == 200


def test_tftp_counts_reach_the_metrics(host: Netns) -> None:
    """A transfer (curl), a refused request (tftp-hpa) and junk datagrams, as /metrics and
    /api/v1/stats show them once the server has seen each request end."""
    fetch = ["curl", "-sS", "--interface", "10.66.0.11", "-o", "/dev/null"]
    host.run(*fetch, "tftp://10.66.0.1/undionly.kpxe")  # 3000 bytes
    out = host.run("tftp", "10.66.0.1", "-m", "binary", "-c", "get", "nope", "/dev/null")
    assert "Error code 1" in out.stdout + out.stderr
    junk = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    junk += "for b in (b'', b'\\x00\\x04\\x00\\x01'): s.sendto(b, ('10.66.0.1', 69))"
    host.run(sys.executable, "-c", junk)
    expected = {
        'layerpy_requests_total{subsystem="tftp",kind="read"} 1',
        'layerpy_failures_total{subsystem="tftp",kind="read"} 0',
        'layerpy_bytes_total{subsystem="tftp",kind="read"} 3000',
        'layerpy_requests_total{subsystem="tftp",kind="denied"} 1',
        'layerpy_failures_total{subsystem="tftp",kind="denied"} 1',
        # the two junk datagrams, and the ACK tftp-hpa sends after an error (to port 69)
        'layerpy_requests_total{subsystem="tftp",kind="malformed"} 3',
        "# TYPE layerpy_bytes_total counter",
    }
    deadline = time.monotonic() + 10
    while not expected <= set(metrics := curl(host, f"{BASE}/metrics")[1].splitlines()):
        assert time.monotonic() < deadline, "\n".join(metrics)
        time.sleep(0.1)
    read = json.loads(curl(host, f"{BASE}/api/v1/stats")[1])["tftp"]["read"]
    assert read["bytes"] == 3000 and read["mean_ms"] >= 0
    node = json.loads(curl(host, f"{BASE}/api/v1/nodes/cn001")[1])
    assert "tftp" in node["timeline"]
