"""DHCP under load: ISC Kea 2.2 against layerpy, same client, same network, same run.

Both servers run one after the other inside a fresh pair of network namespaces joined by
a veth (never on a host interface), the server pinned to CPU 0 and ISC perfdhcp to CPU 1.
perfdhcp acts as a relay agent (`-l RELAY`: giaddr = RELAY, replies come back unicast to
port 67), so no broadcast is involved and both servers pick their subnet by giaddr. It
plays 100 000 clients (`-R`), MACs 52:54:00:00:00:00 + i: perfdhcp 2.2 counts i up from 0
in every run (it is sequential, not random; each capture below checks it and says so).
Two modes, each against both servers:

- static: 100 000 known machines. Kea has one host reservation per MAC (no pool); layerpy
  a node file of four groups of 25 000 with MAC ranges and host-list addresses. Machine i
  gets the same address from both.
- pool: unknown machines from a pool of 262 000 addresses, every lease written to disk
  (Kea: memfile, persist, no LFC; layerpy: network.discover, leases.jsonl). Each load run
  starts the server afresh on an empty lease file, so the clients are new to it.

Both log at INFO, their default, to a file; Kea runs single-threaded, as layerpy's loop.
Measured, per mode and server: start-up (from exec to "DHCP4_STARTED" / "layerpy.server:
serving", the median of the latency rounds' starts), RSS after the last load run;
DISCOVER->OFFER latency at 3000 DISCOVER/s, from one tcpdump on the server's end of the
veth (kernel timestamps at the same capture point for both), matched by (chaddr, xid), as
p50 and p99 (static mode also checks each OFFER's address). Latency is taken in rounds
that alternate the servers (Kea, layerpy, then layerpy, Kea, ...), each a fresh start, a
1 s warm-up at 500/s (Kea with 100 000 reservations stalls ~30 ms on its first packet) and
a 10 s capture; p50 and p99 are over all rounds' DISCOVERs. This machine is a VM whose CPU
now and then runs at a fraction of its speed for ~50 ms (both servers' captures show it,
at random moments), which alone can double one 10 s capture's p99: rounds that
alternate give both servers the same chance of it. Then saturation: the best completed
4-way exchange rate perfdhcp reports over 10 s runs at rising offered rates (1000 to
24000/s).
Run as root: `.venv/bin/python bench/dhcp_kea.py [--quick] [--mode static|pool] [--keep]
[--rates R1,R2,...] [--rounds N]` (--quick: 3 s runs, 4 rates, one latency round; --keep: keep
logs, configs and captures for a look; --rates: these offered rates instead, e.g. twice a
server's saturation to see whether its completed rate levels off; --rounds: latency rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import pairwise
from pathlib import Path

import dpkt

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from netns import Link, Netns  # noqa: E402
from nodefile import BASE_MAC, BOOT_SECTIONS, big_groups, big_ip, big_mac, write_boot_files  # noqa: E402
from packages import install_missing  # noqa: E402

CLIENTS = 100_000
LATENCY_RATE = 3000
LATENCY_ROUNDS = 3  # captures per server, the servers alternating
WARM_UP = (500, 1)  # rate, seconds: first-packet costs stay out of the latency figures
RATES = (1000, 2000, 3000, 4000, 6000, 8000, 12000, 16000, 24000)
QUICK_RATES = (2000, 6000, 12000, 24000)
SERVER_CPU, CLIENT_CPU = "0", "1"
LEASE_TIME = 300
LINK_IF = "lpsrv0"  # Link's name for the server's end of the veth
LAYERPY = Path(sys.executable).with_name("layerpy")
PACKAGES = {"kea-dhcp4": "kea-dhcp4-server", "perfdhcp": "kea-admin", "tcpdump": "tcpdump"}


@dataclass(frozen=True)
class Mode:
    name: str
    subnet: str
    prefix: int
    server: str  # the server's end of the veth
    relay: str  # perfdhcp's end: the giaddr of every request
    pool: tuple[str, str] | None = None  # pool mode: addresses for unknown machines

    @property
    def fresh(self) -> bool:
        """Each load run starts the server on an empty lease file (new clients only)."""
        return self.pool is not None


STATIC = Mode("static", "10.2.0.0/15", 15, "10.3.255.253", "10.3.255.254")
POOL = Mode("pool", "10.4.0.0/14", 14, "10.7.255.253", "10.7.255.254",
            ("10.4.0.10", "10.7.255.250"))  # fmt: skip


# -- the servers' configurations -------------------------------------------------------------


def kea_config(mode: Mode, interface: str, leases: Path) -> dict:
    subnet: dict = {"id": 1, "subnet": mode.subnet}
    if mode.pool:
        subnet["pools"] = [{"pool": f"{mode.pool[0]} - {mode.pool[1]}"}]
    else:
        subnet["reservations"] = [
            {"hw-address": big_mac(i), "ip-address": big_ip(i)} for i in range(CLIENTS)
        ]
    return {
        "Dhcp4": {
            # a relayed request comes unicast to the server's address: a plain UDP socket
            "interfaces-config": {"interfaces": [interface], "dhcp-socket-type": "udp"},
            "lease-database": {
                "type": "memfile",
                "persist": True,
                "name": str(leases),
                "lfc-interval": 0,
            },
            "valid-lifetime": LEASE_TIME,
            "host-reservation-identifiers": ["hw-address"],
            "multi-threading": {"enable-multi-threading": False},  # one CPU, as layerpy's loop
            "subnet4": [subnet],
            "loggers": [
                {
                    "name": "kea-dhcp4",
                    "output_options": [{"output": "stdout"}],
                    "severity": "INFO",
                }
            ],
        }
    }


def layerpy_config(mode: Mode, interface: str) -> str:
    text = [
        f'[server]\ninterface = "{interface}"\naddress = "{mode.server}"\n'
        'dhcp = "authoritative"\ndhcp_probe = 0\nstate_dir = "state"\n',
        "[api]\nlisten = []\n",
        f'[network]\nsubnet = "{mode.subnet}"\nlease_time = {LEASE_TIME}\n',
    ]
    if mode.pool:
        text[-1] += f'pool = "{mode.pool[0]}-{mode.pool[1]}"\ndiscover = true\n'
    text += [BOOT_SECTIONS, f'[switches.bench]\nrelay = "{mode.relay}"\n']
    if not mode.pool:
        text.append(big_groups(CLIENTS))
    return "\n".join(text)


# -- installing and running --------------------------------------------------------------------


def ensure_tools() -> None:
    """Install what is missing, with policy-rc.d forbidding any package to start a service,
    and leave Kea's service disabled (it is only ever run here, by hand, in a namespace)."""
    install_missing(PACKAGES)
    if shutil.which("systemctl"):  # disables it even where systemd does not run (no --now then)
        cmd = ["systemctl", "disable", "--now", "kea-dhcp4-server"]
        subprocess.run(cmd, capture_output=True, check=False)


