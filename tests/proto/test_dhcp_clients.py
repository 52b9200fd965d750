"""``layerpy serve`` answering real DHCP clients (busybox udhcpc, ISC dhclient) in namespaces."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from layerpy.client import Client

LAYERPY = Path(sys.executable).parent / "layerpy"
RECORDER = """#!/bin/sh
case "$1$reason" in
  bound|renew|BOUND|RENEW) ip addr replace "${ip:-$new_ip_address}/24" dev "$interface" ;;
esac
echo "$1$reason ${ip:-$new_ip_address} ${subnet:-$new_subnet_mask} ${router:-$new_routers} \
${hostname:-$new_host_name} ${lease:-$new_dhcp_lease_time}" >> {log}
"""

pytestmark = pytest.mark.netns


@pytest.fixture
def served(link, make_config, tmp_path: Path):
    """`layerpy serve` in the server namespace, knowing the client namespace's MAC; returns
    the process. ``again=True`` starts it anew on the same node file and state directory."""
    config = None

    def start(
        client_mac: str | None = None,
        lease_time: int = 3600,
        discover: bool = False,
        again: bool = False,
    ) -> subprocess.Popen:
        nonlocal config
        if not again:
            config = make_config(
                client_mac=client_mac or link.client_mac(),
                interface=link.server_if,
                server="10.77.0.1",
            )
            text = config.path.read_text().replace(
                'pool = "10.77.0.200-10.77.0.250"',
                f'pool = "10.77.0.200-10.77.0.250"\nlease_time = {lease_time}'
                + ("\ndiscover = true" if discover else ""),
            )  # (and a short look for other DHCP servers: none on this pair of namespaces)
            text = text.replace("[server]\n", "[server]\ndhcp_probe = 0.5\n")
            config.path.write_text(text)
        assert config is not None
        path = tmp_path / "serve.log"
        begun = path.stat().st_size if path.exists() else 0  # a second start appends
        log = path.open("ab")
        server = link.server.popen(
            [str(LAYERPY), "serve", "-c", str(config.path), "--debug"], stdout=log, stderr=log
        )
        deadline = time.monotonic() + 30
        while "layerpy.server: serving" not in path.read_bytes()[begun:].decode(errors="replace"):
            assert server.poll() is None, f"serve exited:\n{path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"serve not up in 30 s:\n{path.read_text()[-3000:]}"
            time.sleep(0.1)  # (DHCP starts last: after its look for other servers)
        return server

    return start


def api(tmp_path: Path, path: str) -> Any:
    """The operator API of the server of this test (its socket, in the state directory)."""
    return Client(str(tmp_path / "state" / "api.sock")).call(path)


def udhcpc_once(link, script: Path, tries: str = "3", check: bool = True):
    """busybox udhcpc: one lease (or failure) in the foreground, then exit."""
    command = ["udhcpc", "-i", link.client_if, "-n", "-q", "-f", "-t", tries, "-T", "1"]
    return link.client.run(*command, "-s", str(script), check=check, timeout=30)


def recorder(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "client.log"
    script = tmp_path / "record.sh"
    script.write_text(RECORDER.replace("{log}", str(log)))
    script.chmod(0o755)
    return script, log


def dhclient(link, tmp_path: Path, script: Path, lease_file: Path):
    """ISC dhclient in the foreground, with its own lease database and pid file."""
    command = ["dhclient", "-d", "-4", "-sf", str(script), "-lf", str(lease_file)]
    return link.client.popen([*command, "-pf", str(tmp_path / "dhclient.pid"), link.client_if])


def wait_for(log: Path, text: str, seconds: float = 20) -> str:
    deadline = time.monotonic() + seconds
    while text not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, (
            f"no {text!r}: {log.read_text() if log.exists() else ''}"
        )
        time.sleep(0.2)
    return log.read_text()


def test_udhcpc_gets_its_fixed_address(link, served, tmp_path: Path) -> None:
    served()
    script, log = recorder(tmp_path)
    udhcpc_once(link, script)
    bound = [line.split() for line in log.read_text().splitlines() if line.startswith("bound")]
    assert bound == [["bound", "10.77.0.12", "255.255.255.0", "10.77.0.1", "cn002", "3600"]]
    node = api(tmp_path, "/api/v1/nodes/cn002")
    assert node["mac"] == link.client_mac()
    # a plain OS client is not a network boot: no boot timeline is started by it
    assert node["run_state"] == "unknown"


def test_udhcpc_renews(link, served, tmp_path: Path) -> None:
    served()
    script, log = recorder(tmp_path)
    client = link.client.popen(
        ["udhcpc", "-i", link.client_if, "-f", "-t", "3", "-T", "1", "-s", str(script)]
    )
    deadline = time.monotonic() + 15
    while "bound" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "no lease"
        time.sleep(0.1)
    client.send_signal(signal.SIGUSR1)  # udhcpc: renew the lease now (unicast to the server)
    while "renew" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"no renewal: {log.read_text() if log.exists() else ''}"
        time.sleep(0.2)
    client.terminate()
    events = [line.split()[:2] for line in log.read_text().splitlines()]
    assert ["bound", "10.77.0.12"] in events and ["renew", "10.77.0.12"] in events


def test_dhclient_lease_and_renew(link, served, tmp_path: Path) -> None:
    served(lease_time=4)
    script, log = recorder(tmp_path)
    lease_file = tmp_path / "dhclient.leases"
    client = dhclient(link, tmp_path, script, lease_file)
    wait_for(log, "RENEW")
    client.terminate()
    events = [line.split() for line in log.read_text().splitlines()]
    assert ["BOUND", "10.77.0.12", "255.255.255.0", "10.77.0.1", "cn002", "4"] in events
    assert ["RENEW", "10.77.0.12", "255.255.255.0", "10.77.0.1", "cn002", "4"] in events
    assert "fixed-address 10.77.0.12;" in lease_file.read_text()


def test_init_reboot_with_a_stale_lease_is_nakked_then_bound(link, served, tmp_path: Path) -> None:
    """dhclient remembers 10.77.0.99 (INIT-REBOOT asks for it): NAK, then a fresh DISCOVER."""
    served()
    script, log = recorder(tmp_path)
    lease_file = tmp_path / "dhclient.leases"
    lease_file.write_text(
        f'lease {{\n  interface "{link.client_if}";\n  fixed-address 10.77.0.99;\n'
        "  option subnet-mask 255.255.255.0;\n  option dhcp-server-identifier 10.77.0.1;\n"
        "  renew 4 2037/01/01 00:00:00;\n  rebind 4 2037/01/01 00:00:00;\n"
        "  expire 4 2037/01/01 00:00:00;\n}\n"
    )
    client = dhclient(link, tmp_path, script, lease_file)
    events = wait_for(log, "BOUND")
    client.terminate()
    assert "BOUND 10.77.0.12 " in events
    stats = api(tmp_path, "/api/v1/stats")["dhcp"]
    assert stats["nak"]["requests"] == 1 and stats["ack"]["requests"] == 1
    serve_log = (tmp_path / "serve.log").read_text()
    assert "init-reboot: 10.77.0.99 is not its address, 10.77.0.12 is" in serve_log


def test_a_stranger_leases_from_the_discovery_pool_and_releases(
    link, served, tmp_path: Path
) -> None:
    served(client_mac="52:54:00:aa:bb:cc", discover=True)
    mac = link.client_mac()
    script, log = recorder(tmp_path)
    client = link.client.popen(
        ["udhcpc", "-i", link.client_if, "-f", "-t", "3", "-T", "1", "-s", str(script)]
    )
    assert "bound 10.77.0.200 255.255.255.0 10.77.0.1" in wait_for(log, "bound")

    def discovery_script() -> str:  # only for the pool address it holds: 403 from here
        url = f"http://10.77.0.1:8080/boot/discover/{mac}.ipxe"
        return link.server.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", url).stdout

    assert discovery_script() == "403"
    client.send_signal(signal.SIGUSR2)  # udhcpc: release the lease
    deadline = time.monotonic() + 10
    while discovery_script() != "404":
        assert time.monotonic() < deadline, "the released lease is still held"
        time.sleep(0.2)
    client.terminate()
    assert api(tmp_path, "/api/v1/stats")["dhcp"]["release"]["requests"] == 1


def test_unknown_mac_gets_nothing_and_is_listed(link, served, tmp_path: Path) -> None:
    served(client_mac="52:54:00:aa:bb:cc")
    script, log = recorder(tmp_path)
    result = udhcpc_once(link, script, tries="2", check=False)
    assert result.returncode != 0
    assert "bound" not in (log.read_text() if log.exists() else "")
    unknown = api(tmp_path, "/api/v1/unknown")
    assert [m["mac"] for m in unknown] == [link.client_mac()]
    assert unknown[0]["requests"] >= 2


def test_garbage_is_counted_and_service_goes_on(link, served, tmp_path: Path) -> None:
    served()
    sender = (
        "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1);"
        "[s.sendto(p, ('10.77.0.1', 67)) for p in (b'', b'x' * 10, b'\\x01' * 300, b'\\x01\\x01\\x06' + b'\\0' * 233 + b'\\x63\\x82\\x53\\x63\\x35\\xff')]"
    )
    link.client.run("ip", "addr", "add", "10.77.0.99/24", "dev", link.client_if)
    link.client.run(sys.executable, "-c", sender)
    link.client.run("ip", "addr", "del", "10.77.0.99/24", "dev", link.client_if)
    time.sleep(0.5)
    stats = api(tmp_path, "/api/v1/stats")
    assert stats["dhcp"]["malformed"]["failures"] == 4
    script, log = recorder(tmp_path)
    udhcpc_once(link, script)
    assert "bound 10.77.0.12" in log.read_text()


# DHCPINFORMs at 300/s from made-up MACs, each claiming a made-up address of the subnet:
# an answer to one would wait for ARP from an address nobody has.
INFORMS = r"""
import os, random, socket, struct, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, sys.argv[1].encode())
end = time.monotonic() + float(sys.argv[2])
sent = 0
while time.monotonic() < end:
    ciaddr = bytes([10, 77, 0, random.randint(2, 199)])
    head = struct.pack("!BBBBIHH4s4s4s4s16s", 1, 1, 6, 0, random.getrandbits(32), 0, 0,
                       ciaddr, bytes(4), bytes(4), bytes(4), os.urandom(6) + bytes(10))
    s.sendto(head + bytes(192) + b"\x63\x82\x53\x63\x35\x01\x08\xff", ("255.255.255.255", 67))
    sent += 1
    time.sleep(max(0.0, sent / 300 - (time.monotonic() - end + float(sys.argv[2]))))
