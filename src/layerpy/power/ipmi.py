"""IPMI over LAN (RMCP+) through pyghmi.

pyghmi blocks, so each operation runs in a worker thread. What pyghmi does underneath, and
what follows from it:

- One process-wide IO thread reads every session's socket; a calling thread sends and then
  waits on an event. A silent BMC makes its caller give up after about 5 s of retries
  (``IpmiException(None)``) without holding up other BMCs' callers.
- A global registry hands a new ``Command`` the live session of the same BMC and user, but
  compares the stored (encoded) credentials with the given ones: given ``str``, nothing
  ever matches, and a stale "initting" entry then makes the next ``Command`` for that BMC
  wait for ever. Given ``bytes`` the registry works, so credentials go in as bytes.
- A command in a logged-in session is retried for about 30 s, with a fresh login on the
  way, while the worker stays blocked. Limited to three sends without re-login, it gives up
  after about 5 s, as a login does; the next operation logs in afresh.
- A reply that arrives before the caller has started waiting is only noticed at the
  retry timer, 0.5-1 s later; under load that hits a third of commands. ``_io_wait`` is
  wrapped to return at once when the session already has packets queued.

Threads come from a pool of ``MAX_SESSIONS`` workers, which bounds concurrent IPMI
sessions (it is the semaphore) and keeps dead BMCs from starving the loop's default
executor. A lock per BMC, held by the worker until pyghmi returns, keeps one command per
session in flight, even after the caller has timed out and moved on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pyghmi.ipmi.command import Command
from pyghmi.ipmi.private import session as pyghmi_session

from layerpy.power.base import PowerError, PowerSpec, scrub

MAX_SESSIONS = 16
TIMEOUT = 6.0  # seconds per operation, waiting for the BMC's lock included
IDLE_REUSE = 20.0  # seconds: an older session is replaced before BMC or pyghmi expire it

T = TypeVar("T")

_executor = ThreadPoolExecutor(MAX_SESSIONS, thread_name_prefix="ipmi")
_locks: dict[tuple[str, int], threading.Lock] = {}
_pyghmi_io_wait = pyghmi_session._io_wait


def _io_wait(timeout: float, myaddr: Any = None, evq: Any = None) -> None:
    """pyghmi's wait for a reply, skipped when the reply is already queued (see above)."""
    if myaddr is not None and evq is None:
        handlers = pyghmi_session.Session.bmc_handlers.get(myaddr, {})
        if any(handler.pktqueue for handler in list(handlers.values())):
            return
    _pyghmi_io_wait(timeout, myaddr, evq)


pyghmi_session._io_wait = _io_wait


class IpmiDriver:
    """One node's BMC; the session is reused while fresh and replaced after any error."""

    def __init__(self, node: str, spec: PowerSpec) -> None:
        assert spec.address
        self.node = node
        self.spec = spec
        self.address = spec.address
        self.port = spec.port or 623
        self._lock = _locks.setdefault((self.address, self.port), threading.Lock())
        self._command: Command | None = None
        self._last_ok = 0.0

    async def status(self) -> str:
        return await self._run(lambda: self._session().get_power()["powerstate"])

    async def on(self) -> None:
        await self._run(lambda: self._session().set_power("on"))

    async def off(self) -> None:
        await self._run(lambda: self._session().set_power("off"))

    async def cycle(self) -> None:
        """Chassis power cycle when on (a harder restart than reset), power on when off."""

        def cycle() -> None:
            command = self._session()
            if command.get_power()["powerstate"] == "off":
                command.set_power("on")
            else:
                response = command.raw_command(netfn=0, command=2, data=[2])
                if "error" in response:
                    raise PowerError(f"power cycle refused: {response['error']}")

        await self._run(cycle)

    async def boot_network_once(self) -> None:
        await self._run(lambda: self._session().set_bootdev("network"))

    async def close(self) -> None:
        """Log out; a BMC that does not answer forgets the session by itself."""
        if self._command is not None:
            with contextlib.suppress(PowerError):
                await self._run(self._logout)

    async def _run(self, operation: Callable[[], T]) -> T:
        """`operation` on a worker thread, as a PowerError within TIMEOUT seconds."""
        deadline = time.monotonic() + TIMEOUT
        started = threading.Event()
        work = asyncio.get_running_loop().run_in_executor(
            _executor, self._blocking, operation, deadline, started
        )
        try:
            return await asyncio.wait_for(work, TIMEOUT)
        except TimeoutError:
            if not started.is_set():
                reason = f"not started in {TIMEOUT:g} s: all {MAX_SESSIONS} IPMI sessions busy"
                raise PowerError(f"{self.node}: BMC {self.address}: {reason}") from None
            raise self._unreachable(TIMEOUT) from None

    def _blocking(self, operation: Callable[[], T], deadline: float, started: threading.Event) -> T:
        """The worker thread's part: the BMC's lock, then the operation."""
        started.set()
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            reason = "unreachable (an earlier command still waits for an answer)"
            raise PowerError(f"{self.node}: BMC {self.address} {reason}")
        begun = time.monotonic()
        try:
            result = operation()
            self._last_ok = time.monotonic()
            return result
        except Exception as error:
            self._logout()
            if isinstance(error, PowerError):
                raise PowerError(f"{self.node}: BMC {self.address}: {error}") from None
            text = str(error) if error.args and error.args[0] else ""
            if text in ("", "timeout", "Session no longer connected"):
                raise self._unreachable(time.monotonic() - begun) from None
            reason = scrub(text, self.spec.password)
            raise PowerError(f"{self.node}: BMC {self.address}: {reason}") from None
        finally:
            self._lock.release()

    def _session(self) -> Command:
        """The session, replaced when broken (another driver for this BMC may have logged
        it out: pyghmi shares it) or idle long enough for the BMC to have dropped it."""
        command = self._command
        if command and (
            command.ipmi_session.broken or time.monotonic() - self._last_ok > IDLE_REUSE
        ):
            self._logout()
        if self._command is None:
            self._command = Command(
                bmc=self.address,
                userid=(self.spec.user or "").encode(),
                password=(self.spec.password or "").encode(),
                port=self.port,
            )
            session = self._command.ipmi_session
            session.logontries, session.maxtimeout = 0, 3  # see the module doc
        return self._command

    def _logout(self) -> None:
        """Drop the session, telling the BMC if it still listens (pyghmi does not wait)."""
        command, self._command = self._command, None
        if command is not None and not command.ipmi_session.broken:
            with contextlib.suppress(Exception):  # a failed session is dropped regardless
                command.ipmi_session.logout()

    def _unreachable(self, seconds: float) -> PowerError:
        return PowerError(
            f"{self.node}: BMC {self.address} unreachable (no answer in {seconds:.0f} s)"
        )
