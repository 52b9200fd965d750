"""Boot storm: N simulated nodes power on at once (or over a window) against a real
``layerpy serve``, and the same DHCP + TFTP + HTTP part against dnsmasq + nginx, one run.

Two namespaces joined by a veth: the server's (layerpy, pinned to CPU 0) and the nodes'
(bench/storm_client.py, one asyncio process pinned to CPU 1). Each node does what firmware,
iPXE and the minOS do (DORA as a PXE ROM, TFTP of undionly.kpxe, DORA as iPXE, boot script,
kernel, initrd; then DORA as the minOS, the agent's hello and heartbeats, its image with
its token, and a report of the image active). The reference stack serves the first part
(to the initrd) with the same files: dnsmasq (DHCP, TFTP) and nginx (HTTP), pinned to CPU 0
too. Nothing leaves the two namespaces.

Prints the time to every node ready (layerpy) and to every initrd (both stacks, and their
ratio), p50/p99 per phase, failures and retries, the server's CPU seconds and peak RSS, and
the bytes moved. `--kill-at S` kills the server with SIGKILL S seconds into the storm and
starts it again at once (same state directory): every node must still get to the end,
none with another address.

Run: `.venv/bin/python bench/storm.py [--nodes 1000] [--window 0] [--kill-at S]` (as root;
installs nginx-light if missing, disabled at boot and never started outside the bench's
namespace). N is a multiple of 250. For its run it raises the kernel's ARP table limits
(gc_thresh2/3: one table for every namespace) to hold every server's nodes, and puts them
back after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))  # as when run: a test loads this file by its path

from reference import cpu_seconds, nginx_config  # noqa: E402

from etcd import EtcdCluster  # noqa: E402
from netns import Netns, sh, unique_name  # noqa: E402
from oci import build_image  # noqa: E402

LAYERPY = ROOT / ".venv" / "bin" / "layerpy"
PYTHON = ROOT / ".venv" / "bin" / "python"
CLIENT = Path(__file__).with_name("storm_client.py")
SERVER = "10.80.0.1"
IPXE = Path("/usr/lib/ipxe")
PHASES = ("dhcp", "tftp", "dhcp_ipxe", "script", "kernel", "initrd", "dhcp_os", "hello",
          "ready", "image", "active")  # fmt: skip
SERVER_CPU, CLIENT_CPU = "0", "1"
BYSTANDER = "10.81.255.254"  # an address of the nodes' namespace that no node has
NEIGHBOURS = Path("/proc/sys/net/ipv4/neigh/default")


def mac(index: int) -> str:
    return ":".join(f"{b:02x}" for b in (0x525401000000 + index).to_bytes(6))


def ip(index: int) -> str:
    return f"10.81.{index // 250}.{index % 250 + 1}"


class Pair:
    """The server's namespace and the nodes': c0 is a bridge in the nodes' namespace (the
    boot segment), the server's s0 a veth onto it (so are the instances' with --instances)."""

    def __init__(self) -> None:
        self.server, self.nodes = Netns("lpstS"), Netns("lpstC")
        self.nodes.run("ip", "link", "add", "c0", "type", "bridge")
        self.nodes.run("ip", "link", "set", "c0", "up")
        # every node address is the nodes' namespace's own (and answers ARP on c0)
        self.nodes.run("ip", "route", "add", "local", "10.81.0.0/16", "dev", "lo")
        self.nodes.run("ip", "route", "add", "10.80.0.0/16", "dev", "c0")
        self.join(self.server, SERVER)

    def join(self, netns: Netns, address: str) -> None:
        """A veth `s0` from netns, with address, onto the bridge."""
        here, there = unique_name("vs"), unique_name("vc")
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", here, "netns", netns.name)
        sh("ip", "link", "set", there, "netns", self.nodes.name)
        self.nodes.run("ip", "link", "set", there, "master", "c0", "up")
        netns.run("ip", "link", "set", here, "name", "s0")
        netns.run("ip", "addr", "add", f"{address}/15", "dev", "s0")
        netns.run("ip", "link", "set", "s0", "up")

    def close(self) -> None:
        self.nodes.close()
        self.server.close()


@contextmanager
def neighbour_room(entries: int) -> Iterator[int]:
    """The kernel's ARP table with room for `entries` for the bench's run, then as it was.

    The table is one for the whole machine, every namespace's entries counted against
    its limit (gc_thresh3, 1 024 by default); a server on the boot segment needs an entry
    per node it answers by unicast. Each server of the bench stands for a host, which has
    a table of its own: here they share one, and a thousand nodes on two instances, beside
    the one-instance server's entries going stale, overflowed it ("neighbor table
    overflow!" in the kernel's log): the kernel then dropped replies and the nodes'
    broadcasts (their entry evicted, no new one made), and the storm failed. Yields
    the limit in force."""
    limits = {name: NEIGHBOURS / name for name in ("gc_thresh2", "gc_thresh3")}
    before = {name: int(path.read_text()) for name, path in limits.items()}
    raised = {name: max(value, entries) for name, value in before.items()}
    for name, path in limits.items():
        path.write_text(str(raised[name]))
    try:
        yield raised["gc_thresh3"]
    finally:
        for name, path in limits.items():  # unless someone changed it since
            if int(path.read_text()) == raised[name]:
                path.write_text(str(before[name]))


def files(directory: Path) -> tuple[Path, Path]:
    """The minOS kernel and initrd (the built ones, else stand-ins of their size)."""
    built = ROOT / "minos" / "out"
    kernel, initrd = directory / "vmlinuz", directory / "initrd"
    if (built / "vmlinuz").exists() and (built / "initrd").exists():
        shutil.copy(built / "vmlinuz", kernel)
        shutil.copy((built / "initrd").resolve(), initrd)
    else:
        kernel.write_bytes(os.urandom(8_247_232))
        initrd.write_bytes(os.urandom(8_823_021))
    return kernel, initrd


def node_list(directory: Path, count: int) -> Path:
    path = directory / "nodes.txt"
    path.write_text("".join(f"sn{i + 1:05d} {mac(i)}\n" for i in range(count)))
    return path


def layerpy_config(directory: Path, count: int, address: str = SERVER, cluster: str = "") -> Path:
    """The node file; `cluster` is an instance's [cluster] table (the rest is the same)."""
    build_image(directory / "tiny", "tiny", "storm")
    path = directory / "nodes.toml"
    path.write_text(f"""\
[server]
interface = "s0"
address = "{address}"
state_dir = "state"
dhcp_probe = 0
heartbeat = 10

{cluster}

[network]
subnet = "10.80.0.0/15"
lease_time = 3600

[minos]
kernel = "vmlinuz"
initrd = "initrd"
cmdline = "console=ttyS0"

[ipxe]
dir = "{IPXE}"

[images.tiny]
source = "oci-layout:tiny:latest"

[groups.storm]
nodes = "sn[00001-{count:05d}]"
ip = "10.81.[0-{count // 250 - 1}].[1-250]"
mac = "{mac(0)}-{mac(count - 1)}"
image = "tiny"
""")
    return path


