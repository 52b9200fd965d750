"""The HTTP side of ``layerpy serve`` with curl as the peer, in a namespace of its own:
the boot network's listener, and the operator API over its Unix socket."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from layerpy.budget import plan
from layerpy.config import Config
from layerpy.files import revision
from layerpy.proto.agent import FILES_PATH, PROTOCOL, Answer, BeatOffer, FilesSpec, encode

from netns import Netns
from oci import build_image

LAYERPY = Path(sys.executable).parent / "layerpy"
BASE = "http://10.66.0.1:8080"

pytestmark = pytest.mark.netns


@dataclass
class Host:
    ns: Netns
    socket: Path  # the operator API
    serve: subprocess.Popen


@contextlib.contextmanager
def serving(config: Config, tmp_path: Path, *options: str) -> Iterator[Host]:
    """``layerpy serve`` in a namespace of its own whose veth holds the server's address,
    both nodes', and a stranger's (10.66.0.99); with 1 024 descriptors, systemd's default."""
    ns = Netns("lph")
    try:
        ns.run("ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        ns.run("ip", "link", "set", "d1", "up")
        for address in ("10.66.0.1/24", "10.66.0.11/24", "10.66.0.12/24", "10.66.0.99/24"):
            ns.run("ip", "addr", "add", address, "dev", "d0")
        ns.run("ip", "link", "set", "d0", "up")
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            limit = ["prlimit", "--nofile=1024:1024"]
            command = [*limit, str(LAYERPY), "serve", "-c", str(config.path), *options]
            host = Host(
                ns, tmp_path / "state" / "api.sock", ns.popen(command, stdout=out, stderr=out)
            )
        deadline = time.monotonic() + 20
        while api(host, "/api/v1/nodes")[0] != 200:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield host
    finally:
        ns.close()


def curl(host: Host, *args: str, source: str = "10.66.0.99") -> tuple[int, str]:
    """A request on the boot network, from `source`."""
    result = host.ns.run("curl", "-s", "--interface", source, "-w", "\n%{http_code}", *args)
    body, _, code = result.stdout.rpartition("\n")
    return int(code), body


def api(host: Host, path: str, *args: str) -> tuple[int, str]:
    """A request to the operator API, as the head node's admin makes it."""
    command = ["curl", "-s", "-g", "--unix-socket", str(host.socket), "-w", "\n%{http_code}"]
    result = host.ns.run(*command, *args, f"http://layerpy{path}", check=False)
    body, _, code = result.stdout.rpartition("\n")
    return int(code or 0), body


def report(host: Host, **fields: object) -> tuple[int, dict]:
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
        host,
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "--data",
        json.dumps(body),
        f"{BASE}/api/v1/agent/report",
    )
    return code, json.loads(text) if text.startswith("{") else {"not json": text}


def test_boot_script_only_for_the_node_itself(host: Host) -> None:
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


def test_kernel_initrd_and_timeline(host: Host, tmp_path: Path) -> None:
    script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
    token = re.search(r"layerpy.token=(\S+)", script).group(1)
    for name, path in (("kernel", "vmlinuz"), ("initrd", "initrd")):
        code, body = curl(host, f"{BASE}/minos/{name}", source="10.66.0.11")
        assert code == 200 and body == (tmp_path / path).read_text()
    code, partial = curl(host, "-r", "0-6", f"{BASE}/minos/kernel")
    assert code == 206 and partial == "vmlinuz"
    code, said = report(host, token=token)
    offer = BeatOffer(8080, said.get("beat", {}).get("key", ""))  # this boot's, made at random
    answer = Answer(node="cn001", heartbeat=2.0, files=FilesSpec(revision([]), ()), beat=offer)
    assert (code, said) == (200, encode(answer))
    assert report(host, token=token, event="heartbeat", seq=2)[0] == 200
    node = json.loads(api(host, "/api/v1/nodes/cn001")[1])
    assert node["run_state"] == "ready"
    assert list(node["timeline"]) == ["script", "kernel", "initrd", "agent_hello", "ready"]


def test_bad_reports_are_refused_and_counted(host: Host) -> None:
    curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")
    assert report(host, token="forged") == (403, {"error": "wrong boot token for cn001"})
    code, body = curl(host, "-X", "POST", "--data", "{not json", f"{BASE}/api/v1/agent/report")
    assert code == 400 and "must be JSON" in body
    code, body = curl(host, "-X", "POST", "--data", '{"node": 1}', f"{BASE}/api/v1/agent/report")
    assert code == 400 and f"protocol None, this side {PROTOCOL}" in body
    code, body = report(host, token="forged", mac="52:54:00:99:00:11\nchain //evil/x")
    assert code == 400 and "report.mac is not a MAC address" in body["error"]
    stats = json.loads(api(host, "/api/v1/stats")[1])["http"]
    assert stats["POST /api/v1/agent/report"]["failures"] == 4
    failures = 'layerpy_http_request_failures_total{method="POST",route="/api/v1/agent/report"} 4.0'
    assert failures in api(host, "/metrics")[1].splitlines()
    nodes = json.loads(api(host, "/api/v1/nodes")[1])
    assert [n["run_state"] for n in nodes] == ["booting", "unknown"]


