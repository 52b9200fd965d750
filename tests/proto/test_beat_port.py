"""Heartbeats by datagram (protocol 1.4) against a real ``layerpy serve``: what a hostile
neighbour sends to the beat port is dropped unanswered and counted, and a real agent's
unchanged heartbeats stop costing HTTP requests while liveness, lost detection and a
reload's news behave as they did with full reports."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from layerpy.proto import beat

from test_http import LAYERPY, Host, api, boot_token, report, serving

pytestmark = pytest.mark.netns

SERVER = ("10.66.0.1", 8080)
# sends each datagram (hex, argv) from `source` and prints the reply's hex, or "-" when
# none comes within a second
SENDER = """
import socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind((sys.argv[1], 0))
sock.settimeout(1)
for data in sys.argv[2:]:
    sock.sendto(bytes.fromhex(data), ("10.66.0.1", 8080))
    try:
        print(sock.recv(512).hex())
    except TimeoutError:
        print("-")
"""
AGENT = """
from layerpy.agent.core import Agent, Log, read_cmdline
cfg = read_cmdline()
Agent(cfg, Log(cfg.node), no_net=True, state_dir=__import__("sys").argv[1]).run()
"""


def send(host: Host, *datagrams: bytes, source: str = "10.66.0.99") -> list[bytes | None]:
    """The reply to each datagram sent from `source`, None where none came."""
    out = host.ns.run(sys.executable, "-c", SENDER, source, *(d.hex() for d in datagrams))
    return [None if line == "-" else bytes.fromhex(line) for line in out.stdout.split()]


def beats(host: Host) -> dict[str, float]:
    """layerpy_beats_total by outcome, and the agent reports handled over HTTP."""
    text = api(host, "/metrics")[1]
    found = {m[0]: float(m[1]) for m in re.findall(r'^layerpy_beats_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}  # fmt: skip
    posts = re.findall(r'^layerpy_http_requests_total\{method="POST",route="/api/v1/agent/report"\} (\S+)$', text, re.M)  # fmt: skip
    return found | {"http reports": float(posts[0]) if posts else 0.0}


def node(host: Host) -> dict:
    code, text = api(host, "/api/v1/nodes/cn001")
    assert code == 200, text
    return json.loads(text)


def wait_for(condition: Callable[[], object], timeout: float, what: str, *logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)
            pytest.fail(f"waited {timeout:g} s for {what}{tails}")
        time.sleep(0.1)


def test_a_neighbour_gets_no_answer_and_changes_nothing(make_config, tmp_path: Path) -> None:
    config = make_config(server="10.66.0.1", interface="d0")
    with serving(config, tmp_path) as host:
        token = boot_token(host, "cn001", "10.66.0.11")
        fields = {"token": token}
        assert report(host, **fields)[0] == 200
        code, answer = report(host, **fields, seq=2, event="heartbeat")
        assert code == 200 and answer["beat"]["port"] == 8080, answer
        key = bytes.fromhex(answer["beat"]["key"])
        assert answer["beat"]["key"] not in api(host, "/api/v1/nodes/cn001")[1]
        old = report(host, **fields, seq=3, event="heartbeat", protocol="1.3")[1]
        assert "beat" not in old or old["beat"] is None  # an agent of the last release
        heard = node(host)["last_report"]

        valid = beat.beat(key, "cn001", 4, 9.0)
        replies = send(host, valid, valid, beat.beat(bytes(16), "cn001", 5, 9.0),
                       beat.beat(key, "cn002", 6, 9.0), b"\xff" * 600, b"",
                       beat.beat(key, "cn001", 3, 9.0))  # fmt: skip
        assert beat.read_reply(key, 4, replies[0]) is beat.Verdict.OK
        assert replies[1:] == [None] * 6, replies  # replayed, forged, unknown, junk, older
        assert node(host)["last_report"] > heard and node(host)["agent"]["seq"] == 4
        counts = beats(host)
        assert {k: counts[k] for k in ("ok", "replayed", "forged", "unknown", "malformed")} == {
            "ok": 1, "replayed": 2, "forged": 1, "unknown": 1, "malformed": 2}  # fmt: skip
        assert "LPb1" not in (tmp_path / "serve.log").read_text()  # nothing logged per beat


def test_an_agents_heartbeats_go_by_datagram_and_it_is_still_lost_and_found(
    make_config, tmp_path: Path
) -> None:
    config = make_config(server="10.66.0.1", interface="d0")
    text = config.path.read_text().replace("heartbeat = 2\n", "heartbeat = 0.5\n", 1)
    config.path.write_text(text)
    log = tmp_path / "agent.log"
    with serving(config, tmp_path) as host:
        token = boot_token(host, "cn001", "10.66.0.11")
        cmdline = tmp_path / "cmdline"
        cmdline.write_text(f"layerpy.server=http://10.66.0.1:8080 layerpy.node=cn001 "
                           f"layerpy.token={token} layerpy.lldp_wait=0 "
                           "BOOTIF=01-52-54-00-99-00-11\n")  # fmt: skip
        env = {**os.environ, "LAYERPY_CMDLINE": str(cmdline), "LAYERPY_NO_NET": "1"}
        with log.open("wb") as out:
            agent = host.ns.popen([sys.executable, "-c", AGENT, str(tmp_path / "agent")],
                                  stdout=out, stderr=out, env=env)  # fmt: skip
        serve_log = tmp_path / "serve.log"
        wait_for(lambda: beats(host).get("ok", 0) >= 3, 60, "three beats taken", log, serve_log)
        before = beats(host)
        wait_for(lambda: beats(host)["ok"] >= before["ok"] + 10, 60, "ten more beats", log)
        after = beats(host)
        assert after["http reports"] == before["http reports"], (before, after)
        assert node(host)["run_state"] == "ready"

        agent.send_signal(signal.SIGSTOP)  # hung: lost after 3 missed heartbeats
        try:
            wait_for(lambda: node(host)["run_state"] == "lost", 30, "cn001 lost", serve_log)
        finally:
            agent.send_signal(signal.SIGCONT)
        wait_for(lambda: node(host)["run_state"] == "ready", 30, "cn001 ready again", log,
                 serve_log)  # fmt: skip
        assert beats(host)["report"] >= 1  # its first beat after was told to report in full

        reports = beats(host)["http reports"]
        config.path.write_text(
            text.replace(
                'nodes = "cn[001-002]"\n', 'nodes = "cn[001-002]"\nvars = { rack = "r7" }\n'
            )
        )
        result = host.ns.run(str(LAYERPY), "reload", "-c", str(config.path), check=False)
        assert result.returncode == 0, result.stdout + result.stderr
        wait_for(lambda: beats(host)["http reports"] > reports, 30,
                 "a full report after the reload", log)  # fmt: skip
        settled = beats(host)
        wait_for(lambda: beats(host)["ok"] >= settled["ok"] + 3, 30, "beats again", log)
        agent.kill()
        assert "unanswered" not in log.read_text()