@dataclass
class Server:
    """One running server: its process (the server itself: ip and taskset exec it)."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float  # seconds from exec to ready

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kib = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]
        return kib / 1024

    def alive(self) -> None:
        if self.proc.poll() is not None:
            sys.exit(f"{self.name} died (exit {self.proc.returncode}); see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start(ns: Netns, name: str, argv: list[str], log: Path, ready: str, **kwargs) -> Server:
    """Start a server pinned to SERVER_CPU, logging to `log`; return once it says `ready`."""
    with log.open("ab") as out:
        began = time.monotonic()
        proc = ns.popen(["taskset", "-c", SERVER_CPU, *argv], stdout=out, stderr=out, **kwargs)
    deadline, seen = began + 300, log.stat().st_size
    while True:
        with log.open("rb") as text:
            text.seek(seen)
            if ready.encode() in text.read():
                return Server(name, proc, log, time.monotonic() - began)
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:]
            sys.exit(f"{name} did not start (exit {proc.poll()}):\n{tail}")
        time.sleep(0.01)


def start_kea(ns: Netns, mode: Mode, tmp: Path) -> Server:
    leases = tmp / "kea-leases4.csv"
    for old in tmp.glob("kea-leases4.csv*"):
        old.unlink()
    conf = tmp / "kea.json"
    if not conf.exists():
        conf.write_text(json.dumps(kea_config(mode, LINK_IF, leases), indent=1))
    env = {**os.environ, "KEA_LOCKFILE_DIR": str(tmp), "KEA_PIDFILE_DIR": str(tmp)}
    argv = ["kea-dhcp4", "-c", str(conf)]
    return start(ns, "kea", argv, tmp / "kea.log", "DHCP4_STARTED", env=env)


def start_layerpy(ns: Netns, mode: Mode, tmp: Path) -> Server:
    conf = tmp / "nodes.toml"
    if not conf.exists():
        write_boot_files(tmp)
        conf.write_text(layerpy_config(mode, LINK_IF))
        checked = ns.run(str(LAYERPY), "check", "-c", str(conf), check=False, timeout=600)
        if checked.returncode:
            sys.exit(f"layerpy check refused {conf}:\n{checked.stdout[-3000:]}{checked.stderr}")
    state = tmp / "state"
    shutil.rmtree(state, ignore_errors=True)  # a fresh start: no leases, no bindings
    argv = [str(LAYERPY), "serve", "-c", str(conf)]
    return start(ns, "layerpy", argv, tmp / "layerpy.log", "layerpy.server: serving")


STARTERS = {"kea": start_kea, "layerpy": start_layerpy}


# -- load and measurement ----------------------------------------------------------------------


@dataclass
class Load:
    """What perfdhcp reports for one run."""

    offered: int  # the rate asked for
    seconds: float
    rate: float  # completed 4-way exchanges per second
    discovers: int
    offers: int
    acks: int

    @property
    def sent_rate(self) -> float:
        return self.discovers / self.seconds

    @property
    def drop_pct(self) -> float:
        """DISCOVERs whose 4-way exchange did not complete."""
        return 100 * (1 - self.acks / self.discovers) if self.discovers else 100.0


def perfdhcp(link: Link, mode: Mode, rate: int, seconds: float) -> Load:
    argv = [
        "taskset", "-c", CLIENT_CPU, "perfdhcp", "-4", "-l", mode.relay,
        "-r", str(rate), "-p", str(seconds), "-R", str(CLIENTS),
        "-b", f"mac={big_mac(0)}", mode.server,
    ]  # fmt: skip
    done = link.client.run(*argv, check=False, timeout=seconds + 60)
    if done.returncode not in (0, 3):  # 3: some exchanges did not complete
        sys.exit(f"perfdhcp failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    out = done.stdout
    found = re.search(r"Rate: ([\d.]+) 4-way exchanges/second", out)
    sections = re.findall(
        r"Statistics for: ([\w-]+)\*+\nsent packets: (\d+)\nreceived packets: (\d+)", out
    )
    counts = {name: (int(sent), int(received)) for name, sent, received in sections}
    if found is None or set(counts) != {"DISCOVER-OFFER", "REQUEST-ACK"}:
        sys.exit(f"cannot read perfdhcp's report:\n{out}")
    discovers, offers = counts["DISCOVER-OFFER"]
    acks = counts["REQUEST-ACK"][1]
    return Load(rate, seconds, float(found.group(1)), discovers, offers, acks)


@dataclass
class Latency:
    discovers: int = 0
    matched: int = 0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    kernel_drops: str = "?"
    wrong: int = 0  # static mode: OFFERs whose yiaddr is not the machine's address
    macs: str = ""  # what the capture shows of perfdhcp's MACs
    delays: list[float] = field(default_factory=list, repr=False)

    def rank(self) -> None:
        """p50 and p99 of the delays."""
        if self.delays:
            ranked = sorted(self.delays)
            self.p50_ms = 1000 * ranked[len(ranked) // 2]
            self.p99_ms = 1000 * ranked[min(len(ranked) - 1, int(len(ranked) * 0.99))]

    @classmethod
    def pooled(cls, rounds: list[Latency]) -> Latency:
        """All rounds' DISCOVERs as one capture."""
        result = cls(
            discovers=sum(r.discovers for r in rounds),
            matched=sum(r.matched for r in rounds),
            kernel_drops="+".join(r.kernel_drops for r in rounds),
            wrong=sum(r.wrong for r in rounds),
            delays=[d for r in rounds for d in r.delays],
        )
        result.rank()
        return result


