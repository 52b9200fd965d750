"""The state engine keeps lab nodes as the file says, through their IPMI BMCs (issue 3)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from session import LabSession, lab_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    """The lab with a node file of its own, which the tests change and reload."""
    run_dir = tmp_path_factory.mktemp("lifecycle")
    session = LabSession(run_dir, config=lab_config(run_dir))
    yield session
    session.close()


def explain(lab, name: str) -> dict:
    return json.loads(lab.cli("explain", name))


def test_nodes_start_off_and_the_server_powers_them_on(lab) -> None:
    lab.start("cn001", "cn002")
    lab.wait_state(["cn001", "cn002"], "ready", timeout=90)
    log = lab.serve_log.read_text()
    for name in ("cn001", "cn002"):
        assert f"{name}: power unknown -> off" in log  # the VM started powered off
        assert f"{name}: fire power.on" in log
        assert lab.nodes()[name]["power"] == "on"
    assert "(converged)" in lab.cli("plan")


def test_frozen_node_is_found_lost_hung_and_power_cycled(lab) -> None:
    lab.lab.vms["cn002"].stop()  # the guest freezes; its BMC still says "on"
    lab.wait_state(["cn002"], "lost", timeout=30)
    lab.wait(lambda: lab.nodes()["cn002"]["boots"] == 2, 60, "cn002 power-cycled and rebooting")
    lab.wait_state(["cn002"], "ready", timeout=90)
    failures = [f["mutation"] for f in explain(lab, "cn002")["failures"]]
    assert "boot.recover" in failures
    assert "cn002: fire power.cycle" in lab.serve_log.read_text()


def test_busy_node_is_powered_off_only_when_free(lab) -> None:
    console = lab.lab.vms["cn001"]
    console.type("\r")
    time.sleep(1)
    console.type("touch /run/layerpy/node/busy\r")  # the container's /run/layerpy
    lab.wait(lambda: lab.nodes()["cn001"]["busy"] == "busy", 60, "cn001 reports busy")
    text = lab.config.read_text()
    lab.config.write_text(text + '\n[nodes.cn001]\npower = "off"\n')
    assert "changed  cn001" in lab.cli("reload", "-c", str(lab.config))
    time.sleep(6)  # three BMC polls: it must stay on
    assert lab.nodes()["cn001"]["power"] == "on"
    assert "blocked by busy=busy" in lab.cli("plan")
    console.type("rm /run/layerpy/node/busy\r")
    lab.wait(lambda: lab.nodes()["cn001"]["power"] == "off", 20, "cn001 powered off")
    assert lab.lab.vms["cn001"].qmp("query-status")["running"] is False
    assert lab.nodes()["cn001"]["run_state"] == "unknown"  # forgotten, not "lost"


def test_dead_bmc_is_an_error_and_delays_no_one(lab) -> None:
    os.killpg(lab.bmcs["cn002"].pid, signal.SIGKILL)
    started = time.monotonic()
    lab.cli("power", "on", "cn001")  # an override: the file still says off
    lab.wait(lambda: lab.nodes()["cn001"]["power"] == "on", 10, "cn001 powered on")
    assert time.monotonic() - started < 5  # not held up by cn002's BMC timing out
    lab.wait(lambda: explain(lab, "cn002")["error"] is not None, 90, "cn002 error")
    assert "unreachable" in explain(lab, "cn002")["error"]
    status = lab.cli("power", "status", "cn[001-002]")
    assert "unreachable" in status and "lab-only-bmc-password" not in status
    lab.wait_state(["cn001"], "ready", timeout=90)
