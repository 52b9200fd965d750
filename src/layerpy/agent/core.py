"""The agent's report loop: tell the server who and where this node is, forever.

Observations flow up (identity, MAC, IP, the switch port heard by LLDP, boot timeline),
intent flows down (heartbeat interval, image, and a node's identity for a machine booted
to be discovered). The loop never exits: a node whose server is away keeps running and
keeps trying, without flooding the console or the network. With several instances serving
the segment it moves to the next when its own stops answering (``servers``); the
container runs on, whoever answers.
"""

from __future__ import annotations

import io
import json
import os
import random
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

import layerpy
from layerpy.agent import firmware, lldp
from layerpy.agent.container import NODE_DIR, Runner
from layerpy.agent.net import Nic, pick_interface, source_address
from layerpy.agent.servers import Servers
from layerpy.proto import beat
from layerpy.proto.agent import (
    REPORT_PATH,
    Answer,
    Cmdline,
    ContractError,
    Event,
    FilesStatus,
    Identity,
    ImageStatus,
    Lldp,
    Milestone,
    ProtocolMismatch,
    Report,
    decode,
    encode,
    node_authorization,
)
from layerpy.proto.lldp import Neighbor
from layerpy.proto.platform import of_machine

BOOT_ID = "/proc/sys/kernel/random/boot_id"
UPTIME = "/proc/uptime"
HOSTNAME = "/proc/sys/kernel/hostname"  # sethostname(2) by another door: no busybox needed
STATE_DIR = "/run/layerpy"
CMDLINE = "/proc/cmdline"
BUSY = os.path.join(NODE_DIR, "busy")  # /run/layerpy/busy in the container
HTTP_TIMEOUT = 5.0
CONFIG_RETRY = 30.0
SPREAD = 0.1  # heartbeats vary by this fraction either way
BEAT_WAIT = 2.0  # seconds to wait for the reply to a heartbeat datagram
BEAT_MISSES = 3  # unanswered datagrams in a row before this boot's beats go by HTTP only
PLATFORM = of_machine(os.uname().machine)  # which image of a multi-architecture index runs here


