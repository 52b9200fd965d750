"""Every node's serial console, captured all the time into a bounded log on the server.

One task per node with a console reads its link (QEMU's serial socket, or IPMI
Serial-over-LAN) for as long as the node is in the file, reconnecting with a backoff when
the link breaks. What it reads goes to the node's log (``consoles/NODE.log`` in the state
directory, 0600, rotated to ``NODE.log.1`` at ``FILE_LIMIT``: at most twice that per
node), to the operators attached to it, and past the watch for the lines a dying kernel
prints (a panic, an oops, a hung task, a lockup): those are observations the node store
turns into a lost node or a warning, seconds after they happen instead of after missed
heartbeats.

Console output comes from the node and is hostile like everything on the boot network: it
is stored as bytes, shown to operators as text (the CLI strips dangerous terminal escapes,
the dashboard shows text, never HTML), and a problem line is quoted only after
``printable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from layerpy.consoles.link import ConsoleError, ConsoleLink, SocketLink
from layerpy.logs import Throttle
from layerpy.power.base import PowerSpec
from layerpy.text import printable

log = logging.getLogger("layerpy.console")
quiet = Throttle(log)  # what a node or a full disk can cause: a few lines a minute

FILE_LIMIT = 1024 * 1024  # bytes of one node's log before it is rotated (one old file kept)
FLUSH_EVERY = 1.0  # seconds between writes of what was captured (one write per node)
PENDING_LIMIT = 256 * 1024  # bytes held for the next write; beyond, the oldest are dropped
LINE_LIMIT = 1024  # bytes of a line looked at for a problem (a longer one is cut)
VIEWER_QUEUE = 256  # chunks queued for one attached operator before they are let go
BACKOFF = (1.0, 60.0)  # seconds between attempts to reach a console: first, cap
SEEN_ON_ATTACH = 4096  # bytes of the log an operator sees when attaching

# What a dying or sick kernel prints. A panic ends the node's life until it is
# power-cycled: the node store makes it lost at once (its FATAL_ON_CONSOLE). The others are
# quoted by `explain` and the event stream; the node may still recover, or stop reporting.
_KERNEL = rb"^(?:<\d>)?(?:\[ *\d+\.\d+\] ?)?"  # a kernel line: level, timestamp, then
PROBLEMS: list[tuple[re.Pattern[bytes], str]] = [
    (re.compile(_KERNEL + rb"Kernel panic - not syncing"), "panic"),
    (re.compile(_KERNEL + rb"(?:Oops[: ]|BUG: unable to handle|general protection fault)"), "oops"),
    (re.compile(_KERNEL + rb"INFO: task \S+ blocked for more than \d+ seconds"), "hung_task"),
    (re.compile(_KERNEL + rb"(?:watchdog: BUG: soft lockup|Watchdog detected hard LOCKUP)"),
     "lockup"),
]  # fmt: skip
# What a node prints that an operator with only the read scope must not see: its boot token
# (on the kernel command line the kernel echoes at boot). Replaced before anything keeps it.
SECRET = re.compile(rb"layerpy\.token=\S*")
SECRET_MARK = b"layerpy.token="
SECRET_HOLD = 256  # bytes held back while a token may still be being printed
STEADY = 60.0  # seconds a link must stay up before its backoff starts afresh

Opener = Callable[[str, PowerSpec], Awaitable[ConsoleLink]]
OnProblem = Callable[[str, str, str], None]  # node, kind, line


async def open_link(node: str, spec: PowerSpec) -> ConsoleLink:
    """The link a node's spec names."""
    assert spec.console is not None
    if spec.console == "sol":
        from layerpy.consoles.sol import open_sol  # pyghmi's console, only where used

        return await open_sol(node, spec)
    return await SocketLink.open(node, spec.console)


@dataclass(eq=False)
class _Console:
    """One node's capture: its log file, what waits to be written, who is attached."""

    node: str
    spec: PowerSpec
    path: Path
    pending: bytearray = field(default_factory=bytearray)
    line: bytearray = field(default_factory=bytearray)
    held: bytes = b""  # the start of what may be a boot token, until it is complete
    viewers: set[asyncio.Queue[bytes | None]] = field(default_factory=set)
    link: ConsoleLink | None = None
    task: asyncio.Task[None] | None = None
    state: str = "connecting"  # connecting, connected, or why it is not


