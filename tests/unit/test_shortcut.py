"""The boot script's shortcut (services.shortcut) answers exactly as the general path:
the same requests, generated and fuzzed, sent to the boot app behind a listener without
the shortcut and behind one with it, get the same bytes back (the Date and the fresh boot
token aside), the same closing of the connection, the same new boots, metrics and
request-log lines. In process, on loopback: the boot app of a real Server's policy, the
client bound to the nodes' own addresses (127.0.0.11 is cn001's)."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import re
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import pytest

from layerpy import digests
from layerpy.proto.agent import REPORT_PATH, Event, Report, encode
from layerpy.server import Server, local_backend
from layerpy.services import listeners
from layerpy.services.http import build_app
from layerpy.services.listeners import ShortcutAnswer
from layerpy.services.shortcut import Shortcut
from layerpy.stats import Stats

CN001, CN002, SB001 = "127.0.0.11", "127.0.0.12", "127.0.0.13"
SECURE = f"""
[groups.secure]
nodes = "sb001"
ip = "{SB001}"
mac = ["52:54:00:99:00:13"]
secure_boot = true
"""
SETTLE = 0.3  # seconds an answer (or the connection's end) may take to come
FUZZ = int(os.environ.get("LAYERPY_FUZZ_EXAMPLES", "300"))
IPXE = b"GET /boot/cn001.ipxe HTTP/1.1\r\nConnection: keep-alive\r\nUser-Agent: iPXE/1.21.1+\r\nHost: 127.0.0.1:8080\r\n\r\n"


@dataclass(frozen=True)
class Case:
    source: str  # the client's address
    segments: tuple[bytes, ...]  # sent one after another, a moment apart


def request(
    target: str = "/boot/cn001.ipxe",
    method: str = "GET",
    version: str = "HTTP/1.1",
    headers: tuple[str, ...] = (),
    body: bytes = b"",
    host: str = "Host: 127.0.0.1",
) -> bytes:
    """A request with Host (HTTP/1.1 needs it: aiohttp answers 400 without) and `headers`."""
    lines = (f"{method} {target} {version}", *([host] if host else []), *headers)
    head = "".join(f"{line}\r\n" for line in lines)
    return head.encode() + b"\r\n" + body


def generated() -> list[Case]:
    """Each way a request may differ from iPXE's, one at a time, and some together."""
    cases = [
        Case(CN001, (IPXE,)),
        Case(CN002, (IPXE,)),
        Case(SB001, (request("/boot/sb001.ipxe"),)),
    ]
    targets = ["/boot/cn001.ipxe", "/boot/cn002.ipxe", "/boot/nobody.ipxe", "/boot/cn%30%301.ipxe",
               "/boot/cn001.ipxe?x=1", "/boot/cn001.ipxe#x", "/boot//cn001.ipxe", "/boot/cn001.IPXE",
               "http://127.0.0.1/boot/cn001.ipxe", "/boot/.ipxe", "/boot/cn001.ipxe/", "*",
               "/boot/discover/52:54:00:99:00:11.ipxe", "/BOOT/cn001.ipxe", "/boot/sb001.ipxe",
               "/boot/cn001.ipxe.ipxe", "/minos/kernel", "/boot/" + "a" * 9000 + ".ipxe"]  # fmt: skip
    for target in targets:
        cases.append(Case(CN001, (request(target),)))
    for method in ["HEAD", "POST", "PUT", "get", "OPTIONS", "DELETE", "BREW", "CONNECT"]:
        cases.append(Case(CN001, (request(method=method),)))
    for version in ["HTTP/1.0", "HTTP/0.9", "HTTP/1.2", "HTTP/2.0", "HTTP/1", "http/1.1"]:
        cases.append(Case(CN001, (request(version=version),)))
    headers = [(), ("Connection: close",), ("Connection: keep-alive",), ("Connection: Close",),
               ("Connection: upgrade", "Upgrade: websocket"),
               ("Connection: Upgrade", "Upgrade: h2c"), ("Expect: 100-continue",),
               ("Expect: nothing",), ("Content-Length: 0",), ("Content-Length: 5",),
               ("Transfer-Encoding: chunked",), ("Host: b",), ("Accept-Encoding: gzip",),
               ("X: " + "y" * 9000,), ("X-Folded: a\r\n b",), ("Bad Header: x",), ("NoColon",),
               ("Connection: keep-alive, close",), ("Content-Length: -1",),
               tuple(f"X-{n}: {n}" for n in range(130))]  # fmt: skip
    for version in ["HTTP/1.1", "HTTP/1.0"]:
        for extra in headers:
            cases.append(Case(CN001, (request(version=version, headers=extra),)))
    cases += [
        Case(CN001, (request(host=""),)),
        Case(CN001, (request(version="HTTP/1.0", host=""),)),
        Case(CN001, (request(headers=("Content-Length: 5",), body=b"hello"),)),
        Case(CN001, (request(headers=("Transfer-Encoding: chunked",), body=b"0\r\n\r\n"),)),
        Case(CN001, (IPXE + IPXE,)),  # pipelined
        Case(CN001, (IPXE, IPXE, request(headers=("Connection: close",)))),  # kept alive
        Case(CN001, (IPXE, request("/minos/kernel"), IPXE)),  # to aiohttp, midway
        Case(CN001, (IPXE[:20], IPXE[20:])),  # a request in two segments
        Case(CN001, (b"\r\n" + IPXE,)),
        Case(CN001, (IPXE[:-2],)),  # never finished
        Case(CN001, (b"",)),
        Case(CN001, (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",)),  # TLS
        Case(CN002, (request("/boot/cn002.ipxe"),)),  # another address's
    ]
    return cases


def mangled(rng: random.Random, data: bytes, alphabet: bytes, most: int) -> bytes:
    """`data` with 1 to `most` bytes flipped, dropped, doubled or inserted."""
    part = bytearray(data)
    for _ in range(rng.randint(1, most)):
        at = rng.randrange(len(part))
        what = rng.randrange(4)
        if what == 0:
            part[at] = rng.choice(alphabet)
        elif what == 1:
            del part[at]
        elif what == 2:
            part[at:at] = part[at : at + rng.randint(1, 8)]
        else:
            part.insert(at, rng.choice(alphabet))
    return bytes(part)


def fuzzed(count: int, seed: int = 29) -> list[Case]:
    """iPXE's request, mangled."""
    rng = random.Random(seed)
    alphabet = b" :/\r\n\t.%?#01aAzZ\x00\x7f\xff-_HTTPGET"
    return [Case(rng.choice([CN001, CN001, CN002]), (mangled(rng, IPXE, alphabet, 4),))
            for _ in range(count)]  # fmt: skip


class Counted(Shortcut):
    """The shortcut, counting what it answered (to show the comparison exercised it)."""

    answered = 0

    def __call__(self, data: bytes, remote: str) -> ShortcutAnswer:
        answer = super().__call__(data, remote)
        self.answered += isinstance(answer, tuple)
        return answer


@dataclass
class Rig:
    """The boot app behind two listeners on 127.0.0.1: its general path, and the shortcut."""

    server: Server
    general: int  # the ports
    fast: int
    shortcut: Counted
    admission: listeners.Admission  # the fast listener's

    def transports(self) -> list[asyncio.Transport]:
        """The fast listener's connections."""
        held = [getattr(connection, "transport", None) for connection in self.admission.held]
        return [transport for transport in held if transport is not None]


@asynccontextmanager
async def listening(make_config, state: str = "state") -> AsyncIterator[Rig]:
    """The rig, its server's records in the directory `state` beside the node file."""
    config = make_config(server="127.0.0.1", interface="lo", extra=SECURE)
    directory = config.server.state_dir.parent / state
    config = replace(config, server=replace(config.server, state_dir=directory))
    server = Server(config, local_backend(config))
    app = build_app(server.policy, server.stats, server.lifecycle, server.catalog,
                    log_requests=True)  # fmt: skip
    runner = await listeners.runner(app)
    shortcut = Counted(app)
    ports, admission = [], None
    try:
        for fast in (None, shortcut):
            admission = listeners.Admission("boot HTTP", total=5000, per_address=5000)
            site = listeners.AdmittedSite(runner, "127.0.0.1", 0, admission, shortcut=fast)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        assert admission is not None
        yield Rig(server, ports[0], ports[1], shortcut, admission)
    finally:
        await runner.cleanup()
        await server.close()


async def exchange(port: int, case: Case) -> tuple[bytes, bool]:
    """What the server sent back, and whether it closed the connection."""
    sock = socket.socket()
    sock.bind((case.source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    reader, writer = await asyncio.open_connection(sock=sock)
    received, closed = b"", False
    try:
        for segment in case.segments:
            writer.write(segment)
            await writer.drain()
            try:
                async with asyncio.timeout(SETTLE):
                    while chunk := await reader.read(65536):
                        received += chunk
                    closed = True
            except TimeoutError:
                pass
            except ConnectionError:
                closed = True
            if closed:
                break
    finally:
        writer.close()
    return received, closed


def normal(answer: bytes) -> bytes:
    answer = re.sub(rb"Date: [^\r]*\r\n", b"Date: -\r\n", answer)
    return re.sub(rb"layerpy\.token=\S+", b"layerpy.token=-", answer)


def http_metrics(stats: Stats) -> Counter[str]:
    counts: Counter[str] = Counter()
    for (subsystem, kind), series in stats.series.items():
        if subsystem == "http":
            counts[f"{kind} requests"] += series.requests
            counts[f"{kind} failures"] += series.failures
    return counts


class Lines(logging.Handler):
    """The per-request debug lines (log_requests), without their times."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if re.search(r" -> \d+ in [\d.]+ ms$", message):
            self.lines[re.sub(r" in [\d.]+ ms$", "", message)] += 1


async def run_all(
    server: Server, port: int, cases: list[Case], together: int = 100
) -> tuple[list, Counter, Counter, int]:
    """Each case's normal answer, and what the server counted, logged and booted (cases
    `together` at a time)."""
    before, boots = http_metrics(server.stats), sum(n.boots for n in server.nodes.nodes.values())
    lines = Lines()
    logger = logging.getLogger("layerpy.http")
    logger.addHandler(lines)
    level, logger.level = logger.level, logging.DEBUG
    try:
        answers = []
        for start in range(0, len(cases), together):
            batch = cases[start : start + together]
            answers += await asyncio.gather(*(exchange(port, case) for case in batch))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    metrics = http_metrics(server.stats)
    metrics.subtract(before)
    booted = sum(n.boots for n in server.nodes.nodes.values()) - boots
    return [(normal(data), closed) for data, closed in answers], metrics, lines.lines, booted


@pytest.mark.parametrize("kind", ["generated", "fuzzed"])
def test_the_shortcut_answers_as_the_general_path(make_config, kind: str) -> None:
    cases = generated() if kind == "generated" else fuzzed(FUZZ)

    async def compare() -> None:
        async with listening(make_config) as rig:
            expected = await run_all(rig.server, rig.general, cases)
            assert rig.shortcut.answered == 0
            got = await run_all(rig.server, rig.fast, cases)
            answered = rig.shortcut.answered
        for case, want, have in zip(cases, expected[0], got[0], strict=True):
            assert have == want, f"{case}: the shortcut answered\n{have}\nthe general path\n{want}"
        assert got[1:] == expected[1:], "metrics, request-log lines or new boots differ"
        answered_ok = sum(data.startswith(b"HTTP/1.1 200") for data, _ in expected[0])
        assert answered >= (10 if kind == "generated" else 1), (
            f"the shortcut answered {answered} of {answered_ok} scripts"
        )

    asyncio.run(compare())


ADDRESSES = {"cn001": CN001, "cn002": CN002}
MACS = {"cn001": "52:54:00:99:00:11", "cn002": "52:54:00:99:00:12"}


def report_body(name: str, token: str, seq: int, event: str = "heartbeat", /, **fields) -> bytes:
    """A report as the agent's urllib sends it (json.dumps of the contract's encoding)."""
    report = Report(node=name, token=token, mac=MACS[name], ip=ADDRESSES[name],
                    boot_id="0f1e2d3c", seq=seq, event=Event(event), hostname=name,
                    uptime=100.0 + seq, agent_version="0.1.0")  # fmt: skip
    return json.dumps(encode(report) | fields).encode()


def post(body: bytes, *headers: str, length: int | None = None, **parts) -> bytes:
    """A report's POST as urllib makes it (Connection: close), with `headers` added."""
    size = len(body) if length is None else length
    lines = ("Accept-Encoding: identity", f"Content-Length: {size}",
             "Content-Type: application/json", "User-Agent: layerpy-agent/0.1.0",
             "Connection: close", *headers)  # fmt: skip
    return request(**{"target": REPORT_PATH, "method": "POST"} | parts, headers=lines, body=body)


def halves(data: bytes) -> tuple[bytes, bytes]:
    """urllib's two sends: the head, then the body."""
    end = data.index(b"\r\n\r\n") + 4
    return data[:end], data[end:]


def report_cases(tokens: dict[str, str]) -> list[Case]:
    """Reports of cn001 and cn002 (their tokens of this boot) in each form one can take,
    valid and not, whole and in pieces; in order, one at a time (each may change the
    node's state, which later answers show)."""
    one, two = tokens["cn001"], tokens["cn002"]
    hello = post(report_body("cn001", one, 1, "hello"))
    beat = post(report_body("cn001", one, 2))
    old = post(report_body("cn002", two, 3, "hello", protocol="1.3"))
    cases = [
        Case(CN001, (hello,)),
        Case(CN001, halves(beat)),
        Case(CN002, halves(old)),
        Case(CN002, (post(report_body("cn002", two, 4, protocol="1.3")),)),
        Case(CN001, (post(report_body("cn001", one, 5, "change", busy=True)),)),
        Case(CN002, (post(report_body("cn001", one, 6)),)),  # another address: the token says
        Case(CN001, (post(report_body("cn001", "0" * 32, 7)),)),  # wrong token: 403
        Case(CN001, (post(report_body("cn002", one, 8)),)),  # cn002's with cn001's token
        Case(CN001, (post(report_body("cn001", one, 9, node="nobody")),)),  # 404
        Case(CN001, (post(report_body("cn001", one, 10, protocol="2.0")),)),  # 400, a problem
        Case(CN001, (post(report_body("cn001", one, 11, protocol="1.4")),)),  # and well again
        Case(CN001, (post(report_body("cn001", one, 12, seq="x")),)),  # 400
        Case(CN001, (post(report_body("cn001", one, 13, mac="52:54:00:99:00:99")),)),
        Case(CN001, (post(report_body("cn001", one, 14, hostname="h\u00e9")),)),  # UTF-8
        Case(CN001, (post(report_body("cn001", one, 15, hostname="\ud800")),)),  # surrogate
        Case(CN001, (post(b'{"a": 1}'),)),
        Case(CN001, (post(b"[]"),)),
        Case(CN001, (post(b"not json"),)),
        Case(CN001, (post(b"[" * 100_000 + b"]" * 100_000),)),  # nested too deep, and long
        Case(CN001, (post(json.dumps({"a": "\ud800"}).encode("utf-16")),)),
        Case(CN001, (post(b""),)),
        Case(
            CN001,
            (
                post(report_body("cn001", one, 16)).replace(b"Connection: close\r\n", b""),
                post(report_body("cn001", one, 17)),
            ),
        ),  # kept alive, then closed
        Case(CN001, (post(report_body("cn001", one, 18), version="HTTP/1.0"),)),
        Case(CN001, (post(report_body("cn001", one, 19), "Expect: 100-continue"),)),
        Case(CN001, (post(report_body("cn001", one, 20), "Content-Encoding: gzip"),)),
        Case(CN001, (post(report_body("cn001", one, 21), "Transfer-Encoding: chunked"),)),
        Case(CN001, (post(report_body("cn001", one, 22), length=2 * 1024 * 1024),)),  # 413
        Case(CN001, (post(report_body("cn001", one, 23), target=REPORT_PATH + "?x=1"),)),
        Case(CN001, (post(report_body("cn001", one, 24), method="PUT"),)),
        Case(CN001, (beat[:-5], beat[-5:])),  # the body's end later
        Case(CN001, (beat[:-5], beat[-5:-2], beat[-2:])),  # in three pieces: aiohttp's
        Case(CN001, (halves(beat)[0],)),  # the body never comes
        Case(CN001, (post(report_body("cn001", one, 25), length=10),)),  # more than it said
        Case(CN001, (hello + hello,)),  # pipelined
        Case(CN001, (post(report_body("cn001", one, 26)),)),
    ]
    return cases


def fuzzed_reports(tokens: dict[str, str], count: int, seed: int = 29) -> list[Case]:
    """cn001's report with its head or its body mangled (the Content-Length then follows
    the body, or not); sent whole or as urllib sends it."""
    rng = random.Random(seed)
    alphabet = b' :/\r\n\t.{}[]",0123456789aez-\\u\x00\x7f\xff'
    cases = []
    for seq in range(100, 100 + count):
        head, body = halves(post(report_body("cn001", tokens["cn001"], seq)))
        if rng.random() < 0.3:
            head = mangled(rng, head, alphabet, 3)
        else:
            body = mangled(rng, body, alphabet, 3)
            if rng.random() < 0.8:  # the length follows the body
                head = re.sub(rb"Content-Length: \d+", b"Content-Length: %d" % len(body), head)
        segments = (head + body,) if rng.random() < 0.5 else (head, body)
        cases.append(Case(CN001, segments))
    return cases


def nodes_now(server: Server) -> list[tuple]:
    """What reports change on cn001 and cn002, times aside."""
    return [(n.run_state, n.busy, n.image_state, n.mac, n.hostname, n.problem, n.secure_boot,
             n.agent_seq, n.agent_uptime, n.last_report is not None, sorted(n.agent))
            for n in (server.nodes.nodes["cn001"], server.nodes.nodes["cn002"])]  # fmt: skip


@pytest.mark.parametrize("kind", ["generated", "fuzzed"])
def test_the_shortcut_answers_reports_as_the_general_path(
    make_config, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each path has a server of its own; each run boots both nodes and sends its cases one
    at a time; after each the nodes' state is compared too. The tokens of both runs are
    the same (aiohttp's 400 may quote one, however mangled); the beat key of an answer is
    fresh each time."""

    async def run(rig: Rig, port: int) -> tuple[list, list, Counter, Counter]:
        """The normal answers, the nodes after each case, the metrics and log lines."""
        issued = itertools.count()
        monkeypatch.setattr(digests, "new", lambda: f"token-of-this-run-{next(issued):06d}")
        tokens = {}
        for name, address in ADDRESSES.items():
            script = rig.server.policy.script_now(name, address)
            assert script is not None
            tokens[name] = re.search(r"layerpy\.token=(\S+)", script)[1]  # type: ignore[index]
        cases = report_cases(tokens) if kind == "generated" else fuzzed_reports(tokens, FUZZ)
        answers, states, metrics, lines = [], [], Counter(), Counter()
        for case in cases:
            said, counted, logged, _ = await run_all(rig.server, port, [case], together=1)
            answers += [(re.sub(rb'"key": "[0-9a-f]+"', b'"key": -', a), c) for a, c in said]
            states.append(nodes_now(rig.server))
            metrics.update(counted)
            lines.update(logged)
        return answers, states, +metrics, lines

    async def compare() -> None:
        async with listening(make_config, "general") as rig:
            expected = await run(rig, rig.general)
            assert rig.shortcut.answered == 0
        async with listening(make_config, "fast") as rig:
            got = await run(rig, rig.fast)
            answered = rig.shortcut.answered
        for number, (want, have) in enumerate(zip(expected[0], got[0], strict=True)):
            assert have == want, (
                f"case {number}: the shortcut answered\n{have}\nthe general path\n{want}"
            )
        assert got[1] == expected[1], "the nodes' state after a case differs"
        assert got[2:] == expected[2:], "metrics or request-log lines differ"
        assert answered >= (15 if kind == "generated" else 10), f"the shortcut answered {answered}"

    asyncio.run(compare())


def test_a_kept_connection_lives_idle_timeout_past_its_last_answer(
    make_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp's keep-alive timeout, kept by the shortcut: measured from the last answer,
    not from the connection."""
    monkeypatch.setattr(listeners, "IDLE_TIMEOUT", 1.0)

    async def check() -> None:
        async with listening(make_config) as rig:
            loop = asyncio.get_running_loop()
            sock = socket.socket()
            sock.bind((CN001, 0))
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", rig.fast))
            reader, writer = await asyncio.open_connection(sock=sock)
            began = loop.time()
            for _ in range(3):  # answers 0.6 s apart: 1.2 s after the connection, still open
                writer.write(IPXE)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                length = int(re.search(rb"Content-Length: (\d+)", head)[1])  # type: ignore[index]
                await asyncio.wait_for(reader.readexactly(length), 5)
                last = loop.time()
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(reader.read(1), 0.6)
            assert loop.time() - began > 1.5
            assert rig.shortcut.answered == 3
            assert await asyncio.wait_for(reader.read(1), 5) == b"", "never closed"
            assert loop.time() - last >= 1.0
            writer.close()

    asyncio.run(check())


def test_a_client_that_takes_no_answers_is_not_read_from(make_config) -> None:
    """Answers the shortcut writes wait in the transport when the client takes none: past
    its high-water mark the connection is not read any more (no more requests, no more
    answers piling up), as aiohttp's own handler would pause. The client sends iPXE's
    request a segment at a time, each once the last was answered, and never reads."""
    sent = 8_000  # ~10 MB of answers: more than the sockets' buffers hold

    async def check() -> None:
        async with listening(make_config) as rig:

            def flood(sock: socket.socket) -> int:
                """Requests sent until one is not answered within 2 s."""
                for number in range(sent):
                    sock.sendall(IPXE)
                    deadline = time.monotonic() + 2
                    while rig.shortcut.answered <= number:
                        if time.monotonic() > deadline:
                            return number
                        time.sleep(0.0005)
                return sent

            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.bind((CN001, 0))
                sock.connect(("127.0.0.1", rig.fast))
                answered = await asyncio.to_thread(flood, sock)
                held = max(transport.get_write_buffer_size() for transport in rig.transports())
            assert answered < sent, "the server read every request of a client that took none"
            assert held < 1024 * 1024, f"{held} bytes of answers held for the client"

    asyncio.run(check())
