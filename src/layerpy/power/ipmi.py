"""IPMI over LAN (RMCP+) through pyghmi.

pyghmi blocks, so each operation runs in a worker thread. What pyghmi does underneath, and
what follows from it:

- One process-wide IO thread reads every session's socket; a calling thread sends and then
  waits on an event, so a silent BMC holds up only its own caller.
- pyghmi waits ``initialtimeout`` (0.5-1 s) for an answer before sending again, and a login
  sends each packet at most twice. A BMC that answers in 2 s or more (real ones do, busy
  or just reset) then never gets a session: its late answers meet newer requests and read
  as "no cipher suite match" or "incorrect password". ``PACKET_TIMEOUT`` raises that wait
  above a slow BMC's answer; the price is that a dead BMC is known after ``DEAD_AFTER``.
- A global registry hands a new ``Command`` the live session of the same BMC and user, but
  compares the stored (encoded) credentials with the given ones: given ``str``, nothing
  ever matches, and a stale "initting" entry then makes the next ``Command`` for that BMC
  wait for ever. Given ``bytes`` the registry works, so credentials go in as bytes.
- A command in a logged-in session would be retried for about 30 s, with a fresh login on
  the way, while the worker stays blocked. Limited to one resend without re-login, it
  gives up after ``2 * PACKET_TIMEOUT``; the next operation logs in afresh.
- A reply that arrives before the caller has started waiting is only noticed at the
  retry timer, ``PACKET_TIMEOUT`` later; under load that hits a third of commands, and a
  login beside a dead BMC's nearly always. ``_io_wait`` is wrapped to return at once when
  packets are already queued, and to wait at most ``WAKE_EVERY`` in any case.

Work for one BMC runs one job at a time (pyghmi shares a session per BMC and user, and two
commands in one session confuse it), in a bounded pool of daemon threads. A login is a job
of its own and always runs to its end, even when its caller has stopped waiting: the next
call then finds the session ready (or joins the login still under way) instead of starting
over, so a slow BMC does get a session. A command whose caller gave up before it started
is dropped: a stale "power on" must not run behind the engine's back. The threads are
daemons and never joined, so a thread stuck on a dead BMC never holds up the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pyghmi.ipmi.command import Command
from pyghmi.ipmi.private import session as pyghmi_session

from layerpy.power.base import MAX_SESSIONS, PowerError, PowerSpec, scrub

PACKET_TIMEOUT = 6.0  # seconds pyghmi waits for each answer: above a slow BMC's 2-5 s
DEAD_AFTER = 2 * PACKET_TIMEOUT  # a login sends twice before the BMC counts as unreachable
TIMEOUT = 45.0  # seconds a caller waits: a first contact is 8 exchanges, 32 s at 4 s each
IDLE_REUSE = 20.0  # seconds: an older session is replaced before BMC or pyghmi expire it
LOGOUT_WAIT = 2.0  # seconds close() waits for the logout to be sent
WAKE_EVERY = 0.2  # seconds: the longest a worker sleeps before looking for its answer

T = TypeVar("T")

pyghmi_session.initialtimeout = PACKET_TIMEOUT
_pyghmi_io_wait = pyghmi_session._io_wait
_pyghmi_max_timeout = pyghmi_session.Session._getmaxtimeout


def _max_timeout(session: Any) -> float:
    """pyghmi's bound on a whole exchange, derived from its packet timers, comes out at 2 s
    for the privilege request that ends a login once those timers are long: a BMC answering
    in 4 s would then be dropped just as its answer arrives. Never below ``DEAD_AFTER``."""
    return max(_pyghmi_max_timeout(session), DEAD_AFTER)


pyghmi_session.Session._getmaxtimeout = _max_timeout


def _io_wait(timeout: float, myaddr: Any = None, evq: Any = None) -> None:
    """pyghmi's wait for a reply, skipped when the reply is already queued and never
    longer than WAKE_EVERY (see above): every caller loops until its own condition holds."""
    if evq is None:
        if myaddr is None:
            if pyghmi_session.sessionqueue:
                return
        else:
            handlers = pyghmi_session.Session.bmc_handlers.get(myaddr, {})
            if any(handler.pktqueue for handler in list(handlers.values())):
                return
    _pyghmi_io_wait(min(timeout, WAKE_EVERY), myaddr, evq)


pyghmi_session._io_wait = _io_wait


class _Pool:
    """At most ``size`` daemon threads running jobs in order of submission.

    Not a ThreadPoolExecutor: that one runs every queued job and joins its threads at
    interpreter exit, so 1024 dead BMCs' queued polls held ``layerpy serve`` for minutes.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._threads = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, job))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if self._threads < self.size:
                    self._threads += 1
                    threading.Thread(target=self._work, name="ipmi", daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            future, job = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job())
                except BaseException as error:  # handed to the caller, if any
                    future.set_exception(error)
            del future, job
            self._idle.release()


_pool = _Pool(MAX_SESSIONS)


