"""IPMI Serial-over-LAN: a node's serial console through its BMC, with pyghmi's console.

pyghmi blocks, and keeps its sessions in module globals that ``layerpy.power.ipmi`` patches
(one lock, sends that never block, its timers): read that module's doc first. A console
lives beside the power driver's sessions to the same BMC, in the same process, like this:

- A session of its own. pyghmi hands a new session the live one of the same BMC and user,
  and the power driver logs its sessions out when they are idle or broken: sharing would
  end the console, or let the driver's commands interleave with SOL. The console's session
  never joins another (``_SolSession.__new__``), and none joins it, since it gives a Kg that
  power sessions do not: the password, which is what RMCP+ uses when no Kg is given, so
  nothing changes on the wire.
- A UDP socket of its own, read by a thread of its own. pyghmi's IO thread reads its shared
  sockets, queues a reference to the session for each packet for whoever calls
  ``Session.wait_for_rsp`` next, and wakes every such caller on any packet of the process:
  a thread per console calling it would run every other session's work (and each other's),
  and with no one else calling it the references would pile up. Instead the console's
  thread polls its socket and an eventfd that ``write()`` and ``close()`` use to wake it,
  and processes only its own session (two descriptors per console). The two entry points
  that pyghmi's other threads still reach, through its tables of sessions with timers
  (``_timedout``, ``_keepalive``), do nothing outside that thread or hand the work to it,
  so the session's state is only ever touched there. The patched global lock is taken
  only for moments by pyghmi's own code, never held while waiting; sends never block.
- The console's thread is pyghmi's event loop for that session: it processes the BMC's
  packets (SOL data, which pyghmi acknowledges, and answers), resends what pyghmi's timers
  say is due, and sends typed text. Where pyghmi waits, for the acknowledgement of each
  packet of typed text (``Console.wait_for_rsp``) or for the answer to a command of the
  activation (``Session.awaitresponse``), it takes one more turn of that loop, so the
  thread never sleeps on pyghmi's timers and ``close()`` reaches it anywhere.
- A dead BMC: after ``PROBE_AFTER`` seconds without a packet the thread asks the BMC who
  holds the payload (pyghmi's own SOL keepalive, Get Payload Instance Info; the answer also
  tells when someone deactivated it), and after ``DEAD_AFTER`` the link ends with a
  ``ConsoleError``, so the capture reconnects with its backoff. pyghmi's keepalive every
  ~25 s would find a dead BMC only after some 40 s.
- What the node prints crosses to the event loop with ``call_soon_threadsafe`` into a queue
  of ``QUEUE_CHUNKS`` packets; when the reader falls behind, the oldest are dropped and
  counted in ``SolLink.dropped``.
- ``close()`` wakes the thread, which sends Deactivate Payload and Close Session without
  waiting for the answers (a BMC that misses them frees the payload when the session
  times out) and ends; ``close()`` waits at most ``CLOSE_WAIT`` for it.

Taking over: not by default. A BMC serves one SOL session; if another holds it (an admin's
``ipmitool sol activate``), opening fails with "SOL Session active for another client" and
the capture tries again later, instead of kicking the admin out. While the capture holds
it, ``ipmitool sol activate`` says "SOL payload already active on another session"; an
``ipmitool sol deactivate`` takes it away, which the console notices at its next probe and
ends. ``force=True`` deactivates whoever holds it first (pyghmi's ``force``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import select
import socket
import threading
import time
from collections import defaultdict
from typing import Any, ClassVar

from pyghmi.ipmi import console as pyghmi_console
from pyghmi.ipmi.private import session as pyghmi_session

from layerpy.consoles.link import READ_SIZE, ConsoleError
from layerpy.power.base import PowerSpec, scrub
from layerpy.power.ipmi import DEAD_AFTER, LOGOUT_WAIT, PACKET_TIMEOUT, TIMEOUT

log = logging.getLogger("layerpy.console")

PROBE_AFTER = PACKET_TIMEOUT / 2  # seconds without a packet before asking the BMC
OPEN_TIMEOUT = TIMEOUT  # seconds to log in and activate the payload (8 slow exchanges)
CLOSE_WAIT = LOGOUT_WAIT  # seconds close() waits for the thread to say goodbye and end
QUEUE_CHUNKS = 1024  # SOL packets (up to ~256 bytes each) waiting for the reader
ONE_RESEND = PACKET_TIMEOUT + 1.6  # pyghmi's per-command bound: one resend (as the driver)
SOL_INSTANCE = (1, 1, 0, 0, 0, 0)  # payload type SOL, instance 1: Deactivate Payload's data


class _Closing(Exception):
    """close() was called: the console's thread unwinds from wherever it waits."""


