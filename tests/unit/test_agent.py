"""The minOS agent: command line parsing and the report loop against a loopback server.

The loop runs in a thread with LAYERPY_NO_NET semantics (no NIC handling) and talks to a
threaded http.server on 127.0.0.1; intervals are tenths of a second so the file is fast.
"""

from __future__ import annotations

import dataclasses
import http.server
import io
import json
import os
import queue
import socket
import subprocess
import threading
import time

import pytest

import layerpy
from layerpy.agent import Agent, Log, read_cmdline
from layerpy.agent.core import load_config, post_json
from layerpy.agent.net import Nic
from layerpy.agent.servers import SHUN, Servers
from layerpy.proto.agent import (
    MAX_SERVERS,
    PROTOCOL,
    Answer,
    Cmdline,
    ContractError,
    Identity,
    encode,
    normalize_mac,
    split_cmdline,
)
from layerpy.proto.lldp import Neighbor

# -- command line -----------------------------------------------------------------------


def test_cmdline_full() -> None:
    cfg = Cmdline.parse(
        "BOOT_IMAGE=/vmlinuz console=ttyS0 layerpy.server=http://10.99.0.1:8080/ "
        "layerpy.node=cn001 layerpy.token=abc=def BOOTIF=01-52-54-00-12-34-56 quiet\n"
    )
    assert cfg.ok and cfg.problems == []
    assert cfg.server == "http://10.99.0.1:8080"
    assert cfg.report_url == "http://10.99.0.1:8080/api/v1/agent/report"
    assert cfg.node == "cn001"
    assert cfg.token == "abc=def"  # only the first "=" splits
    assert cfg.bootif == "52:54:00:12:34:56"
    assert cfg.heartbeat == 5.0
    assert cfg.lldp_wait == 35.0
    assert cfg.params["quiet"] == ""


@pytest.mark.parametrize(
    ("given", "kept"),
    [("/dev/vdb", "/dev/vdb"), ("LABEL=state", "LABEL=state"), ("/dev/../etc", ""),
     ("LABEL=$(reboot)", ""), ("", "")],
)  # fmt: skip
def test_cmdline_persist_disk(given: str, kept: str) -> None:
    cfg = Cmdline.parse(f"layerpy.server=http://h layerpy.node=n layerpy.persist={given}")
    assert cfg.ok and cfg.persist == kept
    assert bool(cfg.problems) == (given != kept)  # said, and the state stays in RAM
    if kept:
        assert f"layerpy.persist={kept}" in cfg.format().split()


def test_cmdline_heartbeat_quotes_and_last_wins() -> None:
    cfg = Cmdline.parse(
        'layerpy.node=a layerpy.node=b layerpy.server=https://h layerpy.heartbeat=2.5 x="1 2"'
        " layerpy.lldp_wait=0"
    )
    assert cfg.node == "b"
    assert cfg.heartbeat == 2.5
    assert cfg.lldp_wait == 0.0
    assert cfg.params["x"] == "1 2"
    assert cfg.ok


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("layerpy.node=n", "layerpy.server= is missing"),
        ("layerpy.server=http://h", "layerpy.node= is missing"),
        ("layerpy.server=ftp://h layerpy.node=n", "is not an http:// URL"),
        ("", "layerpy.server= is missing"),
    ],
)
def test_cmdline_missing(line: str, problem: str) -> None:
    cfg = Cmdline.parse(line)
    assert not cfg.ok
    assert any(problem in p for p in cfg.problems)


def test_cmdline_soft_problems_keep_ok() -> None:
    cfg = Cmdline.parse(
        "layerpy.server=http://h layerpy.node=n BOOTIF=zz layerpy.heartbeat=-1 layerpy.lldp_wait=x"
    )
    assert cfg.ok
    assert cfg.bootif == ""
    assert cfg.heartbeat == 5.0
    assert cfg.lldp_wait == 35.0
    assert len(cfg.problems) == 3


