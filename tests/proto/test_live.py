"""What operators watch live, against a real ``layerpy serve`` in a namespace: the event
stream (curl as the client), a node's console (a serial line played by the test on a Unix
socket, as QEMU offers one), and the dashboard's files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from test_http import TCP_API, Host, api, boot_token, report, serving

pytestmark = pytest.mark.netns

PANIC = b"[   12.345678] Kernel panic - not syncing: VFS: Unable to mount root fs\r\n"


def ready(host: Host) -> None:
    """cn001 boots (its script, with a boot token) and its agent says hello."""
    token = boot_token(host, "cn001", "10.66.0.11")
    assert report(host, token=token)[0] == 200
    assert report(host, token=token, event="heartbeat", seq=2)[0] == 200


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout:g} s"
        time.sleep(0.1)


@contextlib.contextmanager
def streaming(host: Host, out: Path, *args: str) -> Iterator[subprocess.Popen]:
    """curl following the event stream into `out` until the block ends."""
    command = ["curl", "-sN", "-g", "--unix-socket", str(host.socket), *args]
    with out.open("wb") as sink:
        follower = host.ns.popen([*command], stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield follower
    finally:
        follower.kill()
        follower.wait()


def events(out: Path) -> list[tuple[int | None, str, dict]]:
    """(id, kind, data) of each complete event in a captured stream."""
    found = []
    for block in out.read_text(errors="replace").split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and
                      not line.startswith(":"))  # fmt: skip
        if "event" in fields:
            found.append((int(fields["id"]) if "id" in fields else None, fields["event"],
                          json.loads(fields["data"])))  # fmt: skip
    return found


def test_the_event_stream_carries_every_change_and_resumes(host: Host, tmp_path: Path) -> None:
    everything, only_cn002 = tmp_path / "all.sse", tmp_path / "cn002.sse"
    url = "http://layerpy/api/v1/events/stream"
    with streaming(host, everything, url), streaming(host, only_cn002, f"{url}?nodes=cn002"):
        wait_for(lambda: everything.stat().st_size and only_cn002.stat().st_size, 20,
                 "stream opened (its retry line)")  # fmt: skip
        ready(host)
        off = json.dumps({"nodes": "cn[001-002]", "action": "off"})
        assert api(host, "/api/v1/power", "-X", "POST", "--data", off)[0] == 200

        def seen(out: Path, kind: str, test: Callable[[dict], bool]) -> bool:
            return any(k == kind and test(data) for _, k, data in events(out))

        def operator(data: dict) -> bool:
            return data["fields"].get("who") == "uid 0 (root)"

        wait_for(lambda: seen(everything, "event", operator), 20, "operator event on the stream")
        wait_for(lambda: seen(only_cn002, "event", operator), 20, "operator event, filtered")
        wait_for(lambda: seen(everything, "desired", lambda d: d["node"] == "cn001"), 20,
                 "desired power off of cn001")  # fmt: skip
    hello = [e for e in events(everything) if e[1] == "observed" and e[2]["node"] == "cn001"
             and e[2]["fields"].get("run_state") == "init"]  # fmt: skip
    assert hello, events(everything)
    assert all(data["node"] in ("cn002", "cn[001-002]") for _, _, data in events(only_cn002))
    operator_event = next(e for e in events(everything) if e[1] == "event")
    assert operator_event[2]["message"] == "uid 0 (root) from unix socket: power off cn[001-002]"

    # resumed after the hello: everything after it, and nothing before
    resumed = tmp_path / "resumed.sse"
    first_id = hello[0][0]
    with streaming(host, resumed, "-H", f"Last-Event-ID: {first_id}", url):
        wait_for(lambda: seen(resumed, "event", operator), 20, "the operator event, resumed")
    ids = [number for number, _, _ in events(resumed)]
    assert ids and min(ids) == first_id + 1, ids

    code, body = api(host, "/api/v1/events/stream", "-H", "Last-Event-ID: 1; DROP")
    assert (code, body) == (400, "Last-Event-ID must be an event's number\n")
    assert api(host, "/api/v1/events/stream?nodes=cn[1-", "-m", "5")[0] == 400


def test_a_stop_does_not_wait_for_watchers(make_config, tmp_path: Path) -> None:
    with serving(make_config(server="10.66.0.1", interface="d0"), tmp_path) as host:
        out = tmp_path / "stream.sse"
        with streaming(host, out, "http://layerpy/api/v1/events/stream"):
            wait_for(lambda: out.stat().st_size, 20, "stream opened")
            began = time.monotonic()
            host.serve.send_signal(signal.SIGTERM)
            host.serve.wait(timeout=50)  # aiohttp alone would wait 60 s for the stream
            assert time.monotonic() - began < 15, "the stop waited for the open stream"


class SerialLine:
    """The node's side of a serial console: a Unix socket server that prints what the
    test says and keeps what it receives (QEMU's ``-chardev socket,server=on``)."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.received = bytearray()
        self.peer: socket.socket | None = None
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                peer, _ = self.listener.accept()
            except OSError:
                return
            self.peer, self.connections = peer, self.connections + 1
            self._read(peer)

    def _read(self, peer: socket.socket) -> None:
        """Until the server or hang_up ends the connection. Neither a reset nor a recv that
        the shutdown does not wake may keep the next connection from being accepted (the
        capture once reconnected in 1 s and the test waited 150 s for it)."""
        peer.settimeout(0.2)
        while peer is self.peer:  # hang_up makes it None
            try:
                data = peer.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            self.received += data

    def say(self, data: bytes) -> None:
        assert self.peer is not None
        self.peer.sendall(data)

    def hang_up(self) -> None:
        peer, self.peer = self.peer, None
        if peer is not None:
            peer.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """The thread ends first: one left in accept() outlives the test, and a close racing
        its next accept() could hand it a later test's socket of the same number."""
        peer = self.peer
        self.listener.shutdown(socket.SHUT_RDWR)  # ends accept(); close() would not
        self.hang_up()
        self.thread.join(20)
        self.listener.close()
        if peer is not None:
            peer.close()


async def attach(host: Host, node: str, typed: bytes, until: bytes) -> bytes:
    """Attach to a node's console over the API socket, type, and read until `until`."""
    connector = aiohttp.UnixConnector(path=str(host.socket))
    async with aiohttp.ClientSession(connector=connector) as session:
        url = f"http://layerpy/api/v1/nodes/{node}/console/attach"
        async with session.ws_connect(url) as ws:
            seen = b""
            await ws.send_bytes(typed)
            async with asyncio.timeout(30):
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.BINARY:
                        seen += message.data
                    if until in seen:
                        return seen
    raise AssertionError(f"the console ended before {until!r}: {seen!r}")


def test_a_console_is_captured_typed_into_and_a_panic_makes_the_node_lost(
    console_host: tuple[Host, SerialLine], tmp_path: Path
) -> None:
    host, line = console_host
    wait_for(lambda: line.peer is not None, 20, "the server connecting to cn001's console")
    ready(host)
    node = json.loads(api(host, "/api/v1/nodes/cn001")[1])
    assert node["run_state"] == "ready"

    line.say(b"login: \x1b]0;evil title\x07")
    seen = asyncio.run(attach(host, "cn001", b"root\r", b"login: "))
    assert b"login: " in seen
    wait_for(lambda: b"root\r" in line.received, 20, "typed keys reaching the serial line")

    line.say(b"Debian GNU/Linux 12 cn001 ttyS0\r\n" + PANIC)
    wait_for(lambda: json.loads(api(host, "/api/v1/nodes/cn001")[1])["run_state"] == "lost",
             20, "cn001 lost after the panic on its console")  # fmt: skip
    explained = json.loads(api(host, "/api/v1/nodes/cn001/explain")[1])
    assert explained["console"] == (
        "panic: [   12.345678] Kernel panic - not syncing: VFS: Unable to mount root fs"
    )
    code, tail = api(host, "/api/v1/nodes/cn001/console?bytes=4096")
    assert code == 200 and "Kernel panic" in tail and tail.startswith("login: ")
    assert api(host, "/api/v1/nodes/cn001/console?bytes=0")[0] == 400
    assert api(host, "/api/v1/nodes/cn999/console")[0] == 404

    # the log outlives the connection, which comes back
    line.hang_up()
    # its backoff (1 s doubling to 60 s, +-20 %) may have grown while the server started
    wait_for(lambda: line.connections >= 2, 150, "the capture reconnecting")
    log = tmp_path / "state" / "consoles" / "cn001.log"
    wait_for(log.exists, 20, "the console log file")
    assert log.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state" / "consoles").stat().st_mode & 0o777 == 0o700
    serve_log = (tmp_path / "serve.log").read_text()
    assert "cn001: run_state ready -> lost: kernel panic on the console" in serve_log
    assert "evil title" not in serve_log


def test_the_dashboard_files_need_no_token_but_its_data_does(host: Host) -> None:
    def tcp(path: str, *args: str) -> subprocess.CompletedProcess[str]:
        return host.ns.run("curl", "-s", "-i", *args, f"{TCP_API}{path}", check=False)

    page = tcp("/")
    assert page.stdout.startswith("HTTP/1.1 200") and "<title>layerpy</title>" in page.stdout
    assert "Content-Security-Policy: default-src 'self'" in page.stdout
    assert tcp("/dashboard/dashboard.js").stdout.startswith("HTTP/1.1 200")
    for path in ("/dashboard/__init__.py", "/dashboard/..%2fserver.py", "/dashboard/"):
        assert tcp(path).stdout.startswith("HTTP/1.1 401"), path  # not the page's: not public
        assert api(host, path)[0] == 404, path  # nor served to an operator
    for path in ("/api/v1/whoami", "/api/v1/events/stream", "/api/v1/nodes/cn001/console"):
        assert tcp(path).stdout.startswith("HTTP/1.1 401"), path
    assert json.loads(api(host, "/api/v1/whoami")[1]) == {"name": "uid 0 (root)",
                                                            "scope": "admin"}  # fmt: skip
    assert "X-Layerpy-Seq" in host.ns.run("curl", "-s", "-i", "--unix-socket", str(host.socket),
                                          "http://layerpy/api/v1/nodes").stdout  # fmt: skip
    code, body = api(host, "/api/v1/nodes/cn001/console")
    assert code == 409 and body.startswith("cn001 has no console")


def test_a_stop_does_not_wait_for_an_attached_console(
    console_host: tuple[Host, SerialLine],
) -> None:
    host, line = console_host
    wait_for(lambda: line.peer is not None, 20, "the server connecting to cn001's console")

    async def attached_through_a_stop() -> str:
        connector = aiohttp.UnixConnector(path=str(host.socket))
        async with aiohttp.ClientSession(connector=connector) as session:
            url = "http://layerpy/api/v1/nodes/cn001/console/attach"
            async with session.ws_connect(url) as ws:
                await ws.receive()  # the tail: attached
                host.serve.send_signal(signal.SIGTERM)
                async with asyncio.timeout(30):
                    async for _ in ws:
                        pass
                return f"closed {ws.close_code}"

    began = time.monotonic()
    assert asyncio.run(attached_through_a_stop()).startswith("closed")
    host.serve.wait(timeout=50)
    assert time.monotonic() - began < 15, "the stop waited for the console session"
