"""Serial-over-LAN with real peers: ipmitool and layerpy's console (consoles/sol.py) against
the lab BMC (vm-lab/bmc.py), which bridges SOL to a serial line this test plays: a Unix
socket server where QEMU's serial chardev would be, that prints lines and records what is
typed into it.

As in test_power.py, everything runs inside a lab namespace: the BMC at 10.99.1.11 beside a
tiny paused QEMU (for power, over QMP), ipmitool through ``ip netns exec`` on a pty, and
layerpy in a child process started the same way (this file run as a script, ``SCENARIOS``
below). The serial line is the test's channel to the child, as it would be to a person: the
test prints what the child waits for and waits for what the child types. Times are
CLOCK_MONOTONIC, which both processes read alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyghmi.ipmi.private import session as pyghmi_session

from layerpy.consoles.link import ConsoleError
from layerpy.consoles.sol import CLOSE_WAIT, PROBE_AFTER, SolLink, _SolSession, open_sol
from layerpy.power import PowerSpec, make_driver
from layerpy.power.ipmi import DEAD_AFTER

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vm-lab"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bmc import SOL_IDLE, qmp, start_bmc
from lab import Lab
from netns import need_root

BMC = "10.99.1.11"
DEAD = "10.99.1.99"  # on bmc0's subnet, nothing answers there
PASSWORD = "lab-bmc-Secret-7"
SPEC = PowerSpec("ipmi", BMC, "admin", PASSWORD)
WAIT = 60.0  # seconds any one condition is waited for: generous, they take milliseconds
IPMITOOL = ["ipmitool", "-I", "lanplus", "-H", BMC, "-U", "admin", "-E", "sol", "activate"]
IPMITOOL_ENV = {**os.environ, "IPMI_PASSWORD": PASSWORD}  # -E: not on the command line


class SerialLine:
    """The VM's serial socket as the BMC meets it: one client at a time, what is printed
    to it, what it received."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.client: socket.socket | None = None
        self.clients = 0  # connections so far
        self.events: list[str] = []  # what happened when, for the messages of failed waits
        self.received = bytearray()
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError as error:
                self.events.append(f"{time.monotonic():.3f} accept: {error!r}")
                return  # closed
            with self.changed:
                self.client, self.clients = client, self.clients + 1
                self.events.append(f"{time.monotonic():.3f} connection {self.clients}")
                self.changed.notify_all()
            try:
                while data := client.recv(4096):
                    with self.changed:
                        self.received += data
                        self.changed.notify_all()
            except OSError:
                pass
            with self.changed:
                self.client = None
                self.events.append(f"{time.monotonic():.3f} connection {self.clients} ended")
                self.changed.notify_all()
            client.close()

    def print(self, data: bytes) -> None:
        with self.changed:
            assert self.client is not None, "nobody on the serial line to print to"
            client = self.client
        client.sendall(data)

    def wait(self, condition: Callable[[], bool], waited_for: str, timeout: float = WAIT) -> None:
        with self.changed:
            if not self.changed.wait_for(condition, timeout):
                tail = bytes(self.received[-300:])
                raise AssertionError(f"{waited_for}: not in {timeout:g} s (received {tail!r}; "
                                     f"at {time.monotonic():.3f}: {self.events})")  # fmt: skip

    def wait_connected(self, clients: int) -> None:
        self.wait(lambda: self.client is not None and self.clients >= clients,
                  f"the BMC on the serial line (connection {clients}, SOL activated)")  # fmt: skip

    def wait_let_go(self) -> None:
        self.wait(lambda: self.client is None, "the BMC leaving the serial line (SOL ended)")

    def wait_typed(self, text: bytes) -> None:
        self.wait(lambda: text in self.received, f"{text!r} typed on the serial line")

    def close(self) -> None:
        """The thread ends before the socket closes: an accept() under way, or about to
        start, would otherwise take a connection of the next test's serial line, which
        gets the same descriptor number."""
        self.server.shutdown(socket.SHUT_RDWR)  # ends accept(); close() would not
        with self.changed:
            if self.client is not None:
                self.client.shutdown(socket.SHUT_RDWR)
        self.thread.join(WAIT)
        self.server.close()
        self.path.unlink(missing_ok=True)