def test_cmdline_names_every_server_and_one_stays_todays_form() -> None:
    one = Cmdline("http://10.99.0.1:8080", "cn001", "tok", "52:54:00:12:34:56", 2.0)
    assert one.format() == (  # byte for byte what agents before several servers read
        "layerpy.server=http://10.99.0.1:8080 layerpy.node=cn001 layerpy.token=tok"
        " layerpy.heartbeat=2 BOOTIF=01-52-54-00-12-34-56"
    )
    assert Cmdline.parse(one.format()).servers == ("http://10.99.0.1:8080",)
    urls = ("http://10.99.0.1:8080", "https://head-2.example.org/lp", "http://[fd00::2]:80")
    many = Cmdline("", "cn001", "tok", servers=urls)
    assert many.server == urls[0]
    assert "layerpy.server=" + ",".join(urls) + " " in many.format()
    back = Cmdline.parse(many.format())
    assert back.ok and back.problems == []
    assert (back.server, back.servers) == (urls[0], urls)


@pytest.mark.parametrize(
    "forged",
    [
        "http://user:secret@10.0.0.1",  # credentials
        "ftp://10.0.0.1",
        "http://10.0.0.1:99999",  # no such port
        "http://10.0.0.1/a?b=c",  # a query
        "http://10.0.0.1/" + "a" * 300,  # too long
        "http://-bad-.host",
        "http://10.0.0.1/\x1b[2J",  # escapes for a terminal
        "javascript:alert(1)",
        "http:///path",
    ],
)
def test_cmdline_drops_a_forged_server_and_says_so(forged: str) -> None:
    cfg = Cmdline.parse(f"layerpy.server=http://10.99.0.1:8080,{forged} layerpy.node=n")
    assert cfg.ok and cfg.servers == ("http://10.99.0.1:8080",)  # the good one is kept
    assert len(cfg.problems) == 1 and "is not an http:// URL" in cfg.problems[0]
    alone = Cmdline.parse(f"layerpy.server={forged} layerpy.node=n")
    assert not alone.ok and alone.servers == ()


def test_cmdline_keeps_at_most_max_servers_once_each() -> None:
    urls = [f"http://10.99.0.{i}:8080" for i in range(1, 13)]
    cfg = Cmdline.parse(f"layerpy.server={','.join(urls)},{urls[0]} layerpy.node=n")
    assert cfg.servers == tuple(urls[:MAX_SERVERS])
    assert any(f"keeping the first {MAX_SERVERS}" in p for p in cfg.problems)
    doubled = Cmdline.parse(f"layerpy.server={urls[0]},{urls[0]}/,{urls[1]} layerpy.node=n")
    assert doubled.servers == tuple(urls[:2]) and doubled.problems == []


def test_answer_servers_are_optional_and_checked() -> None:
    old = {"node": "cn001", "heartbeat": 5, "protocol": "1.1"}  # a server before 1.2
    assert Answer.from_json(old).servers is None
    new = Answer.from_json(old | {"servers": ["http://a:1", "http://b:1/"]})
    assert new.servers == ("http://a:1", "http://b:1")
    for bad in ([], ["http://a:1"] * (MAX_SERVERS + 1), ["http://u:p@a"], "http://a", [1]):
        with pytest.raises(ContractError, match=r"answer\.servers"):
            Answer.from_json(old | {"servers": bad})


@pytest.mark.parametrize(
    ("raw", "mac"),
    [
        ("01-52-54-00-12-34-56", "52:54:00:12:34:56"),
        ("52:54:00:AB:CD:EF", "52:54:00:ab:cd:ef"),
        ("52-54-00-ab-cd-ef", "52:54:00:ab:cd:ef"),
        ("525400abcdef", "52:54:00:ab:cd:ef"),
        ("52:54:00:ab:cd", ""),
        ("52:54:00:ab:cd:gg", ""),
        ("", ""),
    ],
)
def test_normalize_mac(raw: str, mac: str) -> None:
    assert normalize_mac(raw) == mac


