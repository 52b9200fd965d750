"""The boot network as an attacker sees it (issue 26): forged relayed DHCP, and floods of
forged datagrams at every datagram service, from a client namespace with real sockets.

The server runs in one namespace; the client namespace holds the relay's address
(10.77.0.254, the giaddr of [switches.sw1]), an attacker's (10.77.0.99) and a machine's
(10.77.0.14), and sends from any other address of the subnet too (IP_FREEBIND): what a
host on a flat segment can do.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from ipaddress import IPv4Address
from pathlib import Path

import pytest
from test_live import wait_for

from layerpy.proto import dhcp
from layerpy.proto.agent import FILES_PATH, PROTOCOL

from dhcp_requests import BIOS, IPXE, request

LAYERPY = Path(sys.executable).parent / "layerpy"
SERVER, RELAY, ATTACKER, MACHINE = "10.77.0.1", "10.77.0.254", "10.77.0.99", "10.77.0.14"
BASE = f"http://{SERVER}:8080"
SWITCH = f'\n[switches.sw1]\nrelay = "{RELAY}"\n'
CN003 = '\n[nodes.cn003]\nip = "10.77.0.13"\nlocation = "sw1:swp3"\n'
CN004 = '\n[nodes.cn004]\nlocation = "sw1:swp4"\n'
OLD, FORGED, NEW = "52:54:00:aa:00:01", "52:54:00:66:66:66", "52:54:00:aa:00:02"
SECRET = "munge-secret-of-cn004"
CN004_SECRET = '\n[files."/etc/munge/munge.key"]\nsecret = "munge.key"\nnodes = "cn004"\n'

pytestmark = pytest.mark.netns

# Sends each [source, source port, destination, destination port, hex payload] from its
# source address, local or not (IP_FREEBIND and IP_TRANSPARENT: as root), one socket per datagram, a little paced so
# that the server's socket buffer is not what is measured.
SENDER = r"""
import json, socket, sys, time
IP_FREEBIND, IP_TRANSPARENT = 15, 19
for source, sport, dest, dport, payload in json.load(sys.stdin):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
        sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.bind((source, sport))
        sock.sendto(bytes.fromhex(payload), (dest, dport))
    time.sleep(0.0003)
"""

Datagram = tuple[str, int, str, int, bytes]


class Served:
    """`layerpy serve` in the server namespace of `link`; the client namespace sends."""

    def __init__(self, link, tmp_path: Path) -> None:
        self.link, self.tmp_path = link, tmp_path
        self.log = tmp_path / "serve.log"

    def api(self, path: str, *args: str) -> tuple[int, str]:
        command = ["curl", "-s", "-g", "--unix-socket", str(self.tmp_path / "state" / "api.sock")]
        result = self.link.server.run(*command, "-w", "\n%{http_code}", *args,
                                      f"http://layerpy{path}", check=False)  # fmt: skip
        body, _, code = result.stdout.rpartition("\n")
        return int(code or 0), body

    def json(self, path: str):
        code, body = self.api(path)
        assert code == 200, (path, code, body)
        return json.loads(body)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a /metrics family's samples that carry these labels."""
        text = self.api("/metrics")[1]
        total = 0.0
        for line in text.splitlines():
            match = re.match(rf"{name}(\{{.*\}})? (\S+)$", line)
            if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
                total += float(match.group(2))
        return total

    def send(self, datagrams: list[Datagram]) -> None:
        rows = [[s, sp, d, dp, payload.hex()] for s, sp, d, dp, payload in datagrams]
        subprocess.run(self.link.client.cmd(sys.executable, "-c", SENDER), input=json.dumps(rows),
                       text=True, check=True, timeout=300)  # fmt: skip

    def curl(self, source: str, *args: str) -> tuple[int, str]:
        result = self.link.client.run("curl", "-s", "--interface", source, "-w", "\n%{http_code}",
                                      *args, check=False)  # fmt: skip
        body, _, code = result.stdout.rpartition("\n")
        return int(code or 0), body

    def events(self, kind: str) -> list[str]:
        return [e["message"] for e in self.json("/api/v1/events") if e["kind"] == kind]

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