def reference(pair: Pair, directory: Path, count: int, kernel: Path, initrd: Path) -> list:
    """dnsmasq + nginx serving the same boot, pinned as layerpy is; their processes."""
    www = directory / "www"
    www.mkdir()
    shutil.copy(kernel, www / "vmlinuz")
    shutil.copy(initrd, www / "initrd")
    (www / "boot.ipxe").write_text(f"#!ipxe\nkernel http://{SERVER}:8080/vmlinuz console=ttyS0\n"
                                   f"initrd http://{SERVER}:8080/initrd\nboot\n")  # fmt: skip
    hosts = directory / "dhcp-hosts"
    hosts.write_text("".join(f"{mac(i)},{ip(i)}\n" for i in range(count)))
    conf = directory / "dnsmasq.conf"
    conf.write_text(f"""\
port=0
interface=s0
bind-interfaces
dhcp-authoritative
dhcp-range=10.81.0.0,static,255.254.0.0,1h
dhcp-hostsfile={hosts}
dhcp-leasefile={directory}/dnsmasq.leases
dhcp-match=set:ipxe,77,"iPXE"
dhcp-boot=tag:!ipxe,undionly.kpxe
dhcp-boot=tag:ipxe,http://{SERVER}:8080/boot.ipxe
enable-tftp
tftp-root={IPXE}
tftp-max=2000
pid-file={directory}/dnsmasq.pid
user=root
""")
    nginx = nginx_config(directory, f"listen {SERVER}:8080; root {www};", 8192)
    pin = ["taskset", "-c", SERVER_CPU]
    log = (directory / "reference.log").open("wb")
    return [
        pair.server.popen([*pin, "dnsmasq", "-k", f"--conf-file={conf}"], stdout=log, stderr=log),
        pair.server.popen([*pin, "nginx", "-c", str(nginx)], stdout=log, stderr=log),
    ]


