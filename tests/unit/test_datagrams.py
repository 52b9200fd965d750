"""The drained UDP socket on loopback: every datagram read, at most BATCH per wakeup of
the loop, and a reply the kernel refuses reported instead of queued."""

from __future__ import annotations

import asyncio
import socket
import time

from layerpy.services.datagrams import BATCH, Datagrams

BURST = 3 * BATCH + 10  # fits the default receive buffer (about 270 small datagrams)


def loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


def test_a_burst_is_read_whole_and_in_batches() -> None:
    """A few batches' worth of waiting datagrams all arrive in order, and the loop runs other work after the
    first BATCH of them: a flood on one socket cannot starve the rest of the process."""

    async def main() -> tuple[list[tuple[bytes, tuple[str, int]]], list[int]]:
        endpoint = Datagrams(loopback_socket())
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sender.bind(("127.0.0.1", 0))
        got: list[tuple[bytes, tuple[str, int]]] = []
        seen_by_other_work: list[int] = []
        everything = asyncio.Event()

        def on_datagram(data: bytes, sender_address: tuple[str, int]) -> None:
            if not got:  # runs once this batch is over
                asyncio.get_running_loop().call_soon(lambda: seen_by_other_work.append(len(got)))
            got.append((data, sender_address))
            if len(got) == BURST:
                everything.set()

        for number in range(BURST):  # all queued in the kernel before the loop looks
            sender.sendto(number.to_bytes(2), endpoint.sock.getsockname())
        endpoint.listen(on_datagram)
        try:
            async with asyncio.timeout(30):  # generous: a busy machine
                await everything.wait()
        except TimeoutError:
            raise AssertionError(f"waited 30 s for {BURST} datagrams, {len(got)} came") from None
        endpoint.close()
        sender.close()
        return got, seen_by_other_work

    got, seen_by_other_work = asyncio.run(main())
    assert [int.from_bytes(data) for data, _ in got] == list(range(BURST))
    assert {address[0] for _, address in got} == {"127.0.0.1"}
    assert seen_by_other_work == [BATCH]


def test_a_send_the_kernel_refuses_is_reported_not_queued() -> None:
    async def main() -> tuple[bool, bool]:
        receiver = loopback_socket()
        endpoint = Datagrams(loopback_socket())  # no SO_BROADCAST: broadcasts are refused
        delivered = endpoint.send(b"reply", receiver.getsockname())
        refused = endpoint.send(b"reply", ("255.255.255.255", 9))
        endpoint.close()
        assert receiver.recv(100) == b"reply"
        receiver.close()
        return delivered, refused

    assert asyncio.run(main()) == (True, False)


def test_close_stops_reading_and_closes_the_socket() -> None:
    async def main() -> None:
        endpoint = Datagrams(loopback_socket())
        endpoint.listen(lambda data, sender: None)
        fd = endpoint.sock.fileno()
        endpoint.close()
        endpoint.close()  # twice is harmless
        assert endpoint.sock.fileno() == -1
        assert not asyncio.get_running_loop().remove_reader(fd)  # False: none was left

    asyncio.run(main())


def test_shed_is_asked_with_how_long_each_datagram_waited() -> None:
    """With a shed callback, each datagram's wait in the socket comes from the kernel's
    time stamp of its arrival: one that waited while the loop was busy shows it, and the
    ones it sheds are never handed on."""

    async def main() -> list[tuple[bytes, float]]:
        endpoint = Datagrams(loopback_socket())
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        address = endpoint.sock.getsockname()
        seen: list[tuple[bytes, float]] = []
        handed: list[bytes] = []
        new = asyncio.Event()

        def shed(data: bytes, waited: float) -> bool:
            seen.append((data, waited))
            return data != b"new"

        def on_datagram(data: bytes, _sender: tuple[str, int]) -> None:
            handed.append(data)
            new.set()

        async def held_back(data: bytes, hold: float) -> float:
            """Send `data` while the loop is busy for `hold` s; the wait shed was told."""
            count = len(seen)
            sender.sendto(data, address)
            time.sleep(hold)  # the loop is busy: the datagram waits in the socket meanwhile
            while len(seen) == count:
                await asyncio.sleep(0.01)
            return seen[-1][1]

        endpoint.listen(on_datagram, shed=shed)
        try:
            async with asyncio.timeout(30):
                # the kernel starts time-stamping a moment after the first socket asks (in
                # deferred work): until then a datagram seems to arrive when it is read
                while await held_back(b"probe", 0.05) < 0.05:
                    pass
                seen.clear()
                old = await held_back(b"old", 0.3)
                sender.sendto(b"new", address)
                await new.wait()
        except TimeoutError:
            raise AssertionError(
                f"waited 30 s for time-stamped datagrams; shed saw {seen}"
            ) from None
        finally:
            endpoint.close()
            sender.close()
        assert handed == [b"new"] and seen[0] == (b"old", old)
        return seen

    seen = asyncio.run(main())
    (_, old), (_, new) = seen
    assert old >= 0.3 and old > new >= -0.01, seen  # new: read as it came
