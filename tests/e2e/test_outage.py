"""Server down while nodes run (issue 15): lab nodes keep their containers through a crash
of ``layerpy serve`` and a long outage, and report back to the restarted server (same
state directory) without a reboot, a power command or a container restart.

The outage lasts ``LAYERPY_OUTAGE_SECONDS`` (30 s by default, short enough for CI; the
figure in docs/scale.md is a 600 s run), and at least until the nodes' DHCP leases (10 s
here) ran out: a node keeps its address past its lease while no server answers. Each
container prints one line on its node's console when it starts (with the VM's uptime
then): its identity, from inside the VM.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from oci import build_image
from session import LabSession, lab_text

pytestmark = pytest.mark.e2e

OUTAGE = float(os.environ.get("LAYERPY_OUTAGE_SECONDS", "30"))
NODES = ["cn001", "cn002"]
ADDRESSES = {"cn001": "10.99.0.11", "cn002": "10.99.0.12"}
HEARTBEAT = 2  # configs/lab.toml
START = r"\[sleeper\] SLEEPER-START at (\S+)"
SLEEP = "echo SLEEPER-START at $(cut -d' ' -f1 /proc/uptime); exec sleep 1000000"
# what the agent prints when its container stops or dies
STOPPED = re.compile(r"stopping, the server wants none|container exited|container of .* is gone")
LEASE = 10  # seconds (busybox udhcpc may round it up to 30): it runs out within the outage
KEPT = "udhcpc: no lease on eth0 now; keeping {address} until a DHCP server answers"
BOUND = "udhcpc: bound {address}/"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    """Two lab nodes (BMC-controlled, powered on by the server) running one image."""
    run_dir = tmp_path_factory.mktemp("outage")
    layout = build_image(run_dir / "oci", "sleeper", "SLEEPER-IMAGE")
    text = lab_text().replace('power = "on"\n', 'power = "on"\nimage = "sleeper"\n', 1)
    text = text.replace("lease_time = 3600", f"lease_time = {LEASE}", 1)
    text += f'\n[images.sleeper]\nsource = "oci-layout:{layout}:latest"\n'
    text += f'command = ["/bin/sh", "-c", "{SLEEP}"]\n'
    config = run_dir / "nodes.toml"
    config.write_text(text)
    session = LabSession(run_dir, config)
    try:
        session.start(*NODES)
        yield session
    finally:
        session.close()


def starts(lab: LabSession, name: str) -> list[str]:
    """The VM uptimes at which its container started, as the container itself printed."""
    return re.findall(START, lab.lab.vms[name].serial_log.read_text(errors="replace"))


def answers_ping(lab: LabSession, address: str) -> bool:
    """One answer of three pings from the lab's namespace (the node file's address, which
    the API would show even for a node that lost it)."""
    pings = lab.lab.run(["busybox", "ping", "-c", "3", "-W", "5", address], check=False)
    return pings.returncode == 0


def since(path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def consoles_say(lab: LabSession, line: str, marks: dict[str, int]) -> bool:
    """Every node's console, since its mark, has `line` with the node's address in it."""
    return all(
        line.format(address=ADDRESSES[n]) in since(lab.lab.vms[n].serial_log, marks[n])
        for n in NODES
    )


def test_nodes_keep_their_containers_while_the_server_is_down(lab: LabSession) -> None:
    def running() -> bool:
        nodes = lab.nodes()
        return all(
            nodes[n]["run_state"] == "ready"
            and nodes[n]["image"]["state"] == "active"
            and len(starts(lab, n)) == 1
            for n in NODES
        )

    lab.wait(running, 300, "cn001 and cn002 ready, image sleeper active, its container started")
    before = lab.nodes()
    started = {n: starts(lab, n) for n in NODES}
    bmc_logs = {n: lab.run_dir / f"{n}.bmc.log" for n in NODES}
    bmc_marks = {n: path.stat().st_size for n, path in bmc_logs.items()}
    serial_marks = {n: lab.lab.vms[n].serial_log.stat().st_size for n in NODES}

    lab.crash()
    time.sleep(OUTAGE)  # the outage itself: what is being tested

    deadline = time.monotonic() + 180  # generous: a lease of at most 30 s, a busy machine
    while not consoles_say(lab, KEPT, serial_marks):  # not lab.wait: it stops without a server
        assert time.monotonic() < deadline, "both nodes' leases running out: not in 180 s"
        time.sleep(0.5)
    assert all(lab.lab.vms[n].alive() for n in NODES)
    down = {n: since(lab.lab.vms[n].serial_log, serial_marks[n]) for n in NODES}
    for name in NODES:  # the agents noticed, and kept trying; the addresses stayed
        assert "server unreachable since uptime" in down[name], down[name][-2000:]
        assert answers_ping(lab, ADDRESSES[name]), f"{name} lost {ADDRESSES[name]}"
    outage_marks = {n: lab.lab.vms[n].serial_log.stat().st_size for n in NODES}

    restarted = time.time()
    log_start = lab.serve()
    serving = time.time()

    def back(after: float) -> bool:
        nodes = lab.nodes()
        return all(
            nodes[n]["run_state"] == "ready"
            and nodes[n]["image"]["state"] == "active"
            and nodes[n]["last_report"] > after
            for n in NODES
        )

    lab.wait(lambda: back(serving), 240, "both nodes reporting again, ready, image active")

    lab.wait(  # udhcpc asks again every ~40 s (10 tries 2 s apart, then 20 s) once none answered
        lambda: consoles_say(lab, BOUND, outage_marks), 240,
        "both nodes leasing their addresses from the server again",
    )  # fmt: skip
    took = time.time() - restarted
    # three heartbeats more: whatever the first answers told the agents is done by then
    settled = time.time() + 3 * HEARTBEAT
    lab.wait(lambda: back(settled), 120, f"both nodes reporting after {settled:.0f}, ready")
    after = lab.nodes()
    print(f"outage {OUTAGE:g} s; both nodes ready {took:.1f} s after the server was started again")

    served = since(lab.serve_log, log_start)
    for name in NODES:
        console = since(lab.lab.vms[name].serial_log, serial_marks[name])
        assert starts(lab, name) == started[name], f"{name}: its container started again"
        assert not STOPPED.search(console), f"{name}: {STOPPED.search(console)}"
        assert "server reachable again after" in console, console[-2000:]
        assert after[name]["boots"] == before[name]["boots"], f"{name} booted again"
        assert after[name]["boot"]["boot_id"] == before[name]["boot"]["boot_id"]
        assert after[name]["agent"]["uptime"] > before[name]["agent"]["uptime"] + OUTAGE
        assert answers_ping(lab, ADDRESSES[name]), f"{name} lost {ADDRESSES[name]}"
        assert after[name]["image"]["digest"] == before[name]["image"]["digest"]
        power = since(bmc_logs[name], bmc_marks[name])
        assert "power:" not in power, f"{name}'s BMC was told: {power}"
        assert not re.search(rf"{name}: (fire power\.|power (on|off|cycle)$)", served, re.M)
