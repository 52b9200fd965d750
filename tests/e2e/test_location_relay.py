"""Identity by location through DHCP option 82 from a relay in the switch (issue 5)."""

from __future__ import annotations

import json
import time

import pytest
from location import located_node_file, plug, stranger

from relay import start_relay
from session import LabSession

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("relay")
    session = LabSession(run_dir, config=located_node_file(run_dir, "location"))
    start_relay(session.lab, {"tap-m1": "swp2"})
    yield session
    session.close()


def explain(lab, name: str) -> dict:
    return json.loads(lab.cli("explain", name))


def test_unknown_machine_on_swp2_becomes_cn002(lab) -> None:
    started = time.time()
    vm = lab.lab.add_vm(stranger("m1", 1))
    lab.wait_state(["cn002"], "ready", timeout=90)
    node = lab.nodes()["cn002"]
    assert (node["mac"], node["ip"], node["hostname"]) == (
        "52:54:00:aa:00:01",
        "10.99.0.12",
        "cn002",
    )
    evidence = explain(lab, "cn002")["location"]
    assert (evidence["source"], evidence["switch"], evidence["port"]) == (
        "dhcp-option-82",
        "sw1",
        "swp2",
    )
    bound = next(e["time"] for e in lab.api("/api/v1/events") if e["kind"] == "bound")
    print(
        f"\noption 82: power-on to bound {bound - started:.1f} s, to ready {time.time() - started:.1f} s"
    )
    assert vm.alive()


def test_replaced_hardware_takes_over_cn002(lab) -> None:
    lab.lab.vms["m1"].kill()  # the old machine is gone
    lab.wait_state(["cn002"], "lost", timeout=30)
    plug(lab.lab, "tap-m2", "swp2")
    lab.lab.add_vm(stranger("m2", 2))
    lab.wait(lambda: lab.nodes()["cn002"]["mac"] == "52:54:00:aa:00:02", 60, "m2 bound")
    lab.wait_state(["cn002"], "ready", timeout=90)
    assert lab.nodes()["cn002"]["ip"] == "10.99.0.12"
    events = lab.api("/api/v1/events")
    assert any(
        e["kind"] == "replaced" and "52:54:00:aa:00:01 -> 52:54:00:aa:00:02" in e["message"]
        for e in events
    ), events


def test_two_live_machines_on_one_port_conflict(lab) -> None:
    plug(lab.lab, "tap-m3", "swp2")
    vm = lab.lab.add_vm(stranger("m3", 3))
    lab.wait(lambda: explain(lab, "cn002")["conflict"] is not None, 60, "conflict shown")
    assert "52:54:00:aa:00:03 claims sw1:swp2" in explain(lab, "cn002")["conflict"]
    unknown = {m["mac"]: m for m in lab.api("/api/v1/unknown")}
    assert "belongs to cn002" in unknown["52:54:00:aa:00:03"]["conflict"]
    node = lab.nodes()["cn002"]
    assert (node["mac"], node["run_state"]) == ("52:54:00:aa:00:02", "ready")  # not stolen
    assert not vm.wait_serial(r"net0: 10\.99\.0\.12", 5)