print(sent)
"""


def test_an_inform_flood_does_not_silence_dhcp(link, served, tmp_path: Path) -> None:
    served(discover=True)  # strangers get pool grants: INFORMs from them used to be answered
    flood = link.client.popen([sys.executable, "-c", INFORMS, link.client_if, "15"],
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        script, log = recorder(tmp_path)
        deadline = time.monotonic() + 10
        while (
            api(tmp_path, "/api/v1/stats").get("dhcp", {}).get("inform", {}).get("requests", 0)
            < 300
        ):  # the flood is on
            assert time.monotonic() < deadline, "no INFORM flood"
            time.sleep(0.2)
        begun = time.monotonic()
        udhcpc_once(link, script, tries="10")
        took = time.monotonic() - begun
        assert flood.poll() is None, "the flood ended before the lease: the test proves nothing"
        print(f"\nleased in {took:.1f} s during a 300/s INFORM flood")
        assert "bound 10.77.0.12" in log.read_text()
    finally:
        flood.wait(30)
    stats = api(tmp_path, "/api/v1/stats")["dhcp"]
    assert stats["inform"]["requests"] >= 1000 and stats["silent"]["requests"] >= 1000


# One DISCOVER from a made-up MAC; prints the address offered.
DISCOVER_ONCE = r"""
import os, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, sys.argv[1].encode())
s.bind(("0.0.0.0", 68))
xid = int.from_bytes(os.urandom(4))
chaddr = bytes.fromhex(sys.argv[2].replace(":", ""))
head = struct.pack("!BBBBIHH4s4s4s4s16s", 1, 1, 6, 0, xid, 0, 0x8000, bytes(4), bytes(4),
                   bytes(4), bytes(4), chaddr + bytes(10))
