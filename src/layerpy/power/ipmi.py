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
- pyghmi guards its sessions with two global locks taken in opposite orders: a send holds
  KEEPALIVE_SESSIONS, then takes WAITING_SESSIONS; timeout processing holds
  WAITING_SESSIONS and resends, taking KEEPALIVE_SESSIONS. Two workers meeting there
  deadlock, and every IPMI call of the process hangs for good: callers see "no answer",
  later ones "an earlier command still waits", and the exit (which joined the workers)
  never comes. With 1 024 sessions whose BMCs had just died it happened within seconds
  (tests/proto/test_shutdown.py). Both names are made one lock here. Timeout processing,
  under that lock, drops a broken session with a logout that first waits for the
  command in flight, a second or more with everyone else waiting: a broken session is
  dropped here without that logout.
- pyghmi's send switches the shared UDP socket to blocking mode, its IO thread switches
  it back before each read: a send between the two leaves the IO thread blocked in
  ``recvfrom()`` on a socket with nothing to read, and every IPMI call of the process
  waits for good. Sends here never switch the mode (``MSG_DONTWAIT``).
- A reply that arrives before the caller has started waiting is only noticed at the
  retry timer, ``PACKET_TIMEOUT`` later; under load that hits a third of commands, and a
  login beside a dead BMC's nearly always. ``_io_wait`` here returns at once when packets
  are already queued, and waits at most ``WAKE_EVERY`` in any case.

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
import socket
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
SKIP_DEAD = 30.0  # seconds after a BMC went silent that actions are not even tried
IDLE_REUSE = 20.0  # seconds: an older session is replaced before BMC or pyghmi expire it
LOGOUT_WAIT = 2.0  # seconds close() waits for the logout to be sent
WAKE_EVERY = 0.2  # seconds: the longest a worker sleeps before looking for its answer

T = TypeVar("T")

pyghmi_session.initialtimeout = PACKET_TIMEOUT
pyghmi_session.WAITING_SESSIONS = pyghmi_session.KEEPALIVE_SESSIONS  # no lock-order deadlock
_pyghmi_max_timeout = pyghmi_session.Session._getmaxtimeout


def _max_timeout(session: Any) -> float:
    """pyghmi's bound on a whole exchange, derived from its packet timers, comes out at 2 s
    for the privilege request that ends a login once those timers are long: a BMC answering
    in 4 s would then be dropped just as its answer arrives. Never below ``DEAD_AFTER``."""
    return max(_pyghmi_max_timeout(session), DEAD_AFTER)


pyghmi_session.Session._getmaxtimeout = _max_timeout
_pyghmi_logout = pyghmi_session.Session.logout


def _logout(session: Any, sessionok: bool = True) -> Any:
    """pyghmi's logout; for a broken session (``sessionok`` false, pyghmi's own call
    under its global lock) without the logout request, which waits first (see above)."""
    if not sessionok:
        session.logged = 0
    return _pyghmi_logout(session, sessionok)


pyghmi_session.Session.logout = _logout


def _io_wait(timeout: float, myaddr: Any = None, evq: Any = None) -> None:
    """pyghmi's wait for a reply (the IO thread sets the event), skipped when the reply is
    already queued, never longer than WAKE_EVERY (every caller loops until its own
    condition holds) and not for ever should the IO thread miss it; its wake-up call to
    the IO thread does not block (see above)."""
    ps = pyghmi_session
    if evq is None:
        if myaddr is None:
            if ps.sessionqueue:
                return
        else:
            handlers = ps.Session.bmc_handlers.get(myaddr, {})
            if any(handler.pktqueue for handler in list(handlers.values())):
                return
    timeout = max(0.0, min(timeout, WAKE_EVERY))
    event = threading.Event()
    if evq is not None:
        evq.append(event)
    deadline = timeout + ps._monotonic_time()
    ps.ioqueue.append((deadline, event, myaddr))
    if deadline < ps.selectdeadline and ps.iosockets:
        wake = ps.iosockets[0]
        _io_sendto(wake, b"\x01", (ps.myself, wake.getsockname()[1]))
    event.wait(timeout + WAKE_EVERY)


def _io_sendto(sock: socket.socket, packet: bytes, sockaddr: Any) -> None:
    """pyghmi's send, without switching the shared socket to blocking mode: the IO thread
    switches it back before each read, and a switch between the two left it blocked in
    recvfrom() for good (see above). A full buffer drops the packet; it is sent again."""
    with contextlib.suppress(OSError):
        sock.sendto(packet, socket.MSG_DONTWAIT, sockaddr)