def uptime() -> float:
    """Seconds since boot: the only clock that means something before NTP."""
    try:
        with open(UPTIME, encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def read_cmdline(path: str | None = None) -> Cmdline:
    """The kernel command line (``LAYERPY_CMDLINE`` names another file, for tests)."""
    path = path or os.environ.get("LAYERPY_CMDLINE") or CMDLINE
    with open(path, encoding="utf-8", errors="replace") as f:
        return Cmdline.parse(f.read())


def boot_id() -> str:
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


class Log:
    """One line per event on stderr (the console in the minOS), prefixed with the node."""

    def __init__(self, node: str = "?", stream: io.TextIOBase | None = None) -> None:
        self.node = node or "?"
        self.stream = stream

    def __call__(self, msg: str) -> None:
        stream = self.stream or sys.stderr
        try:
            stream.write(f"layerpy-agent {self.node}: {msg}\n")
            stream.flush()
        except (OSError, ValueError):
            pass


class Outcome:
    """What one POST produced: ``kind`` is ok, forbidden, rejected or unreachable."""

    __slots__ = ("body", "detail", "kind", "status")

    def __init__(self, kind: str, status: int = 0, body: object = None, detail: str = "") -> None:
        self.kind = kind
        self.status = status
        self.body = body
        self.detail = detail


def post_json(url: str, body: dict, timeout: float) -> Outcome:
    """POST JSON and classify the answer; never raises for network or HTTP errors."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": f"layerpy-agent/{layerpy.__version__}",
        },
    )
    # No proxies: the server is on the node's own boot network, whatever the environment says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            status = resp.status
            raw = resp.read()
    except urllib.error.HTTPError as e:
        status = e.code
        with_reason = f"HTTP {e.code} {e.reason}"
        e.close()
        if status == 403:
            return Outcome("forbidden", status, detail=with_reason)
        if status >= 500 or status == 429:  # down or overloaded: back off
            return Outcome("unreachable", status, detail=with_reason)
        return Outcome("rejected", status, detail=with_reason)
    except (OSError, ValueError, urllib.error.URLError) as e:
        reason = getattr(e, "reason", None) or e
        return Outcome("unreachable", detail=str(reason))
    except Exception as e:  # http.client.HTTPException and friends: a broken peer
        return Outcome("unreachable", detail=f"{type(e).__name__}: {e}")
    if status >= 300:
        return Outcome("rejected", status, detail=f"HTTP {status}")
    try:
        parsed = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return Outcome("ok", status, {}, detail="response is not JSON")
    return Outcome("ok", status, parsed if isinstance(parsed, dict) else {})


class Agent:
    """Report loop state; time, sleep and the stop condition are injectable for tests."""

    def __init__(
        self,
        cfg: Cmdline,
        log: Log,
        *,
        no_net: bool = False,
        state_dir: str = STATE_DIR,
        timeout: float = HTTP_TIMEOUT,
        backoff_min: float = 1.0,
        poll: float = 1.0,
        sleep: Callable[[float], object] = time.sleep,
        stopped: Callable[[], bool] = lambda: False,
        agent_start: float | None = None,
        runner: Runner | None = None,
        listen: Callable[[str, float, list[str]], Neighbor | None] = lldp.listen,
        efi: str = firmware.EFI,
    ) -> None:
        self.cfg = cfg
        self.servers = Servers(cfg.servers)
        self.runner = runner
        if runner is not None:
            runner.authorization = node_authorization(Identity(cfg.node, cfg.token))
            runner.use(self.servers.current)
        self.log = log
        self.no_net = no_net
        self.state_dir = state_dir
        self.state_path = os.path.join(state_dir, "agent-state.json")
        self.timeout = timeout
        self.backoff_min = backoff_min
        self.poll = poll
        self.sleep = sleep
        self.stopped = stopped
        self.heartbeat = cfg.heartbeat
        self.boot_id = boot_id()
        self.secure_boot = firmware.secure_boot(efi)  # the firmware's word: fixed for a boot
        said = {True: "on", False: "off", None: "unknown (UEFI variables unreadable)"}
        log(f"Secure Boot {said[self.secure_boot]}")
        self.seq = 0
        self.hello_done = False
        self.timeline: dict[str, float | None] = {
            **dict.fromkeys(Milestone),
            Milestone.AGENT_START: uptime() if agent_start is None else agent_start,
        }
        self.listen = listen
        self.lldp: Lldp | None = None  # the neighbour as reported
        self.lldp_ignored = 0
        self._ended = threading.Event()
        self.nic: Nic | None = None
        self.sent: dict[str, object] = {}  # observations in the last accepted report
        self.answer: Answer | None = None  # the last one the server sent
        self._answered_by = ""  # the server that sent it (its beat offer is for that one)
        self._beat_misses = 0  # datagrams unanswered in a row, under the offered key
        self._failing = ""  # kind of the current failure streak, "" while all is well
        self._answer_problem = ""  # the last answer that broke the contract, said once
        self._since = 0.0
        self._failures = 0
        self._backoff = backoff_min
        self._none_answers = False  # said that no server answers, in this run of failures
        self._load_state()

    # -- state that survives an agent restart within one boot (kept on tmpfs) --

    def _load_state(self) -> None:
        try:
            with open(self.state_path, encoding="utf-8") as f:
                st = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(st, dict) or st.get("boot_id") != self.boot_id:
            return
        node, token = st.get("node"), st.get("token")
        saved = isinstance(node, str) and node and isinstance(token, str)
        if saved and (node, token) != (self.cfg.node, self.cfg.token):
            was = self.cfg.node  # the command line still names the machine as it booted
            self._take_identity(node, token)
            self.log(f"continuing as {node}, the identity adopted in this boot (was {was})")
        if isinstance(st.get("lldp"), dict):
            try:
                self.lldp = decode(Lldp, st["lldp"], "saved lldp")
            except ContractError:
                self.lldp = None
        self.lldp_ignored = int(st.get("lldp_ignored", 0))
        self.seq = int(st.get("seq", 0))
        self.hello_done = bool(st.get("hello_done"))
        tl = st.get("timeline")
        if isinstance(tl, dict):
            for key in self.timeline:
                if isinstance(tl.get(key), int | float):
                    self.timeline[key] = float(tl[key])
        self.log(f"restarted in the same boot: continuing at seq {self.seq}")

    def _save_state(self) -> None:
        st = {
            "boot_id": self.boot_id,
            "node": self.cfg.node,
            "token": self.cfg.token,
            "seq": self.seq,
            "hello_done": self.hello_done,
            "timeline": self.timeline,
            "lldp": encode(self.lldp),
            "lldp_ignored": self.lldp_ignored,
        }
        try:
            os.makedirs(os.path.dirname(self.state_path), exist_ok=True)
            tmp = self.state_path + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the token
            with open(fd, "w", encoding="utf-8") as f:
                json.dump(st, f)
            os.replace(tmp, self.state_path)
        except OSError:
            pass

    # -- observation and reporting --

    def bring_up_network(self) -> None:
        if self.no_net:
            return
        self.nic = Nic(self.cfg.bootif, self.cfg.node, self.log, uptime, run_dir=self.state_dir)
        self.nic.bring_up(self.sleep)
        if self.timeline[Milestone.NIC_UP] is None:
            self.timeline[Milestone.NIC_UP] = self.nic.nic_up
        if self.timeline[Milestone.IP_ACQUIRED] is None:
            self.timeline[Milestone.IP_ACQUIRED] = self.nic.ip_acquired

    def observe(self) -> dict[str, object]:
        """Facts whose change triggers an immediate report."""
        if self.nic is not None:
            mac, ip = self.nic.mac, self.nic.address()
        else:
            url = urllib.parse.urlsplit(self.servers.current)
            mac, ip = self.cfg.bootif, source_address(url.hostname or "", url.port or 80)
        busy = "busy" if os.path.exists(os.path.join(self.state_dir, BUSY)) else "free"
        facts = {"mac": mac, "ip": ip, "hostname": socket.gethostname(), "busy": busy}
        heard = self.lldp  # the switch port: where the node is plugged in, not when it was heard
        facts["lldp"] = (heard.chassis_id, heard.port_id) if heard else None
        image = self.image()
        facts["image"] = (image.state, image.digest, image.error)
        facts["files"] = self.runner.files() if self.runner is not None else None
        return facts

    def image(self) -> ImageStatus:
        return self.runner.report() if self.runner is not None else ImageStatus()

    def body(self, obs: dict[str, object], event: Event) -> Report:
        return Report(
            node=self.cfg.node,
            token=self.cfg.token,
            mac=str(obs["mac"]),
            ip=str(obs["ip"]),
            hostname=str(obs["hostname"]),
            boot_id=self.boot_id,
            seq=self.seq,
            event=event,
            busy=obs["busy"] == "busy",
            uptime=uptime(),
            timeline=dict(self.timeline),
            lldp=self.lldp,
            lldp_ignored=self.lldp_ignored,
            agent_version=layerpy.__version__,
            image=self.image(),
            files=self.runner.files() if self.runner is not None else FilesStatus(),
            persist=self.runner.persist if self.runner is not None else None,
            secure_boot=self.secure_boot,
            platform=PLATFORM,
        )

    def report(self, obs: dict[str, object]) -> Outcome:
        if not self.hello_done:
            event = Event.HELLO
            self.timeline[Milestone.HELLO] = uptime()
        elif obs != self.sent:
            event = Event.CHANGE
        else:
            event = Event.HEARTBEAT
            if self._beat():
                self._save_state()
                return Outcome("ok")
        self.seq += 1
        server = self.servers.current
        out = post_json(server + REPORT_PATH, encode(self.body(obs, event)), self.timeout)
        if out.kind == "ok":
            self.sent = obs
            answer = self._read_answer(out.body)
            self._answered_by = server
            if event == Event.HELLO:
                self.hello_done = True
                self.log(
                    f"hello accepted by {server} (seq {self.seq}, ip {obs['ip'] or '-'},"
                    f" heartbeat {self.heartbeat:g} s)"
                )
            elif event == Event.CHANGE:
                self.log(f"reported change: ip {obs['ip'] or '-'}, {obs['busy']}")
            if out.detail:
                self.log(f"server answered oddly: {out.detail}")
            if answer is not None and answer.identity is not None:
                self._adopt(answer.identity)  # last: a new identity undoes hello_done
        self._save_state()
        return out

    def _beat(self) -> bool:
        """An unchanged heartbeat as one datagram to the server that offered it (protocol
        1.4, ``layerpy.proto.beat``): True when the server took it; False when the report
        goes by HTTP (no offer, no reply, or the server wants a full report)."""
        offer = self.answer.beat if self.answer is not None else None
        server = self.servers.current
        if offer is None or server != self._answered_by or self._beat_misses >= BEAT_MISSES:
            return False
        key = bytes.fromhex(offer.key)
        self.seq += 1
        verdict = None
        try:
            host = urllib.parse.urlsplit(server).hostname or ""
            found = socket.getaddrinfo(host, offer.port, 0, socket.SOCK_DGRAM)
            family, kind, _, _, address = found[0]
            with socket.socket(family, kind) as sock:
                sock.connect(address)  # replies from elsewhere never reach this socket
                sock.send(beat.beat(key, self.cfg.node, self.seq, uptime()))
                deadline = time.monotonic() + BEAT_WAIT
                while verdict is None and (left := deadline - time.monotonic()) > 0:
                    sock.settimeout(left)
                    verdict = beat.read_reply(key, self.seq, sock.recv(64))
        except OSError:  # no reply in time, or no route: the report goes by HTTP
            pass
        if verdict is None:
            self._beat_misses += 1
            if self._beat_misses == BEAT_MISSES:
                self.log(f"heartbeat datagrams to {server} (udp {offer.port}) unanswered: "
                         "reporting every heartbeat over HTTP")  # fmt: skip
            return False
        self._beat_misses = 0
        return verdict == beat.Verdict.OK

    def _read_answer(self, body: object) -> Answer | None:
        """Apply the server's answer; one that breaks the contract is said once, ignored."""
        try:
            answer = Answer.from_json(body)
        except ContractError as error:
            problem = str(error)
            if isinstance(error, ProtocolMismatch):
                problem += "; keeping the current image and heartbeat"
            if problem != self._answer_problem:
                self.log(problem)
            self._answer_problem = problem
            return None
        self._answer_problem = ""
        if answer.beat != (self.answer.beat if self.answer is not None else None):
            self._beat_misses = 0  # a new key (a restarted or another server): try again
        self.answer = answer
        if answer.heartbeat != self.heartbeat:
            self.log(f"heartbeat is now {answer.heartbeat:g} s (from server)")
            self.heartbeat = answer.heartbeat
        if answer.servers is not None:
            if self.servers.update(answer.servers):
                self.log(f"servers are now {', '.join(answer.servers)} (from server)")
            self._follow()
        if self.runner is not None:
            self.runner.want(answer.image, answer.files)
        return answer

    # -- LLDP: which switch port this node is plugged into --

    def _listen_lldp(self, ifname: str) -> None:
        """Listen for the switch for ever (one round per ``lldp_wait``): a slow switch or a
        cable moved to another port is still reported; a failure is logged once, retried."""
        wait = self.cfg.lldp_wait
        failing = ""
        told_none = False
        while not (self.stopped() or self._ended.is_set()):
            ignored: list[str] = []
            try:
                heard = self.listen(ifname, wait, ignored)
            except OSError as e:
                if str(e) != failing:
                    failing = str(e)
                    self.log(f"cannot listen for LLDP on {ifname or '?'}: {e}; retrying")
                self.sleep(wait)
                continue
            failing = ""
            if ignored and not self.lldp_ignored:
                self.log(f"ignoring malformed LLDP frames on {ifname}: {ignored[0]}")
            self.lldp_ignored += len(ignored)
            if heard is not None:
                self._heard(heard, ifname)
            elif self.lldp is None and not told_none:
                told_none = True
                self.log(f"no LLDP neighbour on {ifname} within {wait:g} s; still listening")

    def _heard(self, heard: Neighbor, ifname: str) -> None:
        old = self.lldp
        heard_at = uptime()
        if old and (old.chassis_id, old.port_id) == (heard.chassis_id, heard.port_id):
            heard_at = old.heard_at or heard_at  # same port: since when we know it
        else:
            self.log(
                f"LLDP on {ifname}: switch {heard.system_name or heard.chassis_id},"
                f" port {heard.port_id} (at uptime {heard_at:.2f} s)"
            )
        self.lldp = Lldp(
            chassis_id=heard.chassis_id,
            port_id=heard.port_id,
            chassis_subtype=heard.chassis_subtype,
            port_subtype=heard.port_subtype,
            system_name=heard.system_name,
            port_description=heard.port_description,
            ttl=heard.ttl,
            heard_at=heard_at,
        )

    # -- a new identity from the server (a discovered machine bound to a node) --

    def _take_identity(self, node: str, token: str) -> None:
        self.cfg.node, self.cfg.token = node, token
        self.log.node = node
        if self.runner is not None:
            self.runner.hostname = node  # for the next container it starts
            self.runner.authorization = node_authorization(Identity(node, token))

    def _adopt(self, identity: Identity) -> None:
        """Become the node the server names: new name, token, hostname and address, then a
        hello as that node. The report URL stays; seq and timeline go on."""
        node, token = identity.node, identity.token
        if (node, token) == (self.cfg.node, self.cfg.token):
            return
        self.log(f"now {node} (was {self.cfg.node})")
        self._take_identity(node, token)
        self.timeline[Milestone.IDENTITY] = uptime()
        self.hello_done = False
        if self.nic is not None:  # the machine is ours to rename and re-address
            try:
                with open(HOSTNAME, "w", encoding="ascii") as f:
                    f.write(node)
            except (OSError, ValueError) as e:
                self.log(f"cannot set the hostname to {node}: {e}")
            self.nic.redo_dhcp(node, self.sleep)

    def _next_delay(self, out: Outcome) -> float:
        """Seconds until the next report; logs transitions, not every failed attempt."""
        if out.kind != "unreachable":  # an answer, even a refusal: this server is up
            self.servers.answered()
            self._none_answers = False
        if out.kind == "ok":
            if self._failing == "unreachable":
                self.log(
                    f"server reachable again after {uptime() - self._since:.1f} s"
                    f" ({self._failures} failed reports)"
                )
            elif self._failing:
                self.log(f"server accepts reports again (seq {self.seq})")
            self._failing, self._failures, self._backoff = "", 0, self.backoff_min
            # nodes powered on together drift apart instead of reporting in step forever
            return self.heartbeat * random.uniform(1 - SPREAD, 1 + SPREAD)
        self._failures += 1
        if out.kind != self._failing:
            self._failing, self._since = out.kind, uptime()
            if out.kind == "unreachable":
                if len(self.servers.urls) < 2:  # with others, the move says it
                    self.log(f"server unreachable since uptime {self._since:.1f} s: {out.detail}")
            elif out.kind == "forbidden":
                self.log(
                    f"server refused our token ({out.detail}); retrying every {self.heartbeat:g} s"
                )
            else:
                self.log(f"server rejected the report ({out.detail}); retrying")
        if out.kind != "unreachable":
            return self.heartbeat
        self._move(out.detail)
        # capped exponential backoff, jittered: a thousand nodes that lost the server at
        # once must not come back at once
        delay = min(self._backoff, self.heartbeat) * random.uniform(0.5, 1.0)
        self._backoff = min(self._backoff * 2, self.heartbeat)
        return delay

    def _follow(self) -> None:
        """Report to the server the answer lists first (the node's owner) from now on."""
        was = self.servers.current
        lead = self.servers.lead()
        if lead is None:
            return
        self.log(f"moving from {was} to {lead}: the server names it first (it owns this node)")
        if self.runner is not None:
            self.runner.use(lead)

    def _move(self, detail: str) -> None:
        """Report to the next server round the list: one line per move, and one when every
        server failed (then the agent goes on round the list quietly)."""
        was = self.servers.current
        move = self.servers.failed()
        if move is None:
            return
        following, new = move
        if new:
            self.log(f"server {was} stopped answering ({detail}); moving to {following}")
        elif not self._none_answers:
            self._none_answers = True
            self.log(f"no server answers since uptime {self._since:.1f} s; trying each in turn")
        if self.runner is not None:
            self.runner.use(following)

    def run(self) -> None:
        """Bring up the network, listen for LLDP aside, then report until ``stopped()``."""
        self.bring_up_network()
        if self.cfg.lldp_wait > 0:
            ifname = self.nic.name if self.nic else (pick_interface(self.cfg.bootif) or ("",))[0]
            threading.Thread(target=self._listen_lldp, args=(ifname,), daemon=True).start()
        try:
            self._report_loop()
        finally:
            self._ended.set()  # the listener ends too: after a crash, main() starts anew

    def _report_loop(self) -> None:
        self._failing, self._since, self._failures = "", 0.0, 0
        self._backoff = self.backoff_min
        last_dhcp_check = time.monotonic()
        while not self.stopped():
            obs = self.observe()
            sent_at = time.monotonic()  # the interval runs from send to send
            out = self.report(obs)
            delay = self._next_delay(out)
            if out.kind == "ok" and not self.hello_done:
                delay = 0.0  # a new identity says hello at once
            deadline = sent_at + delay
            while not self.stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.sleep(min(left, self.poll))
                if self.runner is not None:
                    self.runner.tick()
                if self.nic is not None and time.monotonic() - last_dhcp_check > 10:
                    last_dhcp_check = time.monotonic()
                    self.nic.keep_dhcp()
                if self.hello_done and not self._failing and self.observe() != self.sent:
                    break  # report the change now


def load_config(log: Log, sleep: Callable[[float], object], stopped: Callable[[], bool]) -> Cmdline:
    """Read the command line until it names a server and a node; complain slowly."""
    while True:
        try:
            cfg = read_cmdline()
        except OSError as e:
            log(f"cannot read the kernel command line: {e}; retrying in {CONFIG_RETRY:g} s")
        else:
            log.node = cfg.node or log.node
            if cfg.ok:
                for problem in cfg.problems:
                    log(f"warning: {problem}")
                return cfg
            log(
                "cannot start: " + "; ".join(cfg.problems)
                + f" on the kernel command line; retrying in {CONFIG_RETRY:g} s"
            )  # fmt: skip
        if stopped():
            raise SystemExit(1)
        sleep(CONFIG_RETRY)


def main() -> None:
    """Entry point of ``python -m layerpy.agent``: never returns while the node is up."""
    start = uptime()
    log = Log()
    no_net = os.environ.get("LAYERPY_NO_NET") == "1"
    log(f"layerpy agent {layerpy.__version__} starting at uptime {start:.2f} s (pid {os.getpid()})")
    while True:
        try:
            cfg = load_config(log, time.sleep, lambda: False)
            log(f"server {', '.join(cfg.servers)}, boot interface {cfg.bootif or 'first Ethernet'}")
            state_dir = os.environ.get("LAYERPY_STATE_DIR", STATE_DIR)
            runner = Runner(state_dir, log, cfg.node, persist_disk=cfg.persist)
            Agent(
                cfg, log, no_net=no_net, state_dir=state_dir, agent_start=start, runner=runner
            ).run()
        except KeyboardInterrupt:
            log("interrupted")
            raise SystemExit(130) from None
        except Exception:
            for line in traceback.format_exc().rstrip().splitlines():
                log(line)
            log("agent loop crashed; restarting in 10 s")
            time.sleep(10)
