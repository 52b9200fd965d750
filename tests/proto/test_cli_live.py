"""The ``layerpy`` command line against a real ``layerpy serve`` in a namespace (issue 14):
``-o json`` on the commands that print data, ``status --watch`` and ``watch`` following the
event stream (also through a connection that breaks, and a server that restarts), and
``console`` on a serial line the test plays, piped and on a pseudo-terminal."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_live import SerialLine, ready, wait_for

from test_http import LAYERPY, Host, api, boot_token, report

pytestmark = pytest.mark.netns

HOSTILE = "[bold red]pwned[/] \x1b]0;title\x07\x1b[2J"
TIME = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} ")


def cli(host: Host, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``layerpy ARGS -c nodes.toml`` in the server's namespace (the API socket, found)."""
    config = ["-c", str(host.socket.parent.parent / "nodes.toml")]
    done = host.ns.run(str(LAYERPY), *args, *config, check=False)
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def as_json(host: Host, *args: str) -> object:
    return json.loads(cli(host, *args).stdout)


@contextlib.contextmanager
def running(host: Host, out: Path, *args: str, env: tuple[str, ...] = ()) -> Iterator[
    subprocess.Popen
]:  # fmt: skip
    """``layerpy ARGS`` in the background, stdout to `out`, stderr to `out`.err."""
    config = ["-c", str(host.socket.parent.parent / "nodes.toml")]
    with out.open("wb") as sink, out.with_suffix(".err").open("wb") as errors:
        # Ctrl-C must work even when this test runs where SIGINT is ignored (a background
        # job of a shell): ignoring is inherited, and Python then keeps ignoring it
        command = ["env", "--default-signal=INT", *env, str(LAYERPY), *args, *config]
        process = host.ns.popen(command, stdout=sink, stderr=errors, stdin=subprocess.DEVNULL)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def interrupted(process: subprocess.Popen) -> int:
    """Ctrl-C (SIGINT), and the exit status it leaves with."""
    process.send_signal(signal.SIGINT)
    return process.wait(10)


def admin_env(host: Host) -> tuple[str, ...]:
    return (f"LAYERPY_TOKEN={(host.socket.parent / 'admin.token').read_text().strip()}",)


def test_every_command_that_prints_data_says_it_as_json(host: Host) -> None:
    token = boot_token(host, "cn001", "10.66.0.11")
    assert report(host, token=token, hostname=HOSTILE)[0] == 200

    nodes = as_json(host, "status", "-o", "json")
    assert [n["name"] for n in nodes] == ["cn001", "cn002"]
    assert nodes[0]["hostname"] == "[bold red]pwned[/] ?]0;title??[2J"
    assert as_json(host, "status", "--json")[0]["name"] == "cn001"  # the old spelling
    assert [e["name"] for e in as_json(host, "plan", "-o", "json")] == ["cn001", "cn002"]
    assert as_json(host, "explain", "cn001")["name"] == "cn001"  # JSON by default, as it was
    assert [e["name"] for e in as_json(host, "explain", "cn[001-002]", "-o", "json")] == [
        "cn001",
        "cn002",
    ]
    powered = as_json(host, "power", "status", "cn[001-002]", "-o", "json")
    assert set(powered) == {"cn001", "cn002"} and powered["cn001"]["controlled"] is False
    assert as_json(host, "reload", "-o", "json") == {"added": [], "removed": [], "changed": []}
    bound = as_json(host, "bind", "cn002", "52:54:00:99:00:55", "-o", "json")
    assert "conflict" in bound and "power" in bound
    assert as_json(host, "unknown", "-o", "json") == []
    kinds = [e["kind"] for e in as_json(host, "events", "-o", "json")]
    assert "operator" in kinds and "replaced" in kinds
    assert [t["name"] for t in as_json(host, "token", "list", "-o", "json")] == ["admin"]
    checked = as_json(host, "check", "--file-only", "-o", "json")
    assert checked["valid"] is True and len(checked["nodes"]) == 2
    assert as_json(host, "image", "list", "-o", "json") == []

    for args in (("status",), ("explain", "cn001", "-o", "table"), ("events",), ("plan",)):
        table = cli(host, *args).stdout
        assert "cn00" in table and "\x1b" not in table and "\x07" not in table, args
    assert "[bold red]pwned[/]" in cli(host, "status").stdout  # text, never markup