def test_split_cmdline() -> None:
    assert split_cmdline('  a=1\tb="x y"  c "" d\n') == ["a=1", "b=x y", "c", "", "d"]


def test_read_cmdline_env_override(tmp_path, monkeypatch) -> None:
    path = tmp_path / "cmdline"
    path.write_text("layerpy.server=http://h:1 layerpy.node=n7\n")
    monkeypatch.setenv("LAYERPY_CMDLINE", str(path))
    assert read_cmdline().node == "n7"


def test_load_config_complains_instead_of_crashing(tmp_path, monkeypatch) -> None:
    path = tmp_path / "cmdline"
    path.write_text("console=ttyS0\n")
    monkeypatch.setenv("LAYERPY_CMDLINE", str(path))
    out = io.StringIO()
    with pytest.raises(SystemExit):
        load_config(Log(stream=out), lambda s: None, lambda: True)
    line = out.getvalue()
    assert line.startswith("layerpy-agent ?: cannot start: layerpy.server= is missing")
    assert "retrying in 30 s" in line


def test_log_prefix() -> None:
    out = io.StringIO()
    Log("cn001", out)("hello")
    assert out.getvalue() == "layerpy-agent cn001: hello\n"


# -- report loop against a loopback server ----------------------------------------------


class FakeServer:
    """Threaded http.server recording report bodies; status and heartbeat are settable."""

    def __init__(self, port: int = 0) -> None:
        self.reports: list[dict] = []
        self.times: list[float] = []
        self.status = 200
        self.heartbeat: float | None = 0.2
        self.identity: Identity | None = None
        self.protocol = "1.0"
        self.servers: list[str] | None = None
        self.cond = threading.Condition()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n))
                with owner.cond:
                    owner.reports.append({"path": self.path, **body})
                    owner.times.append(time.monotonic())
                    owner.cond.notify_all()
                data = b"{}"
                if owner.status == 200 and owner.heartbeat is not None:
                    node = body.get("node") or "t1"
                    answer = Answer(node, owner.heartbeat, identity=owner.identity,
                                    servers=owner.servers, protocol=owner.protocol)  # fmt: skip
                    data = json.dumps(encode(answer)).encode()
                self.send_response(owner.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def wait(self, n: int, timeout: float = 30.0) -> list[dict]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.reports) >= n, timeout), self.reports
            return list(self.reports)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Running:
    """An Agent looping in a thread until stopped; its log lines are kept."""

    def __init__(self, port: int | str, state_dir, extra: str = "", **kw: object) -> None:
        server = f"http://127.0.0.1:{port}" if isinstance(port, int) else port
        self.cfg = Cmdline.parse(
            f"layerpy.server={server} layerpy.node=t1 layerpy.token=tok "
            f"BOOTIF=01-52-54-00-12-34-56 {extra}"
        )
        self.out = io.StringIO()
        self.stop = threading.Event()
        opts = {"timeout": 1.0, "backoff_min": 0.05, "poll": 0.02, "listen": self.deaf, **kw}
        self.agent = Agent(
            self.cfg,
            Log("t1", self.out),
            no_net=True,
            state_dir=str(state_dir),
            sleep=self.stop.wait,
            stopped=self.stop.is_set,
            **opts,
        )
        self.thread = threading.Thread(target=self.agent.run, daemon=True)
        self.thread.start()

    def deaf(self, ifname: str, wait: float, ignored: list[str]) -> None:
        """No switch: every LLDP round hears nothing (real LLDP needs AF_PACKET and root)."""
        self.stop.wait(wait)

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()

    def wait_log(self, text: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines()):
            assert time.monotonic() < deadline, (text, self.lines())
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def server():
    srv = FakeServer()
    yield srv
    srv.close()


@pytest.fixture
def agents():
    started: list[Running] = []
    yield started
    for a in started:
        a.close()


