"""Power by command against the lab (issue 28, point 4): ``layerpy serve`` powers a QEMU VM
on, off and through a cycle with ``vm-lab/qmp_power.py`` as the node's ``command`` driver
(QEMU's QMP socket standing in for a PDU outlet), the status follows, and a status command
that prints garbage or hangs is a power error that says so. One VM, booted from the network
to ready by the server's own power-on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from session import MACHINES, REPO, LabSession, lab_text

pytestmark = pytest.mark.e2e

QMP_POWER = REPO / "vm-lab" / "qmp_power.py"
COMMANDS = REPO / "tests" / "commands"
STATUS = f"/usr/bin/python3 {QMP_POWER} {{address}} status"  # prints QEMU's run state


def node_file(run_dir: Path, status: str, extra: str = "") -> str:
    """The lab's node file with cn001 alone, powered by qmp_power.py through its QMP socket."""
    text = lab_text()
    group = text[text.index("[groups.compute]") :]
    tool = f"/usr/bin/python3 {QMP_POWER} {{address}}"  # the standard library only
    bmc = (
        f'[groups.compute]\nnodes = "cn001"\nip = "10.99.0.11"\nmac = ["52:54:00:99:00:11"]\n'
        f'power = "on"\n\n[groups.compute.bmc]\ndriver = "command"\n'
        f'address = "{run_dir}/{{node}}.qmp"\n'
        f'on = "{tool} on"\noff = "{tool} off"\ncycle = "{tool} cycle"\nstatus = "{status}"\n'
        "status_on = '^(running|paused)$'\nstatus_off = '^(prelaunch|shutdown)$'\n" + extra
    )
    return text.replace(group, bmc)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("power_command").resolve()
    config = run_dir / "nodes.toml"
    config.write_text(node_file(run_dir, STATUS))
    # the VM first (powered off, -S; no BMC: only the commands), so that the first status
    # the server reads is the VM's
    session = LabSession(run_dir, config=config,
                         before_serve=lambda lab: lab.add_vm(MACHINES["cn001"]))  # fmt: skip
    yield session
    session.close()


def explain(lab: LabSession) -> dict:
    return json.loads(lab.cli("explain", "cn001"))


def gone(pid: int) -> bool:
    """No such process, or a zombie (no command line): a killed one its parent has not
    reaped yet."""
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def qemu(lab: LabSession) -> str:
    return lab.lab.vms["cn001"].qmp("query-status")["status"]


def test_the_server_powers_the_vm_on_by_command_and_it_boots_to_ready(lab) -> None:
    lab.wait_state(["cn001"], "ready", timeout=180)
    log = lab.serve_log.read_text()
    assert "cn001: power unknown -> off" in log  # the status command read "prelaunch"
    assert "cn001: fire power.on" in log
    assert qemu(lab) == "running" and lab.nodes()["cn001"]["power"] == "on"


def test_off_and_on_by_command_and_the_status_follows(lab) -> None:
    lab.cli("power", "off", "cn001")
    lab.wait(lambda: qemu(lab) == "prelaunch", 60, "QEMU stopped and reset by the off command")
    lab.wait(lambda: lab.nodes()["cn001"]["power"] == "off", 30, "cn001's power read as off")
    lab.cli("power", "clear", "cn001")  # the file says on
    lab.wait(lambda: qemu(lab) == "running", 60, "QEMU running again by the on command")
    lab.wait_state(["cn001"], "ready", timeout=180)


def test_a_cycle_by_command_reboots_the_vm(lab) -> None:
    boots = lab.nodes()["cn001"]["boots"]
    lab.cli("power", "cycle", "cn001")
    lab.wait(
        lambda: lab.nodes()["cn001"]["boots"] > boots, 120, "cn001 booting again after the cycle"
    )
    lab.wait_state(["cn001"], "ready", timeout=180)
    assert "cn001: power cycle" in lab.serve_log.read_text()


def reload_with(lab: LabSession, status: str, extra: str = "") -> None:
    lab.config.write_text(node_file(lab.run_dir, status, extra))
    assert "changed  cn001" in lab.cli("reload", "-c", str(lab.config))


def test_a_status_command_printing_garbage_is_an_error_saying_so(lab) -> None:
    reload_with(lab, str(COMMANDS / "garbage.sh"))
    lab.wait(lambda: (explain(lab)["error"] or "").find("matches neither") > 0, 60,
             "the garbage status shown as cn001's power error")  # fmt: skip
    error = explain(lab)["error"]
    assert error.startswith("cn001: status command ") and error.isprintable() and len(error) < 2000
    assert qemu(lab) == "running"  # an unreadable status switches nothing


def test_a_hanging_status_command_is_killed_and_an_error(lab) -> None:
    hang = COMMANDS / "hang.sh"
    reload_with(lab, f"{hang} {lab.run_dir}/hang-{{node}}", "timeout = 2\n")
    lab.wait(lambda: "no end in 2 s: killed" in (explain(lab)["error"] or ""), 120,
             "the hanging status shown as cn001's power error")  # fmt: skip
    pids = [int(pid) for pid in (lab.run_dir / "hang-cn001").read_text().split()]
    lab.wait(lambda: all(map(gone, pids)), 30, "the hanging status command and its sleep killed")
    reload_with(lab, STATUS)  # a good status again: the error ends
    lab.wait(lambda: explain(lab)["error"] is None, 120, "cn001's power error gone (after backoff)")
    assert lab.nodes()["cn001"]["power"] == "on"