pyghmi_session._io_wait = _io_wait
pyghmi_session._io_sendto = _io_sendto


class _Pool:
    """At most ``size`` daemon threads running jobs in order of submission.

    Not a ThreadPoolExecutor: that one joins its threads at interpreter exit, so a thread
    stuck in pyghmi (on a dead BMC for seconds, in its lock deadlock for ever) held up the
    exit of ``layerpy serve``.
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


def _retrieved(result: asyncio.Future[Any]) -> None:
    if not result.cancelled():
        result.exception()


def _settle(future: Future[T], job: Callable[[], T]) -> None:
    """Run `job` into `future` (in a thread)."""
    try:
        future.set_result(job())
    except BaseException as error:
        future.set_exception(error)


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
        self._silent_since: float | None = None  # when it last failed to answer at all

    async def status(self) -> str:
        """Always asked, also of a silent BMC: the poller's reads are what find it back."""
        return await self._run(lambda command: command.get_power()["powerstate"])

    async def on(self) -> None:
        await self._act(lambda command: command.set_power("on"))

    async def off(self) -> None:
        await self._act(lambda command: command.set_power("off"))

    async def cycle(self) -> None:
        """Chassis power cycle when on (a harder restart than reset), power on when off."""

        def cycle(command: Command) -> None:
            if command.get_power()["powerstate"] == "off":
                command.set_power("on")
            else:
                response = command.raw_command(netfn=0, command=2, data=[2])
                if "error" in response:
                    raise PowerError(f"power cycle refused: {response['error']}")

        await self._act(cycle)

    async def boot_network_once(self) -> None:
        await self._act(lambda command: command.set_bootdev("network"))

    async def close(self) -> None:
        """Drop queued work and log out; a BMC that does not answer forgets the session by
        itself. Waits at most ``LOGOUT_WAIT`` seconds: a shutdown must not hang on a BMC."""
        for job in list(self._jobs):
            job.cancel()
        if self._command is None:
            return
        if self._channel.busy:  # stuck on a command: the logout follows it, unwaited for
            self._submit(self._logout)
            return
        # pyghmi sends a logout without waiting for its answer: a thread of its own, so
        # that workers busy with dead BMCs do not hold it up
        logout: Future[None] = Future()
        threading.Thread(target=_settle, args=(logout, self._logout), daemon=True).start()
        result = asyncio.wrap_future(logout)
        result.add_done_callback(_retrieved)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LOGOUT_WAIT):
                await asyncio.shield(result)

    # -- the caller's side -------------------------------------------------------------

    async def _act(self, operation: Callable[[Command], T]) -> T:
        """An action, not tried for ``SKIP_DEAD`` seconds after the BMC went silent: each
        try would hold one of the few IPMI workers for ``DEAD_AFTER`` seconds, and enough
        dead BMCs would keep live ones waiting behind them."""
        silent = self._silent_since
        if silent is not None and (age := time.monotonic() - silent) < SKIP_DEAD:
            raise PowerError(
                f"{self.node}: BMC {self.address} unreachable ({age:.0f} s ago): not tried "
                f"again before {SKIP_DEAD - age:.0f} s, or its next poll answering"
            )
        return await self._run(operation)

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
        result = asyncio.wrap_future(job)
        result.add_done_callback(_retrieved)  # no "never retrieved" once the caller left
        try:  # asyncio.timeout: 3.11's wait_for can swallow a cancel that meets the result
            async with asyncio.timeout(remaining):
                return await asyncio.shield(result)
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
            self._silent_since = None
            return result
        except Exception as error:
            self._logout()
            if isinstance(error, PowerError):
                raise PowerError(f"{self.node}: BMC {self.address}: {error}") from None
            text = str(error) if error.args and error.args[0] else ""
            # pyghmi reads a command's timed-out answer ({"error": "timeout"}) as if it had
            # come and fails on its missing "command": that is silence too
            silent = isinstance(error, KeyError) or text in ("", "timeout")
            if silent or text == "Session no longer connected":
                self._silent_since = time.monotonic()
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
        """Whole seconds, rounded down: 12.4 and 12.6 s read alike, so that the node store,
        which logs an error again when its text changes, does not log each poll."""
        return PowerError(
            f"{self.node}: BMC {self.address} unreachable (no answer in {int(seconds)} s)"
        )