def test_watch_prints_each_event_as_it_comes(host: Host, tmp_path: Path) -> None:
    everything, only_cn002 = tmp_path / "all.json", tmp_path / "cn002.txt"
    with (
        running(host, everything, "watch", "-o", "json") as json_watcher,
        running(host, only_cn002, "watch", "cn002") as line_watcher,
    ):
        # the watchers are following once the operator events of a call reach both
        wait_for(lambda: cli(host, "power", "clear", "cn002") and everything.stat().st_size
                 and only_cn002.stat().st_size, 20, "both watchers following")  # fmt: skip
        ready(host)
        cli(host, "power", "off", "cn[001-002]")
        wait_for(lambda: "power off cn[001-002]" in only_cn002.read_text(), 20, "the power off")
        wait_for(lambda: '"run_state": "ready"' in everything.read_text(), 20, "cn001 ready")
        assert interrupted(json_watcher) == 0 and interrupted(line_watcher) == 0

    found = [json.loads(line) for line in everything.read_text().splitlines()]
    assert all(set(e) == {"seq", "time", "node", "kind", "fields", "message"} for e in found)
    seqs = [e["seq"] for e in found]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    kinds = {e["kind"] for e in found}
    assert {"observed", "event", "desired"} <= kinds, kinds
    assert any(e["node"] == "cn001" and e["fields"].get("run_state") == "ready" for e in found)

    lines = only_cn002.read_text().splitlines()
    assert lines and all(TIME.match(line) for line in lines), lines
    assert all(" cn002 " in line or "cn[001-002]" in line for line in lines), lines
    assert any("uid 0 (root) from unix socket: power off cn[001-002]" in line for line in lines)
    assert "cn001 " not in only_cn002.read_text()
    assert everything.with_suffix(".err").read_text() == ""


PROXY = r"""
import asyncio, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()

async def serve(client_reader, client_writer):
    reader, writer = await asyncio.open_connection("127.0.0.1", 8081)
    await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", 9081)
    print("listening", flush=True)
    await server.serve_forever()

asyncio.run(main())
"""


@contextlib.contextmanager
def proxy(host: Host) -> Iterator[None]:
    """A TCP relay 127.0.0.1:9081 -> the operator listener: the test can break the line."""
    relay = host.ns.popen([sys.executable, "-c", PROXY], stdout=subprocess.PIPE)
    assert relay.stdout is not None and relay.stdout.readline() == b"listening\n"
    try:
        yield
    finally:
        relay.kill()
        relay.wait()


def test_watch_resumes_after_a_broken_connection_and_a_restart(host: Host, tmp_path: Path) -> None:
    """--retry over https-like TCP with a token: a broken line loses nothing (Last-Event-ID);
    a restarted server says what was lost (a gap: its numbers go on rising) and is followed."""
    out, err = tmp_path / "watch.json", tmp_path / "watch.err"
    server = ("--server", "http://127.0.0.1:9081")
    with running(host, out, "watch", "-o", "json", "--retry", *server,
                 env=admin_env(host)) as watcher:  # fmt: skip
        with proxy(host):
            wait_for(lambda: cli(host, "power", "clear", "cn001") and out.stat().st_size, 20,
                     "the watcher following")  # fmt: skip
        wait_for(lambda: "reconnecting in 1 s" in err.read_text(), 20, "the break noticed")
        assert watcher.poll() is None
        cli(host, "power", "on", "cn002")  # while nobody watches
        with proxy(host):
            wait_for(lambda: "power on cn002" in out.read_text(), 30, "the missed event")
            seqs = [json.loads(line)["seq"] for line in out.read_text().splitlines()]
            assert seqs == list(range(seqs[0], seqs[-1] + 1)), seqs  # none lost, none twice
            restart(host, tmp_path)
            # the watcher's backoff doubles (1 s to 60 s) while the server restarts: a slow
            # start on a busy machine can put its next try half a minute past the start
            wait_for(lambda: '{"kind": "gap"}' in out.read_text(), 150, "the restart's gap")
            cli(host, "power", "off", "cn001")
            wait_for(lambda: "power off cn001" in out.read_text(), 30, "an event after it")
            assert interrupted(watcher) == 0


def restart(host: Host, tmp_path: Path) -> None:
    """Stop the server and start it again in its namespace, on the same state."""
    host.serve.send_signal(signal.SIGTERM)
    host.serve.wait(30)
    with (tmp_path / "serve2.log").open("wb") as sink:
        command = [str(LAYERPY), "serve", "-c", str(tmp_path / "nodes.toml")]
        host.serve = host.ns.popen(command, stdout=sink, stderr=sink)
    wait_for(lambda: api(host, "/api/v1/nodes")[0] == 200, 30, "the server back")