class _Channel:
    """One BMC's jobs, run one at a time and in order; cancelled ones are skipped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self.busy = False

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            self._pending.append((future, job))
            if self.busy:
                return future
            self.busy = True
        _pool.submit(self._next)
        return future

    def _next(self) -> None:
        """Run the first pending job not cancelled, then hand the channel to the pool again
        (a BMC with a queue does not keep a thread from other BMCs)."""
        while True:
            with self._lock:
                if not self._pending:
                    self.busy = False
                    return
                future, job = self._pending.popleft()
            if future.set_running_or_notify_cancel():
                break
        try:
            future.set_result(job())
        except BaseException as error:
            future.set_exception(error)
        with self._lock:
            if not self._pending:
                self.busy = False
                return
        _pool.submit(self._next)


_channels: dict[tuple[str, int], _Channel] = {}


class IpmiDriver:
    """One node's BMC; the session is reused while fresh and replaced after any error."""

    def __init__(self, node: str, spec: PowerSpec) -> None:
        assert spec.address
        self.node = node
        self.spec = spec
        self.address = spec.address
        self.port = spec.port or 623
        self._channel = _channels.setdefault((self.address, self.port), _Channel())
        self._command: Command | None = None
        self._last_ok = 0.0
        self._login: Future[None] | None = None
        self._jobs: set[Future[Any]] = set()

    async def status(self) -> str:
        return await self._run(lambda command: command.get_power()["powerstate"])

    async def on(self) -> None:
        await self._run(lambda command: command.set_power("on"))

    async def off(self) -> None:
        await self._run(lambda command: command.set_power("off"))

    async def cycle(self) -> None:
        """Chassis power cycle when on (a harder restart than reset), power on when off."""

        def cycle(command: Command) -> None:
            if command.get_power()["powerstate"] == "off":
                command.set_power("on")
            else:
                response = command.raw_command(netfn=0, command=2, data=[2])
                if "error" in response:
                    raise PowerError(f"power cycle refused: {response['error']}")

        await self._run(cycle)

    async def boot_network_once(self) -> None:
        await self._run(lambda command: command.set_bootdev("network"))

    async def close(self) -> None:
        """Drop queued work and log out; a BMC that does not answer forgets the session by
        itself. Waits at most ``LOGOUT_WAIT`` seconds: a shutdown must not hang on a BMC."""
        for job in list(self._jobs):
            job.cancel()
        if self._command is not None:
            busy = self._channel.busy  # still stuck on a command: the logout comes after
            logout = self._submit(self._logout)
            if not busy:
                with contextlib.suppress(TimeoutError, PowerError):
                    logout_done = asyncio.shield(asyncio.wrap_future(logout))
                    await asyncio.wait_for(logout_done, LOGOUT_WAIT)

    # -- the caller's side -------------------------------------------------------------

    async def _run(self, operation: Callable[[Command], T]) -> T:
        """`operation` on the session, logging in first when needed; a PowerError within
        TIMEOUT seconds. The login goes on when the caller stops waiting; the operation
        is dropped if it has not started by then."""
        begun = time.monotonic()
        if self._stale():
            login = self._login
            if login is None or login.done():
                login = self._login = self._submit(self._log_in)
            await self._wait(login, begun, "logging in", keep=True)
        job = self._submit(lambda: self._blocking(operation))
        return await self._wait(job, begun, "waiting for the answer", keep=False)

    async def _wait(self, job: Future[T], begun: float, doing: str, *, keep: bool) -> T:
        """The job's result; when the caller stops waiting (timeout or cancellation), a job
        not to `keep` is dropped unless it has started."""
        remaining = max(0.0, TIMEOUT - (time.monotonic() - begun))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job)), remaining)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.cancelled() and task is not None and not task.cancelling():
                raise PowerError(f"{self.node}: BMC {self.address}: driver closed") from None
            if not keep:
                job.cancel()
            raise
        except TimeoutError:
            if not keep and job.cancel():
                reason = "not started: the BMC's earlier commands, or all IPMI workers, busy"
            else:
                reason = f"still {doing}: the BMC answers slowly or not at all"
            message = f"{self.node}: BMC {self.address} gave no answer in {TIMEOUT:g} s ({reason})"
            raise PowerError(message) from None

    def _submit(self, job: Callable[[], T]) -> Future[T]:
        future = self._channel.submit(job)
        self._jobs.add(future)
        future.add_done_callback(self._jobs.discard)
        return future

    def _stale(self) -> bool:
        """No session, or one that is broken (another driver for this BMC may have logged
        it out: pyghmi shares it) or idle long enough for the BMC to have dropped it."""
        command = self._command
        return (
            command is None
            or command.ipmi_session.broken
            or time.monotonic() - self._last_ok > IDLE_REUSE
        )

    # -- the worker's side -------------------------------------------------------------

    def _log_in(self) -> None:
        self._blocking(lambda command: None)

    def _blocking(self, operation: Callable[[Command], T]) -> T:
        """In a worker: the session (a fresh login if stale), then the operation."""
        begun = time.monotonic()
        try:
            if self._stale():
                self._logout()
                self._command = Command(
                    bmc=self.address,
                    userid=(self.spec.user or "").encode(),
                    password=(self.spec.password or "").encode(),
                    port=self.port,
                )
                session = self._command.ipmi_session
                # one resend per command, no re-login inside it (see the module doc)
                session.logontries, session.maxtimeout = 0, PACKET_TIMEOUT + 1.6
                self._last_ok = time.monotonic()
            result = operation(self._command)
            # pyghmi asks an unknown vendor's BMC for its device id before every command,
            # doubling each command's time; the answer does not change within a session
            self._command._oemknown = self._command._oem is not None
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
