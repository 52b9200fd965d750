"""The lab's location topologies with real peers, each in namespaces the test creates.

LLDP: vm-lab/switch.py sends on one end of a veth, layerpy.agent.lldp listens on the other.
Option 82: vm-lab/relay.py puts "VM ports" (veths named like lab taps, the far end in a
client namespace) behind Debian's dhcrelay; busybox udhcpc asks for a lease from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from ipaddress import IPv4Address
from pathlib import Path

import pytest

from layerpy.proto import dhcp
from layerpy.proto.lldp import LLDP_MULTICAST

from netns import Netns

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vm-lab"))

from lab import Lab, wait_file
from relay import start_relay
from switch import start_switch

pytestmark = pytest.mark.netns

VM_LAB = Path(__file__).resolve().parents[2] / "vm-lab"
CHASSIS = "02:00:00:00:0a:01"
LISTEN = """
import json, sys, time
from dataclasses import asdict
from layerpy.agent.lldp import listen
ignored = []
start = time.monotonic()
neighbor = listen(sys.argv[1], float(sys.argv[2]), ignored)
print(json.dumps({"neighbor": neighbor and asdict(neighbor), "ignored": ignored,
                  "elapsed": time.monotonic() - start}))
"""
SEND_FOREVER = """
import socket, sys, time
frames = [bytes.fromhex(text) for text in sys.argv[2:]]
with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as sock:
    while True:
        for frame in frames:
            sock.sendto(frame, (sys.argv[1], 0))
        time.sleep(0.05)
"""
RECORDER = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"br0")
sock.bind(("10.99.0.1", 67))
print("listening", flush=True)
with open(sys.argv[1], "a") as out:
    while True:
        data, (source, _) = sock.recvfrom(4096)
        print(source, data.hex(), file=out, flush=True)
"""
LEASE_SCRIPT = """#!/bin/sh
case "$1" in bound) ip addr add "$ip/24" dev "$interface"; echo "$ip $router" > {out} ;; esac
"""


def listen(ns: Netns, ifname: str, timeout: float) -> dict:
    return json.loads(ns.run(sys.executable, "-c", LISTEN, ifname, str(timeout)).stdout)


@pytest.fixture(autouse=True)
def root() -> None:
    if os.geteuid():
        pytest.fail("protocol tests need root (run them through tests/run.sh)")


@pytest.fixture
def ports():
    """A "switch" namespace with ports p1 and p2, each a veth to a node namespace's eth0."""
    switch, nodes = Netns("lps"), [Netns("lpn"), Netns("lpn")]
    try:
        for number, node in enumerate(nodes, 1):
            switch.run("ip", "link", "add", f"p{number}", "type", "veth", "peer", "name", "eth0")
            switch.run("ip", "link", "set", "eth0", "netns", node.name)
            switch.run("ip", "link", "set", f"p{number}", "up")
            node.run("ip", "link", "set", "eth0", "up")
        yield switch, nodes
    finally:
        for ns in (switch, *nodes):
            ns.close()


def test_each_port_hears_its_own_port_id_within_the_interval(ports) -> None:
    switch, nodes = ports
    switch.popen(
        [sys.executable, str(VM_LAB / "switch.py"), "--interval", "1", "p1=swp1", "p2=swp2"]
    )
    for number, node in enumerate(nodes, 1):
        heard = listen(node, "eth0", 5)
        assert heard["elapsed"] < 1.5
        assert heard["ignored"] == []
        assert heard["neighbor"] == {
            "chassis_id": CHASSIS,
            "chassis_subtype": 4,
            "port_id": f"swp{number}",
            "port_subtype": 5,
            "ttl": 4,
            "system_name": "sw1",
            "port_description": f"sw1 swp{number}",
            "system_description": None,
            "other_tlvs": [],
        }


