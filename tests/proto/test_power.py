"""Power control with real peers: ipmitool and curl against the lab BMC driving a real QEMU,
and layerpy's drivers (ipmi, redfish, qemu) against the same BMC and VM.

Everything runs inside a lab namespace: the BMC at 10.99.1.11 on the lab's ``bmc0``,
ipmitool and curl through ``ip netns exec``, and the drivers in a child process started
the same way (this file run as a script, ``SCENARIOS`` below).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from layerpy.power import NoneDriver, PowerError, PowerSpec, make_driver
from layerpy.power.base import MAX_SESSIONS, scrub
from layerpy.power.ipmi import DEAD_AFTER
from layerpy.power.poller import Poller

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vm-lab"))

from bmc import qmp, start_bmc
from lab import Lab

BMC = "10.99.1.11"
DEAD = "10.99.1.99"  # on bmc0's subnet, nothing answers there
PASSWORD = "lab-bmc-Secret-7"
REDFISH = f"http://{BMC}:8000"
SYSTEM = f"{REDFISH}/redfish/v1/Systems/1"


class Rig:
    """A lab namespace with one tiny paused QEMU (no NIC, no disk) and its BMC."""

    def __init__(self, run_dir: Path, delay: float = 0.0, start_after: float = 0.0) -> None:
        """`delay` and `start_after`: a slow BMC, one that opens its ports late."""
        self.lab = Lab(run_dir, ra=False)
        try:
            self.qmp_path = run_dir / "cn001.qmp"
            qemu = ["qemu-system-x86_64", "-accel", "tcg", "-m", "64", "-S", "-nodefaults"]
            qemu += ["-display", "none", "-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
            self.lab.popen(qemu, log=run_dir / "cn001.qemu.log")
            deadline = time.monotonic() + 10
            while not self.qmp_path.exists():
                assert time.monotonic() < deadline, (run_dir / "cn001.qemu.log").read_text()
                time.sleep(0.05)
            (run_dir / "bmc.pass").write_text(PASSWORD + "\n")
            password = run_dir / "bmc.pass"
            start_bmc(self.lab, "cn001", BMC, password, delay=delay, start_after=start_after)
        except BaseException:
            self.lab.close()
            raise

    def vm(self) -> str:
        """QEMU's own run state, asked over QMP behind the BMC's back."""
        return qmp(self.qmp_path, "query-status")[0]["status"]

    def ipmitool(self, *args: str, check: bool = True) -> str:
        cmd = ["ipmitool", "-I", "lanplus", "-H", BMC, "-U", "admin", "-P", PASSWORD, *args]
        result = self.lab.run(cmd, check=False, timeout=30)
        assert not check or result.returncode == 0, result.stderr
        return result.stdout + result.stderr

    def curl(self, *args: str) -> tuple[int, dict[str, str], Any]:
        """Status, headers (lower-case names) and JSON body of one curl call."""
        result = self.lab.run(["curl", "-s", "-i", "--max-time", "5", *args])
        head, _, body = result.stdout.replace("\r\n", "\n").partition("\n\n")
        status_line, *lines = head.splitlines()
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        return int(status_line.split()[1]), headers, json.loads(body) if body else None

    def in_lab(self, scenario: str, timeout: float = 60, **args: Any) -> Any:
        """Run SCENARIOS[scenario] in a child process inside the namespace."""
        cmd = [sys.executable, __file__, scenario, json.dumps(args)]
        result = self.lab.run(cmd, check=False, timeout=timeout)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory):
    rig = Rig(tmp_path_factory.mktemp("power"))
    yield rig
    rig.lab.close()


@pytest.mark.netns
def test_ipmitool_drives_the_vm_through_the_bmc(rig: Rig) -> None:
    rig.ipmitool("power", "off")
    assert "Chassis Power is off" in rig.ipmitool("power", "status")
    assert rig.vm() == "prelaunch"
    assert "Up/On" in rig.ipmitool("power", "on")
    assert "Chassis Power is on" in rig.ipmitool("power", "status")
    assert rig.vm() == "running"
    rig.ipmitool("power", "cycle")
    assert rig.vm() == "running"
    assert "Down/Off" in rig.ipmitool("power", "off")
    assert (rig.vm(), rig.ipmitool("power", "status").strip()) == (
        "prelaunch",
        "Chassis Power is off",
    )
    rig.ipmitool("power", "cycle")  # from off: powers on
    assert rig.vm() == "running"

    # A VM frozen behind the BMC's back still reads "on"; a reset thaws it.
    qmp(rig.qmp_path, "stop")
    assert "Chassis Power is on" in rig.ipmitool("power", "status")
    assert rig.vm() == "paused"
    rig.ipmitool("power", "reset")
    assert rig.vm() == "running"
    rig.ipmitool("power", "off")


@pytest.mark.netns
def test_ipmitool_bootdev_pxe_lasts_one_boot(rig: Rig) -> None:
    assert "Set Boot Device to pxe" in rig.ipmitool("chassis", "bootdev", "pxe")
    assert "Force PXE" in rig.ipmitool("chassis", "bootparam", "get", "5")
    boot = rig.curl("-u", f"admin:{PASSWORD}", SYSTEM)[2]["Boot"]
    assert (boot["BootSourceOverrideTarget"], boot["BootSourceOverrideEnabled"]) == ("Pxe", "Once")
    rig.ipmitool("power", "on")
    assert "No override" in rig.ipmitool("chassis", "bootparam", "get", "5")
    rig.ipmitool("power", "off")


@pytest.mark.netns
def test_ipmitool_cipher_17_refused_and_wrong_password(rig: Rig) -> None:
    out = rig.ipmitool("-C", "17", "power", "status", check=False)
    assert "no matching cipher suite" in out
    assert "Chassis Power is" in rig.ipmitool("-C", "3", "power", "status")
    wrong = ["ipmitool", "-I", "lanplus", "-H", BMC, "-U", "admin", "-P", "nope", "power", "status"]
    assert rig.lab.run(wrong, check=False, timeout=30).returncode != 0


@pytest.mark.netns
def test_redfish_with_curl(rig: Rig) -> None:
    code, _, root = rig.curl(f"{REDFISH}/redfish/v1")
    assert code == 200 and root["Systems"] == {"@odata.id": "/redfish/v1/Systems"}
    assert rig.curl(SYSTEM)[0] == 401
    assert rig.curl("-u", "admin:wrong", SYSTEM)[0] == 401
    code, _, systems = rig.curl("-u", f"admin:{PASSWORD}", f"{REDFISH}/redfish/v1/Systems")
    assert systems["Members"] == [{"@odata.id": "/redfish/v1/Systems/1"}]

    login = json.dumps({"UserName": "admin", "Password": PASSWORD})
    sessions = f"{REDFISH}/redfish/v1/SessionService/Sessions"
    code, headers, _ = rig.curl(
        "-X", "POST", "-H", "Content-Type: application/json", "--data", login, sessions
    )
    assert code == 201 and headers["location"].startswith("/redfish/v1/SessionService/Sessions/")
    token = ["-H", f"X-Auth-Token: {headers['x-auth-token']}"]
    reset = f"{SYSTEM}/Actions/ComputerSystem.Reset"

    def post(reset_type: str) -> tuple[int, Any]:
        code, _, body = rig.curl(
            *token, "-X", "POST", "--data", json.dumps({"ResetType": reset_type}), reset
        )
        return code, body

    assert post("On")[0] == 204
    system = rig.curl(*token, SYSTEM)[2]
    assert (system["PowerState"], rig.vm()) == ("On", "running")
    assert system["Actions"]["#ComputerSystem.Reset"]["ResetType@Redfish.AllowableValues"] == [
        "On",
        "ForceOff",
        "ForceRestart",
        "PowerCycle",
    ]
    assert post("ForceRestart")[0] == 204 and rig.vm() == "running"
    assert post("PowerCycle")[0] == 204 and rig.vm() == "running"
    assert post("ForceOff")[0] == 204
    assert (rig.curl(*token, SYSTEM)[2]["PowerState"], rig.vm()) == ("Off", "prelaunch")
    code, body = post("Hibernate")
    assert code == 400 and "ResetType: one of On, ForceOff" in body["error"]["message"]

    boot = {"Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}}
    assert rig.curl(*token, "-X", "PATCH", "--data", json.dumps(boot), SYSTEM)[0] == 204
    assert rig.curl(*token, SYSTEM)[2]["Boot"]["BootSourceOverrideTarget"] == "Pxe"
    assert "Force PXE" in rig.ipmitool("chassis", "bootparam", "get", "5")

    assert rig.curl(*token, "-X", "DELETE", f"{REDFISH}{headers['location']}")[0] == 204
    assert rig.curl(*token, SYSTEM)[0] == 401


@pytest.mark.netns
@pytest.mark.parametrize(
    ("driver", "address"),
    [("ipmi", BMC), ("redfish", REDFISH), ("redfish", SYSTEM), ("qemu", "cn001.qmp")],
)
def test_driver_against_the_lab(rig: Rig, driver: str, address: str) -> None:
    if driver == "qemu":
        address = str(rig.qmp_path)
    no_override = {"Boot": {"BootSourceOverrideTarget": "None"}}
    rig.curl("-u", f"admin:{PASSWORD}", "-X", "PATCH", "--data", json.dumps(no_override), SYSTEM)
    steps = rig.in_lab("exercise", driver=driver, address=address, qmp_path=str(rig.qmp_path))
    assert steps == [
        ["off", None, "prelaunch"],
        ["status", "off", "prelaunch"],
        ["on", None, "running"],
        ["status", "on", "running"],
        ["cycle", None, "running"],
        ["status", "on", "running"],
        ["off", None, "prelaunch"],
        ["cycle", None, "running"],  # from off: powers on
        ["status", "on", "running"],
        ["boot_network_once", None, "running"],
        ["off", None, "prelaunch"],
        ["status", "off", "prelaunch"],
    ]
    target = rig.curl("-u", f"admin:{PASSWORD}", SYSTEM)[2]["Boot"]["BootSourceOverrideTarget"]
    assert target == ("None" if driver == "qemu" else "Pxe")  # lab VMs netboot anyway


@pytest.mark.netns
def test_dead_bmc_fails_fast_and_does_not_hold_up_a_live_one(rig: Rig) -> None:
    result = rig.in_lab("dead_and_live")
    # a login sends twice, each time waiting longer than a slow BMC takes to answer
    assert re.fullmatch(
        r"cn099: BMC 10\.99\.1\.99 unreachable \(no answer in 1[1-4] s\)", result["ipmi_error"]
    )
    assert result["ipmi_failed_after"] < DEAD_AFTER + 2
    assert result["live_done_at"] < result["ipmi_failed_after"]
    assert max(result["live_latencies"]) < 1.0, result
    assert result["redfish_error"].startswith("cn099: BMC http://10.99.1.99:8000 unreachable (")
    assert result["redfish_failed_after"] < 6.5


@pytest.mark.netns
def test_dead_bmcs_cannot_keep_a_live_one_waiting(rig: Rig) -> None:
    """Each try at a dead BMC holds an IPMI worker for seconds: with twice as many dead
    BMCs as workers, a live BMC's actions waited behind theirs (about 24 s)."""
    result = rig.in_lab("dead_crowd", timeout=300)
    polls = result["polls"]
    assert all(error and "unreachable (no answer in" in error for _, error in polls), polls
    assert [error for _, error in result["live"]] == [None, None, None], result["live"]
    slowest = max(seconds for seconds, _ in result["live"])
    print(f"\nlive BMC beside 32 dead ones: slowest action {slowest:.1f} s")
    assert slowest < 10.0, result["live"]
    for seconds, error in result["actions"]:
        assert "not tried again" in error and seconds < 1.0, (seconds, error)


