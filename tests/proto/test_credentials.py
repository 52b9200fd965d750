"""Credentials against a real ``layerpy serve`` in a namespace: wrong operator tokens are
limited per source, boot tokens are kept as digests, the console WebSocket refuses other
sites, and event streams that stop reading are dropped and give their memory back."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from test_live import SerialLine, wait_for

from layerpy.auth import GUESS_EVERY, GUESSES

from test_http import BASE, TCP_API, Host, api, boot_token, report, serving

pytestmark = pytest.mark.netns

ATTACKER, OPERATOR = "10.66.0.99", "10.66.0.12"  # two addresses of the test's veth


def guesses(host: Host, token: str, count: int, source: str) -> list[str]:
    """`count` requests with `token` on one kept-alive connection: the status of each."""
    urls = [part for _ in range(count) for part in ("-o", "/dev/null", f"{TCP_API}/api/v1/nodes")]
    command = ["curl", "-s", "--interface", source, "-H", f"Authorization: Bearer {token}",
               "-w", "%{http_code}\n", *urls]  # fmt: skip
    return host.ns.run(*command).stdout.split()


def metric(host: Host, name: str, **labels: str) -> float:
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    text = api(host, "/metrics")[1]
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_wrong_operator_tokens_are_limited_per_source(host: Host, tmp_path: Path) -> None:
    admin = (tmp_path / "state" / "admin.token").read_text().strip()
    answers = guesses(host, "lpy_guess", 300, ATTACKER)
    assert answers[:GUESSES] == ["401"] * GUESSES and set(answers[GUESSES:]) == {"429"}
    refused = host.ns.run("curl", "-s", "-i", "--interface", ATTACKER, "-H",
                          f"Authorization: Bearer {admin}", f"{TCP_API}/api/v1/nodes").stdout  # fmt: skip
    assert refused.startswith("HTTP/1.1 429"), refused  # a right token too: it is not read
    retry = int(re.search(r"^Retry-After: (\d+)$", refused, re.M).group(1))
    assert 0 < retry <= GUESS_EVERY
    assert "too many wrong operator tokens from 10.66.0.99: try again in" in refused
    assert guesses(host, admin, 1, OPERATOR) == ["200"]  # another source is not held
    assert api(host, "/api/v1/nodes")[0] == 200  # nor the Unix socket
    assert metric(host, "layerpy_http_rejected_total", reason="guessing") >= 300 - GUESSES
    log = (tmp_path / "serve.log").read_text()
    assert log.count("10.66.0.99: 10 wrong operator tokens: its tokens are refused (429)") == 1
    assert "lpy_guess" not in log and admin not in log
    # the attacker's source is held only while it goes on guessing
    deadline = time.monotonic() + retry + 20
    while guesses(host, admin, 1, ATTACKER) != ["200"]:
        assert time.monotonic() < deadline, f"the limit outlived Retry-After ({retry} s)"
        time.sleep(0.5)


def test_boot_tokens_are_kept_nowhere_but_in_the_nodes_script(host: Host, tmp_path: Path) -> None:
    """A node boots and reports (and sends its token mangled); then no state file, API
    answer, event or log line holds its boot token."""
    token = boot_token(host, "cn001", "10.66.0.11")
    assert report(host, token=token)[0] == 200
    assert report(host, token=token, event="heartbeat", seq=2)[0] == 200
    assert report(host, token=token + "\n", seq=3)[0] == 400  # a mangled token: not echoed
    assert report(host, token=token[:-1] + "#", seq=3)[0] == 400
    answers = [api(host, path)[1] for path in (
        "/api/v1/nodes", "/api/v1/nodes/cn001", "/api/v1/nodes/cn001/explain",
        "/api/v1/nodes/cn[001-002]/explain", "/api/v1/unknown", "/api/v1/events",
        "/api/v1/plan", "/api/v1/stats", "/metrics")]  # fmt: skip
    stream = host.ns.run("curl", "-s", "-m", "2", "-H", "Last-Event-ID: 1", "--unix-socket",
                         str(host.socket), "http://layerpy/api/v1/events/stream",
                         check=False).stdout  # fmt: skip
    assert '"node":"cn001"' in stream  # the history, replayed
    state = tmp_path / "state"
    files = {path: path.read_bytes() for path in state.rglob("*") if path.is_file()}
    assert any(b'"sha256"' in data for path, data in files.items() if path.name == "boots.jsonl")
    everything = [*answers, stream, (tmp_path / "serve.log").read_text()]
    assert not [text[:200] for text in everything if token in text]
    assert not [path for path, data in files.items() if token.encode() in data]


@pytest.fixture
def console_host(make_config, tmp_path: Path) -> Iterator[tuple[Host, SerialLine]]:
    """cn001's console a serial line the test plays; one more origin allowed."""
    line = SerialLine(tmp_path / "cn001.console")
    bmc = f'bmc = {{ driver = "none", console = "{tmp_path}/{{node}}.console" }}\n'
    origins = '\n[api]\norigins = ["https://ops.example.com"]\n'
    config = make_config(server="10.66.0.1", interface="d0", bmc=bmc, more=origins)
    try:
        with serving(config, tmp_path) as host:
            wait_for(lambda: line.peer is not None, 20, "the server on cn001's console")
            yield host, line
    finally:
        line.close()


