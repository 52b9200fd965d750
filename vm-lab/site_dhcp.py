"""The site's own DHCP server beside the lab's layerpy: dnsmasq on another "machine".

``start_site_dhcp(lab)`` puts a namespace of its own (``<lab.netns>-site``) on the lab's
bridge through a veth, at 10.99.0.2, and runs dnsmasq there as a site's authoritative
server would: it hands out 10.99.0.100-150 (and fixed addresses for the MACs in
`reserved`), knows nothing about PXE, and pings an address before offering it. layerpy in
``dhcp = "proxy"`` mode answers the same broadcasts with boot information only.

    lab namespace                          site namespace
    br0 10.99.0.1/24 ── site-port ══ veth ══ site0 10.99.0.2/24 ── dnsmasq

Lifetime as in relay.py: dnsmasq is a tracked process of the lab; once it runs the
namespace's name is deleted, so the namespace goes with it.
"""

from __future__ import annotations

import subprocess

from lab import Lab, die_with_parent, terminate, wait_file

SITE_ADDRESS = "10.99.0.2/24"
SITE_RANGE = ("10.99.0.100", "10.99.0.150")


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)


def start_site_dhcp(
    lab: Lab, reserved: dict[str, str] | None = None, timeout: float = 15
) -> subprocess.Popen:
    """Start the site's dnsmasq; `reserved` maps MACs to the fixed addresses it gives them.
    Its log (every DHCP exchange) is ``site-dhcp.log`` in the lab's run_dir."""
    netns = f"{lab.netns}-site"
    log = lab.run_dir / "site-dhcp.log"
    start = log.stat().st_size if log.exists() else 0
    _sh("ip", "netns", "add", netns)
    try:
        lab.run(["ip", "link", "add", "site-port", "type", "veth", "peer", "name", "site0",
                 "netns", netns])  # fmt: skip
        lab.run(["sysctl", "-qw", "net.ipv6.conf.site-port.disable_ipv6=1"])
        lab.run(["ip", "link", "set", "site-port", "master", lab.bridge, "up"])
        in_site = ["ip", "netns", "exec", netns]
        for command in (
            ["ip", "link", "set", "lo", "up"],
            ["sysctl", "-qw", "net.ipv6.conf.site0.disable_ipv6=1"],
            ["ip", "addr", "add", SITE_ADDRESS, "dev", "site0"],
            ["ip", "link", "set", "site0", "up"],
        ):
            _sh(*in_site, *command)
        dnsmasq = [
            *in_site, "dnsmasq", "--no-daemon", "--conf-file=/dev/null", "--port=0",
            "--interface=site0", "--bind-interfaces", "--log-dhcp", "--pid-file=",
            f"--dhcp-range={SITE_RANGE[0]},{SITE_RANGE[1]},255.255.255.0,1h",
            f"--dhcp-leasefile={lab.run_dir / 'site-dhcp.leases'}",
            *(f"--dhcp-host={mac},{ip}" for mac, ip in (reserved or {}).items()),
        ]  # fmt: skip
        proc = lab.popen(dnsmasq, log=log, preexec_fn=die_with_parent)
        if not wait_file(log, "DHCP, IP range", timeout, start, lambda: proc.poll() is None):
            terminate([proc])
            raise RuntimeError(f"dnsmasq did not start:\n{log.read_text()[start:][-2000:]}")
        return proc
    finally:
        _sh("ip", "netns", "del", netns)  # the name only: the namespace lives on in dnsmasq