def test_hello_body(server, agents, tmp_path) -> None:
    agents.append(Running(server.port, tmp_path))
    hello = server.wait(1)[0]
    assert hello.pop("path") == "/api/v1/agent/report"
    assert set(hello) == {
        "node", "token", "mac", "ip", "hostname", "boot_id", "seq", "event",
        "busy", "uptime", "timeline", "lldp", "lldp_ignored", "agent_version", "image", "files", "persist",
        "secure_boot", "platform", "protocol",
    }  # fmt: skip
    assert hello["platform"] == "linux/amd64"  # this machine's, from uname
    assert hello["node"] == "t1"
    assert hello["token"] == "tok"
    assert hello["mac"] == "52:54:00:12:34:56"
    assert hello["ip"] == "127.0.0.1"
    assert hello["hostname"] == socket.gethostname()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert hello["boot_id"] == f.read().strip()
    assert hello["seq"] == 1
    assert hello["event"] == "hello"
    assert hello["protocol"] == PROTOCOL
    assert hello["image"]["state"] == "none"
    assert hello["busy"] is False
    assert (hello["lldp"], hello["lldp_ignored"]) == (None, 0)  # no switch heard yet
    assert isinstance(hello["uptime"], float) and hello["uptime"] > 0
    tl = hello["timeline"]
    assert set(tl) == {"agent_start", "nic_up", "ip_acquired", "hello", "identity"}
    assert tl["nic_up"] is None and tl["ip_acquired"] is None  # no NIC handling in tests
    assert tl["identity"] is None
    assert tl["agent_start"] <= tl["hello"] <= hello["uptime"]
    assert hello["agent_version"] == layerpy.__version__
    agents[0].wait_log("hello accepted by http://127.0.0.1:")


def test_heartbeat_from_response_is_honoured(server, agents, tmp_path) -> None:
    # The command line says 5 s; the server says 0.2 s: several reports within a second.
    agents.append(Running(server.port, tmp_path))
    reports = server.wait(5)
    assert [r["seq"] for r in reports[:5]] == [1, 2, 3, 4, 5]
    assert [r["event"] for r in reports[:5]] == ["hello"] + ["heartbeat"] * 4
    gaps = [b - a for a, b in zip(server.times[1:5], server.times[2:6], strict=False)]
    # the answer's 0.2 s, not the cmdline's 5 s (no lower bound: on a busy machine one late
    # report shortens the gap after it)
    assert all(g < 2.5 for g in gaps), gaps
    agents[0].wait_log("heartbeat is now 0.2 s (from server)")


def test_heartbeat_slows_down_too(server, agents, tmp_path) -> None:
    server.heartbeat = 30
    agents.append(Running(server.port, tmp_path, "layerpy.heartbeat=0.1"))
    server.wait(1)
    time.sleep(0.5)
    assert len(server.reports) == 1  # the next one is 30 s away


def test_forbidden_then_accepted(server, agents, tmp_path) -> None:
    server.status = 403
    agents.append(Running(server.port, tmp_path, "layerpy.heartbeat=0.1"))
    reports = server.wait(3)
    assert all(r["event"] == "hello" for r in reports)  # not accepted yet: still hello
    a = agents[0]
    refused = [line for line in a.lines() if "refused our token" in line]
    assert len(refused) == 1, a.lines()  # logged once, not per attempt
    assert "HTTP 403" in refused[0]
    server.status = 200
    a.wait_log("hello accepted")
    a.wait_log("server accepts reports again")
    n = len(server.reports)
    after = server.wait(n + 1)[-1]
    assert after["event"] == "heartbeat"
    assert after["seq"] == n + 1


def test_server_errors_back_off(server, agents, tmp_path) -> None:
    server.status = 503
    agents.append(Running(server.port, tmp_path, backoff_min=0.1))
    server.wait(5)
    gaps = [b - a for a, b in zip(server.times, server.times[1:], strict=False)]
    # exponential, each wait jittered to half to all of it: 0.05-0.1, 0.1-0.2, 0.2-0.4, 0.4-0.8
    assert gaps[3] > 0.35 and gaps[3] > gaps[0] * 2, gaps
    assert sum("server unreachable since" in line for line in agents[0].lines()) == 1


