"""The descriptor plan under attack from the boot network (issue 26): a crowd of idle HTTP
connections from many addresses, and a crowd of stalled TFTP transfers, while a node
boots and reports and an operator works. The server runs with 1 024 descriptors."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerpy.budget import plan

from test_http import BASE, TCP_API, Host, api, curl, report

pytestmark = pytest.mark.netns

LIMIT = 1024  # what test_http.serving gives the server
PLAN = plan(LIMIT)

# Connections from each of the given addresses that never send a byte; one closed by the
# server is opened again at once, from the same address (runs until killed, 120 s at most).
CROWD = r"""
import resource, selectors, socket, sys, time
addresses, each, port = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
watch = selectors.DefaultSelector()

def connect(address):
    s = socket.socket()
    s.setblocking(False)
    s.bind((address, 0))
    s.connect_ex(("10.66.0.1", port))
    watch.register(s, selectors.EVENT_READ, address)

for address in addresses:
    for _ in range(each):
        connect(address)
print("connected", flush=True)
end = time.monotonic() + 120
while time.monotonic() < end:
    for key, _ in watch.select(1):
        try:
            if key.fileobj.recv(1):
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        watch.unregister(key.fileobj)
        key.fileobj.close()
        connect(key.data)
"""

# Read requests from `each` ports of each address, DATA never acknowledged; asked again
# every half second from every port (the server ignores a request from a port whose
# transfer still runs, so each port holds one transfer; 120 s at most).
STALLED = r"""
import resource, selectors, socket, sys, time
addresses, each = sys.argv[1].split(","), int(sys.argv[2])
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
watch = selectors.DefaultSelector()
ports = []
for address in addresses:
    for _ in range(each):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((address, 0))
        s.setblocking(False)
        watch.register(s, selectors.EVENT_READ)
        ports.append(s)
request = b"\x00\x01undionly.kpxe\x00octet\x00"
print("asking", flush=True)
end = time.monotonic() + 120
while time.monotonic() < end:
    for s in ports:
        s.sendto(request, ("10.66.0.1", 69))
    asked = time.monotonic()
    while (left := asked + 0.5 - time.monotonic()) > 0:
        for key, _ in watch.select(left):
            try:
                key.fileobj.recv(2048)  # DATA or a refusal, read and dropped
            except OSError:
                pass
"""


def add_addresses(host: Host, addresses: list[str]) -> None:
    batch = "".join(f"addr add {address}/32 dev d0\n" for address in addresses)
    subprocess.run(host.ns.cmd("ip", "-batch", "-"), input=batch, text=True, check=True,
                   capture_output=True)  # fmt: skip


@contextlib.contextmanager
def attacking(host: Host, script: str, ready: bytes, *args: str) -> Iterator[None]:
    """The script running in the namespace once it says `ready`; killed at the end."""
    attacker = host.ns.popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE)
    try:
        assert attacker.stdout.readline() == ready, "the attacker did not start"
        yield
    finally:
        attacker.kill()
        attacker.wait()


def counted(host: Host, subsystem: str, kind: str) -> int:
    code, text = api(host, "/api/v1/stats")
    assert code == 200, f"the stats over the Unix socket: {code} {text[:300]}"
    stats = json.loads(text).get(subsystem, {})
    return stats.get(kind, {}).get("requests", 0)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not in {timeout:.0f} s: {what}"
        time.sleep(0.2)


def descriptors(host: Host) -> int:
    return len(os.listdir(f"/proc/{host.serve.pid}/fd"))  # ip netns exec and prlimit exec


def timed(host: Host, *command: str) -> tuple[str, float]:
    """curl's status (or "000") and its total time, in seconds."""
    result = host.ns.run("curl", "-s", "-o", "/dev/null", "--max-time", "10", "-w",
                         "%{http_code} %{time_total}", *command, check=False)  # fmt: skip
    code, seconds = result.stdout.split()
    return code, float(seconds)