def test_watch_says_when_the_server_goes_away(host: Host, tmp_path: Path) -> None:
    refused = cli(host, "watch", "cn[1-", "--retry", check=False)  # retrying will not help
    assert refused.returncode == 1 and "nodes: 'cn[1-': '[' is never closed" in refused.stderr

    out = tmp_path / "watch.txt"
    with running(host, out, "watch") as watcher:
        wait_for(lambda: cli(host, "power", "clear", "cn001") and out.stat().st_size, 20,
                 "the watcher following")  # fmt: skip
        host.serve.send_signal(signal.SIGTERM)
        assert watcher.wait(20) == 1
    err = out.with_suffix(".err").read_text()
    assert err.startswith("layerpy: watch: the server went away") and "--retry" in err, err
    assert TIME.match(out.read_text())


def read_count(host: Host) -> int:
    stats = json.loads(api(host, "/api/v1/stats")[1])
    return stats["http"].get("GET /api/v1/nodes", {}).get("requests", 0)


def test_status_watch_redraws_on_events_a_few_times_a_second(host: Host, tmp_path: Path) -> None:
    out = tmp_path / "status.txt"
    with running(host, out, "status", "--watch") as watcher:
        wait_for(lambda: "2 nodes at" in out.read_text(), 20, "the first view")
        ready(host)
        wait_for(lambda: re.search(r"run\s+unknown\s+1\s+cn002\s*\n\s+ready\s+1\s+cn001",
                                   out.read_text()), 20, "cn001 ready in the view")  # fmt: skip
        before = read_count(host)
        began = time.monotonic()
        burst = "for i in $(seq 100); do curl -s -o /dev/null -X POST --unix-socket {} " \
                "-d '{{\"nodes\":\"cn002\",\"action\":\"clear\"}}' http://layerpy/api/v1/power; done"  # fmt: skip
        host.ns.run("sh", "-c", burst.format(host.socket), timeout=120)
        time.sleep(1)
        reads, seconds = read_count(host) - before, time.monotonic() - began
        print(f"\n100 operator calls in {seconds:.1f} s: {reads} re-reads of the nodes")
        assert 1 <= reads <= seconds / 0.3 + 2
        assert interrupted(watcher) == 0
    view = out.read_text()
    assert re.search(r"power\s+unknown\s+2\s+cn\[001-002\]", view), view
    assert "\x1b" not in view and out.with_suffix(".err").read_text() == ""


def test_status_watch_waits_for_a_server(host: Host, tmp_path: Path) -> None:
    out = tmp_path / "status.txt"
    with running(host, out, "status", "--watch", "--server", str(tmp_path / "none.sock")) as w:
        wait_for(lambda: "trying again every 2 s" in out.read_text(), 20, "the view of no server")
        assert "no layerpy API socket at" in out.read_text()
        assert interrupted(w) == 0


def test_console_log_prints_the_tail_without_harmful_escapes(
    console_host: tuple[Host, SerialLine],
) -> None:
    host, line = console_host

    def log(*args: str) -> bytes:
        config = ["-c", str(host.socket.parent.parent / "nodes.toml")]
        command = host.ns.cmd(str(LAYERPY), "console", "cn001", "--log", *args, *config)
        return subprocess.run(command, capture_output=True, check=True).stdout

    line.say(b"\x1b[32mone\x1b[0m\r\ntwo \x1b]52;c;cm0gLXJm\x07\r\nthree\r\n")
    wait_for(lambda: log().endswith(b"three\r\n"), 20, "the log")
    assert log() == b"\x1b[32mone\x1b[0m\r\ntwo \r\nthree\r\n"
    assert log("--lines", "1") == b"three\r\n"
    assert log("--bytes", "7") == b"three\r\n"
    missing = cli(host, "console", "cn999", "--log", check=False)
    assert missing.returncode == 1 and "404 no node named cn999" in missing.stderr
    missing = cli(host, "console", "cn999", check=False)
    assert missing.returncode == 1 and "404 no node named cn999" in missing.stderr


def test_console_without_one_says_how_to_configure_it(host: Host) -> None:
    for args in (("console", "cn001", "--log"), ("console", "cn001")):
        refused = cli(host, *args, check=False)
        assert refused.returncode == 1, args
        assert "409 cn001 has no console: give its bmc a console" in refused.stderr, args