def test_reload_applies_whole_files_and_refuses_broken_ones(host: Host, make_config) -> None:
    config = make_config(server="10.66.0.1", interface="d0")
    good = config.path.read_text()
    config.path.write_text(
        good.replace('nodes = "cn[001-002]"', 'nodes = "cn[001-002]"\npower = "off"')
        + '\n[nodes.cn005]\nip = "10.66.0.15"\n'
    )
    result = host.ns.run(str(LAYERPY), "reload", "-c", str(config.path))
    assert result.stdout.split("\n")[:3] == [
        "added    cn005",
        "removed  -",
        "changed  cn001, cn002",
    ]
    config.path.write_text(good.replace('nodes = "cn[001-002]"', 'nodes = "cn[001-003]"'))
    result = host.ns.run(str(LAYERPY), "reload", "-c", str(config.path), check=False)
    assert result.returncode == 2
    assert "groups.compute.ip: has 2 entries for 3 nodes" in result.stderr
    assert "running configuration stays in force" in result.stderr
    nodes = json.loads(api(host, "/api/v1/nodes")[1])
    assert [n["name"] for n in nodes] == ["cn001", "cn002", "cn005"]


def test_explain_takes_a_node_or_a_hostlist(host: Host) -> None:
    def explain(expression: str) -> tuple[int, str]:
        return api(host, f"/api/v1/nodes/{expression}/explain")

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


def test_tftp_counts_reach_the_metrics(host: Host) -> None:
    """A transfer (curl), a refused request (tftp-hpa) and junk datagrams, as /metrics and
    /api/v1/stats show them once the server has seen each request end."""
    fetch = ["curl", "-sS", "--interface", "10.66.0.11", "-o", "/dev/null"]
    host.ns.run(*fetch, "tftp://10.66.0.1/undionly.kpxe")  # 3000 bytes
    out = host.ns.run("tftp", "10.66.0.1", "-m", "binary", "-c", "get", "nope", "/dev/null")
    assert "Error code 1" in out.stdout + out.stderr
    junk = "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    junk += "for b in (b'', b'\\x00\\x04\\x00\\x01'): s.sendto(b, ('10.66.0.1', 69))"
    host.ns.run(sys.executable, "-c", junk)
    expected = {
        "layerpy_tftp_transfers_total 1.0",
        "layerpy_tftp_transfer_failures_total 0.0",
        "layerpy_tftp_transfer_bytes_total 3000.0",
        'layerpy_tftp_rejected_total{reason="denied"} 1.0',
        # the two junk datagrams, and the ACK tftp-hpa sends after an error (to port 69)
        'layerpy_tftp_rejected_total{reason="malformed"} 3.0',
        "# TYPE layerpy_tftp_transfer_bytes_total counter",
    }
    deadline = time.monotonic() + 10
    while not expected <= set(metrics := api(host, "/metrics")[1].splitlines()):
        assert time.monotonic() < deadline, "\n".join(metrics)
        time.sleep(0.1)
    read = json.loads(api(host, "/api/v1/stats")[1])["tftp"]["read"]
    assert read["bytes"] == 3000 and read["mean_ms"] >= 0
    node = json.loads(api(host, "/api/v1/nodes/cn001")[1])
    assert "tftp" in node["timeline"]


# -- operators: the API is theirs alone ------------------------------------------------------

TCP_API = "http://127.0.0.1:8081"  # the default operator listener, inside the namespace


def tcp_api(host: Host, path: str, *args: str, token: str | None = None) -> tuple[int, str]:
    """A request to the operator API over TCP, with a bearer token if given."""
    auth = ["-H", f"Authorization: Bearer {token}"] if token else []
    command = ["curl", "-s", "-g", "-w", "\n%{http_code}", *auth, *args, f"{TCP_API}{path}"]
    body, _, code = host.ns.run(*command).stdout.rpartition("\n")
    return int(code), body