def test_garbage_is_ignored_and_counted(ports) -> None:
    switch, (node, _) = ports
    lldp_header = LLDP_MULTICAST[0] + bytes.fromhex("020000000a99") + b"\x88\xcc"
    garbage = [
        lldp_header + b"\x02\x07\x04\x02",  # chassis id cut short
        lldp_header + b"\x04\x03\x05p1\x02\x03\x07sw\x06\x02\x00\x1e",  # port id first
        bytes.fromhex("525400990011") + lldp_header[6:] + b"\x02\x03\x07sw",  # unicast
    ]
    switch.popen([sys.executable, "-c", SEND_FOREVER, "p1", *(f.hex() for f in garbage)])
    heard = listen(node, "eth0", 1.5)
    assert heard["neighbor"] is None
    assert len(heard["ignored"]) >= 10
    assert set(heard["ignored"]) == {
        "TLV type 1 at offset 0: length 7 runs past the end (2 bytes left)",
        "must start with chassis id, port id, ttl [1, 2, 3]; found [2, 1, 3]",
        "destination 52:54:00:99:00:11 is not an LLDP multicast address",
    }
    switch.popen([sys.executable, str(VM_LAB / "switch.py"), "--interval", "1", "p1=swp1"])
    heard = listen(node, "eth0", 5)
    assert heard["neighbor"]["port_id"] == "swp1"


def lab_with_ports(run_dir: Path, taps: list[str]) -> tuple[Lab, list[Netns]]:
    """A lab without VMs, and a client namespace behind each of `taps` (its eth0)."""
    lab = Lab(run_dir, ra=False)
    clients: list[Netns] = []
    try:
        for tap in taps:
            clients.append(Netns("lpc"))
            link = ["ip", "link", "add", tap, "type", "veth", "peer", "name", "eth0"]
            lab.run([*link, "netns", clients[-1].name])
            clients[-1].run("ip", "link", "set", "eth0", "up")
    except BaseException:
        close(lab, clients)
        raise
    return lab, clients


def close(lab: Lab, clients: list[Netns]) -> None:
    for client in clients:
        client.close()
    lab.close()


def udhcpc(client: Netns, script: Path | str) -> subprocess.Popen[bytes]:
    """busybox udhcpc: two DISCOVERs a second apart, then give up (or take the lease)."""
    cmd = ["udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t", "2", "-T", "1", "-s", str(script)]
    return client.popen(cmd)


def test_relay_adds_circuit_id_of_each_port(tmp_path: Path) -> None:
    lab, clients = lab_with_ports(tmp_path / "lab", ["tap-c1", "tap-c2"])
    try:
        record = tmp_path / "relayed.hex"
        lab.popen([sys.executable, "-c", RECORDER, str(record)], log=tmp_path / "recorder.log")
        assert wait_file(tmp_path / "recorder.log", "listening", 10)
        relay = start_relay(lab, {"tap-c1": "swp1", "tap-c2": "swp2", "tap-late": "swp3"})
        # a tap that did not exist yet (its VM not added) was made, on its port's bridge
        assert "master pb-swp3" in lab.run(["ip", "link", "show", "tap-late"]).stdout
        for proc in [udhcpc(client, "/bin/true") for client in clients]:
            proc.wait(timeout=20)
        lines = [line.split() for line in record.read_text().splitlines()]
        packets = [dhcp.decode(bytes.fromhex(data)) for _, data in lines]
        # dhcrelay sends from its giaddr: the default of [switches] relay_sources (issue 26)
        assert {source for source, _ in lines} == {"10.99.0.254"}
        for number, client in enumerate(clients, 1):
            mac = client.run("cat", "/sys/class/net/eth0/address").stdout.strip()
            mine = [packet for packet in packets if packet.mac == mac]
            assert len(mine) == 2, "each DISCOVER relayed once, from its own port only"
            for packet in mine:
                assert packet.message_type == dhcp.DISCOVER
                assert packet.giaddr == IPv4Address("10.99.0.254")
                assert packet.hops == 1
                # sub-option 1 (agent circuit id) = the port's interface name, no remote id
                assert packet.options[82] == b"\x01\x04" + f"swp{number}".encode()
        assert len(packets) == 4, "no DISCOVER reaches br0 other than through the relay"
    finally:
        close(lab, clients)
    assert relay.poll() is not None, "dhcrelay ends with the lab"


