"""The default minOS on the NICs of real servers (issue 12): lab VMs whose only NIC is an
Intel e1000e (PXE from its option ROM, BIOS) or a Realtek RTL8139 (UEFI: OVMF with the
NIC's iPXE EFI driver), powered on by layerpy through their BMCs, boot it to ready: its /init loads the driver the hardware's modalias
names (no udev), the agent's DHCP and reports go over that NIC. The kernel is the generic
one (linux-image-amd64) minos/build.sh builds by default; the serial log shows the driver.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.e2e

MACHINES = {"cn001": ("e1000e", "e1000e"), "cn003": ("rtl8139", "8139too")}  # NIC, driver


def test_real_server_nics_boot_the_default_minos_to_ready(lab) -> None:
    minos = (lab.config.parent / "../minos/out/BUILDINFO").resolve().read_text()
    assert "kernel_package=linux-image-" in minos and "-cloud-" not in minos, minos
    vms = lab.start(*MACHINES, nic={name: nic for name, (nic, _) in MACHINES.items()})
    assert [vm.spec.firmware for vm in vms] == ["bios", "uefi"]
    lab.wait_state(list(MACHINES), "ready", timeout=240)
    nodes = lab.nodes()
    for name, (_, driver) in MACHINES.items():
        assert nodes[name]["ip"] == f"10.99.0.1{name[-1]}", nodes[name]
        serial = lab.lab.vms[name].serial_log.read_text(errors="replace")
        found = re.search(rf"minos: \S+, node {name}, modules: ([^\r\n]*)", serial)
        assert found, f"{name}: /init did not say which modules it loaded"
        loaded = found.group(1).split()  # what /init loaded, as /proc/modules lists it
        assert driver in loaded and "virtio_net" not in loaded, loaded