def test_the_boot_network_gets_no_operator_api(host: Host) -> None:
    for path in ("/api/v1/nodes", "/api/v1/images", "/api/v1/events", "/metrics"):
        assert curl(host, f"{BASE}{path}")[0] == 404, path
    off = json.dumps({"nodes": "cn[001-002]", "action": "off"})
    for path in ("/api/v1/power", "/api/v1/reload"):
        assert curl(host, "-X", "POST", "--data", off, f"{BASE}{path}")[0] in (404, 405), path
    loopback = host.ns.run("curl", "-s", "http://127.0.0.1:8080/boot/cn001.ipxe", check=False)
    assert loopback.returncode == 7  # nothing listens there: the boot listener is the address


def test_operators_need_a_token_with_the_right_scope(host: Host, tmp_path: Path) -> None:
    curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")  # a boot token in boots.jsonl
    state = tmp_path / "state"
    admin = (state / "admin.token").read_text().strip()
    assert admin.startswith("lpy_") and admin not in (state / "tokens.json").read_text()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (state, *state.iterdir())}
    assert modes["state"] == 0o700 and modes["api.sock"] == 0o600, modes
    assert modes["admin.token"] == modes["tokens.json"] == modes["boots.jsonl"] == 0o600, modes

    code, body = tcp_api(host, "/api/v1/nodes")
    assert code == 401 and "an operator token is needed" in body
    assert tcp_api(host, "/metrics", token="lpy_forged")[0] == 401
    assert tcp_api(host, "/metrics", token=admin)[0] == 200

    cli = [str(LAYERPY), "token"]
    config = ["-c", str(tmp_path / "nodes.toml")]
    viewer = host.ns.run(*cli, "add", "viewer", *config).stdout.strip()
    listed = host.ns.run(*cli, "list", *config).stdout
    assert "viewer" in listed and "read" in listed and viewer not in listed and admin not in listed
    assert tcp_api(host, "/api/v1/nodes", token=viewer)[0] == 200
    off = json.dumps({"nodes": "cn001", "action": "off"})
    code, body = tcp_api(host, "/api/v1/power", "-X", "POST", "--data", off, token=viewer)
    assert (code, body) == (403, "token viewer may only read (scope read)\n")
    host.ns.run(*cli, "revoke", "viewer", *config)
    assert tcp_api(host, "/api/v1/nodes", token=viewer)[0] == 401  # at once, no restart

    code, body = tcp_api(host, "/api/v1/power", "-X", "POST", "--data", off, token=admin)
    assert code == 200 and json.loads(body)["cn001"]["override"] is True
    env = ["env", f"LAYERPY_TOKEN={admin}"]
    shown = host.ns.run(*env, str(LAYERPY), "power", "on", "cn002", "--server", TCP_API).stdout
    assert "cn002" in shown
    refused = host.ns.run(str(LAYERPY), "power", "status", "cn002", "--server", TCP_API,
                          check=False)  # fmt: skip
    assert refused.returncode == 1 and "needs a token" in refused.stderr
    host.ns.run(str(LAYERPY), "power", "clear", "cn[001-002]", *config)  # the socket, found

    events = [e for e in json.loads(api(host, "/api/v1/events")[1]) if e["kind"] == "operator"]
    assert [e["message"] for e in events] == [
        "token admin from 127.0.0.1: power off cn001",
        "token admin from 127.0.0.1: power on cn002",
        "uid 0 (root) from unix socket: power clear cn[001-002]",
    ]
    log = (tmp_path / "serve.log").read_text()
    assert "layerpy.api: token viewer from 127.0.0.1 may only read: refused POST" in log
    assert "layerpy.api: token admin from 127.0.0.1: power off cn001" in log
    for secret in (admin, viewer):
        assert secret not in log


def test_cycle_spares_busy_nodes_unless_forced(host: Host) -> None:
    script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
    token = re.search(r"layerpy.token=(\S+)", script).group(1)
    assert report(host, token=token, busy=True)[0] == 200

    def cycle(**force: bool) -> dict:
        body = json.dumps({"nodes": "cn[001-002]", "action": "cycle", **force})
        code, text = api(host, "/api/v1/power", "-X", "POST", "--data", body)
        assert code == 200, text
        return {name: state["skipped"] for name, state in json.loads(text).items()}

    assert cycle() == {"cn001": "busy: not cycled (force to cycle it anyway)", "cn002": None}
    assert cycle(force=True) == {"cn001": None, "cn002": None}


