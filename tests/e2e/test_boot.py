"""QEMU VMs PXE-boot from `layerpy serve` into the minOS and report ready (issue 2)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

NODES = {"cn001": "10.99.0.11", "cn002": "10.99.0.12", "cn003": "10.99.0.13", "cn004": "10.99.0.14"}


def test_bios_and_uefi_nodes_become_ready(lab) -> None:
    vms = lab.start("cn001", "cn002", "cn003", "cn004", "stray")
    assert [vm.spec.firmware for vm in vms] == ["bios", "bios", "uefi", "uefi-pxe", "bios"]
    lab.wait_state(list(NODES), "ready", timeout=90)
    nodes = lab.nodes()
    for name, ip in NODES.items():
        node = nodes[name]
        assert (node["ip"], node["hostname"], node["boots"]) == (ip, name, 1), node
        phases = [p for p in node["timeline"] if p != "tftp"]
        assert phases[:3] == ["dhcp_discover", "dhcp_ack", "script"], phases
        assert {"kernel", "initrd", "agent_hello", "ready"} <= set(phases)
    # OVMF's own PXE fetched iPXE over TFTP first, then iPXE asked again: one boot
    assert "tftp" in nodes["cn004"]["timeline"] and nodes["cn004"]["boot"]["firmware"] == "uefi"


def test_unknown_machine_does_not_boot_and_is_listed(lab) -> None:
    def asked_again() -> bool:
        return any(m["requests"] >= 3 for m in lab.api("/api/v1/unknown"))

    lab.wait(asked_again, 60, "the unknown machine asks repeatedly")
    unknown = lab.api("/api/v1/unknown")
    assert [m["mac"] for m in unknown] == ["52:54:00:99:00:99"]
    assert unknown[0]["firmware"] == "ipxe"
    serial = lab.lab.vms["stray"].serial_log.read_text(errors="replace")
    assert "Configuring (net0 52:54:00:99:00:99)" in serial
    assert "net0: 10.99." not in serial and "Filename:" not in serial
    assert "52:54:00:99:00:99" not in {n["mac"] for n in lab.nodes().values()}


def test_reboot_keeps_the_address_and_starts_a_new_timeline(lab) -> None:
    before = lab.nodes()["cn001"]
    assert before["run_state"] == "ready"
    lab.lab.vms["cn001"].reset()
    lab.wait(lambda: lab.nodes()["cn001"]["boots"] == 2, 30, "cn001 boots again")
    lab.wait_state(["cn001"], "ready", timeout=90)
    after = lab.nodes()["cn001"]
    assert after["ip"] == before["ip"] == "10.99.0.11"
    assert after["boot"]["boot_id"] != before["boot"]["boot_id"]
    assert after["boot"]["started"] > before["boot"]["started"] + before["timeline"]["ready"]
    assert next(iter(after["timeline"])) == "dhcp_discover"