def capture(link: Link, mode: Mode, pcap: Path, seconds: float) -> tuple[Load, Latency]:
    """perfdhcp at LATENCY_RATE while tcpdump records port 67 on the server's veth."""
    err = pcap.with_name(f"{pcap.stem}-tcpdump.txt")
    argv = [
        "taskset", "-c", CLIENT_CPU, "tcpdump", "-i", LINK_IF, "-n", "-s", "0", "-Z", "root",
        "-B", "32768", "--time-stamp-precision", "nano", "-w", str(pcap), "udp port 67",
    ]  # fmt: skip
    with err.open("wb") as out:
        dump = link.server.popen(argv, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 10
    while b"listening on" not in err.read_bytes():
        if dump.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"tcpdump did not start: {err.read_text()}")
        time.sleep(0.01)
    try:
        load = perfdhcp(link, mode, LATENCY_RATE, seconds)
        time.sleep(1.5)  # tcpdump hands packets over per block, at least once a second
    finally:
        if dump.poll() is None:
            os.killpg(dump.pid, signal.SIGINT)
        dump.wait(10)
    latency = delays(pcap, mode.pool is None)
    found = re.search(r"(\d+) packets? dropped by kernel", err.read_text())
    latency.kernel_drops = found.group(1) if found else "?"
    return load, latency