def test_node_behind_relay_gets_a_lease_then_reaches_the_server(tmp_path: Path) -> None:
    lab, (client,) = lab_with_ports(tmp_path / "lab", ["tap-c1"])
    try:
        conf = tmp_path / "udhcpd.conf"
        conf.write_text(
            f"interface br0\nstart 10.99.0.11\nend 10.99.0.11\n"
            f"lease_file {tmp_path / 'leases'}\npidfile {tmp_path / 'udhcpd.pid'}\n"
            "opt subnet 255.255.255.0\nopt router 10.99.0.1\n"
        )
        (tmp_path / "leases").touch()
        lab.popen(["busybox", "udhcpd", "-f", "-a", "0", str(conf)], log=tmp_path / "udhcpd.log")
        start_relay(lab, {"tap-c1": "swp1"})
        start_switch(lab, {"tap-c1": "swp1"}, interval=1)
        script = tmp_path / "lease.sh"
        script.write_text(LEASE_SCRIPT.replace("{out}", str(tmp_path / "lease")))
        script.chmod(0o755)
        assert udhcpc(client, script).wait(timeout=20) == 0
        assert (tmp_path / "lease").read_text().split() == ["10.99.0.11", "10.99.0.1"]
        # the node's own address on the server's subnet, and the server on-link for it
        assert client.run("busybox", "ping", "-c", "1", "-W", "2", "10.99.0.1").returncode == 0
        assert lab.run(["busybox", "ping", "-c", "1", "-W", "2", "10.99.0.11"]).returncode == 0
        # LLDP from the lab's switch reaches the node through its port as well
        assert listen(client, "eth0", 5)["neighbor"]["port_id"] == "swp1"
    finally:
        close(lab, [client])


def test_layerpy_behind_dhcrelay_binds_and_replaces_by_port(make_config, tmp_path: Path) -> None:
    """The relay's own datagrams (Debian's dhcrelay, sending from its giaddr) still name a
    node by its port now that a relay is who sent the packet (issue 26): a machine on swp1
    becomes cn003 and gets its address; another MAC on the same port replaces it."""
    config = make_config(
        more='\n[switches.sw1]\nrelay = "10.99.0.254"\n\n[nodes.cn003]\nip = "10.99.0.13"\n'
        'location = "sw1:swp1"\n'
    )
    config.path.write_text(
        config.path.read_text().replace("[server]\n", "[server]\ndhcp_probe = 0\n")
    )
    lab, (client,) = lab_with_ports(tmp_path / "lab", ["tap-c1"])
    try:
        serve_log = tmp_path / "serve.log"
        layerpy = str(Path(sys.executable).parent / "layerpy")
        lab.popen([layerpy, "serve", "-c", str(config.path)], log=serve_log)
        assert wait_file(serve_log, "layerpy.server: serving", 30), serve_log.read_text()
        start_relay(lab, {"tap-c1": "swp1"})
        script = tmp_path / "lease.sh"
        script.write_text(LEASE_SCRIPT.replace("{out}", str(tmp_path / "lease")))
        script.chmod(0o755)

        def api(path: str):
            socket = str(tmp_path / "state" / "api.sock")
            answer = lab.run(["curl", "-s", "--unix-socket", socket, f"http://layerpy{path}"])
            return json.loads(answer.stdout)

        macs = []
        for mac in ("52:54:00:aa:00:01", "52:54:00:aa:00:02"):
            client.run("ip", "link", "set", "eth0", "address", mac)
            client.run("ip", "addr", "flush", "dev", "eth0")
            assert udhcpc(client, script).wait(timeout=20) == 0
            assert (tmp_path / "lease").read_text().split()[0] == "10.99.0.13"
            assert api("/api/v1/nodes/cn003")["mac"] == mac
            macs.append(mac)
        events = {e["kind"]: e["message"] for e in api("/api/v1/events")}
        assert events["bound"] == f"{macs[0]} is cn003 by its location sw1:swp1 (dhcp-option-82)"
        assert events["replaced"] == (
            f"hardware replaced at sw1:swp1 (dhcp-option-82): {macs[0]} -> {macs[1]}"
        )
        assert api("/api/v1/nodes/cn003/explain")["binding"]["previous"] == macs[0]
    finally:
        close(lab, [client])