def test_idle_crowd_from_many_addresses_starves_neither_nodes_nor_operators(
    host: Host, tmp_path: Path
) -> None:
    """2 000 idle connections from 200 addresses, refilled as they are closed: each of 20
    boot-script fetches by a node, and each operator's list of nodes over TCP, answered
    within 1 s (they shared one budget of 768 before: 20 of 20 fetches failed)."""
    crowd = [f"10.66.1.{n}" for n in range(1, 201)]
    add_addresses(host, crowd)
    admin = (tmp_path / "state" / "admin.token").read_text().strip()
    with attacking(host, CROWD, b"connected\n", ",".join(crowd), "10", "8080"):
        wait_until(lambda: counted(host, "http", "shed") + counted(host, "http", "refused")
                   > 2000 - PLAN.boot_http, 60, "the crowd filling the boot listener")  # fmt: skip
        took = []
        for _ in range(20):
            code, node = timed(host, "--interface", "10.66.0.12", f"{BASE}/boot/cn002.ipxe")
            assert code == "200" and node < 1.0, f"the node's boot script: {code} in {node} s"
            code, operator = timed(host, "-H", f"Authorization: Bearer {admin}",
                                   f"{TCP_API}/api/v1/nodes")  # fmt: skip
            assert code == "200" and operator < 1.0, f"the operator's list: {code} {operator} s"
            took.append((node, operator))
        shed = counted(host, "http", "shed")
    print(f"\n2000 idle from 200 addresses: node {max(t[0] for t in took) * 1000:.0f} ms, "
          f"operator {max(t[1] for t in took) * 1000:.0f} ms at most; {shed} shed")  # fmt: skip
    assert shed > 0
    log = (tmp_path / "serve.log").read_text()
    full = f"of {PLAN.boot_http} in use, {PLAN.boot_http - PLAN.boot_http_known} from unknown"
    assert log.count(full) >= 1, log[-3000:]
    assert len(log.splitlines()) < 100, log[-3000:]  # not a line per connection


def test_stalled_tftp_crowd_leaves_descriptors_for_reports_and_a_nodes_fetch(
    host: Host, tmp_path: Path
) -> None:
    """1 000 stalled TFTP transfers from 40 addresses: the agent's reports are all
    answered 200, a node's TFTP fetch completes as quickly as without them, and the
    process stays inside its plan (they took 1 023 of 1 024 descriptors before)."""
    crowd = [f"10.66.2.{n}" for n in range(1, 41)]
    add_addresses(host, crowd)
    script = curl(host, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")[1]
    token = re.search(r"layerpy.token=(\S+)", script).group(1)
    fetch = ["curl", "-sS", "--interface", "10.66.0.11", "-o", str(tmp_path / "got"), "-w",
             "%{time_total}", "--max-time", "30", "tftp://10.66.0.1/undionly.kpxe"]  # fmt: skip
    usual = float(host.ns.run(*fetch).stdout)
    before = descriptors(host)
    with attacking(host, STALLED, b"asking\n", ",".join(crowd), "25"):
        held = (PLAN.tftp - PLAN.tftp_known) * 2  # a socket and the file each
        wait_until(lambda: descriptors(host) > before + held * 3 // 4, 60,
                   "the stalled transfers holding their budget")  # fmt: skip
        most = 0
        for seq in range(2, 22):
            code, answer = report(host, token=token, event="heartbeat", seq=seq)
            assert code == 200, f"report {seq}: {code} {answer}"
            most = max(most, descriptors(host))
        wait_until(lambda: counted(host, "tftp", "refused") > 0, 60, "refusals over the budget")
        result = host.ns.run(*fetch, check=False)
        assert result.returncode == 0, f"the node's TFTP fetch: {result.stderr}"
        during = float(result.stdout)
        assert (tmp_path / "got").read_bytes() == (tmp_path / "ipxe" / "undionly.kpxe").read_bytes()
        refused = counted(host, "tftp", "refused")
    print(
        f"\n1000 stalled TFTP from 40 addresses: fetch {usual * 1000:.0f} ms before, "
        f"{during * 1000:.0f} ms during; {most} descriptors at most; {refused} refused"
    )
    assert during < max(1.0, 5 * usual), (usual, during)
    assert most < LIMIT - PLAN.reserve, most
    assert json.loads(api(host, "/api/v1/nodes/cn001")[1])["run_state"] != "lost"
    log = (tmp_path / "serve.log").read_text()
    assert log.count("too many transfers") < 20, log[-3000:]  # a few, then a count
