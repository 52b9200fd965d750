"""The option-82 topology: lab VMs behind a DHCP relay that names the switch port they use.

ISC dhcrelay (Debian's isc-dhcp-relay 4.4.3) runs in a "switch" namespace of its own: it
cannot share the lab namespace, where the server already owns UDP port 67 and would receive
the relayed replies addressed to the relay itself. ``start_relay(lab, {"tap-cn001": "swp1"})``
builds this (names for the defaults: relay address 10.99.0.254, server 10.99.0.1):

    lab namespace                              switch namespace (<lab.netns>-sw)
    br0 10.99.0.1/24 ── sw-uplink ═══ veth ═══ uplink 10.99.0.254/32, proxy ARP
                                                 routes 10.99.0.1/32 dev uplink, default via it
    pb-swp1 (bridge) ── pv-swp1 ══ veth ══════ swp1 10.99.0.254/32 ─┐ isolated ports of
      └ tap-cn001 ─ QEMU cn001                 swp2 ...              ├ bridge sw0 10.99.0.254/24
    pb-swp2 ...                                ra.py sw0             ┘ proxy ARP (+ pvlan)
                                               dhcrelay -a -id swp1 -id swp2 -iu uplink 10.99.0.1

DHCP: a client's broadcast reaches dhcrelay on its port only (isolated ports do not flood
to each other, else dhcrelay would relay it a second time from the port it leaves by). The
relay forwards it to the server with giaddr 10.99.0.254 and option 82 sub-option 1 (circuit
id) = the port's interface name, e.g. ``52 06 01 04 73 77 70 31`` ("swp1"); stock dhcrelay
sends no remote id. The server answers giaddr:67 on br0 (10.99.0.254 is on its subnet and
the switch owns it); dhcrelay picks the port from the circuit id and strips option 82.
A renewal, unicast to 10.99.0.1, is both routed there and relayed (dhcrelay sees every
request on its ports), so the server gets it twice: once plain, once with option 82.

IP after DHCP: nodes keep their addresses in 10.99.0.0/24 and talk to 10.99.0.1 as if on
the same link. sw0 answers a node's ARP for anything outside that node's own port (proxy
ARP, pvlan) and uplink answers the server's ARP for 10.99.0.0/24 addresses (proxy ARP): the
switch routes between them, and finds a node's port by ARPing on sw0. So every VM of the
subnet must sit behind the relay: the switch answers for all of 10.99.0.0/24 on br0.
``ra.py sw0`` spares iPXE its IPv6 wait, as ``ra.py br0`` does on the plain lab.

Lifetime: dhcrelay and ra.py are the lab's tracked processes; once they run, the namespace's
name is deleted, so the namespace (and the veths into it) vanishes with them, on the lab's
teardown or if the caller dies (they get SIGTERM when their parent dies).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lab import Lab, die_with_parent, terminate, wait_file

HERE = Path(__file__).resolve().parent
UPLINK = "uplink"
SWITCH_BRIDGE = "sw0"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


def _network(lab: Lab, netns: str, ports: dict[str, str], address: str, server: str) -> None:
    """Per-port bridges in the lab namespace, the switch namespace behind them (see above)."""

    def lab_sh(*cmd: str) -> None:
        lab.run(list(cmd))

    def sw_sh(*cmd: str) -> None:
        _sh("ip", "netns", "exec", netns, *cmd)

    relay_ip = address.split("/")[0]
    lab_sh("ip", "link", "add", "sw-uplink", "type", "veth", "peer", "name", UPLINK, "netns", netns)
    lab_sh("sysctl", "-qw", "net.ipv6.conf.sw-uplink.disable_ipv6=1")
    lab_sh("ip", "link", "set", "sw-uplink", "master", lab.bridge, "up")
    sw_sh("ip", "link", "set", "lo", "up")
    opts = ["stp_state", "0", "forward_delay", "0", "mcast_snooping", "0"]
    sw_sh("ip", "link", "add", SWITCH_BRIDGE, "type", "bridge", *opts)
    for tap, port in ports.items():
        bridge, veth = f"pb-{port}", f"pv-{port}"
        lab_sh("ip", "link", "add", bridge, "type", "bridge", *opts)
        lab_sh("ip", "link", "add", veth, "type", "veth", "peer", "name", port, "netns", netns)
        if lab.run(["ip", "link", "show", tap], check=False).returncode:
            lab_sh("ip", "tuntap", "add", "dev", tap, "mode", "tap")  # add_vm leaves it here
        # the lab side stays silent (no IPv6, no ARP answers): the node sees only the switch
        for dev in (bridge, veth, tap):
            lab_sh("sysctl", "-qw", f"net.ipv6.conf.{dev}.disable_ipv6=1")
        lab_sh("sysctl", "-qw", f"net.ipv4.conf.{bridge}.arp_ignore=8")
        lab_sh("ip", "link", "set", bridge, "up")
        for dev in (veth, tap):
            lab_sh("ip", "link", "set", dev, "master", bridge, "up")
        sw_sh("sysctl", "-qw", f"net.ipv6.conf.{port}.disable_ipv6=1")
        sw_sh("ip", "link", "set", port, "master", SWITCH_BRIDGE)
        sw_sh("ip", "link", "set", port, "type", "bridge_slave", "isolated", "on")
        sw_sh("ip", "addr", "add", f"{relay_ip}/32", "dev", port)  # dhcrelay's giaddr
        sw_sh("ip", "link", "set", port, "up")
    sw = SWITCH_BRIDGE
    sw_sh(
        *("sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv4.conf.all.send_redirects=0"),
        *(f"net.ipv6.conf.{sw}.accept_ra=0", f"net.ipv6.conf.{sw}.accept_dad=0"),
        *(f"net.ipv4.conf.{sw}.proxy_arp=1", f"net.ipv4.conf.{sw}.proxy_arp_pvlan=1"),
        *(f"net.ipv4.conf.{sw}.send_redirects=0", f"net.ipv4.neigh.{sw}.proxy_delay=0"),
        *(f"net.ipv6.conf.{UPLINK}.disable_ipv6=1", f"net.ipv4.conf.{UPLINK}.proxy_arp=1"),
        f"net.ipv4.neigh.{UPLINK}.proxy_delay=0",
    )
    sw_sh("ip", "addr", "add", address, "dev", sw)
    sw_sh("ip", "link", "set", sw, "up")
    sw_sh("ip", "addr", "add", f"{relay_ip}/32", "dev", UPLINK)
    sw_sh("ip", "link", "set", UPLINK, "up")
    sw_sh("ip", "route", "add", f"{server}/32", "dev", UPLINK)
    sw_sh("ip", "route", "add", "default", "via", server, "dev", UPLINK)


def start_relay(
    lab: Lab,
    ports: dict[str, str],
    server: str = "10.99.0.1",
    address: str = "10.99.0.254/24",
    ra: bool = True,
    timeout: float = 15,
) -> subprocess.Popen:
    """Put each tap (created if missing) behind switch port `ports[tap]` and start dhcrelay.

    Call it before or after ``lab.add_vm``: a tap that add_vm already put on br0 moves to
    its port, and a tap made here is left alone by add_vm. Port names are interface names
    (1-12 characters) and are what option 82's circuit id carries. Returns dhcrelay's
    process once it listens; its log is ``relay.log`` in the lab's run_dir.
    """
    for port in ports.values():
        if not 1 <= len(port) <= 12 or port in (UPLINK, SWITCH_BRIDGE, "lo"):
            raise ValueError(f"port {port!r}: 1-12 characters, not {UPLINK} or {SWITCH_BRIDGE}")
    netns = f"{lab.netns}-sw"
    log = lab.run_dir / "relay.log"
    start = log.stat().st_size if log.exists() else 0
    _sh("ip", "netns", "add", netns)
    try:
        _network(lab, netns, ports, address, server)
        in_switch = ["ip", "netns", "exec", netns]
        if ra:
            ra_cmd = [*in_switch, sys.executable, str(HERE / "ra.py"), SWITCH_BRIDGE]
            lab.popen(ra_cmd, log=lab.run_dir / "relay-ra.log", preexec_fn=die_with_parent)
        downstream = [arg for port in ports.values() for arg in ("-id", port)]
        relay_cmd = [*in_switch, "dhcrelay", "-d", "--no-pid", "-4", "-a", *downstream]
        relay_cmd += ["-iu", UPLINK, server]
        proc = lab.popen(relay_cmd, log=log, preexec_fn=die_with_parent)
        ready = r"Sending on +Socket/fallback"
        if not wait_file(log, ready, timeout, start, lambda: proc.poll() is None):
            terminate([proc])
            raise RuntimeError(f"dhcrelay did not start:\n{log.read_text()[start:][-2000:]}")
        return proc
    finally:
        _sh("ip", "netns", "del", netns)  # the name only: the namespace lives on in dhcrelay
