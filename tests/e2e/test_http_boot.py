"""OVMF's own UEFI HTTP boot (issue 11): no PXE, no TFTP at all. The firmware asks with
option 60 HTTPClient and architecture 16, gets an http:// URL to the iPXE EFI binary, and
the node reaches the minOS and reports ready."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e


def test_ovmf_http_boot_reaches_the_minos_without_tftp(lab) -> None:
    (vm,) = lab.start("cn003", firmware={"cn003": "uefi-http"})
    lab.wait_state(["cn003"], "ready", timeout=240)
    node = lab.nodes()["cn003"]
    assert node["boot"]["firmware"] == "uefi-http", node["boot"]
    assert node["ip"] == "10.99.0.13" and node["boots"] == 1, node
    assert {"dhcp_ack", "script", "kernel", "initrd", "ready"} <= set(node["timeline"])
    stats = lab.api("/api/v1/stats")
    assert "tftp" not in stats, stats["tftp"]  # not one TFTP request reached the server
    serial = vm.serial_log.read_text(errors="replace")
    assert "Start PXE" not in serial
    assert "URI: http://10.99.0.1:8080/ipxe/snponly.efi" in serial