def test_server_down_and_back(agents, tmp_path) -> None:
    srv = FakeServer()
    port = srv.port
    try:
        a = Running(port, tmp_path)
        agents.append(a)
        srv.wait(2)
    finally:
        srv.close()
    a.wait_log("server unreachable since uptime")
    time.sleep(0.5)  # several failed attempts (0.05, 0.1, 0.2 s backoff)
    assert sum("unreachable" in line for line in a.lines()) == 1, a.lines()
    seq_before = a.agent.seq
    assert seq_before >= 4
    srv = FakeServer(port)
    try:
        a.wait_log("server reachable again after")
        back = srv.wait(1)[0]
        assert back["event"] == "heartbeat"
        assert back["seq"] >= seq_before
        assert "failed reports" in next(line for line in a.lines() if "again" in line)
    finally:
        srv.close()


def test_change_is_reported_immediately(server, agents, tmp_path) -> None:
    server.heartbeat = 30
    a = Running(server.port, tmp_path)
    agents.append(a)
    server.wait(1)
    real = a.agent.observe
    a.agent.observe = lambda: {**real(), "ip": "10.99.0.77"}
    t0 = time.monotonic()
    change = server.wait(2)[1]
    assert time.monotonic() - t0 < 1.0
    assert change["event"] == "change"
    assert change["ip"] == "10.99.0.77"
    time.sleep(0.2)
    assert len(server.reports) == 2  # reported once, then back to the 30 s heartbeat


def test_busy_flag_is_reported_immediately(server, agents, tmp_path) -> None:
    server.heartbeat = 30
    agents.append(Running(server.port, tmp_path))
    assert server.wait(1)[0]["busy"] is False
    (tmp_path / "node").mkdir(exist_ok=True)  # the container's /run/layerpy
    (tmp_path / "node" / "busy").touch()  # what a job does to keep its node from power-off
    change = server.wait(2)[1]
    assert (change["event"], change["busy"]) == ("change", True)
    (tmp_path / "node" / "busy").unlink()
    assert server.wait(3)[2]["busy"] is False


def test_restart_in_same_boot_continues(server, agents, tmp_path) -> None:
    first = Running(server.port, tmp_path)
    server.wait(2)
    first.close()
    seq = first.agent.seq
    n = len(server.reports)
    second = Running(server.port, tmp_path)
    agents.append(second)
    again = server.wait(n + 1)[n]
    assert again["seq"] == seq + 1
    assert again["event"] == "change"  # the server already had this boot's hello
    assert again["timeline"]["hello"] == server.reports[0]["timeline"]["hello"]
    second.wait_log("restarted in the same boot")


def test_post_json_outcomes(server) -> None:
    url = f"http://127.0.0.1:{server.port}/api/v1/agent/report"
    ok = post_json(url, {"x": 1}, 1.0)
    assert (ok.kind, ok.status, ok.body["heartbeat"]) == ("ok", 200, 0.2)
    server.status = 404
    assert post_json(url, {}, 1.0).kind == "rejected"
    server.status = 500
    assert post_json(url, {}, 1.0).kind == "unreachable"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    down = post_json(f"http://127.0.0.1:{free}/", {}, 1.0)
    assert down.kind == "unreachable" and "refused" in down.detail.lower()


# -- LLDP and identity -------------------------------------------------------------------

SWP1 = Neighbor("02:00:00:00:0a:01", 4, "swp1", 5, 120, system_name="leaf1")