s.sendto(head + bytes(192) + b"\x63\x82\x53\x63\x35\x01\x01\xff", ("255.255.255.255", 67))
s.settimeout(10)
while True:
    reply = s.recv(2048)
    if reply[4:8] == xid.to_bytes(4):
        print(socket.inet_ntoa(reply[16:20]))
        break
"""


def test_a_pool_lease_survives_kill_9(link, served, tmp_path: Path) -> None:
    """A discovery lease is journalled before its ACK: after kill -9 and a restart the
    server gives its address to nobody else, and the client keeps it."""
    server = served(client_mac="52:54:00:aa:bb:cc", discover=True)  # this client: a stranger
    script, log = recorder(tmp_path)
    udhcpc_once(link, script)
    assert "bound 10.77.0.200" in log.read_text()
    server.kill()  # SIGKILL: nothing is flushed or closed
    server.wait(10)
    served(again=True)
    offered = link.client.run(sys.executable, "-c", DISCOVER_ONCE, link.client_if,
                              "52:54:00:dd:00:01").stdout.strip()  # fmt: skip
    assert offered == "10.77.0.201"  # .200 is still held, by the first client
    log.write_text("")
    udhcpc_once(link, script)
    assert "bound 10.77.0.200" in log.read_text()
    assert "restored 1 discovery pool leases" in (tmp_path / "serve.log").read_text()


@pytest.fixture
def site_dhcp(link, tmp_path: Path):
    """dnsmasq as the site's DHCP server, in the client namespace at 10.77.0.2."""
    link.client.run("ip", "addr", "add", "10.77.0.2/24", "dev", link.client_if)
    command = ["dnsmasq", "--no-daemon", "--conf-file=/dev/null", "--port=0",
               f"--interface={link.client_if}", "--bind-interfaces", "--log-dhcp",
               "--dhcp-range=10.77.0.100,10.77.0.150,255.255.255.0,1h",
               f"--dhcp-leasefile={tmp_path / 'dnsmasq.leases'}", "--pid-file="]  # fmt: skip
    with (tmp_path / "dnsmasq.log").open("wb") as out:
        process = link.client.popen(command, stdout=out, stderr=out)
    try:
        wait_for(tmp_path / "dnsmasq.log", "DHCP, IP range")
        yield process
    finally:
        process.terminate()
        process.wait(10)


def test_an_authoritative_server_refuses_to_start_beside_another(
    link, make_config, site_dhcp, tmp_path: Path
) -> None:
    config = make_config(client_mac=link.client_mac(), interface=link.server_if,
                         server="10.77.0.1")  # fmt: skip
    command = [str(LAYERPY), "serve", "-c", str(config.path)]
    refused = link.server.run(*command, check=False, timeout=60)
    assert refused.returncode == 1
    assert (
        f"layerpy serve: another DHCP server answers on {link.server_if}: 10.77.0.2; two "
        'servers would hand out conflicting addresses. Stop it, set [server] dhcp = "proxy" '
        'to boot nodes beside it, or set [server] other_dhcp = "expected" in the node file '
        "if it is meant to be"
    ) in refused.stderr
    text = config.path.read_text().replace("[server]\n", '[server]\nother_dhcp = "expected"\n')
    config.path.write_text(text)
    log = tmp_path / "expected.log"
    with log.open("wb") as out:
        server = link.server.popen(command, stdout=out, stderr=out)
    try:
        wait_for(log, "listening on")
        assert f"another DHCP server answers on {link.server_if}: 10.77.0.2" in log.read_text()
    finally:
        server.terminate()
        server.wait(20)