# IPMI answers 4 s late; Redfish 6 s, above the 5 s a request was once allowed: Redfish
# BMCs are the slower kind. Both open their ports only 8 s after the driver first tries.
SLOW = {"ipmi": (BMC, 4.0), "redfish": (REDFISH, 6.0)}
LATE = 8.0


def slow_and_late(run_dir: Path, driver: str) -> dict[str, Any]:
    """The slow_late scenario against a lab of its own whose BMC is late and slow."""
    address, delay = SLOW[driver]
    rig = Rig(run_dir, delay=delay, start_after=LATE)
    try:
        args = {"driver": driver, "address": address, "qmp_path": str(rig.qmp_path)}
        return rig.in_lab("slow_late", timeout=400, **args)
    finally:
        rig.lab.close()


@pytest.mark.netns
def test_slow_and_late_bmcs_are_read_and_switched(tmp_path: Path) -> None:
    """A BMC that comes up after the driver first tries, then answers every request
    seconds late, is still found by the poller, and on/off/cycle then succeed at the
    first attempt; an action whose caller stopped waiting before the BMC was there is
    not carried out later. Both drivers at once, each in its own lab: the time is spent
    waiting for the BMCs, not computing."""
    with ThreadPoolExecutor() as pool:
        runs = {driver: pool.submit(slow_and_late, tmp_path / driver, driver) for driver in SLOW}
        results = {driver: run.result() for driver, run in runs.items()}
    for driver, result in results.items():
        reports, steps = result["reports"], result["steps"]
        print(f"\n{driver}, {SLOW[driver][1]:g} s late answers, listening after {LATE:g} s: "
              f"state read {result['read_after']:.1f} s after the first try; "
              f"polls {reports}; steps {steps}")  # fmt: skip
        first = next(r for r in reports if r[1] is not None)
        assert first[1:] == ["off", None, "prelaunch"], reports  # the abandoned "on" never ran
        assert all(r[2] for r in reports[: reports.index(first)]), reports  # errors until then
        assert [step[:3] for step in steps] == [
            ["on", None, "running"],
            ["status", "on", "running"],
            ["cycle", None, "running"],
            ["off", None, "prelaunch"],
            ["status", "off", "prelaunch"],
        ], driver