def test_bad_json_is_a_400_never_a_500(host: Host, tmp_path: Path) -> None:
    bodies = {
        "deep": b"[" * 60_000 + b"]" * 60_000,
        "surrogate": b'{"node": "\\ud800", "protocol": "1.0"}',
        "not utf-8": b'{"node": "\xff"}',
    }
    for what, body in bodies.items():
        (tmp_path / "body").write_bytes(body)
        data = ["-X", "POST", "--data-binary", f"@{tmp_path / 'body'}"]
        code, text = curl(host, *data, f"{BASE}/api/v1/agent/report")
        assert code == 400, (what, text)
        code, text = api(host, "/api/v1/power", *data)
        assert code == 400, (what, text)
    body = tmp_path / "body"  # over each listener's limit: refused by its length, unread
    data = ["-X", "POST", "--data-binary", f"@{body}"]
    body.write_bytes(b" " * 128 * 1024 + b"{}")
    assert api(host, "/api/v1/power", *data) == (413, "the body is over 131072 bytes, the limit\n")
    body.write_bytes(b" " * 1024 * 1024 + b"{}")
    code, text = curl(host, *data, f"{BASE}/api/v1/agent/report")
    assert (code, text) == (413, "the body is over 1048576 bytes, the limit\n")


def test_image_files_only_for_their_nodes(host: Host) -> None:
    image = f"{BASE}/images/sha256:{'ab' * 32}/rootfs.tar"
    code, body = curl(host, image, source="10.66.0.11")
    assert (code, body) == (403, "image files are for the nodes that run them\n")
    script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
    token = re.search(r"layerpy.token=(\S+)", script).group(1)
    for claimed in (f"cn002 {token}", "cn001 forged", "cn001"):
        code, _ = curl(host, "-H", f"Authorization: Layerpy-Node {claimed}", image)
        assert code == 403, claimed
    code, body = curl(host, "-H", f"Authorization: Layerpy-Node cn001 {token}", image)
    assert code == 403 and "is not cn001's" in body  # its own token, but not its image
    assert api(host, f"/images/sha256:{'ab' * 32}/rootfs.tar")[0] == 404  # operators pass


NODE_FILES = """
[nodes.cn001]
vars = { role = "head" }

[files."/etc/motd"]
template = "motd.j2"

[files."/etc/munge/munge.key"]
secret = "munge.key"
nodes = "cn001"
"""
MUNGE_SECRET = "munge-secret-0f3a9c"


def boot_token(host: Host, node: str, source: str) -> str:
    script = curl(host, f"{BASE}/boot/{node}.ipxe", source=source)[1]
    return re.search(r"layerpy.token=(\S+)", script).group(1)


def test_a_nodes_files_go_to_that_node_only(make_config, tmp_path: Path) -> None:
    """The answer names the files by digest; the bytes go only to the node they are for,
    by its boot token; operators see revisions, never a secret (issue 13)."""
    (tmp_path / "motd.j2").write_text(
        "{{ node.name }} is {{ node.vars.role | default('compute') }}\n"
    )
    (tmp_path / "munge.key").write_text(MUNGE_SECRET)
    (tmp_path / "munge.key").chmod(0o600)
    config = make_config(server="10.66.0.1", interface="d0", more=NODE_FILES)
    with serving(config, tmp_path, "--debug") as host:
        tokens = {"cn001": boot_token(host, "cn001", "10.66.0.11"),
                  "cn002": boot_token(host, "cn002", "10.66.0.12")}  # fmt: skip
        code, answer = report(host, token=tokens["cn001"])
        assert code == 200
        files = {f["path"]: f for f in answer["files"]["files"]}
        assert sorted(files) == ["/etc/motd", "/etc/munge/munge.key"]
        key = files["/etc/munge/munge.key"]
        assert (key["mode"], key["owner"], key["size"]) == (0o400, "root:root", len(MUNGE_SECRET))
        assert MUNGE_SECRET not in json.dumps(answer)  # digests, not bytes

        url = f"{BASE}{FILES_PATH}{key['digest']}"
        mine = f"Authorization: Layerpy-Node cn001 {tokens['cn001']}"
        assert curl(host, "-H", mine, url, source="10.66.0.11") == (200, MUNGE_SECRET)
        motd = files["/etc/motd"]["digest"]
        assert curl(host, "-H", mine, f"{BASE}{FILES_PATH}{motd}") == (200, "cn001 is head\n")
        for claimed in (f"cn002 {tokens['cn002']}", f"cn002 {tokens['cn001']}", "cn001 forged"):
            code, body = curl(host, "-H", f"Authorization: Layerpy-Node {claimed}", url)
            assert code == 403 and MUNGE_SECRET not in body, claimed
        assert curl(host, url)[0] == 403  # no credential
        code, theirs = report(host, node="cn002", mac="52:54:00:99:00:12", ip="10.66.0.12",
                              token=tokens["cn002"])  # fmt: skip
        assert [f["path"] for f in theirs["files"]["files"]] == ["/etc/motd"]
        assert api(host, f"{FILES_PATH}{key['digest']}")[0] == 404  # not on the operator API

        revision = answer["files"]["revision"]
        report(host, token=tokens["cn001"], seq=2, event="change",
               files={"revision": revision, "error": None})  # fmt: skip
        node = json.loads(api(host, "/api/v1/nodes/cn001")[1])
        assert node["files"] == {"revision": revision, "error": None}
        explained = json.loads(api(host, "/api/v1/nodes/cn001/explain")[1])
        assert explained["files"] == {"running": revision, "wanted": revision, "error": None}
        everything = "\n".join(
            api(host, path)[1] for path in ("/api/v1/nodes", "/api/v1/nodes/cn001/explain",
                                            "/api/v1/events", "/metrics")
        )  # fmt: skip
    log = (tmp_path / "serve.log").read_text()
    assert "cn001: files revision " + revision in log
    assert MUNGE_SECRET not in everything + log