class FakeLldp:
    """Stands in for lldp.listen: a round returns the neighbour the test lets it hear, or
    None after `wait` seconds; malformed frames are counted as the real one does."""

    def __init__(self) -> None:
        self.heard: queue.Queue[tuple[Neighbor, int]] = queue.Queue()
        self.waits: list[float] = []

    def hear(self, neighbor: Neighbor, malformed: int = 0) -> None:
        self.heard.put((neighbor, malformed))

    def __call__(self, ifname: str, wait: float, ignored: list[str]) -> Neighbor | None:
        self.waits.append(wait)
        try:
            neighbor, malformed = self.heard.get(timeout=wait)
        except queue.Empty:
            return None
        ignored.extend(["bad frame"] * malformed)
        return neighbor


def test_lldp_reported_at_once_when_heard(server, agents, tmp_path) -> None:
    server.heartbeat = 30
    fake = FakeLldp()
    a = Running(server.port, tmp_path, "layerpy.lldp_wait=0.1", listen=fake)
    agents.append(a)
    assert server.wait(1)[0]["lldp"] is None
    a.wait_log("no LLDP neighbour on")  # a silent round: it keeps listening
    t0 = time.monotonic()
    fake.hear(SWP1, malformed=2)
    change = server.wait(2)[1]
    assert time.monotonic() - t0 < 1.0
    assert change["event"] == "change"
    heard_at = change["lldp"].pop("heard_at")
    assert change["lldp"] == {
        "chassis_id": "02:00:00:00:0a:01", "chassis_subtype": 4, "port_id": "swp1",
        "port_subtype": 5, "system_name": "leaf1", "port_description": None, "ttl": 120,
    }  # fmt: skip
    assert change["lldp_ignored"] == 2
    assert server.reports[0]["uptime"] < heard_at <= change["uptime"]
    fake.hear(dataclasses.replace(SWP1, ttl=90))  # the same port again: nothing to report
    fake.hear(dataclasses.replace(SWP1, port_id="swp7"))  # the machine was moved
    moved = server.wait(3)[2]
    assert (moved["event"], moved["lldp"]["port_id"]) == ("change", "swp7")
    assert moved["lldp"]["heard_at"] >= heard_at  # /proc/uptime ticks in 10 ms
    time.sleep(0.1)
    assert len(server.reports) == 3
    assert set(fake.waits) == {0.1}


def test_lldp_wait_zero_turns_it_off(server, agents, tmp_path) -> None:
    fake = FakeLldp()
    agents.append(Running(server.port, tmp_path, "layerpy.lldp_wait=0", listen=fake))
    server.wait(2)
    assert fake.waits == []


def test_identity_switch(server, agents, tmp_path) -> None:
    server.heartbeat = 30
    server.identity = Identity("cn002", "tok2")
    a = Running(server.port, tmp_path, "layerpy.node=discover layerpy.token=d1")
    agents.append(a)
    first, hello = server.wait(2)
    assert (first["node"], first["token"], first["event"]) == ("discover", "d1", "hello")
    # at once, without waiting for the 30 s heartbeat: a hello as the node, seq going on
    assert (hello["node"], hello["token"], hello["event"]) == ("cn002", "tok2", "hello")
    assert (hello["seq"], hello["path"]) == (2, first["path"])
    tl = hello["timeline"]
    assert first["timeline"]["hello"] <= tl["identity"] <= tl["hello"]
    assert tl["agent_start"] == first["timeline"]["agent_start"]
    a.wait_log(": now cn002 (was discover)")
    a.wait_log("layerpy-agent cn002: hello accepted")
    time.sleep(0.2)
    assert len(server.reports) == 2  # the server names cn002 again: nothing to do
    a.close()
    assert (tmp_path / "agent-state.json").stat().st_mode & 0o077 == 0  # it holds the token
    # A respawned agent reads the same command line (discover) and goes on as cn002.
    server.identity = None
    b = Running(server.port, tmp_path, "layerpy.node=discover layerpy.token=d1")
    agents.append(b)
    again = server.wait(3)[2]
    assert (again["node"], again["token"], again["event"], again["seq"]) == (
        "cn002", "tok2", "change", 3,
    )  # fmt: skip
    b.wait_log("continuing as cn002, the identity adopted in this boot (was discover)")