async def open_console(host: Host, origin: str | None) -> int:
    """The HTTP status of a console WebSocket opened with this Origin (101: open)."""
    connector = aiohttp.UnixConnector(path=str(host.socket))
    async with aiohttp.ClientSession(connector=connector) as session:
        url = "http://layerpy/api/v1/nodes/cn001/console/attach"
        try:
            async with session.ws_connect(url, origin=origin) as ws:
                message = await asyncio.wait_for(ws.receive(), 30)  # the tail: attached
                assert message.type == aiohttp.WSMsgType.BINARY, message
                return 101
        except aiohttp.WSServerHandshakeError as refused:
            return refused.status


def test_the_console_websocket_refuses_other_sites(
    console_host: tuple[Host, SerialLine], tmp_path: Path
) -> None:
    host, _ = console_host
    opened = {origin: asyncio.run(open_console(host, origin)) for origin in (
        None,  # the CLI names no origin
        "http://layerpy",  # the dashboard's own: the Host it was served from
        "https://ops.example.com",  # [api] origins
        "HTTPS://OPS.example.com:443",  # the same, as another browser may write it
        "https://evil.example", "http://layerpy.evil.example", "null",
        "https://ops.example.com:8443", "http://layerpy:8080")}  # fmt: skip
    assert opened == {
        None: 101, "http://layerpy": 101, "https://ops.example.com": 101,
        "HTTPS://OPS.example.com:443": 101, "https://evil.example": 403,
        "http://layerpy.evil.example": 403, "null": 403, "https://ops.example.com:8443": 403,
        "http://layerpy:8080": 403,
    }  # fmt: skip
    assert metric(host, "layerpy_http_rejected_total", reason="cross_origin") == 5
    code, body = api(host, "/api/v1/nodes/cn001/console/attach", "-H", "Origin: https://x.example",
                     "-H", "Connection: Upgrade", "-H", "Upgrade: websocket", "-H",
                     "Sec-WebSocket-Version: 13", "-H", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")  # fmt: skip
    assert code == 403 and "a console opened from https://x.example is refused" in body
    log = (tmp_path / "serve.log").read_text()
    assert "refused a console WebSocket of uid 0 (root) from unix socket: Origin " in log


READERS = 200
BOOTS = 3000  # boot script fetches: two changes each, some 400 bytes of events
RETURNED_WITHIN = 20 << 20  # what may stay of the readers' memory once they are gone


def rss(pid: int) -> int:
    """The resident set of a process, in bytes (from /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB$", status, re.M).group(1)) * 1024


def boots(host: Host, count: int) -> None:
    """cn001 fetches its boot script `count` times (events on the feed), 500 a connection."""
    for start in range(0, count, 500):
        urls = [part for _ in range(start, min(count, start + 500))
                for part in ("-o", "/dev/null", f"{BASE}/boot/cn001.ipxe")]  # fmt: skip
        host.ns.run("curl", "-s", "--interface", "10.66.0.11", *urls, timeout=300)


def test_event_streams_that_stop_reading_are_dropped_and_memory_returns(host: Host) -> None:
    """200 streams that never read, while the feed produces some 1.2 MB of events: each is
    dropped past its byte budget (counted), and once they are gone the server's RSS is
    back within RETURNED_WITHIN of before."""
    pid = host.serve.pid
    boots(host, BOOTS)  # the feed's history, and the allocator, in their steady state
    before = rss(pid)
    readers = []
    try:
        for _ in range(READERS):
            reader = socket.socket(socket.AF_UNIX)
            reader.connect(str(host.socket))
            reader.sendall(b"GET /api/v1/events/stream HTTP/1.1\r\nHost: layerpy\r\n\r\n")
            readers.append(reader)
        boots(host, BOOTS)
        peak = rss(pid)
        wait_for(lambda: metric(host, "layerpy_http_rejected_total", reason="slow_reader")
                 >= READERS, 120, f"{READERS} streams dropped for not reading")  # fmt: skip
    finally:
        for reader in readers:
            reader.close()
    stream = {"method": "GET", "route": "/api/v1/events/stream"}
    wait_for(lambda: metric(host, "layerpy_http_requests_total", **stream) >= READERS, 60,
             f"the {READERS} streams' handlers ended")  # fmt: skip
    deadline = time.monotonic() + 60
    while (after := rss(pid)) > before + RETURNED_WITHIN:
        assert time.monotonic() < deadline, (
            f"RSS {before >> 20} MB before, {peak >> 20} MB with the readers, "
            f"{after >> 20} MB after they went"
        )
        time.sleep(0.5)
    print(f"\nRSS {before >> 20} MB before, {peak >> 20} MB with {READERS} stalled readers, "
          f"{after >> 20} MB after")  # fmt: skip