@pytest.fixture
def serve(link, make_config, tmp_path: Path) -> Iterator[Callable[..., Served]]:
    """Start `layerpy serve` with the test node file plus `more`, in `mode`."""
    for address in (RELAY, ATTACKER, MACHINE):
        link.client.run("ip", "addr", "add", f"{address}/24", "dev", link.client_if)

    def start(more: str = "", *, proxy: bool = False, server: str = "") -> Served:
        config = make_config(interface=link.server_if, server=SERVER)
        text = config.path.read_text() + more
        text = text.replace("[server]\n", f"[server]\ndhcp_probe = 0\n{server}")
        if proxy:
            text = text.replace('pool = "10.77.0.200-10.77.0.250"\n', "")
            text = text.replace('ip = "10.77.0.[11-12]"\n', "")
            text = text.replace("[server]\n", '[server]\ndhcp = "proxy"\n')
        else:
            text = text.replace('pool = "', 'discover = true\npool = "')
        config.path.write_text(text)
        served = Served(link, tmp_path)
        with served.log.open("ab") as out:
            process = link.server.popen([str(LAYERPY), "serve", "-c", str(config.path)],
                                        stdout=out, stderr=out)  # fmt: skip
        wait_for(lambda: "layerpy.server: serving" in served.log.read_text()
                 or process.poll() is not None, 30, "the server to serve")  # fmt: skip
        assert process.poll() is None, served.log.read_text()[-3000:]
        return served

    yield start


def relayed(mac: str, port: str, *, message: int = dhcp.DISCOVER, **firmware: bytes) -> bytes:
    """A DHCP message as dhcrelay forwards it: giaddr the relay, circuit id the port."""
    circuit = port.encode()
    options = {"o82": bytes([1, len(circuit)]) + circuit, **(firmware or BIOS)}
    return dhcp.encode(request(message, mac, giaddr=IPv4Address(RELAY), **options))


def test_a_forged_relay_takes_no_node_and_the_relay_still_does(serve) -> None:
    """Issue 26: DISCOVERs with giaddr = the relay and the circuit of cn003's port, sent
    by a host that is not the relay, bind nothing, lease nothing and are counted; the
    same from the relay's address binds cn003, and later replaces its hardware, which
    shows as an event, on the node (explain) and as one log line with the node's name."""
    host = serve(SWITCH + CN003)
    forged = [(ATTACKER, 67, SERVER, 67, relayed(FORGED, "swp3"))]
    host.send(forged)
    host.send([(RELAY, 67, SERVER, 67, relayed(OLD, "swp3"))])
    wait_for(lambda: host.json("/api/v1/nodes/cn003")["mac"] == OLD, 20, "cn003 bound by the relay")
    host.send(forged)  # cn003 has a machine now (not alive): the forgery would replace it
    host.send([(RELAY, 67, SERVER, 67, relayed(NEW, "swp3"))])
    wait_for(lambda: host.events("replaced"), 20, "the relay's new hardware to replace cn003's")
    assert host.events("bound") == [f"{OLD} is cn003 by its location sw1:swp3 (dhcp-option-82)"]
    assert host.events("replaced") == [
        f"hardware replaced at sw1:swp3 (dhcp-option-82): {OLD} -> {NEW}"
    ]
    assert host.metric("layerpy_dhcp_outcomes_total", outcome="untrusted-relay") == 2
    assert FORGED not in json.dumps(host.json("/api/v1/unknown"))  # not even seen
    assert FORGED not in json.dumps(host.json("/api/v1/nodes"))
    explained = host.json("/api/v1/nodes/cn003/explain")
    assert (explained["binding"]["mac"], explained["binding"]["previous"]) == (NEW, OLD)
    replaced = [line for line in host.lines() if "hardware replaced" in line]
    assert len(replaced) == 1 and replaced[0].endswith(f"cn003: {host.events('replaced')[0]}")
    assert any(f"dropped a relayed discover from {ATTACKER}" in line for line in host.lines())


def test_under_rebind_confirm_new_hardware_waits_for_layerpy_bind(serve, tmp_path) -> None:
    host = serve(SWITCH + CN003, server='rebind = "confirm"\n')
    host.send([(RELAY, 67, SERVER, 67, relayed(OLD, "swp3"))])
    wait_for(lambda: host.json("/api/v1/nodes/cn003")["mac"] == OLD, 20, "cn003 bound")
    host.send([(RELAY, 67, SERVER, 67, relayed(NEW, "swp3"))])
    wait_for(lambda: host.events("rebind"), 20, "the new machine to wait for an operator")
    node = host.json("/api/v1/nodes/cn003")
    assert node["mac"] == OLD and node["rebind_pending"]["mac"] == NEW
    assert f"`layerpy bind cn003 {NEW}`" in host.events("rebind")[0]
    bind = [str(LAYERPY), "bind", "-c", str(tmp_path / "nodes.toml"), "cn003", NEW]
    host.link.server.run(*bind)
    explained = host.json("/api/v1/nodes/cn003/explain")
    assert explained["rebind_pending"] is None and explained["binding"]["mac"] == NEW
    assert host.events("replaced") == [f"hardware replaced by uid 0 (root): {OLD} -> {NEW}"]


