"""The simulated nodes of bench/storm.py: what firmware, iPXE and the minOS's agent do, for
N machines at once, from one asyncio process inside the bench's client namespace.

Per node: DHCP DORA as a PXE ROM (option 93, broadcast flag), TFTP of the iPXE binary
(lock-step, blksize 1468), DHCP again as iPXE (user class iPXE), HTTP of the boot script,
kernel and initrd (one keep-alive connection, as iPXE), then as the minOS: DHCP a third
time, the agent's hello, a heartbeat, the image it is told to run (with its token), a
report of the image active. Every exchange is retried as the real client would (DHCP
4/8/16 s, TFTP 1 s per block, HTTP and reports with backoff); retries and failures are
counted. The node addresses are the namespace's own (a ``local`` route), so each node
speaks from its address without 1 000 interfaces.

Prints one JSON document: per node the time each phase ended, the retries, the failure
if any. Run by bench/storm.py; `--until initrd` stops after the initrd (for the
reference stack, which has no agent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address

import uvloop

from layerpy.proto import dhcp
from layerpy.proto.agent import PROTOCOL, Identity, node_authorization

ZERO = IPv4Address(0)
DISCOVER, OFFER, REQUEST, ACK, NAK = 1, 2, 3, 5, 6
DHCP_TRIES = (4.0, 8.0, 16.0, 32.0)  # a PXE ROM's waits
TFTP_TIMEOUT, TFTP_TRIES = 1.0, 6
HTTP_TIMEOUT = 60.0
BLKSIZE = 1468


class Failed(Exception):
    pass


@dataclass
class Node:
    name: str
    mac: bytes
    ip: str = ""
    phases: dict[str, float] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    bytes: int = 0
    addresses: list[str] = field(default_factory=list)  # every address an ACK gave it

    def retried(self, what: str) -> None:
        self.retries[what] = self.retries.get(what, 0) + 1


# -- DHCP ------------------------------------------------------------------------------------


def dhcp_packet(kind: int, node: Node, xid: int, options: dict[int, bytes]) -> bytes:
    """A client's message with the broadcast flag, as PXE ROMs send it."""
    packet = dhcp.DhcpPacket(1, 1, 6, 0, xid, 0, 0x8000, ZERO, ZERO, ZERO, ZERO,
                             node.mac.ljust(16, b"\0"), bytes(64), bytes(128),
                             {dhcp.OPT_MESSAGE_TYPE: bytes((kind,)), **options})  # fmt: skip
    return dhcp.encode(packet)


def dhcp_reply(data: bytes) -> tuple[int, int, str, dict[int, bytes]] | None:
    """(xid, message type, yiaddr, options) of a server's reply; the boot file as option
    67, from BOOTP's own field when the server put it there (dnsmasq does)."""
    try:
        reply = dhcp.decode(data)
    except dhcp.DhcpError:
        return None
    if reply.op != 2 or reply.message_type is None:
        return None
    options = dict(reply.options)
    if 67 not in options and reply.file.strip(b"\0"):
        options[67] = reply.file.split(b"\0", 1)[0]
    return reply.xid, reply.message_type, str(reply.yiaddr), options