@pytest.mark.netns
def test_passwords_never_shown(rig: Rig) -> None:
    messages = rig.in_lab("refused")
    assert messages == {
        "ipmi": "cn001: BMC 10.99.1.11: Incorrect password provided",
        "redfish": "cn001: BMC http://10.99.1.11:8000: login refused: wrong user or password",
    }
    spec = PowerSpec("ipmi", BMC, "admin", PASSWORD)
    assert PASSWORD not in repr(spec) and PASSWORD not in str(spec)
    assert scrub(f"echo {PASSWORD}", PASSWORD) == "echo ***"


def test_make_driver_refuses_unknown_drivers_and_missing_addresses() -> None:
    with pytest.raises(PowerError, match=r"cn001: unknown power driver 'wol'"):
        make_driver("cn001", PowerSpec("wol"))
    with pytest.raises(PowerError, match=r"cn001: power driver redfish needs an address"):
        make_driver("cn001", PowerSpec("redfish"))


def test_none_driver_reports_the_last_command() -> None:
    async def run() -> list[str]:
        power = make_driver("cn001", PowerSpec("none"))
        assert isinstance(power, NoneDriver)
        states = [await power.status()]
        for action in (power.off, power.cycle, power.off, power.on, power.boot_network_once):
            await action()
            states.append(await power.status())
        return states

    assert asyncio.run(run()) == ["on", "off", "on", "off", "on", "on"]