def link_rate(pair: Pair, directory: Path) -> float:
    """Bytes a second the veth carries from the server's core to the nodes' core: nginx
    (sendfile) to eight curl at once, pinned as the storm is. What the storm's bytes need
    at least is their sum over this rate."""
    www, size, streams = directory / "www", 256 << 20, 8
    with (www / "link.bin").open("wb") as sink:
        sink.truncate(size)  # a sparse file: the page cache serves zeros, no disk
    urls = [f"http://{SERVER}:8080/link.bin"] * streams
    fetch = ["taskset", "-c", CLIENT_CPU, "curl", "-sS", "--interface", BYSTANDER,
             "--parallel", "--parallel-max", str(streams),
             *(arg for url in urls for arg in ("-o", "/dev/null", url))]  # fmt: skip
    began = time.monotonic()
    pair.nodes.run(*fetch, timeout=300)
    rate = size * streams / (time.monotonic() - began)
    (www / "link.bin").unlink()
    return rate


def peak_rss(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def storm(pair: Pair, directory: Path, listing: Path, args: argparse.Namespace,
          until: str, serve: list[str] | None = None) -> dict:  # fmt: skip
    """The simulated nodes against whatever serves; with `serve` (layerpy), kill -9 and
    restart it at --kill-at. Returns the client's report and the server's figures."""
    command = ["taskset", "-c", CLIENT_CPU, str(PYTHON), str(CLIENT), "--server", SERVER,
               "--interface", "c0", "--nodes", str(listing), "--window", str(args.window),
               "--until", until]  # fmt: skip
    out = directory / f"client-{until}.json"
    with out.open("wb") as sink:
        client = pair.nodes.popen(command, stdout=sink, stderr=subprocess.PIPE)
    killed = None
    if serve is not None and args.kill_at is not None:
        time.sleep(args.kill_at)
        args.cpu_of_killed = cpu_seconds(args.server_process.pid)  # gone with it, else
        args.server_process.send_signal(signal.SIGKILL)
        args.server_process.wait()
        args.server_process = start_layerpy(pair.server, directory, serve)
        killed = args.kill_at
    client.wait(timeout=1800)
    error = client.stderr.read().decode() if client.stderr else ""
    if client.returncode:
        sys.exit(f"the simulated nodes failed: {error[-3000:]}")
    report = json.loads(out.read_text())
    report["killed_at"] = killed
    return report


def start_layerpy(netns: Netns, directory: Path, command: list[str]) -> subprocess.Popen:
    path = directory / "serve.log"
    start = path.stat().st_size if path.exists() else 0  # a restart appends
    process = launch(netns, directory, command)
    serving(directory, process, start)
    return process


def launch(netns: Netns, directory: Path, command: list[str]) -> subprocess.Popen:
    """`layerpy serve` started, its output appended to directory/serve.log."""
    with (directory / "serve.log").open("ab") as log:
        return netns.popen(command, stdout=log, stderr=log)


def serving(directory: Path, process: subprocess.Popen, start: int = 0) -> None:
    """Until the server says it serves (in its log from byte `start` on)."""
    path = directory / "serve.log"
    deadline = time.monotonic() + 120
    while b"layerpy.server: serving" not in path.read_bytes()[start:]:
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"layerpy serve did not start: {path.read_text()[-3000:]}")
        time.sleep(0.1)


