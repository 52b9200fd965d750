"""A real etcd cluster for tests: each member in a namespace of its own on a bridge.

Members (etcd 3.4, /usr/bin/etcd) sit at 10.79.0.11, .12, .13 on a bridge in a namespace of
its own; a layerpy instance gets a namespace with a veth onto that bridge (`etcd0`, from
10.79.0.101 on), and may be joined to a boot segment besides (`connect`). Everything is
private to this run's namespaces: nothing reaches the default namespace. A member can be
killed (-9), stopped, restarted, or cut off from the others; an instance can be cut off from
every member while its boot link stays up. Teardown kills only the processes started here.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from layerpy.cluster.backend import EtcdBackend
from layerpy.cluster.etcd import Etcd, EtcdUnavailable

from netns import Netns, call_in, sh, unique_name

T = TypeVar("T")

MEMORY = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs for the members' data
SUBNET = "10.79.0"
CLIENT_PORT, PEER_PORT = 2379, 2380


@dataclass(frozen=True)
class Tls:
    """Files of a CA and of a server and a client certificate it signed (`make_tls`)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


class Member:
    """One etcd process in its namespace, with its data directory kept across restarts."""

    def __init__(self, cluster: EtcdCluster, index: int) -> None:
        self.cluster, self.index = cluster, index
        self.name = f"m{index}"
        self.address = f"{SUBNET}.{11 + index}"
        self.netns = Netns("lpem")
        self.data_dir = cluster.data / self.name
        self.log = cluster.tmp_path / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        cluster.plug(self.netns, "eth0", f"{self.address}/24")

    @property
    def url(self) -> str:
        return f"{self.cluster.scheme}://{self.address}:{CLIENT_PORT}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert not self.running, f"etcd {self.name} is already running"
        cmd = [
            "etcd", "--name", self.name, "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://{self.address}:{PEER_PORT}",
            "--initial-advertise-peer-urls", f"http://{self.address}:{PEER_PORT}",
            "--initial-cluster", self.cluster.initial_cluster, "--initial-cluster-token", self.cluster.token,
            "--initial-cluster-state", "new", *self.cluster.extra_args,
        ]  # fmt: skip
        tls = self.cluster.tls
        if tls is not None:
            cmd += ["--cert-file", str(tls.server_cert), "--key-file", str(tls.server_key),
                    "--trusted-ca-file", str(tls.ca), "--client-cert-auth"]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = self.netns.popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """kill -9: no goodbye to the peers, no flush."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """A clean stop (SIGTERM), waited for."""
        self._signal(signal.SIGTERM)

    def restart(self) -> None:
        if self.running:
            self.stop()
        self.start()

    def _signal(self, number: int) -> None:
        assert self.proc is not None, f"etcd {self.name} was never started"
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, number)
        self.proc.wait(timeout=30)

    def isolate(self) -> None:
        """Drop the peers' traffic (port 2380) both ways: the member loses its leader but
        clients still reach it (a member in a minority partition)."""
        _peers(self.netns, True)

    def rejoin(self, check: bool = True) -> None:
        _peers(self.netns, False, check)


class Instance:
    """A namespace for one layerpy instance: `etcd0` on the etcd bridge (plus `connect`)."""

    def __init__(self, cluster: EtcdCluster, index: int) -> None:
        self.address = f"{SUBNET}.{101 + index}"
        self.netns = Netns("lpei")
        try:  # not yet among the cluster's instances: closed here if it cannot be used
            cluster.plug(self.netns, "etcd0", f"{self.address}/24")
            cluster.wait_reachable(self.netns)
        except BaseException:
            self.netns.close()
            raise

    @property
    def name(self) -> str:
        return self.netns.name

    def connect(self, namespace: str, bridge: str, interface: str, address: str | None) -> None:
        """A veth from this namespace (named `interface`, with address) onto `bridge` in
        `namespace`: the boot segment the caller made."""
        here, there = unique_name("vi"), unique_name("vo")
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", here, "netns", self.netns.name)
        sh("ip", "link", "set", there, "netns", namespace)
        sh("ip", "netns", "exec", namespace, "ip", "link", "set", there, "master", bridge, "up")
        self.netns.run("ip", "link", "set", here, "name", interface)
        if address:
            self.netns.run("ip", "addr", "add", address, "dev", interface)
        self.netns.run("ip", "link", "set", interface, "up")

    def cut(self) -> None:
        """Every packet to and from the etcd members dropped (no reset: a silent partition);
        the boot link is left alone."""
        _drop(self.netns, "etcd0", True)

    def restore(self, check: bool = True) -> None:
        _drop(self.netns, "etcd0", False, check)

    def run(self, coroutine: Callable[[], Awaitable[T]], timeout: float = 120) -> T:
        """Run an async function from this namespace (its sockets live here)."""

        async def bounded() -> T:
            async with asyncio.timeout(timeout):
                return await coroutine()

        return call_in(self.netns.name, lambda: asyncio.run(bounded()))


class EtcdCluster:
    """`size` members on a bridge of their own, started and healthy when built."""

    def __init__(
        self,
        tmp_path: Path,
        size: int = 3,
        *,
        tls: Tls | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.tmp_path, self.tls, self.extra_args = tmp_path, tls, extra_args
        self.scheme = "https" if tls else "http"
        self.token = unique_name("lpetcd")
        self.members: list[Member] = []
        self.instances: list[Instance] = []
        self._size = size
        tmp_path.mkdir(parents=True, exist_ok=True)
        # the members' data in memory: on a busy disk, etcd's fsyncs took seconds and
        # first contacts timed out (the logs stay in tmp_path)
        self.data = Path(tempfile.mkdtemp(prefix="layerpy-etcd-", dir=MEMORY))
        self.bridge_ns = Netns("lpeb")
        try:
            self.bridge_ns.run("ip", "link", "add", "br0", "type", "bridge")
            self.bridge_ns.run("ip", "link", "set", "br0", "up")
            self.members = [Member(self, index) for index in range(size)]
            for member in self.members:
                member.start()
            self.wait_healthy()
        except BaseException:
            self.close()
            raise

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"m{i}=http://{SUBNET}.{11 + i}:{PEER_PORT}" for i in range(self._size))

    @property
    def endpoints(self) -> list[str]:
        return [member.url for member in self.members]

    def plug(self, netns: Netns, interface: str, address: str) -> None:
        """A veth from netns (named interface, with address) onto the bridge."""
        here, there = unique_name("ve"), unique_name("vb")
        sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        sh("ip", "link", "set", here, "netns", netns.name)
        sh("ip", "link", "set", there, "netns", self.bridge_ns.name)
        self.bridge_ns.run("ip", "link", "set", there, "master", "br0", "up")
        netns.run("ip", "link", "set", here, "name", interface)
        netns.run("ip", "addr", "add", address, "dev", interface)
        netns.run("ip", "link", "set", interface, "up")

    def add_instance(self) -> Instance:
        instance = Instance(self, len(self.instances))
        self.instances.append(instance)
        return instance

    def etcdctl(
        self, member: Member, *args: str, input: str | None = None, timeout: float = 10
    ) -> subprocess.CompletedProcess[str]:
        """etcdctl from a member's namespace, against that member."""
        cmd = ["etcdctl", "--endpoints", member.url, "--command-timeout=2s"]
        if self.tls is not None:
            cmd += ["--cacert", str(self.tls.ca), "--cert", str(self.tls.client_cert),
                    "--key", str(self.tls.client_key)]  # fmt: skip
        env_cmd = member.netns.cmd("env", "ETCDCTL_API=3", *cmd, *args)
        return subprocess.run(env_cmd, input=input, capture_output=True, text=True, timeout=timeout)

    def wait_reachable(self, netns: Netns, timeout: float = 60) -> None:
        """Until every running member answers from `netns` (a namespace just plugged in: on
        a busy machine an instance's first contact timed out before it could be made).
        Its /version: no leader, proposal or credentials needed (a test may have turned
        authentication on)."""
        deadline = time.monotonic() + timeout
        tls = []
        if self.tls is not None:
            tls = ["--cacert", str(self.tls.ca), "--cert", str(self.tls.client_cert),
                   "--key", str(self.tls.client_key)]  # fmt: skip
        for member in self.members:
            if not member.running:
                continue
            while True:
                result = netns.run("curl", "-sf", "--max-time", "5", *tls,
                                   f"{member.url}/version", check=False, timeout=30)  # fmt: skip
                if result.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"etcd member {member.name} not reachable from {netns.name} within "
                        f"{timeout} s: curl exit {result.returncode} {result.stderr[-300:]}"
                    )
                time.sleep(0.2)

    def wait_healthy(self, timeout: float = 60) -> None:
        """Until every running member answers a linearizable read (so the cluster has a
        leader and quorum)."""
        deadline = time.monotonic() + timeout
        while True:
            sick = {}
            for member in self.members:
                if not member.running:
                    continue
                result = self.etcdctl(member, "endpoint", "health")
                if result.returncode != 0:
                    sick[member.name] = (result.stdout + result.stderr).strip()[-300:]
            if not sick:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd members not healthy within {timeout} s: {sick}")
            time.sleep(0.2)

    def status(self, member: Member) -> dict[str, str]:
        """etcdctl endpoint status of one member: "Leader" ("0": it has none), "MemberID"..."""
        out = self.etcdctl(member, "endpoint", "status", "-w", "fields").stdout
        pairs = (line.split(" : ", 1) for line in out.splitlines() if " : " in line)
        return {name.strip('"'): value for name, value in pairs}

    def leader(self) -> Member:
        """The member that leads now."""
        for member in self.members:
            if member.running:
                status = self.status(member)
                if status.get("Leader") == status.get("MemberID", "none"):
                    return member
        raise AssertionError("no etcd member leads")

    def heal(self) -> None:
        """Back to whole after a test broke things: members rejoined and running, instances
        reconnected, healthy."""
        for member in self.members:
            member.rejoin(check=False)
            if not member.running:
                member.start()
        for instance in self.instances:
            instance.restore(check=False)
        self.wait_healthy()

    def close(self) -> None:
        for instance in self.instances:
            instance.netns.close()
        for member in self.members:
            member.netns.close()
        self.bridge_ns.close()
        shutil.rmtree(self.data, ignore_errors=True)