# --- what runs inside the namespace --------------------------------------------------------


STEPS = ("off", "status", "on", "status", "cycle", "status", "off", "cycle", "status")
STEPS += ("boot_network_once", "off", "status")


async def exercise(driver: str, address: str, qmp_path: str) -> list[list[Any]]:
    """Each step: the action, its result and QEMU's run state right after."""
    power = make_driver("cn001", PowerSpec(driver, address, "admin", PASSWORD))
    steps: list[list[Any]] = []
    try:
        for name in STEPS:
            result = await getattr(power, name)()
            steps.append([name, result, qmp(Path(qmp_path), "query-status")[0]["status"]])
    finally:
        await power.close()
    return steps


async def dead_and_live() -> dict[str, Any]:
    """A dead BMC's status in the background while a live BMC is switched on and off."""
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def fails(driver: str, address: str) -> tuple[str, float]:
        power = make_driver("cn099", PowerSpec(driver, address, "admin", PASSWORD))
        try:
            await power.status()
        except PowerError as error:
            return str(error), loop.time() - started
        finally:
            await power.close()
        raise AssertionError(f"{driver}: a dead BMC answered")

    dead_ipmi = asyncio.create_task(fails("ipmi", DEAD))
    dead_redfish = asyncio.create_task(fails("redfish", f"http://{DEAD}:8000"))
    live = make_driver("cn001", PowerSpec("ipmi", BMC, "admin", PASSWORD))
    latencies = []
    for name in ("status", "on", "status", "off", "status") * 2:
        begun = loop.time()
        await getattr(live, name)()
        latencies.append(loop.time() - begun)
        await asyncio.sleep(0.2)
    live_done_at = loop.time() - started
    await live.close()
    (ipmi_error, ipmi_after), (redfish_error, redfish_after) = await asyncio.gather(
        dead_ipmi, dead_redfish
    )
    return {
        "ipmi_error": ipmi_error,
        "ipmi_failed_after": ipmi_after,
        "redfish_error": redfish_error,
        "redfish_failed_after": redfish_after,
        "live_latencies": latencies,
        "live_done_at": live_done_at,
    }