def owners(config: Path, count: int) -> dict[str, int]:
    """Until every node is owned: the nodes each instance owns (`layerpy cluster`)."""
    deadline = time.monotonic() + 120
    while True:
        answer = subprocess.run([str(LAYERPY), "cluster", "-c", str(config), "-o", "json"],
                                capture_output=True, text=True)  # fmt: skip
        if answer.returncode == 0:
            view = json.loads(answer.stdout)
            owned = {entry["name"]: len(entry["nodes"]) for entry in view["instances"]}
            if sum(owned.values()) == count:
                return owned
        if time.monotonic() > deadline:
            sys.exit(f"the nodes were not all owned in 120 s: {answer.stdout}{answer.stderr}")
        time.sleep(0.5)


def pulled(directory: Path) -> None:
    """Until the server in `directory` has pulled the image."""
    deadline = time.monotonic() + 120
    while b"tiny" not in (directory / "serve.log").read_bytes() or not list(
        (directory / "state" / "images").rglob("rootfs.squashfs")
    ):
        if time.monotonic() > deadline:
            sys.exit(f"the image was not pulled in 120 s: {directory / 'serve.log'}")
        time.sleep(0.2)


def instances(pair: Pair, directory: Path, listing: Path, args: argparse.Namespace) -> dict:
    """The storm against `--instances` layerpy instances on a 3-member etcd (tests/etcd.py),
    each in a namespace of its own on the nodes' bridge (10.80.0.1, .2, ...), the instances
    and etcd's members pinned to SERVER_CPU as the single server is."""
    # the first instance takes the single server's address: that one's link goes, and the
    # nodes forget its MAC (left there, it answered ARP for 10.80.0.1 as well, and the
    # nodes that reached it saw their TFTP and HTTP unanswered)
    pair.server.run("ip", "link", "set", "s0", "down")
    pair.nodes.run("ip", "neigh", "flush", "dev", "c0")
    cluster = EtcdCluster(directory / "etcd")
    servers: list[subprocess.Popen] = []
    try:
        for member in cluster.members:
            assert member.proc is not None
            sh("taskset", "-a", "-p", "-c", SERVER_CPU, str(member.proc.pid))
        endpoints = ", ".join(f'"{url}"' for url in cluster.endpoints)
        folders, commands = [], []
        for k in range(args.instances):
            place, folder = cluster.add_instance(), directory / f"instance{k}"
            folder.mkdir()
            for name in ("vmlinuz", "initrd"):
                os.link(directory / name, folder / name)
            address = f"10.80.0.{k + 1}"
            pair.join(place.netns, address)
            table = f'[cluster]\netcd = [{endpoints}]\nname = "i{k}"\n'
            config = layerpy_config(folder, args.nodes, address, table)
            command = ["taskset", "-c", SERVER_CPU, str(LAYERPY), "serve", "-c", str(config)]
            folders.append(folder)
            commands.append((place.netns, command))
        # started together, as a cluster's instances are: one started alone first takes
        # every node (ownership never moves to a newcomer), and the storm would run on it
        servers = [launch(netns, folder, command)
                   for (netns, command), folder in zip(commands, folders, strict=True)]  # fmt: skip
        for folder, server in zip(folders, servers, strict=True):
            serving(folder, server)
        for folder in folders:
            pulled(folder)
        args.owners = owners(folders[0] / "nodes.toml", args.nodes)
        etcd_pids = [m.proc.pid for m in cluster.members if m.proc is not None]
        before = sum(cpu_seconds(p.pid) for p in servers)
        etcd_before = sum(cpu_seconds(pid) for pid in etcd_pids)
        began = time.monotonic()
        report = storm(pair, directory / "instance0", listing, args, "active")
        result = summary(report, PHASES) | {
            "cpu": sum(cpu_seconds(p.pid) for p in servers) - before,
            "etcd_cpu": sum(cpu_seconds(pid) for pid in etcd_pids) - etcd_before,
            "rss": sum(peak_rss(p.pid) for p in servers),
            "wall": time.monotonic() - began,
            # a node takes TFTP (and HTTP) from the instance whose offer reached it first
            "tftp_by": [(f / "serve.log").read_text().count("tftp: done ") for f in folders],
        }
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server in servers:
            server.wait(60)
        return result
    finally:
        for server in servers:  # one that did not start, or would not stop
            if server.poll() is None:
                server.kill()
                server.wait()
        cluster.close()