class Ipmitool:
    """``ipmitool sol activate`` on a pty, as a person at a terminal runs it."""

    def __init__(self, lab: Lab) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(lab.cmd(IPMITOOL), stdin=slave, stdout=slave,
                                     stderr=slave, env=IPMITOOL_ENV, start_new_session=True)  # fmt: skip
        lab.procs.append(self.proc)  # killed with the lab, should the test fail
        os.close(slave)
        self.output = bytearray()
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: ipmitool is gone
                data = b""
            with self.changed:
                self.output += data
                self.changed.notify_all()
            if not data:
                return

    def wait_for(self, text: bytes) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: text in self.output, WAIT):
                raise AssertionError(f"ipmitool did not show {text!r}: {bytes(self.output)!r}")

    def type(self, text: bytes) -> None:
        os.write(self.master, text)

    def close(self) -> int:
        """End it with ``~.`` (it then deactivates the payload); its exit code. The pty is
        closed once its reader has stopped reading that descriptor number."""
        self.type(b"\r~.")
        try:
            return self.proc.wait(WAIT)
        finally:
            self.reader.join(WAIT)
            os.close(self.master)


class Rig:
    """A lab namespace with a tiny paused QEMU (no serial), its BMC, and the test's serial
    line where the BMC looks for the VM's."""

    def __init__(self, run_dir: Path, sol_idle: float = SOL_IDLE) -> None:
        """`sol_idle`: how long the BMC keeps the payload of a silent session."""
        self.run_dir = run_dir
        self.serial = SerialLine(run_dir / "cn001.console")
        try:
            self.lab = Lab(run_dir, ra=False)
        except BaseException:
            self.serial.close()
            raise
        try:
            self.qmp_path = run_dir / "cn001.qmp"
            qemu = ["qemu-system-x86_64", "-accel", "tcg", "-m", "64", "-S", "-nodefaults"]
            qemu += ["-display", "none", "-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
            self.lab.popen(qemu, log=run_dir / "cn001.qemu.log")
            deadline = time.monotonic() + WAIT
            while not self.qmp_path.exists():
                assert time.monotonic() < deadline, (run_dir / "cn001.qemu.log").read_text()
                time.sleep(0.05)
            (run_dir / "bmc.pass").write_text(PASSWORD + "\n")
            self.bmc = start_bmc(self.lab, "cn001", BMC, run_dir / "bmc.pass", sol_idle=sol_idle)
        except BaseException:
            self.close()
            raise

    def child(self, scenario: str, **args: Any) -> subprocess.Popen[bytes]:
        """SCENARIOS[scenario] in a child process inside the namespace."""
        cmd = self.lab.cmd([sys.executable, __file__, scenario, json.dumps(args)])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
        self.lab.procs.append(proc)
        return proc

    def result(self, proc: subprocess.Popen[bytes], timeout: float = 120) -> Any:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
        return json.loads(out)

    def bmc_log(self) -> str:
        return (self.run_dir / "cn001.bmc.log").read_text()

    @contextlib.contextmanager
    def explained(self, proc: subprocess.Popen[bytes]):
        """A failed wait inside says what the child and the BMC did meanwhile (the child is
        ended for its output): a wait that fails only on a busy machine is read from that."""
        try:
            yield
        except AssertionError as error:
            if proc.poll() is None:
                proc.terminate()
            out, err = proc.communicate(timeout=WAIT)
            said = (out + err).decode(errors="replace")[-3000:]
            # a connection the BMC made that the serial line never took: still queued on
            # the listener (Recv-Q), or taken by another thread of this process
            # (every socket at the path: an accepted one names the process that holds it)
            queued = subprocess.run(["ss", "-xap", "src", str(self.serial.path)],
                                    capture_output=True, text=True).stdout  # fmt: skip
            frames = sys._current_frames()
            threads = [f"{thread.name}: {traceback.format_stack(frames[thread.ident], 4)}"
                       for thread in threading.enumerate() if thread.ident in frames]  # fmt: skip
            raise AssertionError(f"{error}\nthe child (exit {proc.returncode}) said:\n{said}\n"
                                 f"the BMC's log:\n{self.bmc_log()[-3000:]}\nthe serial "
                                 f"line's sockets:\n{queued}threads: {threads}") from None  # fmt: skip

    def wait_log(self, pattern: str) -> None:
        """Until the BMC's log matches `pattern`."""
        deadline = time.monotonic() + WAIT
        while not re.search(pattern, self.bmc_log()):
            assert time.monotonic() < deadline, f"{pattern!r} not in the BMC's log in {WAIT:g} s"
            time.sleep(0.05)

    def close(self) -> None:
        self.lab.close()
        self.serial.close()


@pytest.fixture
def rig(tmp_path: Path):
    need_root()
    rig = Rig(tmp_path)
    yield rig
    rig.close()


@pytest.mark.netns
def test_ipmitool_sol_shows_the_serial_line_and_types_into_it(rig: Rig) -> None:
    ipmitool = Ipmitool(rig.lab)
    ipmitool.wait_for(b"[SOL Session operational")
    rig.serial.wait_connected(1)
    rig.serial.print(b"login: hello from the serial line\r\n")
    ipmitool.wait_for(b"hello from the serial line")
    ipmitool.type(b"typed through ipmitool\r")
    rig.serial.wait_typed(b"typed through ipmitool\r")

    second = rig.lab.run(IPMITOOL, check=False, timeout=WAIT, env=IPMITOOL_ENV,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert second.returncode != 0
    assert "SOL payload already active on another session" in second.stdout + second.stderr

    assert ipmitool.close() == 0
    rig.serial.wait_let_go()
    rig.wait_log(r"sol: released: deactivated by the session of 10\.99\.1\.11:\d+\n")


@pytest.mark.netns
def test_layerpy_reads_types_and_drops_the_oldest_for_a_slow_reader(rig: Rig) -> None:
    """open_sol() reads what the serial line prints and types into it; while nobody reads,
    the oldest output is dropped and counted; close() deactivates the payload, returns at
    once and leaves no thread and no session behind."""
    child = rig.child("converse")
    rig.serial.wait_connected(1)
    rig.serial.print(f"ready {time.monotonic():.6f}\r\n".encode())
    rig.serial.wait_typed(b"typed through layerpy\r")
    burst = b"".join(f"burst {i:05d} {'x' * 80}\r\n".encode() for i in range(6000))
    burst += b"end of burst\r\n"
    rig.serial.print(burst)
    result = rig.result(child)
    rig.serial.wait_let_go()
    print(f"\nopen_sol {result['opened']:.2f} s, first line {result['first_line'] * 1000:.1f} ms "
          f"after it was printed; burst of {len(burst)} bytes: {result['read']} read, "
          f"{result['dropped']} dropped; close {result['closed'] * 1000:.1f} ms")  # fmt: skip
    assert result["opened"] < 5 and result["first_line"] < 1
    assert result["read"] + result["dropped"] == len(burst)  # every byte read or counted
    assert result["dropped"] > 0 and result["tail"].endswith("burst 05999 " + "x" * 80 + "\r\n")
    assert not result["tail"].startswith("burst 00000")  # the oldest went
    assert result["closed"] < CLOSE_WAIT and not result["thread_alive"]
    assert result["sessions_left"] == 0
    rig.wait_log(r"sol: released: deactivated by the session")


@pytest.mark.netns
def test_a_dead_bmc_ends_the_console_in_bounded_time(rig: Rig) -> None:
    child = rig.child("dead")
    rig.serial.wait_connected(1)
    rig.serial.print(b"ready\r\n")
    rig.serial.wait_typed(b"kill the bmc\r")
    os.killpg(rig.bmc.pid, signal.SIGKILL)  # the BMC loses power
    killed_at = time.monotonic()
    result = rig.result(child)
    noticed = result["ended_at"] - killed_at
    print(f"\ndead BMC noticed after {noticed:.1f} s ({result['how']}); "
          f"close {result['closed'] * 1000:.1f} ms")  # fmt: skip
    assert result["how"] == f"ConsoleError: cn001: BMC {BMC}: SOL: no answer in {DEAD_AFTER:g} s"
    assert DEAD_AFTER - PROBE_AFTER - 1 < noticed < DEAD_AFTER + 2
    assert result["closed"] < 0.5 and not result["thread_alive"]
    assert result["sessions_left"] == 0


@pytest.mark.netns
def test_power_through_the_ipmi_driver_while_the_console_is_open(rig: Rig) -> None:
    """The power driver's sessions and the console's to one BMC, in one process: power
    commands answer at once while the console streams and while it is quiet (and probes
    the BMC), and the console loses nothing."""
    child = rig.child("power", qmp_path=str(rig.qmp_path))
    rig.serial.wait_connected(1)
    for i in range(300):  # 6 s of a line every 20 ms while power is switched
        rig.serial.print(f"line {i:04d} {time.monotonic():.6f}\r\n".encode())
        time.sleep(0.02)
    rig.serial.print(b"end of lines\r\n")
    rig.serial.wait_typed(b"quiet phase done\r")
    rig.serial.print(f"bye {time.monotonic():.6f}\r\n".encode())
    result = rig.result(child)
    rig.serial.wait_let_go()
    streaming, quiet = result["streaming"], result["quiet"]
    print(f"\npower while streaming: {len(streaming)} commands, slowest "
          f"{max(s[2] for s in streaming) * 1000:.0f} ms; while quiet: {len(quiet)}, slowest "
          f"{max(s[2] for s in quiet) * 1000:.0f} ms; {len(result['lines'])} lines, slowest "
          f"{result['line_latency'] * 1000:.0f} ms; bye after the quiet phase "
          f"{result['bye_latency'] * 1000:.0f} ms")  # fmt: skip
    assert result["lines"] == list(range(300))  # all, in order
    assert result["dropped"] == 0 and result["line_latency"] < 1 and result["bye_latency"] < 1
    assert result["probed_while_quiet"]
    for phase in (streaming, quiet):
        assert len(phase) >= 8
        for name, state, seconds, vm in phase:
            assert seconds < 2, phase
            if name == "status":
                assert (state, vm) in (("on", "running"), ("off", "prelaunch")), phase
    rig.wait_log(r"sol: released: deactivated by the session")


@pytest.mark.netns
def test_layerpy_leaves_an_active_payload_alone_unless_forced(rig: Rig) -> None:
    """An admin's ipmitool holds the payload: open_sol() is refused; with force it takes
    it over; then the admin's ipmitool is refused while layerpy holds it, and an
    ``ipmitool sol deactivate`` ends layerpy's console at its next probe."""
    ipmitool = Ipmitool(rig.lab)
    ipmitool.wait_for(b"[SOL Session operational")
    rig.serial.wait_connected(1)
    child = rig.child("take_over")
    with rig.explained(child):  # failed twice under stress-ng, cause not yet known
        rig.serial.wait_connected(2)  # forced: deactivated, activated again for layerpy
    rig.serial.wait_typed(b"holding\r")
    again = rig.lab.run(IPMITOOL, check=False, timeout=WAIT, env=IPMITOOL_ENV,
                        stdin=subprocess.DEVNULL)  # fmt: skip
    assert "SOL payload already active on another session" in again.stdout + again.stderr
    rig.serial.print(b"hello layerpy\r\n")
    rig.serial.wait_typed(b"deactivate me\r")
    deactivate = [*IPMITOOL[:-1], "deactivate"]
    rig.lab.run(deactivate, timeout=WAIT, env=IPMITOOL_ENV)
    deactivated_at = time.monotonic()
    result = rig.result(child)
    noticed = result["ended_at"] - deactivated_at
    print(f"\ndeactivated by ipmitool: noticed after {noticed:.1f} s")
    assert result["refused"] == f"cn001: BMC {BMC}: SOL: SOL Session active for another client"
    assert result["forced"] == "hello layerpy\r\n"
    assert result["how"] == f"ConsoleError: cn001: BMC {BMC}: SOL: SOL deactivated"
    assert noticed < PROBE_AFTER + 2
    # the refused console left ipmitool's payload alone: the forced one took it over
    events = re.findall(r"sol: (activated|released: deactivated) by the session of (\S+)\n",
                        rig.bmc_log())  # fmt: skip
    (_, admin), (_, forced), (_, layerpy), _ = events
    assert admin != forced == layerpy, rig.bmc_log()
    ipmitool.close()  # its payload was taken: how it ends does not matter here


@pytest.mark.netns
def test_the_bmc_frees_the_payload_of_a_vanished_client(tmp_path: Path) -> None:
    """layerpy killed while it holds the payload: the BMC frees it after its session
    timeout, as real BMCs do, and the next client gets it."""
    need_root()
    rig = Rig(tmp_path, sol_idle=3)
    try:
        child = rig.child("hold")
        rig.serial.wait_typed(b"holding\r")
        os.killpg(child.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        rig.serial.wait_let_go()
        freed_after = time.monotonic() - killed_at
        print(f"\npayload of a killed client freed after {freed_after:.1f} s")
        # silence counts from the client's last packet, which the BMC heard just before
        # the kill: freed_after was once 2.998 s on a busy machine
        assert 2.5 <= freed_after < 5
        rig.wait_log(r"sol: released: the session was silent for 3 s")
        ipmitool = Ipmitool(rig.lab)
        ipmitool.wait_for(b"[SOL Session operational")
        assert ipmitool.close() == 0
    finally:
        rig.close()


@pytest.mark.netns
def test_unreachable_bmc_wrong_password_and_an_open_given_up(rig: Rig) -> None:
    result = rig.result(rig.child("unreachable"))
    assert result["refused"] == f"cn001: BMC {BMC}: SOL: Incorrect password provided"
    print(f"\nunreachable BMC: {result['failed_after']:.3f} s; an open given up after 1 s "
          f"returned after {result['given_up_after']:.2f} s")  # fmt: skip
    assert result["how"] == f"cn099: BMC {DEAD}: SOL: no answer in {DEAD_AFTER:g} s"
    assert DEAD_AFTER <= result["failed_after"] < DEAD_AFTER + 2
    assert result["given_up_after"] < 1 + CLOSE_WAIT
    assert result["threads_gone_after"] < 1 + CLOSE_WAIT and result["sessions_left"] == 0


# --- what runs inside the namespace --------------------------------------------------------


class Reader:
    """A link's output, read on demand."""

    def __init__(self, link: SolLink) -> None:
        self.link = link
        self.data = bytearray()

    async def until(self, pattern: bytes, start: int = 0) -> re.Match[bytes]:
        """The first match of `pattern` in the output from `start` on, reading until it
        comes."""
        try:
            async with asyncio.timeout(WAIT):
                while not (match := re.compile(pattern).search(self.data, start)):
                    chunk = await self.link.read()
                    assert chunk, f"the console ended before {pattern!r}"
                    self.data += chunk
        except TimeoutError:
            raise AssertionError(f"{pattern!r} not on the console in {WAIT:g} s: "
                                 f"{bytes(self.data[-300:])!r}") from None  # fmt: skip
        return match


async def wait_until(condition: Callable[[], bool], waited_for: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"{waited_for}: not in {WAIT:g} s"
        await asyncio.sleep(0.01)


async def end(link: SolLink) -> str:
    """Read until the link ends; how it did."""
    try:
        async with asyncio.timeout(WAIT):
            while await link.read():
                pass
    except ConsoleError as error:
        return f"ConsoleError: {error}"
    return "end"


async def closed(link: SolLink) -> tuple[float, bool]:
    """How long close() took, and whether its thread is still there a moment later."""
    begun = time.monotonic()
    await link.close()
    seconds = time.monotonic() - begun
    link._thread.join(1)
    return seconds, link._thread.is_alive()


def sessions_left() -> int:
    """Console sessions still in pyghmi's table of sessions."""
    tables = list(pyghmi_session.Session.bmc_handlers.values())
    return sum(isinstance(session, _SolSession) for table in tables for session in table.values())


async def converse() -> dict[str, Any]:
    begun = time.monotonic()
    link = await open_sol("cn001", SPEC)
    opened = time.monotonic() - begun
    reader = Reader(link)
    ready = await reader.until(rb"ready ([\d.]+)\r\n")
    first_line = time.monotonic() - float(ready[1])
    await link.write(b"typed through layerpy\r")
    await wait_until(lambda: link.dropped > 0, "output dropped while nobody reads")
    start = len(reader.data)
    await reader.until(b"end of burst\r\n", start)
    tail = bytes(reader.data[start:])
    seconds, alive = await closed(link)
    return {
        "opened": opened,
        "first_line": first_line,
        "read": len(tail),
        "dropped": link.dropped,
        "tail": tail[:200].decode() + "..." + tail[-200 : -len(b"end of burst\r\n")].decode(),
        "closed": seconds,
        "thread_alive": alive,
        "sessions_left": sessions_left(),
    }


async def dead() -> dict[str, Any]:
    link = await open_sol("cn001", SPEC)
    await Reader(link).until(b"ready\r\n")
    await link.write(b"kill the bmc\r")
    how = await end(link)
    ended_at = time.monotonic()
    seconds, alive = await closed(link)
    return {
        "ended_at": ended_at,
        "how": how,
        "closed": seconds,
        "thread_alive": alive,
        "sessions_left": sessions_left(),
    }


async def power(qmp_path: str) -> dict[str, Any]:
    link = await open_sol("cn001", SPEC)
    driver = make_driver("cn001", SPEC)
    reader = Reader(link)
    lines: list[int] = []
    latency = 0.0

    async def switch(until: Callable[[], bool]) -> list[list[Any]]:
        """Power on, status, off, status, … every 0.1 s until `until`; each step: its
        name, its result, its seconds, QEMU's run state after it."""
        steps = []
        while not until():
            for name in ("on", "status", "off", "status"):
                begun = time.monotonic()
                state = await getattr(driver, name)()
                seconds = time.monotonic() - begun
                vm = qmp(Path(qmp_path), "query-status")[0]["status"]
                steps.append([name, state, seconds, vm])
            await asyncio.sleep(0.1)
        return steps

    async def read_lines() -> None:
        """Each line as it comes, with how long after it was printed."""
        nonlocal latency
        start = 0
        while (line := await reader.until(rb"line (\d+) ([\d.]+)\r\n|end of lines", start))[1]:
            start = line.end()
            lines.append(int(line[1]))
            latency = max(latency, time.monotonic() - float(line[2]))

    try:
        reading = asyncio.create_task(read_lines())
        streaming = await switch(reading.done)
        await reading
        quiet_from = time.monotonic()  # the console probes the BMC in this phase
        quiet = await switch(lambda: time.monotonic() - quiet_from > 2.5 * PROBE_AFTER)
        await link.write(b"quiet phase done\r")
        bye = await reader.until(rb"bye ([\d.]+)\r\n")
        bye_latency = time.monotonic() - float(bye[1])
    finally:
        await driver.close()
    await link.close()
    return {
        "streaming": streaming,
        "quiet": quiet,
        "lines": lines,
        "line_latency": latency,
        "bye_latency": bye_latency,
        "dropped": link.dropped,
        "probed_while_quiet": link._probed > quiet_from,
    }


async def take_over() -> dict[str, Any]:
    try:
        await open_sol("cn001", SPEC)
        refused = "opened"
    except ConsoleError as error:
        refused = str(error)
    link = await open_sol("cn001", SPEC, force=True)
    await link.write(b"holding\r")
    reader = Reader(link)
    await reader.until(b"hello layerpy\r\n")
    await link.write(b"deactivate me\r")
    how = await end(link)
    ended_at = time.monotonic()
    await link.close()
    return {"refused": refused, "forced": reader.data.decode(), "how": how, "ended_at": ended_at}


async def hold() -> None:
    """Hold the console until killed."""
    link = await open_sol("cn001", SPEC)
    await link.write(b"holding\r")
    await end(link)


async def unreachable() -> dict[str, Any]:
    try:
        await open_sol("cn001", PowerSpec("ipmi", BMC, "admin", "Not-The-Password-1"))
        refused = "opened"
    except ConsoleError as error:
        refused = str(error)
    spec = PowerSpec("ipmi", DEAD, "admin", PASSWORD)
    begun = time.monotonic()
    try:
        await open_sol("cn099", spec)
        how = "opened"
    except ConsoleError as error:
        how = str(error)
    failed_after = time.monotonic() - begun
    begun = time.monotonic()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1):
            await open_sol("cn099", spec)
    given_up_after = time.monotonic() - begun
    threads = [t for t in threading.enumerate() if t.name == "sol cn099"]
    for thread in threads:
        thread.join(WAIT)
    return {
        "refused": refused,
        "how": how,
        "failed_after": failed_after,
        "given_up_after": given_up_after,
        "threads_gone_after": time.monotonic() - begun,
        "sessions_left": sessions_left(),
    }


SCENARIOS = {
    "converse": converse,
    "dead": dead,
    "power": power,
    "take_over": take_over,
    "hold": hold,
    "unreachable": unreachable,
}

if __name__ == "__main__":
    scenario, arguments = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(asyncio.run(SCENARIOS[scenario](**arguments))))