class Consoles:
    """The captures of all nodes: the one writer of ``consoles/``."""

    def __init__(
        self, directory: Path, on_problem: OnProblem, opener: Opener = open_link,
        most: int | None = None,
    ) -> None:  # fmt: skip
        self.directory = directory
        self.on_problem = on_problem
        self.opener = opener
        self.most = most  # consoles captured at once: the descriptor plan's share
        self._consoles: dict[str, _Console] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._closed = False
        self._said_most = 0  # the count of consoles the plan's warning was last given for
        # why a node's console is not captured here though it has one, and where it is
        # (an instance of a cluster captures only its own nodes'); None: it has none
        self.elsewhere: Callable[[str], str | None] = lambda node: None

    def sync(self, specs: dict[str, PowerSpec]) -> None:
        """Capture exactly these nodes' consoles (a reload adds, drops and changes some),
        as many as the descriptor plan has room for: those first in name order. Nothing
        after ``close``."""
        if self._closed:
            return
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.most is not None and len(specs) > self.most:
            names = sorted(specs)
            left = names[self.most :]
            if self._said_most != len(specs):  # once per count: a cluster syncs often
                self._said_most = len(specs)
                log.warning(
                    "%d consoles in the node file, room for %d in the descriptor plan: not "
                    "capturing %s%s; raise LimitNOFILE (docs/scale.md)", len(specs), self.most,
                    ", ".join(left[:5]), f" and {len(left) - 5} more" if len(left) > 5 else "",
                )  # fmt: skip
            specs = {name: specs[name] for name in names[: self.most]}
        for node in list(self._consoles):
            if node not in specs or specs[node] != self._consoles[node].spec:
                self._stop(node)
        for node, spec in specs.items():
            if node not in self._consoles:
                console = _Console(node, spec, self.directory / f"{node}.log")
                console.task = asyncio.create_task(self._capture(console))
                self._consoles[node] = console
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_forever())

    def has(self, node: str) -> bool:
        return node in self._consoles

    def state(self, node: str) -> str | None:
        console = self._consoles.get(node)
        return None if console is None else console.state

    def _stop(self, node: str) -> None:
        console = self._consoles.pop(node)
        self._flush(console)
        if console.task is not None:
            console.task.cancel()
        for viewer in console.viewers:
            _offer(viewer, None)

    async def close(self) -> None:
        self._closed = True
        tasks = [c.task for c in self._consoles.values() if c.task is not None]
        for node in list(self._consoles):
            self._stop(node)
        if self._flusher is not None:
            self._flusher.cancel()
            tasks.append(self._flusher)
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- capturing ---------------------------------------------------------------------

    async def _capture(self, console: _Console) -> None:
        """Read the console for as long as the node has one; any failure of a link (a
        driver's bug included) is logged once per reason and retried with a backoff that
        starts afresh only after a link stayed up a while (one that accepts and drops at
        once is not retried every second)."""
        first, cap = BACKOFF
        delay, said = first, ""
        while True:
            up = 0.0
            try:
                console.link = await self.opener(console.node, console.spec)
                up = time.monotonic()
                if said:
                    log.info("%s: console reached again", console.node)
                console.state, said = "connected", ""
                while data := await console.link.read():
                    self._heard(console, data)
                reason = "the console closed the connection"
            except (ConsoleError, OSError) as error:
                reason = str(error)
            except Exception as error:  # a driver's bug: logged, and the capture goes on
                reason = f"{type(error).__name__}: {error}"
                log.exception("%s: console failed", console.node)
            finally:
                link, console.link = console.link, None
                if link is not None:
                    with contextlib.suppress(Exception):
                        await link.close()
            console.state = reason
            if up:
                self._notice(console, f"console of {console.node}: {reason}, reconnecting")
            if reason != said:  # once per reason, not once per attempt
                log.warning("%s: console: %s; trying again", console.node, reason)
                said = reason
            if up and time.monotonic() - up > STEADY:
                delay = first
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(cap, delay * 2)

    def _heard(self, console: _Console, data: bytes) -> None:
        data = _without_secrets(console, data)
        if not data:
            return
        console.pending += data
        if len(console.pending) > PENDING_LIMIT:
            excess = len(console.pending) - PENDING_LIMIT
            del console.pending[:excess]
            quiet.log("console log lost", logging.WARNING, "%s: console log lost %d bytes: "
                      "the disk is slower than the node prints", console.node, excess)  # fmt: skip
        for viewer in list(console.viewers):
            if not _offer(viewer, data):  # too slow: told why, and let go
                console.viewers.discard(viewer)
                _offer(viewer, Notice(b"fell behind the console; attach again"), force=True)
                _offer(viewer, None, force=True)
        self._look_for_problems(console, data)

    def _look_for_problems(self, console: _Console, data: bytes) -> None:
        *complete, rest = (bytes(console.line) + data).split(b"\n")
        console.line = bytearray(rest[-LINE_LIMIT:])
        for line in complete:
            line = line[:LINE_LIMIT].strip(b"\r")
            for pattern, kind in PROBLEMS:
                if pattern.search(line):
                    text = printable(line.decode(errors="replace").strip(), 200)
                    self.on_problem(console.node, kind, text)
                    break

    def _notice(self, console: _Console, text: str) -> None:
        for viewer in console.viewers:
            _offer(viewer, Notice(text.encode()))

    # -- the log files -------------------------------------------------------------------

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY)
            for console in self._consoles.values():
                self._flush(console)

    def _flush(self, console: _Console) -> None:
        if not console.pending:
            return
        data, console.pending = bytes(console.pending), bytearray()
        try:
            if console.path.exists() and console.path.stat().st_size + len(data) > FILE_LIMIT:
                console.path.replace(console.path.with_name(console.path.name + ".1"))
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(console.path, flags, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as error:
            quiet.log("console files", logging.ERROR, "%s: cannot keep its console log %s: %s",
                      console.node, console.path, error.strerror or error)  # fmt: skip

    def tail(self, node: str, size: int) -> bytes:
        """The last `size` bytes the node printed (across the rotation)."""
        console = self._consoles[node]
        data = bytes(console.pending)
        for path in (console.path, console.path.with_name(console.path.name + ".1")):
            if len(data) >= size:
                break
            with contextlib.suppress(OSError), open(path, "rb") as old:
                old.seek(max(0, os.fstat(old.fileno()).st_size - (size - len(data))))
                data = old.read() + data
        return data[-size:]

    # -- operators -----------------------------------------------------------------------

    def attach(self, node: str) -> asyncio.Queue[bytes | None]:
        """A queue of what the node prints from now on (None: the capture ended, or the
        viewer fell behind); the server's notices come as ``Notice``."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(VIEWER_QUEUE)
        self._consoles[node].viewers.add(queue)
        return queue

    def detach(self, node: str, queue: asyncio.Queue[bytes | None]) -> None:
        console = self._consoles.get(node)
        if console is not None:
            console.viewers.discard(queue)

    async def type(self, node: str, data: bytes) -> bool:
        """Send keystrokes; False when the console is not connected now."""
        console = self._consoles.get(node)
        if console is None or console.link is None:
            return False
        await console.link.write(data)
        return True


class Notice(bytes):
    """A line for the operator from the server, not from the node."""


def _offer(queue: asyncio.Queue[bytes | None], item: bytes | None, *, force: bool = False) -> bool:
    """Queue without waiting; `force` makes room by dropping the oldest."""
    if force:
        while queue.full():
            queue.get_nowait()
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        return False
    return True


def _without_secrets(console: _Console, data: bytes) -> bytes:
    """`data` with every boot token replaced; a token (or its marker) still being printed
    at the end is held back until it is complete."""
    data = console.held + data
    cut = len(data)
    start = data.rfind(SECRET_MARK)
    if start >= 0 and not re.search(rb"\s", data[start:]) and len(data) - start < SECRET_HOLD:
        cut = start
    else:
        for size in range(min(len(SECRET_MARK) - 1, len(data)), 0, -1):
            if data.endswith(SECRET_MARK[:size]):
                cut = len(data) - size
                break
    console.held = data[cut:]
    return SECRET.sub(SECRET_MARK + b"***", data[:cut])