def _drop(netns: Netns, interface: str, on: bool, check: bool = True) -> None:
    action = "-I" if on else "-D"
    netns.run("iptables", action, "INPUT", "-i", interface, "-j", "DROP", check=check)
    netns.run("iptables", action, "OUTPUT", "-o", interface, "-j", "DROP", check=check)


def _peers(netns: Netns, on: bool, check: bool = True) -> None:
    action = "-I" if on else "-D"
    for chain, port in (("INPUT", "--dport"), ("INPUT", "--sport"), ("OUTPUT", "--dport"), ("OUTPUT", "--sport")):  # fmt: skip
        netns.run(
            "iptables", action, chain, "-p", "tcp", port, str(PEER_PORT), "-j", "DROP", check=check
        )


def make_tls(directory: Path, server_ips: list[str]) -> Tls:
    """A CA, a server certificate for those addresses, and a client certificate (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)

    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, cwd=directory)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=layerpy test CA")  # fmt: skip
    sans = ",".join(f"IP:{ip}" for ip in server_ips)
    for name, extra in (("server", f"subjectAltName={sans}"), ("client", "extendedKeyUsage=clientAuth")):  # fmt: skip
        (directory / f"{name}.ext").write_text(extra + "\n")
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext")  # fmt: skip
    return Tls(*(directory / name for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))  # fmt: skip


async def first_contact(etcd: Etcd, timeout: float = 30) -> None:
    """etcd.open(), again while the members do not answer yet (a busy machine)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await etcd.open()
            except EtcdUnavailable:
                await asyncio.sleep(0.2)


async def until(condition: Callable[[], object], what: str, timeout: float = 30) -> None:
    """Inside a scenario: wait for condition(); the failure says what was waited for."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"waited {timeout} s for {what}") from None


@asynccontextmanager
async def backend(cluster: EtcdCluster, name: str, prefix: str) -> AsyncIterator[EtcdBackend]:
    """An instance's EtcdBackend on the cluster, open for the block."""
    etcd = Etcd(cluster.endpoints)
    await first_contact(etcd)
    opened = EtcdBackend(etcd, name, prefix)
    try:
        await opened.open()
        yield opened
    finally:
        await opened.close()
        await etcd.close()
