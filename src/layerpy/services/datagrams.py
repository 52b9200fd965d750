"""A UDP socket read by draining: every datagram waiting is read in one wakeup of the loop.

asyncio's datagram transport reads one datagram per wakeup of the event loop. Draining the
DHCP sockets instead raised the Kea bench's pool saturation from 3 115 to 5 487 DORA/s and
cut its p99 at 3 000/s from 0.75 to 0.21 ms (`bench/dhcp_kea.py --quick --mode pool`).
Replies are sent at once or not at all: a full send buffer (replies held back waiting for
ARP) drops the reply, which the caller counts, instead of queueing it without bound as the
transport would.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable

BATCH = 64
"""Datagrams read per wakeup at most, so that a flood on one socket cannot starve the loop."""
RECEIVE_SIZE = 65536  # any UDP payload: nothing is truncated before it is judged
DEEP_BUFFER = 4 << 20  # bytes queued each way on a listening socket (1 000 nodes' requests)
SO_TIMESTAMPNS = 35  # Linux's (asm-generic, x86-64 and arm64): each datagram's arrival time
_TIMESPEC = struct.Struct("@qq")  # struct timespec, as SCM_TIMESTAMPNS carries it
_STAMPED = socket.CMSG_SPACE(_TIMESPEC.size)


def deep_buffers(sock: socket.socket, size: int = DEEP_BUFFER) -> None:
    """Room for the requests of a room powering on at once, and for the replies to them:
    the kernel's default holds about 250 of each and drops the rest, which PXE ROMs then
    wait seconds to repeat (1 000 DISCOVERs at once: 793 repeated, bench/storm.py). Above
    net.core.[rw]mem_max only root may (SO_*BUFFORCE); otherwise as much as allowed."""
    for forced, plain in (("SO_RCVBUFFORCE", "SO_RCVBUF"), ("SO_SNDBUFFORCE", "SO_SNDBUF")):
        for option in (getattr(socket, forced, None), getattr(socket, plain)):
            if option is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, size)
                break
            except OSError:
                continue


class Datagrams:
    """One non-blocking UDP socket, owned from here on (closing this closes it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._reading = False

    def listen(
        self,
        on_datagram: Callable[[bytes, tuple[str, int]], None],
        shed: Callable[[bytes, float], bool] | None = None,
    ) -> None:
        """Hand every datagram that arrives, with its sender, to on_datagram; with `shed`,
        first ask it whether to drop the datagram unread, given how long it waited in the
        socket (seconds, from the kernel's time stamp of its arrival)."""
        sock = self.sock
        if shed is not None:
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)

        def drain() -> None:
            now = time.time()  # the kernel stamps arrivals on the wall clock
            for _ in range(BATCH):
                try:
                    if shed is None:
                        data, sender = sock.recvfrom(RECEIVE_SIZE)
                    else:
                        data, ancillary, _, sender = sock.recvmsg(RECEIVE_SIZE, _STAMPED)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:  # an ICMP error about an earlier reply: nothing to read
                    continue
                if shed is not None and ancillary:
                    seconds, nanoseconds = _TIMESPEC.unpack_from(ancillary[0][2])
                    if shed(data, now - seconds - nanoseconds * 1e-9):
                        continue
                on_datagram(data, sender)

        self._loop.add_reader(sock.fileno(), drain)
        self._reading = True

    def send(self, data: bytes, destination: tuple[str, int]) -> bool:
        """Send now; False when the datagram could not be handed to the kernel."""
        try:
            self.sock.sendto(data, destination)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.sock.fileno())
            self._reading = False
        self.sock.close()
