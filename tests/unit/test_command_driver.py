"""The command power driver with real small programs (tests/commands/): a smart plug that
keeps its state in a file, one that hangs, one that prints megabytes of binary garbage,
one that fails with exit code 3, one that writes down the arguments it got."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from layerpy.config import load
from layerpy.power import PowerError, PowerSpec, make_driver
from layerpy.power.base import MAX_SESSIONS, CommandSpec
from layerpy.power.command import KEEP, CommandDriver
from layerpy.power.poller import Poller

COMMANDS = Path(__file__).resolve().parents[1] / "commands"
PLUG, HANG, GARBAGE = (str(COMMANDS / f"{n}.sh") for n in ("plug", "hang", "garbage"))
EXIT3, ARGS, BUSY = (str(COMMANDS / f"{n}.sh") for n in ("exit3", "args", "busy"))


def driver(node: str = "pi1", password: str | None = None, **commands) -> CommandDriver:
    commands.setdefault("on", ("true",))
    commands.setdefault("off", ("true",))
    commands.setdefault("status", ("echo", "on"))
    spec = PowerSpec("command", password=password, command=CommandSpec(**commands))
    made = make_driver(node, spec)
    assert isinstance(made, CommandDriver)
    return made


def plug(state: Path, **more) -> CommandDriver:
    ops = {op: (PLUG, str(state), op) for op in ("on", "off", "status")}
    return driver(**ops, **more)


def gone(pid: int) -> bool:
    """No such process, or only its zombie (a container's PID 1 may not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        await asyncio.sleep(0.02)


def test_a_plug_is_switched_and_its_status_follows(tmp_path: Path) -> None:
    state = tmp_path / "plug"

    async def scenario() -> list[str]:
        pi = plug(state)
        seen = [await pi.status()]
        await pi.on()
        seen.append(await pi.status())
        await pi.off()
        seen.append(await pi.status())
        await pi.cycle()  # no cycle command: off, then on
        seen.append(await pi.status())
        await pi.boot_network_once()  # no boot_network command: nothing runs
        return seen

    assert asyncio.run(scenario()) == ["off", "on", "off", "on"]
    calls = (tmp_path / "plug.log").read_text().split()
    assert calls == ["status", "on", "status", "off", "status", "off", "on", "status"]


def test_cycle_and_boot_network_commands_when_given(tmp_path: Path) -> None:
    state = tmp_path / "plug"
    pi = plug(state, cycle=(PLUG, str(state), "cycle"), boot_network=(PLUG, str(state), "pxe"))

    async def scenario() -> None:
        await pi.cycle()
        with pytest.raises(PowerError) as failed:
            await pi.boot_network_once()
        assert str(failed.value) == (
            f"pi1: boot_network command {PLUG}: exit code 2; stderr: plug: unknown operation pxe"
        )

    asyncio.run(scenario())
    assert (tmp_path / "plug.log").read_text().split() == ["cycle", "pxe"]


@pytest.mark.parametrize(
    ("printed", "state"),
    [("on\n", "on"), (" OFF \n", "off"), ("outletOn(1)", "on"), ("outletOff(2)", "off")],
)
def test_status_by_output(printed: str, state: str) -> None:
    patterns = {"status_on": "outletOn", "status_off": "outletOff"} if "(" in printed else {}
    pi = driver(status=("printf", "%s", printed), **patterns)
    assert asyncio.run(pi.status()) == state


@pytest.mark.parametrize(
    ("printed", "why"),
    [
        (
            "on and off",
            "output matches neither status_on nor status_off (garbage?); stdout: on and off",
        ),
        ("", "output matches neither status_on nor status_off (garbage?)"),
    ],
)
def test_status_output_matching_neither_state_is_an_error(printed: str, why: str) -> None:
    pi = driver(status=("printf", "%s", printed))
    with pytest.raises(PowerError) as failed:
        asyncio.run(pi.status())
    assert str(failed.value) == f"pi1: status command printf: {why}"


def test_status_output_matching_both_states_is_an_error() -> None:
    pi = driver(status=("echo", "power on, was off"), status_on="on", status_off="off")
    with pytest.raises(PowerError, match="output matches both status_on and status_off"):
        asyncio.run(pi.status())


def test_status_by_exit_code() -> None:
    codes = ((0, "on"), (3, "off"))
    assert asyncio.run(driver(status=("true",), status_exit=codes).status()) == "on"
    assert asyncio.run(driver(status=(EXIT3,), status_exit=codes).status()) == "off"
    with pytest.raises(PowerError) as failed:
        asyncio.run(driver(status=("false",), status_exit=codes).status())
    assert str(failed.value) == "pi1: status command false: exit code 1 means neither (on 0, off 3)"


def test_a_failing_command_names_node_operation_exit_code_and_output() -> None:
    with pytest.raises(PowerError) as failed:
        asyncio.run(driver(on=(EXIT3, "--outlet", "3")).on())
    assert str(failed.value) == (
        f"pi1: on command {EXIT3}: exit code 3; stderr: outlet busy: try again; stdout: partial"
    )
    with pytest.raises(PowerError) as failed:
        asyncio.run(driver(status=(EXIT3,)).status())
    assert str(failed.value).startswith(f"pi1: status command {EXIT3}: exit code 3; stderr: ")


def test_a_program_that_cannot_start() -> None:
    with pytest.raises(PowerError) as failed:
        asyncio.run(driver(off=("/nonexistent/snmpset", "x")).off())
    assert str(failed.value) == (
        "pi1: off command: cannot start /nonexistent/snmpset: No such file or directory"
    )


def test_binary_garbage_is_read_to_its_end_kept_bounded_and_shown_printable() -> None:
    """8 MB on stdout and 1 MB on stderr: the command is not blocked on a full pipe (it
    ends, well within the timeout), KEEP bytes of each are kept, and the error is one
    short printable line."""
    pi = driver(status=(GARBAGE,), timeout=60)

    async def scenario() -> tuple[int, bytes, bytes]:
        return await pi._run("status", (GARBAGE,))

    code, out, err = asyncio.run(scenario())
    assert (code, len(out), len(err)) == (0, KEEP, KEEP)
    with pytest.raises(PowerError) as failed:
        asyncio.run(pi.status())
    message = str(failed.value)
    assert message.startswith(f"pi1: status command {GARBAGE}: output matches neither")
    assert message.isprintable() and len(message) < 2000, message


def test_a_hanging_command_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pi = driver(on=(HANG, str(pids)), timeout=1)
    began = time.monotonic()
    with pytest.raises(PowerError) as failed:
        asyncio.run(pi.on())
    assert time.monotonic() - began < 10
    assert str(failed.value) == f"pi1: on command {HANG}: no end in 1 s: killed; stdout: hanging"
    shell, sleep = (int(pid) for pid in pids.read_text().split())
    deadline = time.monotonic() + 10
    while not (gone(shell) and gone(sleep)):
        assert time.monotonic() < deadline, "the hanging command and its sleep to be gone"
        time.sleep(0.02)


@pytest.mark.parametrize("leaves", [False, True])
def test_a_command_whose_caller_stops_waiting_is_killed(tmp_path: Path, leaves: bool) -> None:
    """The poller's own bound, or a shutdown, cancels the operation: nothing is left, be
    it the command itself or (`leaves`) what it left behind holding its output."""
    pids = tmp_path / "pids"
    status = (HANG, str(pids))
    if leaves:
        status = ("sh", "-c", f"sleep 3600 & echo $! > {pids}.part; mv {pids}.part {pids}")
    pi = driver(status=status, timeout=60)

    async def scenario() -> None:
        task = asyncio.create_task(pi.status())
        await wait_for(pids.exists, 10, "the hanging command started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    for pid in (int(pid) for pid in pids.read_text().split()):
        deadline = time.monotonic() + 10
        while not gone(pid):
            assert time.monotonic() < deadline, f"process {pid} of the cancelled command gone"
            time.sleep(0.02)


def test_a_command_leaving_a_process_behind_with_its_output(tmp_path: Path) -> None:
    """It exits at once, but what it started in the background holds its stdout open."""
    script = "sleep 3600 & echo $! > " + str(tmp_path / "pid") + "; echo on"
    pi = driver(status=("sh", "-c", script), timeout=1)
    with pytest.raises(PowerError) as failed:
        asyncio.run(pi.status())
    assert "exited 0, but what it started kept its output open for 1 s: killed" in str(failed.value)
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 10
    while not gone(pid):
        assert time.monotonic() < deadline, "the background sleep gone"
        time.sleep(0.02)


def test_at_most_max_sessions_commands_at_once(tmp_path: Path) -> None:
    running = tmp_path / "running"
    running.mkdir()
    drivers = [driver(f"pi{i}", status=(BUSY, str(running))) for i in range(MAX_SESSIONS + 8)]
    most = 0

    async def scenario() -> list[str]:
        nonlocal most
        polls = asyncio.gather(*(d.status() for d in drivers))
        while not polls.done():
            most = max(most, len(os.listdir(running)))
            await asyncio.sleep(0.01)
        return await polls

    assert asyncio.run(scenario()) == ["on"] * len(drivers)
    assert MAX_SESSIONS // 2 < most <= MAX_SESSIONS


def test_the_poller_backs_off_a_failing_command() -> None:
    """The same poller as for IPMI: a failing status is reported, retried with backoff."""
    drivers = {"pi1": driver(status=(EXIT3,)), "pi2": driver()}
    reports: list[tuple[str, str | None, str | None]] = []

    async def scenario() -> Poller:
        poller = Poller(drivers, lambda *report: reports.append(report), 0.05, backoff=(5, 60))
        task = asyncio.create_task(poller.run())
        await wait_for(lambda: sum(r[0] == "pi2" for r in reports) >= 3, 20, "three polls of pi2")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return poller

    poller = asyncio.run(scenario())
    failed = [r for r in reports if r[0] == "pi1"]
    assert len(failed) == 1 and failed[0][1] is None and "exit code 3" in failed[0][2]
    assert poller.failures("pi1") == 1 and poller.retry_in("pi1") > 3
    assert ("pi2", "on", None) in reports


NODE_FILE = """\
[server]
interface = "br0"
address = "10.99.0.1"
state_dir = "state"

[network]
subnet = "10.99.0.0/24"
gateway = "10.99.0.1"

[minos]
kernel = "vmlinuz"
initrd = "minos.img"

[ipxe]
dir = "ipxe"

[groups.pis]
nodes = "pi[1-2]"
ip = "10.99.0.[11-12]"
vars = {{ community = "it's a \\"secret\\"; rm -rf / $(reboot) `id`", outlet = 3, x = true }}
bmc = {{ driver = "command", address = "[5-6]", password_env = "LAYERPY_TEST_PW", on = "{args} {out} --community={{community}} '{{node}} {{address}}' {{outlet}}{{x}} {{{{}}}}", off = "true", status = "echo on" }}
"""


def test_no_value_can_add_or_split_arguments(tmp_path: Path, monkeypatch) -> None:
    """Variables with spaces, quotes, a ``;``, ``$(…)`` and backquotes stay inside their
    one argument; the password goes to the environment, never into an argument."""
    for name in ("vmlinuz", "minos.img"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "ipxe").mkdir()
    for name in ("undionly.kpxe", "snponly.efi"):
        (tmp_path / "ipxe" / name).write_bytes(b"x")
    out = tmp_path / "args"
    (tmp_path / "nodes.toml").write_text(NODE_FILE.format(args=ARGS, out=out))
    monkeypatch.setenv("LAYERPY_TEST_PW", "pw with spaces")
    config = load(tmp_path / "nodes.toml")
    asyncio.run(make_driver("pi2", config.nodes["pi2"].bmc).on())
    assert out.read_bytes().split(b"\0")[:-1] == [
        b'--community=it\'s a "secret"; rm -rf / $(reboot) `id`',
        b"pi2 6",
        b"3true",
        b"{}",
        b"pw with spaces",
        b"unset",  # the server's own environment (other nodes' password_env) is not passed
    ]
    assert "pw with spaces" not in repr(config.nodes["pi2"])


def test_make_driver_wants_the_commands() -> None:
    with pytest.raises(PowerError, match=r"^pi1: power driver command needs its commands$"):
        make_driver("pi1", PowerSpec("command"))


def test_a_command_printing_its_password_does_not_put_it_in_the_error() -> None:
    """`set -x`, `curl -v`: what the command printed is shown with the password taken
    out, before it is cut to SHOWN characters (a cut could leave part of it)."""
    secret = "s3cr3t-" + "p" * 200  # longer than what is shown: scrubbed before the cut
    script = 'echo "+ login $LAYERPY_BMC_PASSWORD" >&2; echo "pw=$LAYERPY_BMC_PASSWORD"; exit 3'
    pi = driver(password=secret, on=("sh", "-c", script))
    with pytest.raises(PowerError) as raised:
        asyncio.run(pi.on())
    message = str(raised.value)
    assert "exit code 3" in message and "+ login ***" in message, message
    assert "s3cr3t" not in message
