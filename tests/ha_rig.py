"""A cluster of real `layerpy serve` instances on real etcd, with simulated nodes, for the
failure matrix of issue 27 (tests/cluster/test_failure_matrix.py).

One boot segment: a namespace holding a bridge (named as the lab's BMC bridge, `bmc0`, so
the lab BMCs put their addresses on it too). Each instance is an `Instance` of the etcd
fixture (tests/etcd.py) with a veth `boot0` onto the segment and a node file of its own
(its [server], [api] and [cluster]; the rest the same). Each node is a namespace of its own
on the segment: busybox udhcpc keeps its address (every bound and renew logged), the real
agent runs a real busybox container in it (as tests/proto/test_agent_failover.py does), and
a tiny QEMU (no disk, no NIC) sits behind a lab BMC (vm-lab/bmc.py) that logs every power
command it receives. Everything is torn down by the test; only processes started here are
killed.

With `slurm=N`, N more nodes (sn001…, group `slurm`, no BMC) run the Slurm lab's image
(vm-lab/slurm_lab.py's cached build) through the same agent, with slurm.conf, /etc/hosts and
the munge key delivered by layerpy's [files] from the lab's templates, and slurmctld and
munged (vm-lab/slurm_controller.py) run in a namespace of their own on the segment
(CONTROLLER). Their container runs slurmd by its own entrypoint (SLURMD), not systemd:
systemd as a container's init needs a VM's kernel to itself (docs/ha.md, "The failure
matrix").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from etcd import EtcdCluster
from etcd import Instance as EtcdInstance
from netns import Netns, sh, unique_name
from nodefile import BOOT_SECTIONS, write_boot_files
from oci import build_image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vm-lab"))

from bmc import BMC_DEVICE, qmp, start_bmc
from slurm_controller import Controller, context_from_node_file, make_munge_key, node_files
from slurm_lab import build_image as build_slurm_image

LAYERPY = Path(sys.executable).parent / "layerpy"
SEGMENT = "10.88.0"
BMC_PASSWORD = "matrix-bmc-Secret-3"
SPARE, SPARE_MAC = "sp01", "52:54:00:88:00:31"  # a node that only boots: no agent, no BMC
POWER_LINE = "power: "  # how the lab BMC logs each power command it carries out
CONTROLLER, CONTROLLER_MAC = f"{SEGMENT}.5", "52:54:00:88:00:05"  # slurmctld's namespace

# The slurm image's command in the rig: munged and slurmd as their units start them, slurmd
# the container's main process (it dying ends the container: a restart the agent counts).
# This host's cgroups are hybrid (v1 controllers, an empty v2): slurmd 22.05 refuses
# cgroup v2 there ("Hybrid mode is not supported") and its cgroup/v1 wants a name=systemd
# hierarchy at /sys/fs/cgroup/systemd, so the container mounts one, read-only, in its own
# mount namespace (with proctrack/linuxproc it makes no cgroup in it).
SLURMD = (
    "mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd"
    " && mount -t cgroup -o ro,none,name=systemd cgroup /sys/fs/cgroup/systemd"
    " && install -d -o munge -g munge /run/munge && runuser -u munge -- munged"
    " && exec slurmd -D"
)

# the agent as the minOS runs it, with the container's console a file (no network setup:
# the node's namespace has its address from udhcpc)
AGENT = """
import sys
from layerpy.agent.container import Runner
from layerpy.agent.core import Agent, Log, read_cmdline
cfg = read_cmdline()
log = Log(cfg.node)
runner = Runner(sys.argv[1], log, cfg.node, console=sys.argv[2])
Agent(cfg, log, no_net=True, state_dir=sys.argv[1], runner=runner).run()
"""

# udhcpc's script: take the address, and log every event with it
RECORDER = """#!/bin/sh
case "$1" in
  bound|renew) ip addr replace "$ip/24" dev "$interface" ;;