def summary(report: dict, phases: tuple[str, ...]) -> dict:
    nodes = report["nodes"]
    failed = [n for n in nodes if n["error"]]
    per_phase = {}
    for phase in phases:
        times = sorted(n["phases"][phase] for n in nodes if phase in n["phases"])
        if times:
            per_phase[phase] = (statistics.median(times), times[int(len(times) * 0.99) - 1 or 0],
                                times[-1], len(times))  # fmt: skip
    retries: dict[str, int] = {}
    for node in nodes:
        for what, count in node["retries"].items():
            retries[what] = retries.get(what, 0) + count
    moved = [n["name"] for n in nodes if len(n["addresses"]) > 1]
    return {"phases": per_phase, "failed": failed, "retries": retries, "moved": moved,
            "bytes": sum(n["bytes"] for n in nodes), "client_cpu": report["cpu"]}  # fmt: skip


def run(args: argparse.Namespace, directory: Path, listing: Path, kernel: Path,
        initrd: Path) -> dict[str, dict]:  # fmt: skip
    """The storms asked for, one after another on the same pair of namespaces."""
    results: dict[str, dict] = {}
    pair = Pair()
    try:
        if not args.no_reference:
            servers = reference(pair, directory, args.nodes, kernel, initrd)
            deadline = time.monotonic() + 30  # each writes its pid file once it listens
            while not all((directory / f"{n}.pid").exists() for n in ("dnsmasq", "nginx")):
                if time.monotonic() > deadline:
                    sys.exit(f"the reference did not start: {directory}/reference.log")
                time.sleep(0.1)
            args.link_rate = link_rate(pair, directory)
            before = sum(cpu_seconds(p.pid) for p in servers)
            began = time.monotonic()
            report = storm(pair, directory, listing, args, "initrd")
            results["reference"] = summary(report, PHASES[:6]) | {
                "cpu": sum(cpu_seconds(p.pid) for p in servers) - before,
                "rss": sum(peak_rss(p.pid) for p in servers),
                "wall": time.monotonic() - began,
            }
            for process in servers:  # TERM: nginx's master takes its worker with it
                process.terminate()
                process.wait(30)
        config = layerpy_config(directory, args.nodes)
        command = ["taskset", "-c", SERVER_CPU, str(LAYERPY), "serve", "-c", str(config)]
        args.server_process = start_layerpy(pair.server, directory, command)
        pulled(directory)
        before = cpu_seconds(args.server_process.pid)
        began = time.monotonic()
        report = storm(pair, directory, listing, args, "active", command)
        server = args.server_process
        results["layerpy"] = summary(report, PHASES) | {
            "cpu": cpu_seconds(server.pid) + getattr(args, "cpu_of_killed", 0.0) - before,
            "rss": peak_rss(server.pid),
            "wall": time.monotonic() - began,
            "killed_at": report["killed_at"],
        }
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        if args.instances > 1:
            results[f"{args.instances} instances"] = instances(pair, directory, listing, args)
    finally:
        pair.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--window", type=float, default=0.0, help="arrivals spread over s")
    parser.add_argument("--kill-at", type=float, help="kill -9 and restart layerpy then")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--instances", type=int, default=1,
                        help="2 or more: also a storm on that many instances on etcd")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the logs (the path is said)")
    args = parser.parse_args()
    if args.nodes % 250:
        sys.exit("--nodes must be a multiple of 250")
    if not args.no_reference and not shutil.which("nginx"):
        subprocess.run([str(ROOT / "vm-lab" / "install-packages.sh"), "nginx-light"], check=True)
    directory = Path(tempfile.mkdtemp(prefix="layerpy-storm-"))
    kernel, initrd = files(directory)
    listing = node_list(directory, args.nodes)
    # each server's nodes (the one instance's, going stale, and every instance's), and
    # room for what else runs on the machine
    with neighbour_room(args.nodes * (args.instances + 1) + 1024) as args.neighbours:
        results = run(args, directory, listing, kernel, initrd)
    show(args, results)
    if args.keep:
        print(f"logs and reports kept in {directory}")
    else:
        shutil.rmtree(directory, ignore_errors=True)