def test_a_forged_relay_gets_no_boot_script_token_or_file_in_proxy_mode(serve, tmp_path) -> None:
    """Issue 26: in proxy mode a forged DISCOVER for cn004's port, then a REQUEST on port
    4011 from the attacker's address, got cn004's boot script, its token and its secret
    files. Now nothing: the script stays refused. The same DISCOVER from the relay, then
    the machine's own REQUEST on 4011, still boots cn004 there."""
    (tmp_path / "munge.key").write_text(SECRET)
    (tmp_path / "munge.key").chmod(0o600)
    host = serve(SWITCH + CN004 + CN004_SECRET, proxy=True)

    def boot_request(mac: str, address: str) -> bytes:
        server_id = IPv4Address(SERVER).packed
        return dhcp.encode(
            request(dhcp.REQUEST, mac, ciaddr=IPv4Address(address), o54=server_id, **IPXE)
        )

    for port in (67, 4011):
        host.send([(ATTACKER, 68, SERVER, port, relayed(FORGED, "swp4", **IPXE))])
    host.send([(ATTACKER, 68, SERVER, 4011, boot_request(FORGED, ATTACKER))])
    wait_for(lambda: host.metric("layerpy_dhcp_requests_total") >= 3, 20, "three requests")
    code, script = host.curl(ATTACKER, f"{BASE}/boot/cn004.ipxe")
    assert code == 403 and "token" not in script, script
    assert host.metric("layerpy_dhcp_outcomes_total", outcome="untrusted-relay") == 2
    node = host.json("/api/v1/nodes/cn004")
    assert node["mac"] is None and node["ip"] is None

    host.send([(RELAY, 67, SERVER, 67, relayed(NEW, "swp4", **IPXE))])
    wait_for(lambda: host.json("/api/v1/nodes/cn004")["mac"] == NEW, 20, "cn004 bound by the relay")
    host.send([(MACHINE, 68, SERVER, 4011, boot_request(NEW, MACHINE))])
    wait_for(lambda: host.json("/api/v1/nodes/cn004")["ip"] == MACHINE, 20, "cn004's address")
    code, script = host.curl(MACHINE, f"{BASE}/boot/cn004.ipxe")
    assert code == 200 and "layerpy.token=" in script
    assert host.curl(ATTACKER, f"{BASE}/boot/cn004.ipxe")[0] == 403
    # the secret goes to cn004's machine, by its token, and to nobody else
    token = re.search(r"layerpy\.token=(\S+)", script).group(1)
    hello = {"node": "cn004", "token": token, "mac": NEW, "ip": MACHINE, "boot_id": "b1",
             "seq": 1, "event": "hello", "busy": False, "protocol": PROTOCOL}  # fmt: skip
    code, answer = host.curl(MACHINE, "-X", "POST", "-H", "Content-Type: application/json",
                             "--data", json.dumps(hello), f"{BASE}/api/v1/agent/report")  # fmt: skip
    assert code == 200, answer
    (secret,) = json.loads(answer)["files"]["files"]
    url = f"{BASE}{FILES_PATH}{secret['digest']}"
    assert host.curl(MACHINE, "-H", f"Authorization: Layerpy-Node cn004 {token}", url) == (
        200,
        SECRET,
    )
    for header in ([], ["-H", "Authorization: Layerpy-Node cn004 forged"]):
        code, body = host.curl(ATTACKER, *header, url)
        assert code == 403 and SECRET not in body


# -- floods: the log stays a few lines per kind, the counters say the rest ---------------

FLOOD = 3000  # datagrams per service
LOG_BOUND = 60  # lines the server may write for a whole flood (kinds x BURST and a few)


def anywhere(rng: random.Random) -> str:
    """A source address anywhere in the boot network's subnet but the server's."""
    return f"10.77.0.{rng.randrange(2, 255)}"


def any_mac(rng: random.Random) -> str:
    return "52:54:00:" + ":".join(f"{rng.randrange(256):02x}" for _ in range(3))