class _SolSession(pyghmi_session.Session):
    """A pyghmi session that is only the console's: its own socket, run by `owner` alone."""

    socketpool: ClassVar[defaultdict[socket.socket, int]] = defaultdict(int)  # never shared

    def __new__(cls, *args: Any, **kwargs: Any) -> _SolSession:
        """A new session, never pyghmi's live one of the same BMC and user (module doc)."""
        self = object.__new__(cls)
        self.forbidsock = []
        return self

    def __init__(self, console: _SolConsole, **kwargs: Any) -> None:
        self.console = console
        self.owner = threading.get_ident()
        self.heard = time.monotonic()  # the last packet from the BMC
        self.due = False  # a resend another thread's wait_for_rsp found due
        self.awaited: tuple[int, int] | None = None  # (netfn, command) awaitresponse awaits
        try:
            super().__init__(**kwargs)
        except BaseException:
            self.close_socket()
            raise

    @classmethod
    def _assignsocket(cls, server: Any = None, forbiddensockets: Any = ()) -> socket.socket:
        """A socket pyghmi's IO thread does not read. Its family is the one pyghmi uses for
        every session, as pyghmi decides it (it sends to IPv4-mapped addresses when the
        host has IPv6), and decided now if pyghmi has not yet."""
        ps = pyghmi_session
        if ps.ipv6support is None:
            try:
                with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as probe:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                ps.ipv6support = True
            except OSError:
                ps.ipv6support, ps.myself = False, "127.0.0.1"
        sock = socket.socket(
            socket.AF_INET6 if ps.ipv6support else socket.AF_INET, socket.SOCK_DGRAM
        )
        if ps.ipv6support:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("", 0))
        sock.setblocking(False)
        cls.socketpool[sock] = 1
        return sock

    def process_pktqueue(self) -> None:
        """pyghmi's processing of each packet the socket holds, but none after the answer
        a command waits for: the code after the command comes first. (SOL data the BMC
        sends right after the activation's answer would meet a console not yet listening,
        and come again only when the BMC resends it.)"""
        while not self.answered():
            try:
                data, sockaddr = self.socket.recvfrom(3000)
            except OSError:
                return
            self.heard = time.monotonic()
            self.pktqueue.append((data, sockaddr, self.socket))
            super().process_pktqueue()

    def answered(self) -> bool:
        """The awaited command's answer is in. A timed-out command's answer is pyghmi's
        error, without the "command" its check would look up."""
        response = self.lastresponse
        return (
            self.awaited is not None
            and response is not None
            and ("error" in response or not pyghmi_session.unmatched(response, *self.awaited))
        )

    def awaitresponse(self, retry: bool, netfn: int, command: int) -> None:
        """pyghmi's wait for the answer to a command (the payload's activation) as turns
        of the console's loop, which wake on the session's socket."""
        self.awaitingresponse, self.awaited = True, (netfn, command)
        try:
            while (
                retry and not self.answered() and (self.logging or self.logged or self.onlogpayload)
            ):
                self.console.wait_for_rsp(self.timeout)
        finally:
            self.awaitingresponse, self.awaited = False, None

    def _timedout(self) -> None:
        if threading.get_ident() == self.owner:
            super()._timedout()
        else:
            self.due = True

    def _keepalive(self) -> None:
        """pyghmi's keepalive, sent by the console's thread when it probes (module doc)."""
        if threading.get_ident() == self.owner:
            super()._keepalive()

    def resend_if_due(self) -> None:
        """What pyghmi's wait_for_rsp does for a session whose answer is late."""
        with pyghmi_session.util.protect(pyghmi_session.KEEPALIVE_SESSIONS):  # the one lock
            waiting = self.waiting_sessions.get(self)
            if waiting is not None and waiting["timeout"] <= time.monotonic():
                self.waiting_sessions.pop(self, None)
                self.due = True
            if self.due:
                self.due = False
                self._timedout()

    def resend_at(self) -> float | None:
        waiting = self.waiting_sessions.get(self)
        return None if waiting is None else waiting["timeout"]

    def say_goodbye(self, deactivate: bool) -> None:
        """Deactivate the payload (if it is ours: any session may deactivate it, a refused
        console would kick out whoever holds it) and close the session, without waiting
        for answers (a dead BMC must not hold the thread); then forget the session."""
        with pyghmi_session.util.protect(pyghmi_session.KEEPALIVE_SESSIONS):
            self.waiting_sessions.pop(self, None)
        if self.logged and not self.broken:
            # an unanswered probe is abandoned: pyghmi would queue these behind it
            self.lastpayload, self.incommand = None, False
            self.sol_handler = None  # pyghmi's logout would deactivate it, and wait
            if deactivate:
                with contextlib.suppress(Exception):
                    self.raw_command(netfn=6, command=0x49, data=SOL_INSTANCE, retry=False)
            with contextlib.suppress(Exception):
                self.logout()
        with contextlib.suppress(Exception):
            self.logout(False)  # nothing sent (power.ipmi's patch): pyghmi's bookkeeping
        self.close_socket()

    def close_socket(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
            self.socketpool.pop(self.socket, None)


class _SolConsole(pyghmi_console.Console):
    """pyghmi's client console on a _SolSession, turned by its link's thread."""

    def __init__(self, link: SolLink, address: str, force: bool) -> None:
        """pyghmi's ``Console.__init__`` with the session made a _SolSession, and without
        its turn of pyghmi's global loop."""
        self.link = link
        self.outputlock = threading.RLock()
        self.keepaliveid = None
        self.connected = self.broken = self.activated = self.awaitingack = False
        self.out_handler = link.printed
        self.remseq = self.myseq = self.lastsize = self.retriedpayload = 0
        self.pendingoutput: list[Any] = []
        self.force_session = force
        self.port = link.port
        self.callgotsession = None
        self.ipmi_session = None
        password = (link.spec.password or "").encode()
        self.session = self.ipmi_session = _SolSession(
            self,
            bmc=address,
            userid=(link.spec.user or "").encode(),
            password=password,
            port=link.port,
            kg=password,  # what RMCP+ uses anyway; only so that no power session joins it
            onlogon=self._got_session,
        )

    def _got_session(self, response: dict[str, Any]) -> None:
        """Logged in: activate the payload, with the power driver's limits on commands
        (one resend, no fresh login inside a command: see power.ipmi)."""
        if "error" not in response and self.ipmi_session is not None:
            self.ipmi_session.logontries, self.ipmi_session.maxtimeout = 0, ONE_RESEND
        super()._got_session(response)

    def wait_for_rsp(self, timeout: float) -> None:  # type: ignore[override]
        """Where pyghmi's console waits for an acknowledgement: a turn of the link's loop."""
        self.link.turn(self, timeout)


class SolLink:
    """One node's console over SOL: a ``ConsoleLink`` whose pyghmi side is a thread."""

    def __init__(self, node: str, spec: PowerSpec, ip: str, force: bool) -> None:
        """`ip`: the BMC's address, resolved (see ``open_sol``)."""
        assert spec.address
        self.node, self.spec, self.ip, self.force = node, spec, ip, force
        self.address = spec.address
        self.port = spec.port or 623
        self.dropped = 0  # bytes the node printed that a slow reader never got
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_CHUNKS)  # None: end
        self._error: ConsoleError | None = None
        self._ended = False
        self._opened: asyncio.Future[None] = self._loop.create_future()
        self._done: asyncio.Future[None] = self._loop.create_future()
        # between the event loop and the thread
        self._typed: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._closing = threading.Event()
        # wakes the thread; closed by it as it ends, under the lock, so that no write lands
        # on a descriptor number the process has reused by then
        self._wake_fd: int | None = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._failure: str | None = None  # pyghmi's console's error, in the thread
        self._probed = 0.0
        self._poll: select.poll | None = None  # the session's socket and _wake_fd
        self._thread = threading.Thread(target=self._run, name=f"sol {node}", daemon=True)

    # -- the event loop's side ---------------------------------------------------------

    async def read(self) -> bytes:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # every later read ends too
            if self._error is not None:
                raise self._error
            return b""
        chunks, size = [item], len(item)
        while size < READ_SIZE:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if item is None:
                self._queue.put_nowait(None)
                break
            chunks.append(item)
            size += len(item)
        return b"".join(chunks)

    async def write(self, data: bytes) -> None:
        """Queued for the thread, which sends it in SOL packets; dropped once the link
        ended (the reader sees the end)."""
        if data and not self._ended and not self._closing.is_set():
            self._typed.put(bytes(data))
            self._wake()

    async def close(self) -> None:
        """Ends the link at once for the reader; waits at most ``CLOSE_WAIT`` for the
        thread, which may be inside one of pyghmi's commands (``PACKET_TIMEOUT`` bounds
        those) and then ends by itself."""
        self._closing.set()
        self._wake()
        with contextlib.suppress(TimeoutError):  # the thread's last word ends the link
            async with asyncio.timeout(CLOSE_WAIT):
                await asyncio.shield(self._done)
        self._end(None)

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_fd is not None:
                os.eventfd_write(self._wake_fd, 1)

    def _deliver(self, data: bytes) -> None:
        if self._ended:
            return
        if self._queue.full():
            if not self.dropped:
                log.warning("%s: console output dropped: its reader is slow", self.node)
            oldest = self._queue.get_nowait()
            self.dropped += len(oldest or b"")
        self._queue.put_nowait(data)

    def _activated(self) -> None:
        if not self._opened.done():
            self._opened.set_result(None)

    def _end(self, error: ConsoleError | None) -> None:
        if not self._opened.done():
            self._opened.set_exception(error or ConsoleError(f"{self.node}: console closed"))
            self._opened.exception()  # retrieved: open_sol may have stopped waiting
        if not self._done.done():
            self._done.set_result(None)
        if self._ended:
            return
        self._ended, self._error = True, error
        if self._queue.full():
            self.dropped += len(self._queue.get_nowait() or b"")
        self._queue.put_nowait(None)

    def _post(self, callback: Any, *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone: no one to tell
            self._loop.call_soon_threadsafe(callback, *args)

    # -- the thread's side -------------------------------------------------------------

    def printed(self, data: bytes | dict[str, Any]) -> None:
        """pyghmi's console's output: what the node printed, or a dict: its error (which
        ends the link) or information ("Remote system is powered down")."""
        if isinstance(data, dict):
            if "error" in data and self._failure is None:
                self._failure = str(data["error"])
        elif data:
            self._post(self._deliver, bytes(data))

    def _run(self) -> None:
        error: ConsoleError | None = None
        console: _SolConsole | None = None
        try:
            console = _SolConsole(self, self.ip, self.force)
            while not console.activated:
                self.turn(console)
            self._post(self._activated)
            while True:
                self.turn(console)
                self._send_typed(console)
        except _Closing:
            pass
        except ConsoleError as failure:
            error = failure
        except Exception as failure:  # pyghmi's, with its own words
            error = self._error_from(str(failure) or type(failure).__name__)
        finally:
            if console is not None:  # pyghmi's console stops being active when it learns
                console.session.say_goodbye(deactivate=console.activated)  # it was taken
            with self._wake_lock:
                os.close(self._wake_fd)
                self._wake_fd = None
            self._post(self._end, error)

    def turn(self, console: _SolConsole, timeout: float = DEAD_AFTER) -> None:
        """One turn of the session's loop: wait up to `timeout` for the BMC or a wake-up,
        process what came, resend what is due, probe a quiet BMC. Raises what ends the
        link: ``_Closing``, or a ConsoleError (pyghmi's console failed, or the BMC has
        been silent for ``DEAD_AFTER`` seconds)."""
        session = console.session
        until = [time.monotonic() + timeout, session.heard + DEAD_AFTER]
        if console.activated and not session._isincommand():
            until.append(max(session.heard, self._probed) + PROBE_AFTER)
        resend = session.resend_at()
        if resend is not None:
            until.append(resend)
        wait = max(0.0, min(until) - time.monotonic())
        if self._poll is None:  # poll, not select: a server has more than 1024 descriptors
            self._poll = select.poll()
            self._poll.register(session.socket, select.POLLIN)
            self._poll.register(self._wake_fd, select.POLLIN)
        if self._poll.poll(math.ceil(wait * 1000)):
            with contextlib.suppress(BlockingIOError):  # it was the socket
                os.eventfd_read(self._wake_fd)
        if self._closing.is_set():
            raise _Closing
        session.process_pktqueue()
        session.resend_if_due()
        if self._failure is not None:
            raise self._error_from(self._failure)
        now = time.monotonic()
        if now - session.heard > DEAD_AFTER:
            raise self._error_from(f"no answer in {DEAD_AFTER:g} s")
        quiet = now - max(session.heard, self._probed)
        if console.activated and quiet > PROBE_AFTER and not session._isincommand():
            self._probed = now
            session._keepalive()  # Get Payload Instance Info: ours still?

    def _send_typed(self, console: _SolConsole) -> None:
        """What was typed, one packet at a time: each send returns once acknowledged."""
        while True:
            try:
                data = self._typed.get_nowait()
            except queue.Empty:
                return
            for start in range(0, len(data), console.maxoutcount):
                console.send_data(data[start : start + console.maxoutcount])

    def _error_from(self, reason: str) -> ConsoleError:
        reason = scrub(reason, self.spec.password)
        return ConsoleError(f"{self.node}: BMC {self.address}: SOL: {reason}")


async def open_sol(node: str, spec: PowerSpec, *, force: bool = False) -> SolLink:
    """`node`'s console through its BMC (``spec``: address, user, password, port), once the
    SOL payload is active. ``force`` takes it from whoever holds it (module doc). Raises
    ConsoleError, within ``OPEN_TIMEOUT`` seconds."""
    if not spec.address:
        raise ConsoleError(f"{node}: SOL needs the BMC's address")
    # resolved here: pyghmi resolves a name for a session's first packet while it holds its
    # one lock, which every IPMI call of the process then waits for
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            spec.address, spec.port or 623, type=socket.SOCK_DGRAM
        )
    except OSError as error:
        raise ConsoleError(f"{node}: BMC {spec.address}: {error.strerror or error}") from None
    link = SolLink(node, spec, found[0][4][0], force)
    link._thread.start()
    try:
        async with asyncio.timeout(OPEN_TIMEOUT):
            await asyncio.shield(link._opened)
    except TimeoutError:
        await link.close()
        raise ConsoleError(
            f"{node}: BMC {spec.address}: SOL not active after {OPEN_TIMEOUT:g} s"
        ) from None
    except BaseException:
        await link.close()
        raise
    return link