class Dhcp(asyncio.DatagramProtocol):
    """One port-68 socket for every simulated client; replies found by xid."""

    def __init__(self) -> None:
        self.waiting: dict[int, asyncio.Queue] = {}
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a datagram one (3.11's class says not)

    def datagram_received(self, data: bytes, addr: object) -> None:
        reply = dhcp_reply(data)
        if reply is not None and reply[0] in self.waiting:
            self.waiting[reply[0]].put_nowait(reply)

    async def exchange(self, node: Node, style: str) -> dict[int, bytes]:
        """DISCOVER/OFFER/REQUEST/ACK as `style` ("pxe", "ipxe", "os"); the ACK's options."""
        options = {
            "pxe": {93: b"\0\0", 60: b"PXEClient:Arch:00000:UNDI:002001"},
            "ipxe": {93: b"\0\0", 60: b"PXEClient:Arch:00000:UNDI:002001", 77: b"iPXE"},
            "os": {60: b"layerpy-minos"},
        }[style]
        xid = random.getrandbits(32)
        queue: asyncio.Queue = asyncio.Queue()
        self.waiting[xid] = queue
        try:
            offer = await self._ask(node, DISCOVER, xid, options, queue, OFFER)
            server = offer[3].get(54, b"")
            request = {**options, 50: socket.inet_aton(offer[2]), 54: server}
            ack = await self._ask(node, REQUEST, xid, request, queue, ACK)
        finally:
            del self.waiting[xid]
        node.ip = ack[2]
        if node.ip not in node.addresses:
            node.addresses.append(node.ip)
        return ack[3]

    async def _ask(self, node: Node, kind: int, xid: int, options: dict[int, bytes],
                   queue: asyncio.Queue, want: int) -> tuple:  # fmt: skip
        assert self.transport is not None
        for attempt, wait in enumerate(DHCP_TRIES):
            if attempt:
                node.retried("dhcp")
            self.transport.sendto(dhcp_packet(kind, node, xid, options), ("255.255.255.255", 67))
            deadline = time.monotonic() + wait * random.uniform(0.9, 1.1)
            while (left := deadline - time.monotonic()) > 0:
                try:
                    reply = await asyncio.wait_for(queue.get(), left)
                except TimeoutError:
                    break
                if reply[1] == want:
                    return reply
                if reply[1] == NAK:
                    raise Failed("DHCP NAK")
        raise Failed(f"no DHCP {'OFFER' if want == OFFER else 'ACK'}")


# -- TFTP ------------------------------------------------------------------------------------


class Tftp(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.queue.put_nowait((data, addr))


async def tftp(node: Node, server: str, name: str) -> int:
    """A lock-step read with blksize, as a PXE ROM does; the bytes received."""
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(Tftp, local_addr=(node.ip, 0))
    try:
        request = b"\0\1" + name.encode() + b"\0octet\0blksize\0" + str(BLKSIZE).encode() + b"\0"
        peer, last, expected, got, blksize = (server, 69), request, 1, 0, 512
        tries = 0
        while True:
            transport.sendto(last, peer)
            try:
                data, addr = await asyncio.wait_for(proto.queue.get(), TFTP_TIMEOUT)
            except TimeoutError:
                tries += 1
                node.retried("tftp")
                if tries >= TFTP_TRIES:
                    raise Failed(f"TFTP {name}: no answer after {tries} tries") from None
                continue
            opcode = data[:2]
            if opcode == b"\0\6":  # OACK
                fields = data[2:].split(b"\0")
                if b"blksize" in fields:
                    blksize = int(fields[fields.index(b"blksize") + 1])
                peer, last, tries = addr, b"\0\4\0\0", 0
            elif opcode == b"\0\3":
                block = struct.unpack("!H", data[2:4])[0]
                peer = addr
                if block == expected & 0xFFFF:
                    got += len(data) - 4
                    expected += 1
                    tries = 0
                last = b"\0\4" + data[2:4]
                if block == (expected - 1) & 0xFFFF and len(data) - 4 < blksize:
                    transport.sendto(last, peer)
                    node.bytes += got
                    return got
            elif opcode == b"\0\5":
                raise Failed(f"TFTP error {data[4:-1].decode(errors='replace')}")
    finally:
        transport.close()


# -- HTTP ------------------------------------------------------------------------------------


class Reader(asyncio.BufferedProtocol):
    """The reading side of one HTTP/1.1 connection. The kernel copies each read straight
    into one reused buffer (recv_into): a thousand nodes take 18 GB, and a reader that
    copied them twice more in Python (asyncio's StreamReader) was the storm's slowest
    part. A body over 1 MiB is counted and dropped, a smaller one kept."""

    def __init__(self) -> None:
        self.view = memoryview(bytearray(256 << 10))
        self.head, self.body = bytearray(), bytearray()
        self.status, self.length, self.left, self.keep = 0, 0, -1, False  # left < 0: the head
        self.answer: asyncio.Future[tuple[int, int, bytes]] | None = None

    def expect(self) -> asyncio.Future[tuple[int, int, bytes]]:
        self.answer = asyncio.get_running_loop().create_future()
        return self.answer

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        data: memoryview | bytearray = self.view[:nbytes]
        if self.left < 0:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                if len(self.head) > 1 << 16:
                    self._end(ValueError("HTTP head over 64 KiB"))
                return
            head, data = bytes(self.head[:end]), self.head[end + 4 :]
            self.head = bytearray()
            self.status = int(head.split(b" ", 2)[1])
            self.left = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            self.length, self.keep = self.left, self.left <= 1 << 20
        take = min(len(data), self.left)
        if self.keep:
            self.body += data[:take]
        self.left -= take
        if self.left == 0:
            answer = (self.status, self.length, bytes(self.body))
            self.body, self.left = bytearray(), -1
            self._end(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(exc or ConnectionResetError("closed by the server"))

    def _end(self, outcome: tuple[int, int, bytes] | BaseException) -> None:
        if self.answer is not None and not self.answer.done():
            if isinstance(outcome, BaseException):
                self.answer.set_exception(outcome)
            else:
                self.answer.set_result(outcome)


class Http:
    """One keep-alive connection from a node's address, as iPXE and the agent use."""

    def __init__(self, node: Node, server: str, port: int) -> None:
        self.node, self.server, self.port = node, server, port
        self.transport: asyncio.Transport | None = None
        self.reader: Reader | None = None

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
        keep: bool = False,
    ) -> tuple[int, bytes]:  # fmt: skip
        """The status and, unless it is big (then counted and dropped), the body."""
        for attempt in range(6):
            try:
                async with asyncio.timeout(HTTP_TIMEOUT):
                    return await self._once(method, path, body, headers or {}, keep)
            except (OSError, TimeoutError, ValueError) as error:
                self.close()
                self.node.retried("http")
                last = error
                await asyncio.sleep(min(8.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.0))
        raise Failed(f"HTTP {path}: {type(last).__name__}: {last}")

    async def _once(self, method: str, path: str, body: bytes, headers: dict[str, str],
                    keep: bool) -> tuple[int, bytes]:  # fmt: skip
        if self.transport is None:
            self.transport, self.reader = await asyncio.get_running_loop().create_connection(
                Reader, self.server, self.port, local_addr=(self.node.ip, 0)
            )
        assert self.reader is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.server}"]
        lines += [f"{key}: {value}" for key, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}")
        if not keep:
            lines.append("Connection: close")
        answer = self.reader.expect()
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        status, length, data = await answer
        self.node.bytes += length
        if not keep:
            self.close()
        if status >= 500 or status == 429:
            raise ValueError(f"HTTP {status}")
        return status, data

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.transport = self.reader = None


# -- one node ------------------------------------------------------------------------------


async def boot(node: Node, args: argparse.Namespace, dhcp: Dhcp, began: float) -> None:
    def reached(phase: str) -> None:
        node.phases[phase] = round(time.monotonic() - began, 4)

    try:
        ack = await dhcp.exchange(node, "pxe")
        reached("dhcp")
        server = socket.inet_ntoa(ack[54]) if len(ack.get(54, b"")) == 4 else args.server
        await tftp(node, server, ack.get(67, b"undionly.kpxe").rstrip(b"\0").decode())
        reached("tftp")
        ack = await dhcp.exchange(node, "ipxe")
        reached("dhcp_ipxe")
        script_url = ack.get(67, b"").rstrip(b"\0").decode()
        match = re.match(r"http://([^/:]+):(\d+)(/\S*)", script_url)
        if not match:
            raise Failed(f"iPXE got no boot script URL: {script_url!r}")
        http = Http(node, match.group(1), int(match.group(2)))
        status, script = await http.request("GET", match.group(3), keep=True)
        if status != 200:
            raise Failed(f"boot script: HTTP {status}")
        reached("script")
        text = script.decode()
        for phase in ("kernel", "initrd"):  # "initrd [--name N] URL", as iPXE reads it
            url = re.search(rf"^{phase} (?:--name \S+ )?(\S+)", text, re.M).group(1)
            path = "/" + url.split("/", 3)[3]
            status, _ = await http.request("GET", path, keep=True)
            if status != 200:
                raise Failed(f"{phase}: HTTP {status}")
            reached(phase)
        http.close()
        if args.until == "initrd":
            return
        token = re.search(r"layerpy\.token=(\S+)", text).group(1)
        first = re.search(r"layerpy\.server=http://([0-9.]+)", text)  # the agent's server
        every = re.search(r"layerpy\.heartbeat=([0-9.]+)", text)
        await dhcp.exchange(node, "os")
        reached("dhcp_os")
        server = first.group(1) if first else args.server
        await agent(node, args, token, server, float(every.group(1)) if every else 5.0, reached)
    except Failed as error:
        node.error = str(error)
    except Exception as error:  # a simulated node reports its failure, never crashes all
        where = traceback.extract_tb(error.__traceback__)[-1]
        node.error = f"{type(error).__name__}: {error} (storm_client.py:{where.lineno})"


async def agent(
    node: Node, args: argparse.Namespace, token: str, server: str, heartbeat: float,
    reached: Callable[[str], None],
) -> None:  # fmt: skip
    """The minOS's agent: reports to `server` (the first its command line names). A
    refused token is asked again a heartbeat later, as the agent does (a cluster's owner
    learns a token another instance handed out through etcd, a moment later)."""
    http = Http(node, server, args.http_port)
    seq = 0
    image: dict = {"state": "none"}

    async def report(event: str) -> dict:
        nonlocal seq
        seq += 1
        body = {"node": node.name, "token": token, "mac": node.mac.hex(":"), "ip": node.ip,
                "boot_id": "b00710", "seq": seq, "event": event, "busy": False,
                "protocol": PROTOCOL, "image": image}  # fmt: skip
        for _ in range(20):
            status, answer = await http.request(
                "POST", "/api/v1/agent/report", json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )  # fmt: skip
            if status == 200:
                return json.loads(answer)
            if status == 403:
                node.retried("forbidden")
                await asyncio.sleep(heartbeat * random.uniform(0.9, 1.1))
                continue
            node.retried("report")
            await asyncio.sleep(random.uniform(0.5, 1.5))
        raise Failed(f"report {event}: HTTP {status}")

    answer = await report("hello")
    reached("hello")
    heartbeat = float(answer.get("heartbeat", heartbeat))
    while not answer.get("image"):  # the server assigns the image once the node is ready
        await asyncio.sleep(min(heartbeat, args.poll) * random.uniform(0.9, 1.1))
        answer = await report("heartbeat")
        if "ready" not in node.phases:  # a heartbeat after the hello: the server says ready
            reached("ready")
    spec = answer["image"]
    auth = {"Authorization": node_authorization(Identity(node.name, token))}
    path = "/" + spec["url"].split("/", 3)[3]
    status, _ = await http.request("GET", path, headers=auth)
    if status != 200:
        raise Failed(f"image: HTTP {status}")
    reached("image")
    image = {"state": "active", "name": spec["name"], "digest": spec["digest"]}
    await report("change")
    reached("active")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--http-port", type=int, default=8080)
    parser.add_argument("--interface", required=True)
    parser.add_argument("--nodes", required=True, help="NAME=MAC,... (a file)")
    parser.add_argument("--window", type=float, default=0.0, help="arrivals spread over s")
    parser.add_argument("--until", choices=("initrd", "active"), default="active")
    parser.add_argument("--poll", type=float, default=1.0, help="heartbeat cap while waiting")
    args = parser.parse_args()
    with open(args.nodes) as listing:
        nodes = [Node(name, bytes.fromhex(mac.replace(":", ""))) for name, mac in
                 (line.split() for line in listing if line.strip())]  # fmt: skip
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, args.interface.encode())
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("0.0.0.0", 68))
    _, dhcp = await loop.create_datagram_endpoint(Dhcp, sock=sock)
    began = time.monotonic()

    async def arrive(index: int, node: Node) -> None:
        if args.window:
            await asyncio.sleep(args.window * index / len(nodes))
        await boot(node, args, dhcp, began)

    await asyncio.gather(*(arrive(i, node) for i, node in enumerate(nodes)))
    used = resource.getrusage(resource.RUSAGE_SELF)
    json.dump({"nodes": [vars(n) | {"mac": n.mac.hex(":")} for n in nodes],
               "seconds": time.monotonic() - began,
               "cpu": used.ru_utime + used.ru_stime}, sys.stdout)  # fmt: skip
    sys.stdout.flush()
    os._exit(0)  # sockets of a thousand nodes: no need to tidy them one by one


if __name__ == "__main__":
    uvloop.run(main())  # the simulated nodes need all the speed they can get, as the server