esac
echo "$1 $ip" >> {log}
"""


def wait_for(
    condition: Callable[[], Any], timeout: float, what: str, *logs: Path,
    seen: Callable[[], Any] | None = None,
) -> float:  # fmt: skip
    """Seconds until condition() is true; the failure says what was waited for, what the
    last look saw (`seen()`, else the condition's value) and the tails of the logs named."""
    start = time.monotonic()
    while not (value := condition()):
        if time.monotonic() - start > timeout:
            saw = seen() if seen is not None else value
            tails = "".join(f"\n--- {log.name}:\n{tail(log)}" for log in logs)
            raise AssertionError(f"waited {timeout:g} s for {what}; last saw {saw!r}{tails}")
        time.sleep(0.1)
    return time.monotonic() - start


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"({error})"


@dataclass
class Server:
    """One `layerpy serve` instance: its namespace (on etcd and the segment) and process."""

    rig: Rig
    index: int
    ns: EtcdInstance
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"head{self.index + 1}"

    @property
    def address(self) -> str:
        return f"{SEGMENT}.{1 + self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.address}:8080"

    @property
    def file(self) -> Path:
        return self.rig.config_dir / f"{self.name}.toml"

    @property
    def log(self) -> Path:
        return self.rig.tmp / f"{self.name}.log"

    @property
    def socket(self) -> Path:
        return self.rig.config_dir / f"state-{self.name}" / "api.sock"

    def start(self, code: Path | None = None) -> None:
        """Start (or start again) from the cluster's node file as the rig has it now; `code`:
        a directory holding another copy of the `layerpy` package to run (an upgrade)."""
        self.file.write_text(self.rig.own_tables(self) + self.rig.shared_text)
        command = [str(LAYERPY)] if code is None else [sys.executable, "-m", "layerpy"]
        env = {**os.environ} | ({} if code is None else {"PYTHONPATH": str(code)})
        with self.log.open("ab") as out:
            out.write(f"=== start {time.time():.3f} {code or LAYERPY}\n".encode())
            out.flush()
            self.proc = self.ns.netns.popen([*command, "serve", "-c", str(self.file)],
                                            stdout=out, stderr=out, env=env)  # fmt: skip
        wait_for(lambda: self.api("/api/v1/nodes")[0] == 200 or self.dead(), 60,
                 f"{self.name}'s operator API", self.log)  # fmt: skip
        assert not self.dead(), f"{self.name} stopped:\n{tail(self.log)}"

    def reaches_etcd(self) -> str | bool:
        """Every member answers this instance's namespace (else what curl said)."""
        for url in self.rig.etcd.endpoints:
            result = self.ns.netns.run("curl", "-sS", "--max-time", "2", f"{url}/version",
                                       check=False)  # fmt: skip
            if result.returncode:
                return f"{url}: {result.stderr.strip()}"
        return True

    def dead(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def kill(self) -> None:
        """kill -9: no goodbye to etcd, its lease runs out by itself."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """A clean stop (SIGTERM, as systemd stops it), waited for."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)

    def api(self, path: str, *args: str) -> tuple[int, str]:
        """The operator API on this instance's socket."""
        command = ["curl", "-s", "-g", "--max-time", "10", "--unix-socket", str(self.socket),
                   "-w", "\n%{http_code}"]  # fmt: skip
        result = self.ns.netns.run(*command, *args, f"http://layerpy{path}", check=False)
        body, _, code = result.stdout.rpartition("\n")
        return int(code or 0), body

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, str]:
        return self.api(path, "-X", "POST", "-H", "Content-Type: application/json",
                        "--data", json.dumps(body))  # fmt: skip

    def node(self, name: str) -> dict[str, Any]:
        code, text = self.api(f"/api/v1/nodes/{name}")
        return json.loads(text) if code == 200 else {}

    def cluster(self) -> dict[str, Any]:
        code, text = self.api("/api/v1/cluster")
        return json.loads(text) if code == 200 else {}

    def owns(self) -> list[str]:
        """The nodes this instance owns, as it says itself (GET /api/v1/cluster)."""
        for instance in self.cluster().get("instances", []):
            if instance.get("name") == self.name:
                return sorted(instance.get("nodes", []))
        return []

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The `layerpy` command line against this instance."""
        command, *rest = args
        return self.ns.netns.run(str(LAYERPY), command, "--server", str(self.socket), *rest,
                                 check=False, timeout=60)  # fmt: skip

    def log_text(self, since: int = 0) -> str:
        """The log from byte `since` on (a `log_size()` taken earlier)."""
        return self.log.read_bytes()[since:].decode(errors="replace")

    def log_size(self) -> int:
        return self.log.stat().st_size


@dataclass
class Node:
    """A simulated node: a namespace on the segment with its MAC, udhcpc, the agent and its
    container, and a QEMU behind a lab BMC."""

    rig: Rig
    index: int
    ns: Netns
    mac: str
    name: str
    ip: str
    agent: subprocess.Popen[bytes] | None = None
    dhcp: subprocess.Popen[bytes] | None = None
    bmc_mark: int = 0
    port: str = ""  # its veth's end on the segment's bridge

    @property
    def state(self) -> Path:
        return self.rig.tmp / f"{self.name}-agent"

    @property
    def agent_log(self) -> Path:
        return self.rig.tmp / f"{self.name}-agent.log"

    @property
    def dhcp_log(self) -> Path:
        return self.rig.tmp / f"{self.name}-dhcp.log"

    @property
    def bmc_log(self) -> Path:
        return self.rig.tmp / f"{self.name}.bmc.log"

    def container(self) -> tuple[int, int] | None:
        """The container's process as the agent recorded it: PID and start time."""
        try:
            record = json.loads((self.state / "container.json").read_text())
        except (OSError, ValueError):
            return None
        return record["pid"], record["start"]

    def starts(self) -> int:
        """Containers the agent started (its own log: one line per start)."""
        try:
            return sum(" active in " in line for line in self.agent_log.read_text().splitlines())
        except OSError:
            return 0

    def addresses(self) -> list[str]:
        """Every address udhcpc was given (bound and renew), in order."""
        try:
            lines = self.dhcp_log.read_text().splitlines()
        except OSError:
            return []
        return [line.split()[1] for line in lines if line.split()[0] in ("bound", "renew")]

    def power_commands(self) -> list[str]:
        """The power commands the BMC carried out since `mark_bmc`."""
        text = self.bmc_log.read_bytes()[self.bmc_mark :].decode(errors="replace")
        return [line for line in text.splitlines() if line.startswith(POWER_LINE)]

    def mark_bmc(self) -> None:
        self.bmc_mark = self.bmc_log.stat().st_size

    def start_dhcp(self) -> None:
        script = self.rig.tmp / f"{self.name}-dhcp.sh"
        script.write_text(RECORDER.format(log=self.dhcp_log))
        script.chmod(0o755)
        self.dhcp = self.ns.popen(["busybox", "udhcpc", "-f", "-i", "eth0", "-s", str(script),
                                   "-t", "20", "-T", "1", "-A", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_for(self.addresses, 30, f"{self.name}'s DHCP lease", self.dhcp_log,
                 *(server.log for server in self.rig.servers))  # fmt: skip

    def start_agent(self, token: str) -> None:
        servers = ",".join(server.url for server in self.rig.servers)
        cmdline = self.rig.tmp / f"{self.name}.cmdline"
        cmdline.write_text(f"layerpy.server={servers} layerpy.node={self.name} "
                           f"layerpy.token={token} layerpy.heartbeat=1 layerpy.lldp_wait=0 "
                           f"BOOTIF=01-{self.mac.replace(':', '-')}\n")  # fmt: skip
        env = {**os.environ, "LAYERPY_CMDLINE": str(cmdline), "LAYERPY_NO_NET": "1"}
        with self.agent_log.open("ab") as out:
            command = [sys.executable, "-c", AGENT, str(self.state), str(self.rig.tmp / f"{self.name}.console")]  # fmt: skip
            self.agent = self.ns.popen(command, stdout=out, stderr=out, env=env)

    def start_machine(self) -> None:
        """A running QEMU (no disk, no NIC: its firmware idles) and its lab BMC on the
        segment's bridge."""
        qmp_path = self.rig.tmp / f"{self.name}.qmp"
        qemu = ["qemu-system-x86_64", "-accel", "tcg", "-m", "32", "-nodefaults", "-display", "none",
                "-qmp", f"unix:{qmp_path},server=on,wait=off"]  # fmt: skip
        self.rig.lab.popen(qemu, log=self.rig.tmp / f"{self.name}.qemu.log")
        wait_for(qmp_path.exists, 20, f"{self.name}'s QEMU QMP socket")
        wait_for(lambda: qmp(qmp_path, "query-status")[0]["status"] == "running", 20,
                 f"{self.name}'s QEMU running")  # fmt: skip
        start_bmc(self.rig.lab, self.name, self.bmc, self.rig.tmp / "bmc.pass")

    @property
    def bmc(self) -> str:
        return f"{SEGMENT}.{61 + self.index}"

    def kill_container(self) -> None:
        """The container outlives the agent by design: kill what runs from its state
        directory (only this test's processes name it)."""
        needle = str(self.state.resolve()).encode()
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if needle in f.read():
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


class SegmentLab:
    """A namespace on the segment as vm-lab wants a lab (`start_bmc`, the Slurm
    `Controller`): netns, run_dir, run, popen."""

    def __init__(self, ns: Netns, run_dir: Path) -> None:
        self.ns, self.run_dir, self.netns = ns, run_dir, ns.name

    def run(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        kw = {"check": True, "capture_output": True, "text": True, "timeout": 60} | kw
        return subprocess.run(self.ns.cmd(*cmd), **kw)

    def popen(self, cmd: list[str], log: Path | None = None, **kw: Any) -> subprocess.Popen[bytes]:
        with log.open("ab") if log else open(os.devnull, "wb") as out:
            return self.ns.popen(cmd, stdout=out, stderr=out, **kw)


class Rig:
    """The segment, the instances and the nodes (see the module doc)."""

    def __init__(self, etcd: EtcdCluster, tmp: Path, *, servers: int, nodes: int,
                 prefix: str, extra: str = "", slurm: int = 0) -> None:  # fmt: skip
        self.etcd, self.tmp, self.prefix = etcd, tmp, prefix
        self.config_dir = tmp / "config"
        self.config_dir.mkdir(parents=True)
        self.segment = Netns("lphs")
        self.servers: list[Server] = []
        self.nodes: list[Node] = []
        self.slurm_nodes: list[Node] = []  # sn001…: the Slurm image, slurmd
        self.controller: Controller | None = None  # slurmctld and munged, once started
        self.munge_key = tmp / "munge.key"  # the Slurm nodes' and the controller's
        self.spare = Netns("lphp")
        self.slurm_ns = Netns("lphc") if slurm else None
        try:
            self.segment.run("ip", "link", "add", BMC_DEVICE, "type", "bridge")
            self.segment.run("ip", "link", "set", BMC_DEVICE, "up")
            self.lab = SegmentLab(self.segment, tmp)
            (tmp / "bmc.pass").write_text(BMC_PASSWORD + "\n")
            (self.config_dir / "bmc.pass").write_text(BMC_PASSWORD + "\n")
            (self.config_dir / "bmc.pass").chmod(0o600)
            write_boot_files(self.config_dir)
            images = "".join(self.image(name) for name in ("one", "two"))
            if slurm:
                images += self.slurm(slurm)
            self.shared_text = self.shared(nodes, images + extra)
            for index in range(servers):
                ns = etcd.add_instance()
                ns.connect(self.segment.name, BMC_DEVICE, "boot0", f"{SEGMENT}.{1 + index}/24")
                self.servers.append(Server(self, index, ns))
            for index in range(nodes):
                self.nodes.append(self.add_node(index))
            for index in range(slurm):
                self.slurm_nodes.append(self.add_node(index, "sn", 41))
            self.plug(self.spare, SPARE_MAC)
            self.spare.run("ip", "addr", "add", f"{SEGMENT}.31/24", "dev", "eth0")
            if self.slurm_ns is not None:
                self.plug(self.slurm_ns, CONTROLLER_MAC)
                self.slurm_ns.run("ip", "addr", "add", f"{CONTROLLER}/24", "dev", "eth0")
        except BaseException:
            self.close()
            raise

    def image(self, name: str) -> str:
        layout = build_image(self.tmp / f"oci-{name}", name, f"IMAGE-{name.upper()}")
        return (f'\n[images.{name}]\nsource = "oci-layout:{layout}:latest"\n'
                'command = ["/bin/sh", "-c", "exec sleep 1000000"]\n')  # fmt: skip

    def slurm(self, count: int) -> str:
        """The slurm group, its image and its files (node file TOML); the munge key and the
        image's layout made (the layout from the Slurm lab's cache)."""
        layout = build_slurm_image(self.tmp)["layout"]
        make_munge_key(self.munge_key)
        macs = ", ".join(f'"{self.mac(index, 0x41)}"' for index in range(count))
        command = json.dumps(["/bin/sh", "-c", SLURMD])
        return f"""
[groups.slurm]
nodes = "sn[001-{count:03}]"
ip = "{SEGMENT}.[41-{40 + count}]"
mac = [{macs}]
image = "slurm"
vars = {{ slurm_group = "slurm", slurmctld_address = "{CONTROLLER}" }}

[images.slurm]
source = "oci-layout:{layout}:v1"
command = {command}
{node_files(self.munge_key, "slurm", systemd=False, hosts_everywhere=False)}"""

    def shared(self, nodes: int, more: str) -> str:
        """The cluster's part of the node file."""
        macs = ", ".join(f'"{self.mac(index)}"' for index in range(nodes))
        last = nodes  # cn001 … cn00N
        return f"""
[network]
subnet = "{SEGMENT}.0/24"
gateway = "{SEGMENT}.1"
pool = "{SEGMENT}.200-{SEGMENT}.250"
lease_time = 20
discover = true

{BOOT_SECTIONS}
[groups.compute]
nodes = "cn[001-{last:03}]"
ip = "{SEGMENT}.[11-{10 + last}]"
mac = [{macs}]
image = "one"
bmc = {{ driver = "ipmi", address = "{SEGMENT}.[61-{60 + last}]", user = "admin", password_file = "bmc.pass" }}

[groups.spare]
nodes = "{SPARE}"
ip = "{SEGMENT}.31"
mac = "{SPARE_MAC}"
{more}"""

    def own_tables(self, server: Server) -> str:
        etcd = ", ".join(f'"{url}"' for url in self.etcd.endpoints)
        return f"""[server]
interface = "boot0"
address = "{server.address}"
state_dir = "state-{server.name}"
heartbeat = 1
dhcp_probe = 0.5

[api]
listen = []

[cluster]
etcd = [{etcd}]
name = "{server.name}"
prefix = "{self.prefix}"
"""

    @staticmethod
    def mac(index: int, first: int = 0x11) -> str:
        return f"52:54:00:88:00:{first + index:02x}"

    def add_node(self, index: int, prefix: str = "cn", first: int = 11) -> Node:
        """Node `prefix`NNN at .`first`+index, its MAC ending in the same number (hex)."""
        ns = Netns("lphn")
        name, ip = f"{prefix}{index + 1:03}", f"{SEGMENT}.{first + index}"
        node = Node(self, index, ns, self.mac(index, int(str(first), 16)), name, ip)
        node.port = self.plug(ns, node.mac)
        return node

    def throttle(self, node: Node, rate: str | None) -> None:
        """What the segment sends the node limited to `rate` (tc's units, "2mbit"), or
        no more (None): a slow link, so an image pull takes seconds."""
        if rate is None:
            self.segment.run("tc", "qdisc", "del", "dev", node.port, "root", check=False)
        else:
            self.segment.run("tc", "qdisc", "replace", "dev", node.port, "root", "tbf",
                             "rate", rate, "burst", "16kb", "latency", "400ms")  # fmt: skip

    def plug(self, ns: Netns, mac: str) -> str:
        """A veth `eth0` with that MAC from ns onto the segment's bridge; returns the name
        of its port on the bridge."""
        here, there = unique_name("vn"), unique_name("vs")
        sh("ip", "link", "add", here, "address", mac, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", here, "netns", ns.name)
        sh("ip", "link", "set", there, "netns", self.segment.name)
        self.segment.run("ip", "link", "set", there, "master", BMC_DEVICE, "up")
        ns.run("ip", "link", "set", here, "name", "eth0")
        ns.run("ip", "link", "set", "eth0", "up")
        return there

    def start(self) -> None:
        """Every node's machine, every instance, then every node's address, agent and
        container."""
        for node in self.nodes:
            node.start_machine()
        for server in self.servers:
            wait_for(lambda s=server: s.reaches_etcd(), 30, f"{server.name} reaching etcd")
            server.start()
        everyone = self.nodes + self.slurm_nodes
        wait_for(lambda: {n.name for n in everyone} <= set(self.owners()), 30, "every node owned",
                 *(s.log for s in self.servers), seen=self.owners)  # fmt: skip
        if self.slurm_ns is not None:
            context = context_from_node_file(self.servers[0].file, group="slurm")
            lab = SegmentLab(self.slurm_ns, self.tmp)
            self.controller = Controller(lab, self.tmp / "slurmctld", self.munge_key, context)
        for node in everyone:
            node.start_dhcp()
            node.start_agent(self.token(node))
        for node in self.nodes:
            wait_for(lambda node=node: self.image_state(node) == ("one", "active"), 120,
                     f"{node.name} running image one", node.agent_log)  # fmt: skip
            node.mark_bmc()
        for node in self.slurm_nodes:  # each instance squashes the image (~95 MB) first
            wait_for(lambda node=node: self.image_state(node) == ("slurm", "active"), 300,
                     f"{node.name} running the slurm image", node.agent_log,
                     *(s.log for s in self.servers))  # fmt: skip
        if self.controller is not None:
            self.controller.wait_nodes([n.name for n in self.slurm_nodes], "idle", 120)

    def token(self, node: Node) -> str:
        """A boot token for the node, as its boot script hands it out (from the node's own
        address, to the first instance)."""
        url = f"{self.servers[0].url}/boot/{node.name}.ipxe"
        script = node.ns.run("curl", "-s", "--max-time", "10", url).stdout
        for word in script.split():
            if word.startswith("layerpy.token="):
                return word.split("=", 1)[1]
        raise AssertionError(f"no token in {node.name}'s boot script:\n{script}")

    def image_state(self, node: Node, server: Server | None = None) -> tuple[str, str] | None:
        """(image, state) of a node as an instance reports it."""
        for candidate in [server] if server else self.servers:
            if candidate.dead():
                continue
            image = candidate.node(node.name).get("image") or {}
            return image.get("name"), image.get("state")
        return None

    def owners(self) -> dict[str, str]:
        """node → owning instance, as the first live instance lists them."""
        for server in self.servers:
            if not server.dead():
                return {node: instance["name"] for instance in server.cluster().get("instances", [])
                        for node in instance.get("nodes", [])}  # fmt: skip
        return {}

    def owner_of(self, node: Node) -> Server:
        name = self.owners().get(node.name)
        matches = [server for server in self.servers if server.name == name]
        assert matches, f"{node.name} has no owner: {self.owners()}"
        return matches[0]

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()
        for node in self.nodes + self.slurm_nodes:
            node.ns.close()
            node.kill_container()
        for server in self.servers:
            if not server.dead():
                server.kill()
        self.spare.close()
        if self.slurm_ns is not None:
            self.slurm_ns.close()
        self.segment.close()


# every DHCP reply (OFFER, ACK, NAK) crossing the segment's bridge, one JSON line each; run
# in the segment's namespace, on every interface (a reply is seen on its way in and out)
CAPTURE = """
import json, socket, sys
from layerpy.proto import dhcp
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
print("capturing", flush=True)
while True:
    frame = sock.recv(4096)
    if len(frame) < 42 or frame[12:14] != b"\\x08\\x00" or frame[23] != 17:
        continue
    ihl = (frame[14] & 15) * 4
    udp = 14 + ihl
    if int.from_bytes(frame[udp + 2 : udp + 4]) != 68:
        continue
    try:
        packet = dhcp.decode(frame[udp + 8 :])
    except ValueError:
        continue
    server = packet.options.get(dhcp.OPT_SERVER_ID, b"")
    print(json.dumps({"mac": packet.mac, "xid": packet.xid, "type": packet.message_type,
                      "yiaddr": str(packet.yiaddr),
                      "server": ".".join(map(str, server)) if len(server) == 4 else ""}),
          flush=True)
"""


class Capture:
    """Every DHCP reply on the segment, from the moment it is made until `close`."""

    def __init__(self, rig: Rig) -> None:
        self.path = rig.tmp / f"capture-{time.monotonic_ns()}.jsonl"
        with self.path.open("wb") as out:
            self.proc = rig.segment.popen([sys.executable, "-c", CAPTURE], stdout=out, stderr=out)
        wait_for(lambda: b"capturing" in self.path.read_bytes(), 20, "the DHCP capture", self.path)

    def replies(self) -> list[dict[str, Any]]:
        """Distinct replies (each once, though seen on several ports)."""
        seen: dict[str, dict[str, Any]] = {}
        for line in self.path.read_text().splitlines()[1:]:
            if line.startswith("{"):
                seen.setdefault(line, json.loads(line))
        return list(seen.values())

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait()
