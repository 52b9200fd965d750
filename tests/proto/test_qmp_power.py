"""The command power driver against a real QEMU: ``vm-lab/qmp_power.py`` switching a tiny
paused VM (no NIC, no disk: it need not boot anything to show its power state) through its
QMP socket, as a PDU's tool switches an outlet. No network is involved. The whole path, a
VM booted to ready by ``layerpy serve`` through these commands, is
tests/e2e/test_power_by_command.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerpy.power import PowerError, PowerSpec, make_driver
from layerpy.power.base import CommandSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vm-lab"))

from qmp_power import qmp

QMP_POWER = Path(__file__).resolve().parents[2] / "vm-lab" / "qmp_power.py"


@pytest.fixture
def vm(tmp_path: Path):
    """A paused QEMU (``-S``: off) with only a QMP socket; killed by its PID afterwards."""
    socket = tmp_path / "vm.qmp"
    command = ["qemu-system-x86_64", "-accel", "tcg", "-m", "64", "-S", "-nodefaults"]
    command += ["-display", "none", "-qmp", f"unix:{socket},server=on,wait=off"]
    log = (tmp_path / "qemu.log").open("wb")
    qemu = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            assert qemu.poll() is None, (tmp_path / "qemu.log").read_text()
            assert time.monotonic() < deadline, "QEMU's QMP socket within 30 s"
            time.sleep(0.05)
        yield socket
    finally:
        qemu.kill()
        qemu.wait()
        log.close()


def driver(socket: Path, **more):
    ops = {op: ("/usr/bin/python3", str(QMP_POWER), str(socket), op)
           for op in ("on", "off", "cycle", "status")}  # fmt: skip
    patterns = {"status_on": "^(running|paused)$", "status_off": "^(prelaunch|shutdown)$"}
    return make_driver(
        "cn001", PowerSpec("command", command=CommandSpec(**ops, **patterns, **more))
    )


def state(socket: Path) -> str:
    return qmp(socket, "query-status")[0]["status"]


def test_a_vm_switched_by_command_and_its_status(vm: Path) -> None:
    cn001 = driver(vm)

    async def scenario() -> list[tuple[str, str]]:
        seen = [(await cn001.status(), state(vm))]
        for operation in (cn001.on, cn001.off, cn001.cycle):
            await operation()
            seen.append((await cn001.status(), state(vm)))
        qmp(vm, "stop")  # frozen behind our back: still powered
        seen.append((await cn001.status(), state(vm)))
        await cn001.off()
        seen.append((await cn001.status(), state(vm)))
        return seen

    assert asyncio.run(scenario()) == [
        ("off", "prelaunch"),
        ("on", "running"),
        ("off", "prelaunch"),
        ("on", "running"),
        ("on", "paused"),
        ("off", "prelaunch"),
    ]


def test_a_vm_that_is_gone(tmp_path: Path) -> None:
    cn001 = driver(tmp_path / "absent.qmp")
    with pytest.raises(PowerError) as failed:
        asyncio.run(cn001.on())
    assert str(failed.value) == (
        f"cn001: on command /usr/bin/python3: exit code 1; stderr: qmp_power: "
        f"{tmp_path}/absent.qmp: [Errno 2] No such file or directory"
    )