def delays(pcap: Path, static: bool) -> Latency:
    """DISCOVER in to OFFER out per (chaddr, xid), from the capture's kernel timestamps;
    also what the DISCOVERs show of perfdhcp's MACs, and (static) whether each OFFER
    carries the machine's own address."""
    asked: dict[bytes, Decimal] = {}  # dpkt gives nanosecond stamps as Decimal
    order: list[int] = []
    result = Latency()
    with pcap.open("rb") as f:
        for stamp, frame in dpkt.pcap.Reader(f):
            ip = 14  # Ethernet
            udp = ip + (frame[ip] & 0x0F) * 4
            dhcp = frame[udp + 8 :]
            kind = message_type(dhcp)
            key = dhcp[4:8] + dhcp[28:34]  # xid, chaddr
            if dhcp[0] == 1 and kind == 1:
                asked.setdefault(key, stamp)
                order.append(int.from_bytes(dhcp[28:34]) - BASE_MAC)
            elif dhcp[0] == 2 and kind == 2 and key in asked:
                result.delays.append(float(stamp - asked.pop(key)))
                index = int.from_bytes(dhcp[28:34]) - BASE_MAC
                if static and socket.inet_ntoa(dhcp[16:20]) != big_ip(index):
                    result.wrong += 1
    result.discovers, result.matched = len(order), len(result.delays)
    result.rank()
    if order:
        steps = sum(b == (a + 1) % CLIENTS for a, b in pairwise(order))
        inside = all(0 <= i < CLIENTS for i in order)
        result.macs = (
            f"MAC index {min(order)}..{max(order)} ({len(set(order))} distinct, "
            f"{'all' if inside else 'NOT all'} in [0, {CLIENTS})), "
            f"{steps} of {len(order) - 1} consecutive DISCOVERs step by +1"
        )
    return result


def message_type(dhcp: bytes) -> int | None:
    """Option 53 of a DHCP message (options start after the magic cookie at 236)."""
    at = 240
    while at < len(dhcp) - 1:
        code = dhcp[at]
        if code == 255:
            return None
        if code == 0:
            at += 1
            continue
        if code == 53:
            return dhcp[at + 2]
        at += 2 + dhcp[at + 1]
    return None