def test_an_operator_binds_a_machine_to_a_node(host: Host, tmp_path: Path) -> None:
    bind = [str(LAYERPY), "bind", "-c", str(tmp_path / "nodes.toml"), "cn001"]
    assert (
        host.ns.run(*bind, "52-54-00-99-00-77").stdout == "cn001 is 52-54-00-99-00-77 from now on\n"
    )
    events = [(e["kind"], e["message"]) for e in json.loads(api(host, "/api/v1/events")[1])]
    assert events == [
        ("operator", "uid 0 (root) from unix socket: bind cn001 52:54:00:99:00:77"),
        ("replaced", "hardware replaced by uid 0 (root): 52:54:00:99:00:11 -> 52:54:00:99:00:77"),
    ]
    refused = host.ns.run(*bind, "52:54:00:99:00", check=False)
    assert refused.returncode == 1
    assert "'52:54:00:99:00' is not a MAC address like 52:54:00:12:34:56" in refused.stderr


# 1 100 TCP connections from one address that never send a byte (more than the 1 024
# descriptors the server has under systemd's default limit).
IDLE = r"""
import socket, sys
held = []
for _ in range(1100):
    s = socket.socket()
    s.bind(("10.66.0.99", 0))
    s.setblocking(False)
    s.connect_ex(("10.66.0.1", 8080))
    held.append(s)
print("connected", flush=True)
sys.stdin.read()
"""


