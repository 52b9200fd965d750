"""A connection to one node's serial console, whatever carries it.

The capture (``consoles.capture``) reads a link continuously and writes what an attached
operator types into it; it does not care whether the bytes come from a VM's serial socket
or a BMC's Serial-over-LAN. A link that fails raises ``ConsoleError``; the capture then
opens a new one after a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

READ_SIZE = 4096
KEYSTROKES = 4096  # bytes an operator may send in one message (the CLI sends no more)


class ConsoleError(Exception):
    """A console cannot be reached or broke; the message names the node and the reason,
    never a password."""


class ConsoleLink(Protocol):
    async def read(self) -> bytes:
        """The next bytes the node printed; ``b""`` once the link is closed."""
        ...

    async def write(self, data: bytes) -> None:
        """Send keystrokes to the node."""
        ...

    async def close(self) -> None: ...


class SocketLink:
    """A Unix stream socket that is a serial line: QEMU's ``-chardev socket,server=on``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, node: str, path: str) -> SocketLink:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        except OSError as error:
            reason = error.strerror or error
            raise ConsoleError(f"{node}: console socket {path}: {reason}") from None
        return cls(reader, writer)

    async def read(self) -> bytes:
        try:
            return await self.reader.read(READ_SIZE)
        except OSError:
            return b""

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        with contextlib.suppress(OSError):  # the reader sees the end, the capture reconnects
            await self.writer.drain()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()