@dataclass
class Result:
    startups: list[float] = field(default_factory=list)
    rss_mb: float = 0.0
    steps: list[Load] = field(default_factory=list)
    rounds: list[tuple[Load, Latency]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    on_disk: int = 0  # lease records in the server's file after the last run

    @property
    def saturation(self) -> float:
        return max((step.rate for step in self.steps), default=0.0)

    @property
    def startup(self) -> float:
        return sorted(self.startups)[len(self.startups) // 2] if self.startups else 0.0

    @property
    def latency(self) -> Latency:
        return Latency.pooled([latency for _, latency in self.rounds])

    @property
    def overloaded(self) -> bool:
        """More than 1 % of the exchanges at LATENCY_RATE were lost in some round."""
        return any(load.drop_pct > 1 for load, _ in self.rounds)


def latency_rounds(
    link: Link, mode: Mode, tmp: Path, seconds: int, rounds: int, results: dict[str, Result]
) -> None:
    """Each round: each server started afresh, warmed up, captured at LATENCY_RATE."""
    for round_ in range(rounds):
        names = list(STARTERS) if round_ % 2 == 0 else list(reversed(STARTERS))
        for name in names:
            result = results[name]
            server = STARTERS[name](link.server, mode, tmp / name)
            result.startups.append(server.started)
            try:
                perfdhcp(link, mode, *WARM_UP)
                load, lat = capture(link, mode, tmp / name / f"{name}-{round_}.pcap", seconds)
                server.alive()
            finally:
                server.stop()
            result.rounds.append((load, lat))
            print(
                f"  {name}: ready in {server.started:.2f} s; {LATENCY_RATE}/s -> "
                f"{load.rate:.0f}/s completed, DISCOVER->OFFER p50 {lat.p50_ms:.3f} ms p99 "
                f"{lat.p99_ms:.3f} ms ({lat.matched} of {lat.discovers} matched, tcpdump "
                f"kernel drops {lat.kernel_drops})"
                + (f", {lat.wrong} OFFERs with the wrong address" if mode.pool is None else ""),
                flush=True,
            )
            if round_ == 0:
                print(f"  {name}: perfdhcp {lat.macs}", flush=True)


def saturation(
    link: Link,
    mode: Mode,
    name: str,
    tmp: Path,
    rates: tuple[int, ...],
    seconds: int,
    result: Result,
) -> None:
    """perfdhcp at each offered rate (pool: each on a fresh server and lease file)."""
    starter = STARTERS[name]
    server = starter(link.server, mode, tmp)
    try:
        for rate in rates:
            if mode.fresh and result.steps:
                server.stop()
                server = starter(link.server, mode, tmp)
            load = perfdhcp(link, mode, rate, seconds)
            server.alive()
            result.steps.append(load)
            print(
                f"  {name}: offered {rate:>6}/s sent {load.sent_rate:>8.0f}/s "
                f"completed {load.rate:>8.0f}/s drops {load.drop_pct:5.1f} %",
                flush=True,
            )
        result.rss_mb = server.rss_mb()
    finally:
        server.stop()
    result.on_disk = lease_records(name, tmp)
    print(f"  {name}: {result.on_disk} lease records on disk after the last run", flush=True)
    result.problems = problems(server.log)


def lease_records(name: str, tmp: Path) -> int:
    """Lines in the server's lease file (Kea's CSV less its header, layerpy's journal)."""
    path = tmp / "kea-leases4.csv" if name == "kea" else tmp / "state" / "leases.jsonl"
    if not path.exists():
        return 0
    lines = path.read_bytes().count(b"\n")
    return lines - 1 if name == "kea" else lines


def problems(log: Path) -> list[str]:
    """The distinct lines of a server's log at WARNING or worse, with how often each came
    (both servers print the level; a time stamp and Kea's thread id are left out)."""
    seen: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        found = re.search(r" (WARN|WARNING|ERROR|CRITICAL|FATAL) +(.*)", line)
        if found and "DHCP4_MULTI_THREADING_INFO" not in line:  # Kea says so at WARN
            text = re.sub(r"/\d+\.\d+\]", "]", f"{found.group(1)} {found.group(2)}")
            seen[text] = seen.get(text, 0) + 1
    return [f"{count}x {text}" for text, count in seen.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s runs, 4 rates, one latency round")
    parser.add_argument("--mode", choices=("static", "pool"), help="only this mode")
    parser.add_argument("--keep", action="store_true", help="keep logs, configs and captures")
    parser.add_argument("--rates", help="offered rates for saturation, e.g. 16000,32000,40000")
    parser.add_argument("--rounds", type=int, help="latency rounds per server (0: none)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: namespaces, tcpdump and port 67")
    seconds, rates, rounds = (3, QUICK_RATES, 1) if args.quick else (10, RATES, LATENCY_ROUNDS)
    if args.rates:
        rates = tuple(int(rate) for rate in args.rates.split(","))
    if args.rounds is not None:
        rounds = args.rounds
    ensure_tools()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that teardown runs
    began = time.monotonic()
    results: dict[str, dict[str, Result]] = {}  # mode -> server -> what was measured
    modes = [mode for mode in (STATIC, POOL) if args.mode in (None, mode.name)]
    tmpdir = Path(tempfile.mkdtemp(prefix="lpbench-"))
    if args.keep:
        print(f"logs, configs and captures stay in {tmpdir}")
    try:
        for mode in modes:
            print(f"{mode.name}: subnet {mode.subnet}, relay {mode.relay}", flush=True)
            link = Link(f"{mode.server}/{mode.prefix}", f"{mode.relay}/{mode.prefix}")
            tmp, found = tmpdir / mode.name, results.setdefault(mode.name, {})
            for name in STARTERS:
                found[name] = Result()
                (tmp / name).mkdir(parents=True)
            try:
                latency_rounds(link, mode, tmp, seconds, rounds, found)
                for name in STARTERS:
                    saturation(link, mode, name, tmp / name, rates, seconds, found[name])
            finally:
                link.close()
    finally:
        if not args.keep:
            shutil.rmtree(tmpdir)
    report(results, seconds, rounds, time.monotonic() - began)


def report(results: dict[str, dict[str, Result]], seconds: float, rounds: int, took: float) -> None:
    print(
        f"\n{seconds:g} s per run; latency at {LATENCY_RATE} DISCOVER/s over {rounds} "
        f"alternating round(s) per server; took {took:.0f} s"
    )
    print(
        f"{'mode':7} {'server':8} {'start-up s':>10} {'RSS MB':>7} {'saturation/s':>12} "
        f"{'(offered)':>9} {'p50 ms':>8} {'p99 ms':>8} {'matched':>13}  p99 per round"
    )
    overloaded = False
    for mode, name, r in ((m, n, r) for m, found in results.items() for n, r in found.items()):
        lat = r.latency
        best = max(r.steps, key=lambda step: step.rate, default=None)
        mark = "*" if r.overloaded else " "
        overloaded |= r.overloaded
        print(
            f"{mode:7} {name:8} {r.startup:10.2f} {r.rss_mb:7.1f} {r.saturation:12.0f} "
            f"{f'({best.offered})' if best else '':>9} {lat.p50_ms:7.3f}{mark} "
            f"{lat.p99_ms:7.3f}{mark} {f'{lat.matched}/{lat.discovers}':>13}  "
            + " ".join(f"{part.p99_ms:.3f}" for _, part in r.rounds)
        )
    if overloaded:
        print(f"* over capacity at {LATENCY_RATE}/s: more than 1 % of its exchanges were lost,")
        print("  so its latency is mostly time spent queueing")
    for mode, found in results.items():
        ours, theirs = found["layerpy"], found["kea"]
        sat = ours.saturation / theirs.saturation if theirs.saturation else float("nan")
        p99 = ours.latency.p99_ms / theirs.latency.p99_ms if theirs.rounds else float("nan")
        print(f"{mode}: layerpy/Kea saturation {sat:.2f}x, p99 latency {p99:.2f}x")
    for mode, name, r in ((m, n, r) for m, found in results.items() for n, r in found.items()):
        if r.problems:
            print(f"{mode} {name}: warnings and errors in its log:")
            for line in r.problems[:10]:
                print(f"    {line}")


if __name__ == "__main__":
    main()
