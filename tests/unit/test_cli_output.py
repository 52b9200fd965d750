"""The pure parts of the CLI's output: -o json, status --watch's folded lines, event lines,
the server-sent events parser, the console's escape filter and detach keys."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerpy.cli import event_line, last_lines, node_problems, status_groups, status_line
from layerpy.client import DEFAULT_SOCKET, EventParser, ServerEvent, socket_of
from layerpy.terminal import DetachKeys, EscapeFilter, harmless

LAYERPY = Path(sys.executable).parent / "layerpy"


def node(name: str, power: str = "on", run: str = "ready", image: str = "active",
         **more: object) -> dict:  # fmt: skip
    return {"name": name, "power": power, "run_state": run,
            "image": {"state": image, "error": None}, **more}  # fmt: skip


def test_status_groups_fold_hostlists_by_state_in_their_usual_order() -> None:
    nodes = [node(f"cn{n:03d}") for n in range(1, 129)]
    nodes += [node("cn129", run="lost"), node("login", power="off", run="unknown", image="none")]
    nodes += [node("cn130", run="weird")]
    groups = status_groups(reversed(nodes))
    assert status_line(groups, "run") == (
        "login unknown, cn[001-128] ready, cn129 lost, cn130 weird"
    )
    assert ("power", "on", 130, "cn[001-130]") in groups
    assert ("power", "off", 1, "login") in groups
    assert [state for aspect, state, _, _ in groups if aspect == "image"] == ["none", "active"]
    assert status_groups([]) == []


def test_node_problems_say_what_to_look_at() -> None:
    nodes = [node("cn001"), node("cn002", power_error="bmc unreachable", conflict="x claims")]
    nodes[0]["image"]["error"] = "pull failed"
    assert node_problems(nodes) == ["cn001: pull failed", "cn002: bmc unreachable; x claims"]


def test_event_lines_are_local_time_node_kind_fields_message_and_printable() -> None:
    at = time.mktime((2026, 1, 2, 13, 4, 5, 0, 0, -1)) + 0.25
    line = event_line({"seq": 7, "time": at, "node": "cn001", "kind": "observed",
                       "fields": {"run_state": "ready", "ip": None, "n": 2}, "message": "hi"})  # fmt: skip
    assert line == "13:04:05.250 cn001    observed run_state=ready ip=- n=2 hi"
    hostile = event_line({"time": at, "node": "", "kind": "event",
                          "fields": {"x": "\x1b]0;t\x07"}, "message": "\x1b[2J"})  # fmt: skip
    assert "\x1b" not in hostile and "\x07" not in hostile
    assert hostile == "13:04:05.250 -        event    x=\\x1b]0;t\\x07 \\x1b[2J"


def parse(text: str) -> tuple[list[ServerEvent], EventParser]:
    parser = EventParser()
    found = [event for line in text.split("\n")[:-1] if (event := parser.feed(line))]
    return found, parser


def test_server_sent_events_are_parsed_as_the_standard_says() -> None:
    text = (
        "retry: 2000\n\n"
        ": keepalive\n\n"
        'id: 5\nevent: observed\ndata: {"seq": 5}\n\n'
        "event: gap\ndata: {}\n\n"
        "data:first\ndata: second\n\n"
        "id: 6\nevent: action\n"  # not finished: no blank line yet
    )
    found, parser = parse(text)
    assert found == [
        ServerEvent("5", "observed", '{"seq": 5}'),
        ServerEvent("5", "gap", "{}"),
        ServerEvent("5", "message", "first\nsecond"),
    ]
    assert parser.last_id == "6"  # the id counts from its line on, as in a browser
    assert parser.feed("data: x") is None and parser.feed("") == ServerEvent("6", "action", "x")


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"hello\r\n\tworld\b!", b"hello\r\n\tworld\b!"),
        (
            b"\x1b[1;31mred\x1b[0m \x1b[2J\x1b[H\x1b[?25l",
            b"\x1b[1;31mred\x1b[0m \x1b[2J\x1b[H\x1b[?25l",
        ),
        (b"\x1b(0lqk\x1b(B\x1b7\x1b8\x1b=\x1b>", b"\x1b(0lqk\x1b(B\x1b7\x1b8\x1b=\x1b>"),
        (b"a\x1b]0;title\x07b", b"ab"),  # OSC ended by BEL
        (b"a\x1b]52;c;cm0gLXJmIH4=\x1b\\b", b"ab"),  # clipboard write, ended by ST
        (b"a\x1bP$q m\x1b\\b\x1b_Gf=100;AAAA\x1b\\c\x1b^pm\x1b\\\x1bXsos\x1b\\d", b"abcd"),
        (b"a\x1b]8;;http://x\x1b[31mred", b"a\x1b[31mred"),  # ESC ends a string, starts anew
        (b"a\x1bPq\x18b", b"ab"),  # CAN cancels a string
        (b"\x1b[21t\x1b[8;100;300tx", b"x"),  # window operations: report title, resize
        ("a\u009b31mb\u009d0;t\u0007c".encode(), b"a31mb0;tc"),  # C1 controls as UTF-8
        ("é€😀 naïve".encode(), "é€😀 naïve".encode()),
        (b"bad\xff\x80\xc0\xafok", b"bad" + "\ufffd".encode() * 4 + b"ok"),
        (b"\x00\x05\x07\x0e\x0f\x7fx", b"x"),  # NUL, ENQ (answerback), BEL, SO/SI, DEL
        (b"\x1b[1\x07;31m", b";31m"),  # a control inside CSI: no sequence
        (b"\x1b[" + b"1;" * 40 + b"m", b"1;" * 9 + b"m"),  # too long: dropped, rest is text
        (b"\x1b]" + b"x" * 5000, b"x" * (5000 - 4096)),  # an unended string ends at a bound
    ],
)
def test_the_escape_filter_keeps_what_a_console_needs(raw: bytes, shown: bytes) -> None:
    assert harmless(raw) == shown
    split = EscapeFilter()  # the same, byte by byte: chunks may cut anything anywhere
    assert b"".join(split.feed(raw[i : i + 1]) for i in range(len(raw))) == shown


def test_the_escape_filter_passes_plain_text_as_it_is() -> None:
    text = b"Debian GNU/Linux 12 cn001 ttyS0\r\n\r\ncn001 login: "
    assert EscapeFilter().feed(text) is text


def test_detach_keys() -> None:
    keys = DetachKeys()
    assert keys.feed(b"ls\r") == (b"ls\r", False)
    assert keys.feed(b"ab\x1d.cd") == (b"ab", True)
    keys = DetachKeys()
    assert keys.feed(b"x\x1d") == (b"x", False)  # held: the next key decides
    assert keys.feed(b".") == (b"", True)
    keys = DetachKeys()
    assert keys.feed(b"\x1dq") == (b"\x1dq", False)  # anything else: both bytes go
    assert keys.feed(b"\x1d\x1d") == (b"\x1d\x1d", False)
    assert keys.feed(b".") == (b".", False)


def test_last_lines() -> None:
    assert last_lines(b"a\nb\nc\n", 2) == b"b\nc\n"
    assert last_lines(b"a\nb\nc", 2) == b"b\nc"
    assert last_lines(b"a\n", 5) == b"a\n"
    assert last_lines(b"", 5) == b""


def layerpy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LAYERPY), *args], capture_output=True, text=True)


def test_check_says_its_verdict_as_json(make_config, tmp_path: Path) -> None:
    config = make_config()
    shown = layerpy("check", "--file-only", "-o", "json", "-c", str(config.path))
    assert shown.returncode == 0, shown.stderr
    verdict = json.loads(shown.stdout)
    assert verdict["valid"] is True and verdict["host_problems"] is None
    assert [n["name"] for n in verdict["nodes"]] == ["cn001", "cn002"]
    assert verdict["nodes"][0]["ip"] == "10.99.0.11"
    broken = tmp_path / "broken.toml"
    broken.write_text("[server]\naddress = 'nope'\n")
    shown = layerpy("check", "--json", "-c", str(broken))  # the old spelling still works
    verdict = json.loads(shown.stdout)
    assert shown.returncode == 2 and verdict["valid"] is False and verdict["problems"]
    missing = layerpy("check", "-o", "json", "-c", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "cannot read the file" in missing.stdout


def test_check_names_the_cluster_never_its_password(make_config, tmp_path: Path) -> None:
    (tmp_path / "etcd.pass").write_text("sesame\n")
    (tmp_path / "etcd.pass").chmod(0o600)
    config = make_config(cluster='[cluster]\netcd = ["http://127.0.0.1:2379"]\nname = "head1"\n'
                         'user = "layerpy"\npassword_file = "etcd.pass"\n')  # fmt: skip
    shown = layerpy("check", "--file-only", "-c", str(config.path))
    assert shown.returncode == 0, shown.stderr
    assert "cluster  instance head1 serving 10.99.0.0/24, etcd http://127.0.0.1:2379 under " \
        "/layerpy/v1" in shown.stdout  # fmt: skip
    as_json = layerpy("check", "--file-only", "-o", "json", "-c", str(config.path))
    assert json.loads(as_json.stdout)["cluster"] == {
        "name": "head1", "segment": "10.99.0.0/24", "etcd": ["http://127.0.0.1:2379"],
        "prefix": "/layerpy/v1",
    }  # fmt: skip
    assert "sesame" not in shown.stdout + shown.stderr + as_json.stdout + as_json.stderr


@pytest.mark.parametrize(
    "content",
    [
        b"\x80 not UTF-8\n",
        b"[server]\nheartbeat = " + b"9" * 5000 + b"\n",
        b'[server]\nstate_dir = "~no-such-user-7/state"\n',
    ],
    ids=["not UTF-8", "a number of 5000 digits", "an unknown user's home"],
)
def test_the_api_socket_is_found_in_any_node_file(tmp_path: Path, content: bytes) -> None:
    """Found by tests/fuzz: the lenient reading for 'layerpy reload' raised on these
    (UnicodeDecodeError, ValueError, RuntimeError) instead of falling back."""
    path = tmp_path / "nodes.toml"
    path.write_bytes(content)
    assert socket_of(path) == DEFAULT_SOCKET


def test_status_watch_refuses_json() -> None:
    shown = layerpy("status", "--watch", "-o", "json", "--server", "/nonexistent.sock")
    assert shown.returncode == 2 and "layerpy watch -o json" in shown.stderr
