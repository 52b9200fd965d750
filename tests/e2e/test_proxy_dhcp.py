"""ProxyDHCP in QEMU (issue 11): beside a site's dnsmasq that hands out the addresses,
BIOS (iPXE ROM), UEFI (iPXE ROM) and UEFI with OVMF's own PXE boot the minOS from layerpy
to ready, with the addresses the site's server gave them."""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest

pytestmark = pytest.mark.e2e

SITE_RANGE = (IPv4Address("10.99.0.100"), IPv4Address("10.99.0.150"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    from session import PROXY_CONFIG, LabSession, start_site_dhcp_for_proxy_lab

    session = LabSession(
        tmp_path_factory.mktemp("lab", numbered=True), PROXY_CONFIG, start_site_dhcp_for_proxy_lab
    )
    yield session
    session.close()


def test_nodes_boot_beside_the_site_dhcp_server(lab) -> None:
    serve_log = lab.serve_log.read_text()
    assert "the site's DHCP server answers on br0: 10.99.0.2" in serve_log
    assert "listening on br0 port 67 and 4011 (ProxyDHCP)" in serve_log
    vms = lab.start("cn001", "cn003", "cn004")
    assert [vm.spec.firmware for vm in vms] == ["bios", "uefi", "uefi-pxe"]
    lab.wait_state(["cn001", "cn003", "cn004"], "ready", timeout=240)
    nodes = lab.nodes()
    assert nodes["cn001"]["ip"] == "10.99.0.11"  # reserved for it at the site's server
    for name in ("cn003", "cn004"):
        assert SITE_RANGE[0] <= IPv4Address(nodes[name]["ip"]) <= SITE_RANGE[1], nodes[name]
    for name in ("cn001", "cn003", "cn004"):
        phases = [p for p in nodes[name]["timeline"] if p != "tftp"]
        assert phases[:3] == ["dhcp_discover", "dhcp_ack", "script"], (name, phases)
        assert {"kernel", "initrd", "agent_hello", "ready"} <= set(phases), (name, phases)
        assert nodes[name]["boots"] == 1, nodes[name]
    # OVMF's own PXE took the port-67 offer as it was (boot server, file, option 43) and
    # loaded iPXE over TFTP from its site address; iPXE then asked on port 4011
    assert f"done {nodes['cn004']['ip']}:" in lab.serve_log.read_text()
    # every address came from the site's server: it leased each MAC
    leases = (lab.run_dir / "site-dhcp.leases").read_text()
    for name in ("cn001", "cn003", "cn004"):
        assert f"{nodes[name]['mac']} {nodes[name]['ip']}" in leases, leases