def test_redo_dhcp_releases_then_asks_again(tmp_path) -> None:
    started: list[str] = []

    class FakeNic(Nic):
        """No udhcpc to start and no real interface; the pidfile lives in tmp_path."""

        pidfile = str(tmp_path / "udhcpc.pid")

        def start_udhcpc(self) -> None:
            started.append(self.hostname)

        def address(self) -> str:
            return "10.99.0.12" if started else ""

    nic = FakeNic("", "discover", lambda msg: None, lambda: 1.0, run_dir=str(tmp_path))
    nic.name = "eth0"
    lease = tmp_path / "lease-eth0.env"  # the script keeps the address of a lease on file
    lease.write_text("ip=10.99.0.200\n")
    got = tmp_path / "signals"
    udhcpc = subprocess.Popen(  # stands in for busybox udhcpc: notes the signals it gets
        ["sh", "-c", f"trap '[ -e {lease} ] && echo usr2-kept >>{got} || echo usr2 >>{got}' USR2;"
         f" trap 'echo term >>{got}; rm {nic.pidfile}; exit' TERM; echo $$ >{nic.pidfile};"
         " while :; do sleep 0.01; done"]
    )  # fmt: skip
    try:
        while not os.path.exists(nic.pidfile):
            time.sleep(0.01)
        assert nic.redo_dhcp("cn002", time.sleep, wait=1.0) == "10.99.0.12"
        assert udhcpc.wait(60) == 0  # generous: a busy machine runs the traps late
        assert got.read_text().split() == ["usr2", "term"]  # release (lease dropped), exit
        assert started == ["cn002"]  # a fresh DISCOVER with the new hostname
    finally:
        udhcpc.kill()  # never left behind, whatever failed
        udhcpc.wait()


def test_answer_in_another_major_protocol_is_said_once_and_ignored(
    server, agents, tmp_path
) -> None:
    server.protocol = "2.0"
    server.heartbeat = 0.05  # not applied: the answer is ignored whole
    a = Running(server.port, tmp_path, "layerpy.heartbeat=0.1")
    agents.append(a)
    server.wait(4)
    a.wait_log(f"the server's answer speaks layerpy agent protocol 2.0, this side {PROTOCOL}")
    assert sum("protocol 2.0" in line for line in a.lines()) == 1
    assert a.agent.heartbeat == 0.1


def test_heartbeats_and_retries_are_spread(tmp_path) -> None:
    """Nodes powered on together drift apart, and come back apart after an outage."""
    from layerpy.agent.core import SPREAD, Outcome

    cfg = Cmdline.parse("layerpy.server=http://h layerpy.node=n layerpy.heartbeat=10")
    agent = Agent(cfg, Log("n", io.StringIO()), no_net=True, state_dir=str(tmp_path))
    beats = {agent._next_delay(Outcome("ok")) for _ in range(200)}
    assert len(beats) > 150 and all(10 * (1 - SPREAD) <= b <= 10 * (1 + SPREAD) for b in beats)
    agent._next_delay(Outcome("ok"))
    first = [agent._next_delay(Outcome("unreachable")) for _ in range(5)]
    assert all(b / 2 <= d <= b for d, b in zip(first, (1, 2, 4, 8, 10), strict=True)), first
    firsts = set()
    for _ in range(50):  # each outage starts the schedule afresh, at a different point
        agent._next_delay(Outcome("ok"))
        firsts.add(agent._next_delay(Outcome("unreachable")))
    assert len(firsts) > 40 and all(0.5 <= d <= 1 for d in firsts)


# -- several servers ----------------------------------------------------------------------