def test_console_piped_sends_stdin_then_detaches(
    console_host: tuple[Host, SerialLine], tmp_path: Path
) -> None:
    """Without a terminal: stdin goes to the node until its end, over TCP with a token."""
    host, line = console_host
    line.say(b"login: ")
    wait_for(lambda: cli(host, "console", "cn001", "--log").stdout == "login: ", 20, "the log")
    command = ["env", *admin_env(host), str(LAYERPY), "console", "cn001", "--server",
               "http://127.0.0.1:8081"]  # fmt: skip
    done = subprocess.run(host.ns.cmd(*command), input=b"root\r", capture_output=True,
                          timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"login: "
    assert b"[attached to cn001 console; Ctrl-] then . to detach]" in done.stderr
    wait_for(lambda: b"root\r" in line.received, 20, "the keys on the serial line")


class Terminal:
    """``layerpy`` on a pseudo-terminal, as an operator runs it."""

    def __init__(self, host: Host, *args: str) -> None:
        self.master, self.slave = pty.openpty()
        self.settings = termios.tcgetattr(self.slave)
        config = ["-c", str(host.socket.parent.parent / "nodes.toml")]
        self.process = host.ns.popen(["env", "--default-signal=INT", str(LAYERPY), *args, *config], stdin=self.slave,
                                     stdout=self.slave, stderr=self.slave)  # fmt: skip
        self.seen = b""

    def read_until(self, wanted: bytes | Callable[[bytes], bool], timeout: float = 20) -> bytes:
        test = wanted if callable(wanted) else lambda seen: wanted in seen
        deadline = time.monotonic() + timeout
        while not test(self.seen):
            left = deadline - time.monotonic()
            assert left > 0, f"not seen on the terminal: {wanted!r}; seen {self.seen!r}"
            if select.select([self.master], [], [], left)[0]:
                self.seen += os.read(self.master, 65536)
        return self.seen

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.master)
        os.close(self.slave)


@contextlib.contextmanager
def terminal(host: Host, *args: str) -> Iterator[Terminal]:
    term = Terminal(host, *args)
    try:
        yield term
    finally:
        term.close()


def test_console_attached_on_a_terminal(console_host: tuple[Host, SerialLine]) -> None:
    host, line = console_host
    line.say(b"cn001 login: ")
    with terminal(host, "console", "cn001") as term:
        term.read_until(b"to detach]")
        term.read_until(b"cn001 login: ")
        assert termios.tcgetattr(term.slave)[3] & termios.ECHO == 0  # raw: the node echoes
        term.type(b"root\r\x03\x1d\x1d")  # Ctrl-C and Ctrl-] go to the node too
        wait_for(lambda: b"root\r\x03\x1d\x1d" in line.received, 20, "the keys on the line")
        line.say(b"\x1b]0;evil title\x07\x1b[1mPassword:\x1b[0m ")
        term.read_until(b"\x1b[1mPassword:\x1b[0m ")
        line.hang_up()  # the server says so, as a notice, and reconnects
        term.read_until(b"[console of cn001: the console closed the connection, reconnecting]\r\n")
        term.type(b"\x1d.")
        assert term.process.wait(10) == 0
        term.read_until(b"[detached from cn001]")
        assert b"evil title" not in term.seen and b"\x1b]" not in term.seen
        assert termios.tcgetattr(term.slave) == term.settings  # the terminal as it was
    with terminal(host, "console", "cn001") as term:
        term.read_until(b"to detach]")
        wait_for(lambda: termios.tcgetattr(term.slave) != term.settings, 10, "raw mode")
        term.process.send_signal(signal.SIGTERM)
        assert term.process.wait(10) == 1
        term.read_until(b"stopped by a signal")
        assert termios.tcgetattr(term.slave) == term.settings  # restored on a kill too
    assert "go with --log" in cli(host, "console", "cn001", "--lines", "5", check=False).stderr


def test_status_watch_on_a_terminal_is_a_live_view(host: Host) -> None:
    with terminal(host, "status", "--watch") as term:
        term.read_until(b"2 nodes at")
        ready(host)
        term.read_until(lambda seen: re.search(rb"ready\s+1\s+cn001", seen) is not None)
        term.process.send_signal(signal.SIGINT)
        assert term.process.wait(10) == 0


def test_cluster_on_a_server_without_cluster_says_it_is_a_single_instance(host: Host) -> None:
    assert cli(host, "cluster").stdout == (
        "this server is a single instance (its node file has no [cluster] table)\n"
    )
    assert as_json(host, "cluster", "-o", "json")["cluster"] is False