async def dead_crowd() -> dict[str, Any]:
    """32 dead BMCs (twice the IPMI workers) are polled, as many at once as there are
    workers, and found silent; then each gets an action while a live BMC is switched.
    Times in seconds."""
    loop = asyncio.get_running_loop()
    dead = [make_driver(f"cn{100 + i}", PowerSpec("ipmi", f"10.99.1.{100 + i}", "admin",
                                                  PASSWORD)) for i in range(32)]  # fmt: skip
    workers = asyncio.Semaphore(MAX_SESSIONS)

    async def poll(power: Any) -> None:
        async with workers:
            await power.status()

    live = make_driver("cn001", PowerSpec("ipmi", BMC, "admin", PASSWORD))

    async def timed(call: Any) -> tuple[float, str | None]:
        begun = loop.time()
        try:
            await call
        except PowerError as error:
            return loop.time() - begun, str(error)
        return loop.time() - begun, None

    try:
        polls = await asyncio.gather(*(timed(poll(power)) for power in dead))
        actions = [asyncio.create_task(timed(power.on())) for power in dead]
        switched = [await timed(getattr(live, name)()) for name in ("on", "status", "off")]
        refused = await asyncio.gather(*actions)
    finally:
        await asyncio.gather(live.close(), *(power.close() for power in dead))
    return {"polls": polls, "actions": refused, "live": switched}


async def refused() -> dict[str, str]:
    """The errors of a wrong password, as shown."""
    wrong = "Not-The-Password-1"
    cases = {
        "ipmi": PowerSpec("ipmi", BMC, "admin", wrong),
        "redfish": PowerSpec("redfish", REDFISH, "admin", wrong),
    }
    messages = {}
    for name, spec in cases.items():
        power = make_driver("cn001", spec)
        try:
            await power.status()
        except PowerError as error:
            messages[name] = str(error)
        finally:
            await power.close()
    assert not [text for text in messages.values() if wrong in text]
    return messages


async def slow_late(driver: str, address: str, qmp_path: str) -> dict[str, Any]:
    """Against a late, slow BMC: an "on" abandoned after 3 s, then a poller until it reads
    a state, then a round of actions (each must succeed at once). Times from the start."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    power = make_driver("cn001", PowerSpec(driver, address, "admin", PASSWORD))

    def vm() -> str:
        return qmp(Path(qmp_path), "query-status")[0]["status"]

    with contextlib.suppress(TimeoutError, PowerError):
        await asyncio.wait_for(power.on(), 3)
    reports: list[list[Any]] = []
    read = asyncio.Event()

    def report(name: str, state: str | None, error: str | None) -> None:
        reports.append([round(loop.time() - started, 1), state, error, vm()])
        if state is not None:
            read.set()

    poller = asyncio.create_task(Poller({"cn001": power}, report, 2.0).run())
    try:
        await asyncio.wait_for(read.wait(), 200)  # generous: about 45 s expected
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
    read_after = loop.time() - started
    steps = []
    try:
        for name in ("on", "status", "cycle", "off", "status"):
            begun = loop.time()
            result = await getattr(power, name)()
            steps.append([name, result, vm(), round(loop.time() - begun, 1)])
    finally:
        await power.close()
    return {"reports": reports, "read_after": read_after, "steps": steps}


SCENARIOS = {
    "exercise": exercise,
    "dead_and_live": dead_and_live,
    "dead_crowd": dead_crowd,
    "refused": refused,
    "slow_late": slow_late,
}

if __name__ == "__main__":
    scenario, arguments = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(asyncio.run(SCENARIOS[scenario](**arguments))))