def url(server: FakeServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def test_the_agent_moves_round_its_servers_and_says_so_once_per_move(agents, tmp_path) -> None:
    first, second = FakeServer(), FakeServer()
    try:
        a = Running(f"{url(first)},{url(second)}", tmp_path)
        agents.append(a)
        first.wait(2)
        assert second.reports == []  # the first answers: the agent stays with it
        first.close()
        moved_at = time.monotonic()
        n = second.wait(3)[0]
        assert time.monotonic() - moved_at < 5, "the move took longer than a few backoffs"
        assert n["event"] == "heartbeat" and n["seq"] > 2  # the same boot, carried on
        moves = [line for line in a.lines() if "stopped answering" in line]
        assert moves == [f"layerpy-agent t1: server {url(first)} stopped answering "
                         f"([Errno 111] Connection refused); moving to {url(second)}"]  # fmt: skip
        assert not any("rejected" in line or "unreachable" in line for line in a.lines())
        second.status = 503  # both down: round and round, one line for that
        time.sleep(1.0)
        a.wait_log("no server answers since uptime")
        assert sum("no server answers" in line for line in a.lines()) == 1, a.lines()
        assert sum("stopped answering" in line for line in a.lines()) == 2, a.lines()
        first = FakeServer(first.port)  # the first comes back: used when it is its turn
        first.wait(1)
        a.wait_log("reachable again after")
    finally:
        first.close()
        second.close()


def test_a_refusal_is_an_answer_and_moves_nothing(agents, tmp_path) -> None:
    first, second = FakeServer(), FakeServer()
    try:
        first.status = 403
        a = Running(f"{url(first)},{url(second)}", tmp_path, "layerpy.heartbeat=0.1")
        agents.append(a)
        first.wait(4)
        a.wait_log("server refused our token")
        assert second.reports == [] and not any("moving" in line for line in a.lines())
    finally:
        first.close()
        second.close()


def test_the_answer_names_the_servers_to_move_to(server, agents, tmp_path) -> None:
    """An agent booted knowing one instance learns of another that joined since."""
    later = FakeServer()
    try:
        server.servers = [url(server), url(later)]
        a = Running(server.port, tmp_path)
        agents.append(a)
        a.wait_log(f"servers are now {url(server)}, {url(later)} (from server)")
        server.close()
        later.wait(1)
        a.wait_log(f"moving to {url(later)}")
    finally:
        later.close()


def test_a_server_that_hangs_is_left_after_the_timeout(agents, tmp_path) -> None:
    second = FakeServer()
    with socket.socket() as hung:  # takes connections (the backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        try:
            a = Running(f"http://127.0.0.1:{hung.getsockname()[1]},{url(second)}", tmp_path)
            agents.append(a)
            started = time.monotonic()
            assert second.wait(1)[0]["event"] == "hello"
            assert time.monotonic() - started < 5  # the 1 s timeout and a backoff, not more
            a.wait_log(f"stopped answering (timed out); moving to {url(second)}")
        finally:
            second.close()


def test_the_agent_moves_to_the_server_its_answer_names_first(agents, tmp_path) -> None:
    """The owner of a node is listed first: its heartbeats go there (one line for the move)."""
    first, owner = FakeServer(), FakeServer()
    try:
        first.servers = [url(owner), url(first)]
        owner.servers = [url(owner), url(first)]
        a = Running(f"{url(first)},{url(owner)}", tmp_path)
        agents.append(a)
        owner.wait(3)
        assert len(first.reports) == 1  # the hello, then it moved
        a.wait_log(f"moving from {url(first)} to {url(owner)}: the server names it first")
        assert sum("moving" in line for line in a.lines()) == 1, a.lines()
    finally:
        first.close()
        owner.close()


def test_a_server_that_failed_is_followed_back_only_after_a_while() -> None:
    """Another instance names a dead owner first until the owner's lease ends: the agent
    does not bounce back to it on each answer."""
    servers = Servers(["http://a:1", "http://b:1"])
    assert servers.failed() == ("http://b:1", True)
    servers.answered()
    for _ in range(SHUN):
        assert servers.lead() is None and servers.current == "http://b:1"
    assert servers.lead() == "http://a:1"  # it came back (or still owns the node): followed
    servers.update(["http://b:1", "http://a:1"])
    assert servers.lead() == "http://b:1"
    assert servers.lead() is None
