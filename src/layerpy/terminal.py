"""A node's serial console on the operator's terminal.

What a node prints is not trusted: a compromised or confused node could retitle the
window, write the clipboard (OSC 52), draw images or query and inject answers (DCS, APC),
or reach for C1 controls. ``EscapeFilter`` lets through what a console needs (text, colours
and cursor movement as CSI sequences, charset and keypad switches) and drops the rest.
Keys go the other way through ``DetachKeys``: Ctrl-] then ``.`` detaches, as telnet's
escape and ssh's ``~.`` do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import termios
import tty
from collections.abc import Iterator
from enum import Enum, auto
from typing import TYPE_CHECKING, BinaryIO

from layerpy.consoles.link import KEYSTROKES

if TYPE_CHECKING:
    from aiohttp import ClientWebSocketResponse

ESC, BEL, CAN, SUB, DEL = 0x1B, 0x07, 0x18, 0x1A, 0x7F
KEPT_CONTROLS = frozenset(b"\r\n\t\b")
STRING_STARTS = frozenset(b"]PX^_")  # OSC, DCS, SOS, PM, APC: all dropped to their end
OSC = ord("]")
# CSI finals dropped: t (window operations: resize, move, report the title into the input),
# n and c (status and device queries: the terminal would type its answers to the node, or
# into the operator's shell after a detach), i (printer control)
DROPPED_CSI = frozenset(b"tnci")
DECID = ord("Z")  # ESC Z: an identification query, as CSI c
# What a node may have switched on is switched off when the session ends: colours and
# charset, the cursor, the alternate screen, mouse reports, bracketed paste.
RESET = b"\x1b[0m\x1b(B\x1b[?25h\x1b[?1049l\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?2004l"
SEQUENCE_LIMIT = 64  # a CSI or escape longer than this is no sequence a console needs
STRING_LIMIT = 4096  # an unterminated string must not swallow the console for good
REPLACEMENT = "\ufffd".encode()
# any byte the filter must look at: controls other than \t \n \r \b, DEL, and non-ASCII
_SPECIAL = re.compile(rb"[\x00-\x07\x0b\x0c\x0e-\x1f\x7f-\xff]")

DETACH_KEY = 0x1D  # Ctrl-]
DETACH_HINT = "Ctrl-] then ."
QUIET_AFTER_EOF = 1.0  # with stdin at its end, wait for the console to fall silent
LONGEST_AFTER_EOF = 10.0


class _State(Enum):
    GROUND = auto()
    UTF8 = auto()  # inside a multi-byte character
    ESCAPE = auto()  # after ESC
    INTERMEDIATE = auto()  # ESC and 0x20-0x2F bytes: charset designations and the like
    CSI = auto()  # ESC [
    STRING = auto()  # inside OSC, DCS, SOS, PM or APC
    STRING_ESCAPE = auto()  # ESC inside a string: ST (ESC \) ends it


class EscapeFilter:
    """Console output made harmless for a terminal. It keeps state between chunks (a
    sequence may be cut anywhere) and does no I/O: ``feed`` maps bytes to bytes.

    Kept: printable ASCII, valid UTF-8, CR LF TAB BS, CSI sequences except window
    operations, and two-byte or nF escapes (ESC 7, ESC ( 0, ESC =). Dropped: other C0
    controls, DEL, C1 controls (U+0080-U+009F), OSC/DCS/SOS/PM/APC strings with their
    terminator, malformed sequences; bytes that are not UTF-8 become U+FFFD."""

    def __init__(self) -> None:
        self._state = _State.GROUND
        self._held = bytearray()  # the sequence or character being read
        self._needed = 0  # continuation bytes still to come in UTF8
        self._string_length = 0
        self._osc = False

    def feed(self, data: bytes) -> bytes:
        if self._state is _State.GROUND and not _SPECIAL.search(data):
            return data
        out = bytearray()
        for byte in data:
            while not self._step(byte, out):
                pass
        return bytes(out)

    def _step(self, byte: int, out: bytearray) -> bool:
        """Consume ``byte``; False when it ended a sequence and must be read again."""
        state = self._state
        if state is _State.GROUND:
            self._ground(byte, out)
        elif state is _State.UTF8:
            if not 0x80 <= byte <= 0xBF:
                out += REPLACEMENT
                return self._reset()
            self._held.append(byte)
            self._needed -= 1
            if not self._needed:
                self._character(out)
        elif state in (_State.ESCAPE, _State.INTERMEDIATE, _State.CSI):
            return self._sequence(byte, out)
        elif state is _State.STRING:
            if byte == ESC:
                self._state = _State.STRING_ESCAPE
            elif (byte == BEL and self._osc) or byte in (CAN, SUB):
                self._state = _State.GROUND
            else:
                self._string_length += 1
                if self._string_length >= STRING_LIMIT:
                    self._state = _State.GROUND  # what follows is shown, as harmless text
        else:  # STRING_ESCAPE: ESC \ ends the string; any other ESC ends it and starts anew
            self._state = _State.GROUND
            if byte != ord("\\"):
                self._escape()
                return False
        return True

    def _ground(self, byte: int, out: bytearray) -> None:
        if 0x20 <= byte < DEL or byte in KEPT_CONTROLS:
            out.append(byte)
        elif byte == ESC:
            self._escape()
        elif 0xC2 <= byte <= 0xF4:
            self._state, self._needed = _State.UTF8, 1 if byte < 0xE0 else 2 if byte < 0xF0 else 3
            self._held[:] = bytes([byte])
        elif byte >= 0x80:
            out += REPLACEMENT  # a stray continuation byte, or one no UTF-8 has

    def _character(self, out: bytearray) -> None:
        self._state = _State.GROUND
        try:
            character = self._held.decode()
        except UnicodeDecodeError:  # overlong, a surrogate, beyond U+10FFFF
            out += REPLACEMENT
            return
        if not "\x80" <= character <= "\x9f":  # C1 controls: CSI, OSC, DCS in 8 bits
            out += self._held

    def _sequence(self, byte: int, out: bytearray) -> bool:
        state = self._state
        if byte == ESC:
            self._escape()
        elif state is _State.ESCAPE and byte == ord("["):
            self._state = _State.CSI
            self._held.append(byte)
        elif state is _State.ESCAPE and byte in STRING_STARTS:
            self._state, self._osc, self._string_length = _State.STRING, byte == OSC, 0
        elif 0x20 <= byte <= 0x2F or (state is _State.CSI and 0x30 <= byte <= 0x3F):
            if len(self._held) >= SEQUENCE_LIMIT:
                return self._reset()  # dropped; the rest shows as text
            self._held.append(byte)
            if state is _State.ESCAPE:
                self._state = _State.INTERMEDIATE
        elif (0x40 if state is _State.CSI else 0x30) <= byte <= 0x7E:
            query = byte in DROPPED_CSI if state is _State.CSI else byte == DECID
            if not (query and state in (_State.CSI, _State.ESCAPE)):
                out += self._held
                out.append(byte)
            self._state = _State.GROUND
        else:  # a control or non-ASCII byte: no sequence; the byte is read afresh
            return self._reset()
        return True

    def _escape(self) -> None:
        self._state = _State.ESCAPE
        self._held[:] = bytes([ESC])

    def _reset(self) -> bool:
        self._state = _State.GROUND
        return False


def harmless(data: bytes) -> bytes:
    """``data`` filtered whole (a captured log): an unfinished sequence at its end is
    dropped."""
    return EscapeFilter().feed(data)


class DetachKeys:
    """The operator's keys on their way to the node: Ctrl-] then ``.`` detaches; Ctrl-]
    then any other key sends both (so Ctrl-] itself still reaches the node)."""

    def __init__(self) -> None:
        self._pending = False

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """The bytes to send, and whether to detach (the bytes after it are dropped)."""
        out = bytearray()
        for byte in data:
            if self._pending:
                self._pending = False
                if byte == ord("."):
                    return bytes(out), True
                out += bytes([DETACH_KEY, byte])
            elif byte == DETACH_KEY:
                self._pending = True
            else:
                out.append(byte)
        return bytes(out), False


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """The terminal in raw mode (every key goes to the node: Ctrl-C too), restored however
    the session ends."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        if os.isatty(sys.stdout.fileno()):  # undo the modes the node may have set
            with contextlib.suppress(OSError):
                os.write(sys.stdout.fileno(), RESET)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class Session:
    """One attached console: keys from ``stdin`` to the WebSocket, the node's output
    filtered to ``stdout``, notices to stderr."""

    def __init__(self, socket: ClientWebSocketResponse, stdin: int, stdout: BinaryIO) -> None:
        self.socket, self.stdin, self.stdout = socket, stdin, stdout
        self.raw = os.isatty(stdin)
        self.filter = EscapeFilter()
        self.ended: str | None = None  # why the session ended, if not by the operator
        self._output_seen = asyncio.Event()

    def notice(self, text: str) -> None:
        """A line on stderr, also right in raw mode (where LF does not return the carriage)."""
        end = "\r\n" if self.raw else "\n"
        sys.stderr.write(("\r\n" if self.raw else "") + text + end)
        sys.stderr.flush()

    async def run(self) -> bool:
        """Until the operator detaches or stdin ends (True), or the connection does (False,
        ``ended`` says why)."""
        output = asyncio.ensure_future(self._output())
        keys = asyncio.ensure_future(self._keys())
        try:
            await asyncio.wait((output, keys), return_when=asyncio.FIRST_COMPLETED)
            if keys.done() and not output.done() and not self.raw:
                await self._linger(output)  # a piped command: let its answer arrive
        finally:
            for task in (output, keys):
                task.cancel()
            await asyncio.gather(output, keys, return_exceptions=True)
        return self.ended is None

    async def _output(self) -> None:
        from aiohttp import WSMsgType

        from layerpy.text import printable

        async for message in self.socket:
            if message.type is WSMsgType.BINARY:
                self.stdout.write(self.filter.feed(message.data))
                self.stdout.flush()
                self._output_seen.set()
            elif message.type is WSMsgType.TEXT:
                self.notice(f"[{printable(message.data, 500)}]")
            elif message.type is WSMsgType.ERROR:
                break
        error = self.socket.exception()
        self.ended = (
            f"the console connection broke: {error}"
            if error is not None
            else f"the server closed the console (code {self.socket.close_code})"
        )

    async def _keys(self) -> None:
        """Keys until the detach sequence or the end of stdin."""
        detach = DetachKeys()
        loop = asyncio.get_running_loop()
        ready = asyncio.Queue[bytes]()

        def readable() -> None:
            try:
                ready.put_nowait(os.read(self.stdin, KEYSTROKES))
            except OSError:  # the terminal went away: as good as the end of input
                ready.put_nowait(b"")

        try:
            loop.add_reader(self.stdin, readable)
            read = ready.get
        except PermissionError:  # a regular file (or /dev/null): epoll cannot wait on it

            async def read() -> bytes:
                return await asyncio.to_thread(os.read, self.stdin, KEYSTROKES)

        try:
            while data := await read():
                send, leave = detach.feed(data)
                if send:
                    await self.socket.send_bytes(send)
                if leave:
                    return
        except ConnectionError as error:
            self.ended = f"the console connection broke: {error}"
        finally:
            loop.remove_reader(self.stdin)

    async def _linger(self, output: asyncio.Future[None]) -> None:
        """After the end of stdin, keep printing until the console is quiet for a second
        (at most LONGEST_AFTER_EOF)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LONGEST_AFTER_EOF
        while not output.done() and loop.time() < deadline:
            self._output_seen.clear()
            try:
                await asyncio.wait_for(self._output_seen.wait(), QUIET_AFTER_EOF)
            except TimeoutError:
                return