def show(args: argparse.Namespace, results: dict[str, dict]) -> None:
    how = f"over {args.window:g} s" if args.window else "all at once"
    print(
        f"boot storm: {args.nodes} simulated nodes, arriving {how}; servers on CPU "
        f"{SERVER_CPU}, nodes on CPU {CLIENT_CPU}"
    )
    print(f"the kernel's ARP table (one for all namespaces) held up to {args.neighbours} "
          f"entries for the run: each server's host would have its own")  # fmt: skip
    if args.instances > 1:
        owned = ", ".join(f"{name} {count}" for name, count in sorted(args.owners.items()))
        print(f"{args.instances} instances: layerpy serve with [cluster] on a 3-member etcd, "
              f"instances and etcd all on CPU {SERVER_CPU}; nodes owned when the storm began: "
              f"{owned}")  # fmt: skip
    for stack, result in results.items():
        print(f"\n{stack}: {len(result['failed'])} failed, retries {result['retries'] or 0}, "
              f"server CPU {result['cpu']:.1f} s, peak RSS {result['rss']:.0f} MB, "
              f"{result['bytes'] / 1e9:.2f} GB moved; the nodes' process used "
              f"{result['client_cpu']:.1f} s of CPU in {result['wall']:.1f} s")  # fmt: skip
        if rate := getattr(args, "link_rate", None):
            print(f"  the bytes alone need {result['bytes'] / rate:.1f} s at the veth's "
                  f"{rate / 1e9:.2f} GB/s (nginx to curl, same cores)")  # fmt: skip
        if "etcd_cpu" in result:
            print(f"  etcd's 3 members used {result['etcd_cpu']:.1f} s of CPU besides; TFTP "
                  f"transfers per instance: {', '.join(map(str, result['tftp_by']))}")  # fmt: skip
        if result.get("killed_at") is not None:
            print(
                f"  layerpy killed (SIGKILL) and restarted at {result['killed_at']:g} s; "
                f"nodes whose address changed: {len(result['moved'])}"
            )
        print(f"  {'phase':<10} {'p50 s':>7} {'p99 s':>7} {'last s':>7} {'nodes':>6}")
        for phase, (p50, p99, last, done) in result["phases"].items():
            print(f"  {phase:<10} {p50:7.2f} {p99:7.2f} {last:7.2f} {done:>6}")
        for node in result["failed"][:5]:
            print(f"  failed: {node['name']}: {node['error']}")
    if "reference" in results and "initrd" in results["layerpy"]["phases"]:
        ours = results["layerpy"]["phases"]["initrd"][2]
        theirs = results["reference"]["phases"]["initrd"][2]
        print(
            f"\nevery initrd fetched: layerpy {ours:.1f} s, dnsmasq + nginx {theirs:.1f} s: "
            f"ratio {ours / theirs:.2f}; layerpy to every image active "
            f"{results['layerpy']['phases'].get('active', (0, 0, float('nan')))[2]:.1f} s"
        )
    several = f"{args.instances} instances"
    if several in results:
        print(f"\n{several} against 1 (the last node to reach each phase):")
        for phase in ("script", "hello", "active"):
            one = results["layerpy"]["phases"].get(phase, (0, 0, float("nan")))[2]
            more = results[several]["phases"].get(phase, (0, 0, float("nan")))[2]
            print(f"  {phase:<7} 1 instance {one:6.1f} s, {several} {more:6.1f} s: "
                  f"ratio {more / one:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
