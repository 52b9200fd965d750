"""Secure Boot, enforced (issue 28): a UEFI VM with Debian's Secure Boot OVMF and
Microsoft's keys enrolled refuses the unsigned iPXE that layerpy offers other nodes, and
boots by the signed path once its node has ``secure_boot = true``: Debian's signed shim,
then the signed netboot GRUB (its config from layerpy, by the VM's address), then Debian's
signed kernel, locked down, loading only signed modules, into the minOS and its image;
its agent reports Secure Boot on.

The node has no BMC: the test powers the VM itself, so no power cycle by the engine comes
between the two boots."""

from __future__ import annotations

import json
import time

import pytest

from lab import VmSpec
from oci import build_image
from session import LabSession, lab_text

pytestmark = pytest.mark.e2e
NODE = "sb001"
SPEC = VmSpec(NODE, "52:54:00:99:00:21", "uefi-sb", memory_mb=512)
SECURE = f"[nodes.{NODE}]\nsecure_boot = true\n"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("secboot")
    layout = build_image(run_dir / "layout", "sb", "IMAGE-SB-MARKER")
    config = run_dir / "nodes.toml"
    config.write_text(
        lab_text()
        + f'\n[images.sb]\nsource = "oci-layout:{layout}"\n\n[nodes.{NODE}]\n'
        + f'ip = "10.99.0.21"\nmac = "{SPEC.mac}"\nimage = "sb"\n'
    )
    session = LabSession(run_dir, config=config)
    yield session
    session.close()


def tail(lab) -> str:
    """The end of the VM's serial console, for a failure's message."""
    return lab.lab.vms[NODE].serial_log.read_text(errors="replace")[-3000:]


def test_the_firmware_refuses_the_unsigned_ipxe(lab) -> None:
    """Without secure_boot the node is offered iPXE (snponly.efi) like any UEFI node:
    OVMF's own PXE fetches it by TFTP, and Secure Boot refuses to start it."""
    vm = lab.lab.add_vm(SPEC)
    assert vm.wait_serial(r"NBP filesize is [1-9]", 240), "OVMF's PXE fetching iPXE:\n" + tail(lab)
    # OVMF's boot manager says why: "BdsDxe: failed to load Boot0001 "UEFI PXEv4 (MAC:…)"
    # from PciRoot(…)/…: Access Denied" (its console line for a boot option that failed)
    refused = (
        r'failed to load Boot[0-9A-F]{4} "UEFI PXEv4[^\n]*: (Access Denied|Security Violation)'
    )
    assert vm.wait_serial(refused, 120), "the firmware refusing the unsigned iPXE:\n" + tail(lab)
    assert "iPXE 1." not in vm.serial_log.read_text(errors="replace")  # iPXE never ran
    node = lab.nodes()[NODE]
    assert node["run_state"] == "booting" and node["boot"]["firmware"] == "uefi", node


def test_the_signed_path_boots_to_ready_with_secure_boot_on(lab) -> None:
    lab.config.write_text(lab.config.read_text().replace(f"[nodes.{NODE}]\n", SECURE))
    assert f"changed  {NODE}" in lab.cli("reload", "-c", str(lab.config))
    vm = lab.lab.vms[NODE]
    vm.reset()  # the same VM, firmware and variables: only what layerpy offers changed
    started = time.monotonic()
    assert vm.wait_serial(r"layerpy: booting sb001 into the minOS", 300), (
        "shim loading the signed GRUB, GRUB its config from layerpy:\n" + tail(lab)
    )
    lab.wait_state([NODE], "ready", timeout=400)
    took = time.monotonic() - started
    node = lab.nodes()[NODE]
    print(f"reset to ready by shim and GRUB: {took:.1f} s; timeline {node['timeline']}")
    assert node["secure_boot"] is True and node["problem"] is None, node
    assert {"dhcp_ack", "tftp", "kernel", "initrd", "agent_hello", "ready"} <= set(node["timeline"])
    explained = json.loads(lab.cli("explain", NODE))
    assert explained["secure_boot"] == {"wanted": True, "reported": True}
    assert vm.wait_serial(r"Secure Boot on", 10), "the agent's word on its console:\n" + tail(lab)
    lab.wait(lambda: lab.nodes()[NODE]["image"]["state"] == "active", 180, "image sb active")
    assert vm.wait_serial("IMAGE-SB-MARKER", 30), "the image's container:\n" + tail(lab)
    # the kernel locked itself down (Secure Boot), and its drivers still loaded: all signed
    vm.type("\r")
    time.sleep(1)
    vm.type("mount -t securityfs none /sys/kernel/security; cat /sys/kernel/security/lockdown\r")
    assert vm.wait_serial(r"none \[integrity\] confidentiality", 30), tail(lab)
    vm.type("grep -c . /proc/modules; cut -d' ' -f1 /proc/modules | grep -x virtio_net\r")
    assert vm.wait_serial(r"\nvirtio_net\r?\n", 30), "virtio_net loaded under lockdown:\n" + tail(
        lab
    )
    metrics = lab.lab.run(
        ["curl", "-sf", "--unix-socket", str(lab.socket), "http://layerpy/metrics"]
    )
    assert 'layerpy_nodes_secure_boot{state="on"} 1.0' in metrics.stdout
    # nothing was ever served to it by HTTP but the minOS's reports and image: no iPXE script
    assert f"{NODE}: refused" not in lab.serve_log.read_text()
