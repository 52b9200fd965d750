"""Identity by location through LLDP: a discovery boot becomes the node at its port (issue 5)."""

from __future__ import annotations

import json
import time

import pytest
from location import located_node_file, stranger

from session import LabSession
from switch import start_switch

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("lldp")
    session = LabSession(
        run_dir, config=located_node_file(run_dir, "location-trusted", discover=True)
    )
    # every stranger's tap is port swp2 of sw1, as one port seen over time (or through a hub)
    start_switch(session.lab, {f"tap-l{i}": "swp2" for i in (1, 2, 3)}, interval=2)
    yield session
    session.close()


def explain(lab, name: str) -> dict:
    return json.loads(lab.cli("explain", name))


def test_discovery_boot_becomes_cn002_without_a_reboot(lab) -> None:
    started = time.time()
    vm = lab.lab.add_vm(stranger("l1", 0x11))
    lab.wait_state(["cn002"], "ready", timeout=120)
    node = lab.nodes()["cn002"]
    assert (node["mac"], node["ip"], node["hostname"]) == (
        "52:54:00:aa:00:11",
        "10.99.0.12",
        "cn002",
    )
    evidence = explain(lab, "cn002")["location"]
    assert (evidence["source"], evidence["chassis"], evidence["port"]) == (
        "lldp",
        "02:00:00:00:0a:01",
        "swp2",
    )
    assert vm.wait_serial("now cn002 \\(was discover\\)", 5)
    assert vm.serial_log.read_text(errors="replace").count("Linux version") <= 1  # one kernel boot
    bound = next(e["time"] for e in lab.api("/api/v1/events") if e["kind"] == "bound")
    print(
        f"\nLLDP: power-on to bound {bound - started:.1f} s, to ready {time.time() - started:.1f} s"
    )


def test_replaced_hardware_takes_over_cn002(lab) -> None:
    lab.lab.vms["l1"].kill()
    lab.wait_state(["cn002"], "lost", timeout=30)
    lab.lab.add_vm(stranger("l2", 0x12))
    lab.wait(lambda: lab.nodes()["cn002"]["mac"] == "52:54:00:aa:00:12", 120, "l2 bound")
    lab.wait_state(["cn002"], "ready", timeout=60)
    assert lab.nodes()["cn002"]["ip"] == "10.99.0.12"
    assert any(
        e["kind"] == "replaced" and "52:54:00:aa:00:11 -> 52:54:00:aa:00:12" in e["message"]
        for e in lab.api("/api/v1/events")
    )


def test_two_live_machines_at_one_port_conflict(lab) -> None:
    vm = lab.lab.add_vm(stranger("l3", 0x13))
    lab.wait(lambda: explain(lab, "cn002")["conflict"] is not None, 120, "conflict shown")
    assert "52:54:00:aa:00:13 claims sw1:swp2" in explain(lab, "cn002")["conflict"]
    unknown = {m["mac"]: m for m in lab.api("/api/v1/unknown")}
    assert "belongs to cn002" in unknown["52:54:00:aa:00:13"]["conflict"]
    assert lab.nodes()["cn002"]["mac"] == "52:54:00:aa:00:12"  # not stolen
    assert "now cn002" not in vm.serial_log.read_text(errors="replace")