def forged_dhcp(rng: random.Random, ports: tuple[int, ...]) -> list[Datagram]:
    """Many kinds of made-up DHCP, each from a random address, MAC and port of ours."""
    known, known_ip = "52:54:00:99:00:11", IPv4Address("10.77.0.11")
    server_id = IPv4Address(SERVER).packed

    def one(i: int) -> bytes:
        mac, address = any_mac(rng), IPv4Address(anywhere(rng))
        kinds = [
            lambda: dhcp.encode(request(dhcp.INFORM, known, ciaddr=address, **IPXE)),
            lambda: dhcp.encode(request(dhcp.DISCOVER, mac, **BIOS)),
            lambda: relayed(mac, f"swp{rng.randrange(64)}"),
            lambda: dhcp.encode(request(dhcp.REQUEST, known, o50=address.packed, **IPXE)),
            lambda: dhcp.encode(request(dhcp.REQUEST, mac, ciaddr=address, o54=server_id, **IPXE)),
            lambda: dhcp.encode(request(dhcp.DECLINE, known, o50=address.packed, o54=server_id)),
            lambda: dhcp.encode(request(dhcp.RELEASE, known, ciaddr=address, o54=server_id)),
            lambda: dhcp.encode(request(dhcp.DISCOVER, mac, **{"o93": b"\x00\x63", **IPXE})),
            lambda: rng.randbytes(rng.randrange(1, 600)),
            lambda: dhcp.encode(request(dhcp.REQUEST, known, ciaddr=known_ip, **IPXE))[:200],
        ]
        return kinds[i % len(kinds)]()

    return [(anywhere(rng), rng.choice((67, 68, 1000 + i % 50)), SERVER, rng.choice(ports), one(i))
            for i in range(FLOOD)]  # fmt: skip


def forged_tftp(rng: random.Random) -> list[Datagram]:
    def one(i: int) -> bytes:
        name = f"missing-{rng.randrange(10**9)}.efi".encode()
        kinds = [
            lambda: b"\x00\x01" + name + b"\0octet\0",  # no such file
            lambda: b"\x00\x02" + name + b"\0octet\0",  # a write
            lambda: b"\x00\x01../../etc/" + name + b"\0octet\0",  # outside the root
            lambda: b"\x00\x01undionly.kpxe\0morse\0",  # a mode nobody knows
            lambda: b"\x00\x04" + rng.randbytes(2),  # a stray ACK
            lambda: b"\x00\x05\x00\x01oops\0",  # an ERROR to the listening port
            lambda: rng.randbytes(rng.randrange(0, 600)),
        ]
        return kinds[i % len(kinds)]()

    return [(anywhere(rng), 1024 + rng.randrange(60000), SERVER, 69, one(i)) for i in range(FLOOD)]


def flooded(host: Served, datagrams: list[Datagram], processed: Callable[[], float]) -> list[str]:
    """The server's log lines while it takes `datagrams` (waiting until it has taken at
    least 95 % of them: the kernel may drop a few on a busy machine)."""
    before = len(host.lines())
    host.send(datagrams)
    wait_for(lambda: processed() >= 0.95 * len(datagrams), 120,
             f"the server to take {len(datagrams)} datagrams")  # fmt: skip
    return host.lines()[before:]


def dhcp_taken(host: Served) -> float:
    return host.metric("layerpy_dhcp_outcomes_total") - host.metric(
        "layerpy_dhcp_outcomes_total", outcome="dropped"
    )


@pytest.mark.parametrize("proxy", [False, True], ids=["authoritative", "proxy"])
def test_a_flood_of_forged_dhcp_is_a_few_lines(serve, proxy: bool) -> None:
    """Issue 26: 26 000 INFORMs with random ciaddr were 25 705 lines. Now thousands of
    made-up datagrams of ten kinds, from random addresses, MACs and ports (port 67, and
    4011 in proxy mode), are a few lines per kind; the rest are counted in /metrics."""
    host = serve(SWITCH + CN003, proxy=proxy)
    ports = (67, 4011) if proxy else (67,)
    lines = flooded(host, forged_dhcp(random.Random(26), ports), lambda: dhcp_taken(host))
    print(f"\n{FLOOD} forged DHCP datagrams ({'proxy' if proxy else 'authoritative'}): "
          f"{len(lines)} log lines")  # fmt: skip
    assert len(lines) < LOG_BOUND, "\n".join(lines[-80:])
    assert host.metric("layerpy_log_suppressed_total", subsystem="dhcp") > 0
    assert host.metric("layerpy_dhcp_outcomes_total", outcome="untrusted-relay") > 0
    assert host.json("/api/v1/nodes/cn003")["mac"] is None


def test_a_flood_of_forged_tftp_is_a_few_lines(serve) -> None:
    host = serve()
    taken = lambda: host.metric("layerpy_tftp_rejected_total")  # noqa: E731
    lines = flooded(host, forged_tftp(random.Random(26)), taken)
    print(f"\n{FLOOD} forged TFTP datagrams: {len(lines)} log lines")
    assert len(lines) < LOG_BOUND, "\n".join(lines[-80:])
    assert host.metric("layerpy_log_suppressed_total", subsystem="tftp") > 0
