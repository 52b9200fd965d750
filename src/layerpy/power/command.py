"""Power by command: a PDU outlet (SNMP), a PoE switch port, a smart plug, whatever a
program on the head node can switch.

Each operation runs one program with the argument list the node file's reader made for
this node (never a shell: a value cannot add or split arguments), stdin from /dev/null, in
a session of its own. What the command prints is read as it comes, ``KEEP`` bytes of each
stream kept and the rest read and dropped, so a chatty command never blocks on a full pipe
and never fills the server's memory. After ``timeout`` seconds its whole process group is
killed (SIGKILL) and the operation fails; so it does when the caller stops waiting (the
poller's own bound, a shutdown). At most ``MAX_SESSIONS`` commands run at once in the
process, as many as IPMI's workers: the poller and the engine bound and pace them as they
do IPMI, since they only see the driver.

A failure is a PowerError naming the node, the operation, the program, the exit code or the
timeout, and an excerpt of what it printed, cut and made printable for one log line (the
store logs it once per new error).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import weakref

from layerpy.power.base import MAX_SESSIONS, CommandSpec, PowerError, PowerSpec, scrub
from layerpy.text import printable

KEEP = 4096  # bytes of each stream kept; the rest is read and dropped
SHOWN = 200  # characters of output in an error message
READ = 65536  # bytes read at a time
AFTER_KILL = 1.0  # seconds the output is read on after a kill, until its pipes close
PASSWORD_VARIABLE = "LAYERPY_BMC_PASSWORD"
# What a command gets of the server's environment: no more (other nodes' password_env
# secrets live there too), and its password as PASSWORD_VARIABLE
PASSED_ON = ("PATH", "HOME", "LANG", "LC_ALL", "TZ")

_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _slot() -> asyncio.Semaphore:
    """The process's bound on commands running at once (one per event loop: a semaphore
    belongs to the loop it first waited in)."""
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(MAX_SESSIONS)
    return _slots[loop]


class CommandDriver:
    def __init__(self, node: str, spec: PowerSpec) -> None:
        assert spec.command is not None
        self.node = node
        self.commands: CommandSpec = spec.command
        self.password = spec.password
        self.status_on = re.compile(self.commands.status_on)
        self.status_off = re.compile(self.commands.status_off)

    async def status(self) -> str:
        code, out, err = await self._run("status", self.commands.status, check=False)
        if self.commands.status_exit:
            states = dict(self.commands.status_exit)
            if code in states:
                return states[code]
            known = ", ".join(f"{state} {c}" for c, state in self.commands.status_exit)
            raise self._failed("status", f"exit code {code} means neither ({known})", out, err)
        if code != 0:
            raise self._failed("status", f"exit code {code}", out, err)
        text = out.decode(errors="replace")
        on, off = self.status_on.search(text), self.status_off.search(text)
        if on and off:
            raise self._failed("status", "output matches both status_on and status_off", out)
        if not (on or off):
            why = "output matches neither status_on nor status_off (garbage?)"
            raise self._failed("status", why, out, err)
        return "on" if on else "off"

    async def on(self) -> None:
        await self._run("on", self.commands.on)

    async def off(self) -> None:
        await self._run("off", self.commands.off)

    async def cycle(self) -> None:
        """The cycle command; without one, off and then on (an outlet off is off)."""
        if self.commands.cycle:
            await self._run("cycle", self.commands.cycle)
        else:
            await self.off()
            await self.on()

    async def boot_network_once(self) -> None:
        """The boot_network command; without one nothing: such machines netboot always."""
        if self.commands.boot_network:
            await self._run("boot_network", self.commands.boot_network)

    async def close(self) -> None:
        """Nothing held between commands; a command still running ends with its caller."""

    async def _run(
        self, operation: str, argv: tuple[str, ...], *, check: bool = True
    ) -> tuple[int, bytes, bytes]:
        """Exit code, and the first KEEP bytes of stdout and stderr, of one run of `argv`;
        a PowerError when it cannot start, times out, or (with `check`) exits non-zero."""
        out, err = bytearray(), bytearray()
        env = {name: os.environ[name] for name in PASSED_ON if name in os.environ}
        if self.password is not None:
            env[PASSWORD_VARIABLE] = self.password
        async with _slot():
            try:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                    env=env,
                )
            except OSError as error:
                reason = f"cannot start {printable(argv[0])}: {error.strerror or error}"
                raise PowerError(f"{self.node}: {operation} command: {reason}") from None
            assert process.stdout is not None and process.stderr is not None
            finished = False  # by itself, its output read to the end
            exited = None  # when not: its exit code at the kill, had it exited by itself
            try:
                async with asyncio.timeout(self.commands.timeout):
                    await asyncio.gather(
                        _keep(process.stdout, out), _keep(process.stderr, err), process.wait()
                    )
                finished = True
            except TimeoutError:
                pass
            finally:  # timed out, or the caller stopped waiting: nothing of it is left behind
                if not finished:
                    exited = process.returncode
                    await _end(process, out, err)
        if not finished:
            if exited is None:
                why = f"no end in {self.commands.timeout:g} s: killed"
            else:  # a process it started held its output open
                why = (
                    f"exited {exited}, but what it started kept its output open for "
                    f"{self.commands.timeout:g} s: killed"
                )
            raise self._failed(operation, why, out, err)
        code = process.returncode
        assert code is not None
        if check and code != 0:
            raise self._failed(operation, f"exit code {code}", out, err)
        return code, bytes(out), bytes(err)

    def _failed(self, operation: str, why: str, out: bytes, err: bytes = b"") -> PowerError:
        """The error of one operation, with what the command printed (stderr first), on
        one line; the password taken out before anything is cut (a ``set -x`` or
        ``curl -v`` prints it)."""
        program = printable(getattr(self.commands, operation)[0], 80)
        message = f"{self.node}: {operation} command {program}: {why}"
        for name, data in (("stderr", err), ("stdout", out)):
            text = scrub(data.decode(errors="backslashreplace"), self.password).strip()
            if text:
                message += f"; {name}: {printable(text, SHOWN)}"
        return PowerError(message)


async def _keep(stream: asyncio.StreamReader, kept: bytearray) -> None:
    """Read `stream` to its end, keeping its first KEEP bytes in `kept`."""
    while chunk := await stream.read(READ):
        if len(kept) < KEEP:
            kept += chunk[: KEEP - len(kept)]


async def _end(process: asyncio.subprocess.Process, out: bytearray, err: bytearray) -> None:
    """SIGKILL the command's process group (it leads a session of its own, and what it
    started is in the group too), read its output on until the pipes close, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    assert process.stdout is not None and process.stderr is not None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(AFTER_KILL):
            await asyncio.gather(_keep(process.stdout, out), _keep(process.stderr, err))
    await asyncio.shield(process.wait())