def test_idle_connections_cannot_shut_out_a_node(host: Host, tmp_path: Path) -> None:
    idle = host.ns.popen([sys.executable, "-c", IDLE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert idle.stdout.readline() == b"connected\n"

        def refused() -> int:
            stats = json.loads(api(host, "/api/v1/stats")[1]).get("http", {})
            return stats.get("refused", {}).get("requests", 0)

        deadline = time.monotonic() + 60
        while refused() < 1100 - plan(1024).boot_http_per_address:  # all but one address's
            assert time.monotonic() < deadline, f"{refused()} refused"
            time.sleep(0.2)
        begun = time.monotonic()
        code, script = curl(host, "--max-time", "10", f"{BASE}/boot/cn002.ipxe",
                            source="10.66.0.12")  # fmt: skip
        took = time.monotonic() - begun
        print(f"\nwith 1100 idle connections from one address: answered in {took * 1000:.0f} ms")
        assert code == 200 and script.startswith("#!ipxe")
    finally:
        idle.stdin.close()
        idle.wait(30)
    log = (tmp_path / "serve.log").read_text()
    assert log.count("refusing boot HTTP connections from 10.66.0.99") == 1, log[-2000:]


BMC_SECRET = "Bmc-Planted-Secret-41"
REGISTRY_SECRET = "Registry-Planted-Secret-42"
SECRETS_FILE = """
[images.private]
source = "registry://10.66.0.1:5443/lab/private:1"
user = "puller"
password_env = "LAYERPY_TEST_REGISTRY_PASSWORD"

[nodes.cn003]
ip = "10.66.0.13"
image = "private"
bmc = { driver = "ipmi", address = "10.66.0.99", user = "admin", password_file = "bmc.pass" }
"""


def test_secrets_appear_nowhere_but_where_they_belong(
    make_config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plant a BMC password, a registry password, operator tokens and boot tokens; then
    read every API answer, the log, every state file's mode and the process's command line."""
    (tmp_path / "bmc.pass").write_text(BMC_SECRET + "\n")
    monkeypatch.setenv("LAYERPY_TEST_REGISTRY_PASSWORD", REGISTRY_SECRET)
    config = make_config(server="10.66.0.1", interface="d0", more=SECRETS_FILE)
    log = tmp_path / "serve.log"  # the registry password in the environment, inherited
    with serving(config, tmp_path, "--debug") as host:
        ns = host.ns
        config_args = ["-c", str(config.path)]
        viewer = ns.run(str(LAYERPY), "token", "add", "viewer", *config_args).stdout.strip()
        admin = (tmp_path / "state" / "admin.token").read_text().strip()
        script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
        boot_token = re.search(r"layerpy.token=(\S+)", script).group(1)
        tcp_api(host, "/api/v1/nodes", token="lpy_wrong")  # refused tokens are not logged
        tcp_api(host, "/api/v1/nodes", token=viewer)

        def pulled_or_failed() -> bool:
            images = json.loads(api(host, "/api/v1/images")[1])
            return all(image["state"] in ("ready", "error") for image in images)

        def bmc_failed() -> bool:
            return json.loads(api(host, "/api/v1/nodes/cn003")[1])["power_error"] is not None

        deadline = time.monotonic() + 60
        while not (pulled_or_failed() and bmc_failed()):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        answers = [
            api(host, path)[1]
            for path in ("/api/v1/nodes", "/api/v1/nodes/cn003", "/api/v1/nodes/cn[001-003]/explain",
                         "/api/v1/unknown", "/api/v1/events", "/api/v1/stats", "/api/v1/plan",
                         "/api/v1/images", "/metrics")
        ]  # fmt: skip
        answers.append(ns.run(str(LAYERPY), "status", *config_args).stdout)
        answers.append(ns.run(str(LAYERPY), "token", "list", *config_args).stdout)
        cmdline = Path(f"/proc/{host.serve.pid}/cmdline").read_bytes().decode()
        host.serve.terminate()
        host.serve.wait(20)
    text = log.read_text()
    assert "BMC 10.66.0.99" in text and "registry 10.66.0.1:5443" in text  # both were tried
    everything = "\n".join([*answers, text, cmdline])
    for secret in (BMC_SECRET, REGISTRY_SECRET, admin, viewer, boot_token):
        assert secret not in everything, secret
    state = tmp_path / "state"
    assert state.stat().st_mode & 0o777 == 0o700
    for path in state.rglob("*"):
        if path.is_file() and (BMC_SECRET.encode() in path.read_bytes() or
                               boot_token.encode() in path.read_bytes()):  # fmt: skip
            assert path.stat().st_mode & 0o077 == 0, path
    assert admin not in (state / "tokens.json").read_text()  # digests only


def test_status_shows_what_a_node_reports_as_plain_text(host: Host, tmp_path: Path) -> None:
    """A report's text reaches the terminal as text: no escape sequences, no rich markup."""
    script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
    token = re.search(r"layerpy.token=(\S+)", script).group(1)
    hostile = "[bold red]pwned[/] \x1b]0;title\x07\x1b[2J"
    assert report(host, token=token, hostname=hostile)[0] == 200
    table = host.ns.run(str(LAYERPY), "status", "-c", str(tmp_path / "nodes.toml"))
    assert "\x1b" not in table.stdout and "\x07" not in table.stdout
    assert "[bold red]pwned[/]" in table.stdout  # shown as it is, not taken as markup
    shown = json.loads(api(host, "/api/v1/nodes/cn001")[1])["hostname"]
    assert shown == "[bold red]pwned[/] ?]0;title??[2J"


GARBAGE = r"""
import socket
for junk in (b"\x16\x03\x01\x02\x00\x01" * 50, b"GET /\x00 HTTP/1.1\r\n\r\n",
             b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",
             b"POST /api/v1/agent/report HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n{") * 50:
    s = socket.create_connection(("10.66.0.1", 8080))
    s.sendall(junk)
    s.settimeout(2)
    try:
        s.recv(100)
    except OSError:
        pass
    s.close()
"""


def test_garbage_requests_do_not_flood_the_log(host: Host, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    before = log.stat().st_size
    host.ns.run(sys.executable, "-c", GARBAGE, timeout=120)
    grown = log.read_text()[before:]
    assert len(grown.splitlines()) < 20, grown[-3000:]
    assert curl(host, f"{BASE}/boot/cn002.ipxe", source="10.66.0.12")[0] == 200


STALLER = r"""
import socket, ssl, sys
port, path, *tls = sys.argv[1:]  # tls: a CA file and an operator's token
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server fills up
s.bind(("10.66.0.99", 0))
s.connect(("10.66.0.1", int(port)))
auth = ""
if tls:
    s = ssl.create_default_context(cafile=tls[0]).wrap_socket(s, server_hostname="10.66.0.1")
    auth = f"Authorization: Bearer {tls[1]}\r\n"
s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
print("asked", flush=True)
sys.stdin.read()  # reads nothing until told to
got = 0
try:
    while chunk := s.recv(1 << 20):
        got += len(chunk)
    print("closed", got)
except ConnectionResetError:
    print("reset", got)
"""


@contextlib.contextmanager
def stalling(host: Host, *args: str) -> Iterator[subprocess.Popen]:
    """STALLER, once it has asked for its file; killed at the end, whatever happened."""
    staller = host.ns.popen([sys.executable, "-c", STALLER, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert staller.stdout.readline() == b"asked\n"
        yield staller
    finally:
        staller.kill()
        staller.wait()


def wait_stalled(host: Host) -> None:
    deadline = time.monotonic() + 60  # generous: send_timeout is 2-3 s, on a busy machine
    while stalled(host) < 1:
        assert time.monotonic() < deadline, "a stalled transfer dropped: not in 60 s"
        time.sleep(0.2)


def stalled(host: Host) -> int:
    """File transfers the server dropped because their client took nothing."""
    stats = json.loads(api(host, "/api/v1/stats")[1]).get("http", {})
    return stats.get("stalled", {}).get("requests", 0)


def test_operators_over_https(make_config, tmp_path: Path) -> None:
    """An operator listener on the boot network's address, over TLS (a self-signed cert
    made by openssl): the token works there, plain HTTP does not, and the CLI follows;
    files go through TLS whole, and a client that stops reading is dropped there too."""
    cert, key = tmp_path / "api.crt", tmp_path / "api.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=head",
         "-addext", "subjectAltName=IP:10.66.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = f'\n[api]\nlisten = ["10.66.0.1:8443"]\ntls_cert = "{cert}"\ntls_key = "{key}"\n'
    big = {"srv/big": os.urandom(24 << 20)}  # more than both sides' socket buffers
    build_image(tmp_path / "layout", "a", "IMAGE-A-MARKER", big)
    image = '\n[images.a]\nsource = "oci-layout:layout:latest"\n'
    config = make_config(server="10.66.0.1", interface="d0", more=tls + image)
    config.path.write_text(
        config.path.read_text().replace("[server]\n", "[server]\nsend_timeout = 3\n")
    )
    with serving(config, tmp_path) as host:
        admin = (tmp_path / "state" / "admin.token").read_text().strip()
        https = ["curl", "-s", "--cacert", str(cert), "-o", "/dev/null", "-w", "%{http_code}"]
        url = "https://10.66.0.1:8443/api/v1/nodes"
        auth = ["-H", f"Authorization: Bearer {admin}"]
        assert host.ns.run(*https, *auth, url).stdout == "200"
        assert host.ns.run(*https, url).stdout == "401"
        # an image file through TLS (read in chunks, not sendfile): the bytes the operator
        # socket sends by sendfile, whole and in a range that ends inside a chunk
        deadline = time.monotonic() + 60
        while not (ready := [i for i in json.loads(api(host, "/api/v1/images")[1])
                             if i.get("state") == "ready"]):  # fmt: skip
            assert time.monotonic() < deadline, api(host, "/api/v1/images")[1]
            time.sleep(0.2)
        path = f"/images/{ready[0]['digest']}/rootfs.tar"
        plain, tls_copy = tmp_path / "plain.tar", tmp_path / "tls.tar"
        host.ns.run("curl", "-sf", "--unix-socket", str(host.socket), "-o", str(plain),
                    f"http://layerpy{path}")  # fmt: skip
        get = ["curl", "-sf", "--cacert", str(cert), *auth]
        host.ns.run(*get, "-o", str(tls_copy), f"https://10.66.0.1:8443{path}")
        whole = plain.read_bytes()
        assert len(whole) > 4 * 256 * 1024 and tls_copy.read_bytes() == whole
        part = tmp_path / "part"
        host.ns.run(*get, "-r", "1000-300000", "-o", str(part), f"https://10.66.0.1:8443{path}")
        assert part.read_bytes() == whole[1000:300001]
        with stalling(host, "8443", path, str(cert), admin):
            wait_stalled(host)
        plain = host.ns.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                            "http://10.66.0.1:8443/api/v1/nodes", check=False)  # fmt: skip
        assert plain.stdout != "200"
        env = ["env", f"SSL_CERT_FILE={cert}", f"LAYERPY_TOKEN={admin}"]
        table = host.ns.run(*env, str(LAYERPY), "status", "--server", "https://10.66.0.1:8443")
        assert "cn001" in table.stdout and "cn002" in table.stdout


SLOW_HEADERS = r"""
import socket, time
s = socket.create_connection(("10.66.0.1", 8080))
s.sendall(b"GET /minos/kernel HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
begun = time.monotonic()
s.settimeout(60)
print(s.recv(100) == b"", round(time.monotonic() - begun, 1))
"""


def test_a_request_that_never_ends_is_closed(host: Host) -> None:
    closed, after = host.ns.run(sys.executable, "-c", SLOW_HEADERS, timeout=90).stdout.split()
    print(f"\nincomplete headers: closed after {after} s")
    assert closed == "True" and float(after) < 30


def test_a_client_that_stops_reading_loses_its_transfer(make_config, tmp_path: Path) -> None:
    """A client that asks for a file and reads nothing is dropped after send_timeout, its
    turn freed, counted and said once; a node fetching at the same time is not held up."""
    config = make_config(server="10.66.0.1", interface="d0")
    config.path.write_text(
        config.path.read_text().replace("[server]\n", "[server]\nsend_timeout = 2\n")
    )
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(os.urandom(32 << 20))  # far more than both sides' socket buffers
    with serving(config, tmp_path) as host:
        with stalling(host, "8080", "/minos/kernel") as staller:
            fetched = tmp_path / "fetched"
            curl(host, "-o", str(fetched), f"{BASE}/minos/kernel", source="10.66.0.11")
            assert fetched.read_bytes() == kernel.read_bytes()
            wait_stalled(host)
            staller.stdin.close()
            how, got = staller.stdout.read().decode().split()
            assert how in ("reset", "closed") and int(got) < kernel.stat().st_size, (how, got)
        assert stalled(host) == 1
    log = (tmp_path / "serve.log").read_text()
    said = "dropped the transfer of vmlinuz to 10.66.0.99: it took nothing in 2 s"
    assert log.count(said) == 1, log[-2000:]


def test_uefi_http_boot_fetches_only_the_named_binaries(host: Host, tmp_path: Path) -> None:
    got = tmp_path / "got.efi"
    code, _ = curl(host, "-o", str(got), f"{BASE}/ipxe/snponly.efi", source="10.66.0.11")
    assert code == 200 and got.read_bytes() == (tmp_path / "ipxe" / "snponly.efi").read_bytes()
    node = json.loads(api(host, "/api/v1/nodes/cn001")[1])
    assert "tftp" in node["timeline"]  # the binary's fetch, whichever way it came
    for name in ("nope.efi", "..%2fnodes.toml", "%2e%2e/bmc.pass"):
        assert curl(host, "--path-as-is", f"{BASE}/ipxe/{name}")[0] == 404, name


def test_a_stop_while_starting_is_obeyed(make_config, tmp_path: Path) -> None:
    """SIGTERM while the server still looks for other DHCP servers (here for 60 s): it
    stops at once, not after the look."""
    config = make_config(server="10.66.0.1", interface="d0")
    config.path.write_text(
        config.path.read_text().replace("[server]\n", "[server]\ndhcp_probe = 60\n")
    )
    with serving(config, tmp_path) as host:  # the API is up; DHCP waits for the look
        host.serve.terminate()
        host.serve.wait(20)
    assert "stopped while starting" in (tmp_path / "serve.log").read_text()


def test_boot_files_are_sent_whole_and_new_when_replaced(host: Host, tmp_path: Path) -> None:
    """services.http.QueuedFile: HEAD, conditional and Range requests as FileResponse
    answered them, and a file renamed over (a rebuilt minOS) is sent new at once."""
    kernel = tmp_path / "vmlinuz"
    old = kernel.read_bytes()
    result = host.ns.run("curl", "-sI", f"{BASE}/minos/kernel")
    lines = result.stdout.splitlines()
    fields = (line.split(": ", 1) for line in lines[1:] if ": " in line)
    headers = {name.lower(): value for name, value in fields}
    assert lines[0].startswith("HTTP/1.1 200") and headers["content-length"] == str(len(old))
    etag, modified = headers["etag"], headers["last-modified"]
    assert curl(host, "-H", f"If-Modified-Since: {modified}", f"{BASE}/minos/kernel") == (304, "")
    assert curl(host, "-H", f"If-None-Match: {etag}", f"{BASE}/minos/kernel") == (304, "")
    assert curl(host, "-r", "-3", f"{BASE}/minos/kernel") == (206, old[-3:].decode())
    assert curl(host, "-r", "7-13", f"{BASE}/minos/kernel") == (206, old[7:14].decode())
    assert curl(host, "-r", f"{len(old)}-", f"{BASE}/minos/kernel")[0] == 416
    new = tmp_path / "vmlinuz.new"
    new.write_bytes(b"rebuilt " * 50_000)  # the size of a real transfer: several sendfiles
    new.rename(kernel)
    code, body = curl(host, f"{BASE}/minos/kernel")
    assert code == 200 and body == "rebuilt " * 50_000
    resumed = curl(host, "-r", "0-6", "-H", f"If-Range: {etag}", f"{BASE}/minos/kernel")
    assert resumed == (200, "rebuilt " * 50_000)  # not old bytes 0-6: the file changed
