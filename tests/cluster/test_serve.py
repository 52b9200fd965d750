"""Real ``layerpy serve`` processes as instances of one cluster: each in a namespace of its
own, on the 3-member etcd of tests/etcd.py and on one boot segment (a bridge in a namespace
of the test's), each with a node file of its own whose rest is the cluster's."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from layerpy.proto.agent import PROTOCOL

from etcd import EtcdCluster, Instance
from netns import Netns
from nodefile import BOOT_SECTIONS, InstanceFile

LAYERPY = Path(sys.executable).parent / "layerpy"
SEGMENT = "10.66.0"
NODES = [f"cn{i:03}" for i in range(1, 7)]
WAIT = 30.0  # seconds for anything a test waits for
TAKEOVER = 10.0  # seconds a dead instance's nodes may stay unowned (issue 27)

pytestmark = pytest.mark.netns

REST = f"""\
[network]
subnet = "{SEGMENT}.0/24"
gateway = "{SEGMENT}.1"

{BOOT_SECTIONS}
[groups.compute]
nodes = "cn[001-006]"
ip = "{SEGMENT}.[11-16]"
mac = "52:54:00:66:00:11-52:54:00:66:00:16"
bmc = {{ driver = "none" }}
"""


def own_server(address: str) -> str:
    """An instance's [server] table: its address on the boot segment."""
    return (f'interface = "boot0"\naddress = "{address}"\nstate_dir = "state"\nheartbeat = 2\n'
            f'dhcp = "off"\n')  # fmt: skip


class Head:
    """One ``layerpy serve`` instance: its folder, node file, namespace and process."""

    def __init__(self, file: InstanceFile, instance: Instance, address: str) -> None:
        self.file, self.instance, self.address = file, instance, address
        self.name = file.folder.name
        self.folder, self.path = file.folder, file.path
        self.log = self.folder / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.segment: Netns | None = None  # the boot segment's namespace (the nodes')

    @property
    def ns(self) -> Netns:
        return self.instance.netns

    def start(self) -> None:
        with self.log.open("ab") as out:
            command = [str(LAYERPY), "serve", "-c", str(self.path)]
            self.proc = self.ns.popen(command, stdout=out, stderr=out)

    def serving(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.log.read_text()}"
        return self.call("/api/v1/nodes")[0] == 200

    def call(self, path: str, *args: str) -> tuple[int, str]:
        """A request to this instance's operator API (its Unix socket)."""
        socket = self.folder / "state" / "api.sock"
        command = ["curl", "-s", "-g", "--unix-socket", str(socket), "-w", "\n%{http_code}"]
        result = subprocess.run([*command, *args, f"http://layerpy{path}"],
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        body, _, code = result.stdout.rpartition("\n")
        return int(code or 0), body

    def json(self, path: str) -> Any:
        code, body = self.call(path)
        assert code == 200, f"{path} on {self.name}: {code} {body}"
        return json.loads(body)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``layerpy ARGS -c this node file`` as an operator on this instance's host runs it."""
        return subprocess.run([str(LAYERPY), *args, "-c", str(self.path)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    def boot(self, node: int, hello_to: Head | None = None) -> tuple[list[str], dict[str, Any]]:
        """Node ``cn00<node>`` boots from this instance (its iPXE script: the servers on
        the kernel command line) and its agent says hello here, or to ``hello_to``, at once
        (the servers in the answer)."""
        assert self.segment is not None
        source, base = f"{SEGMENT}.{10 + node}", f"http://{self.address}:8080"
        there = f"http://{(hello_to or self).address}:8080"
        curl = ("curl", "-s", "--interface", source)
        script = self.segment.run(*curl, f"{base}/boot/{NODES[node - 1]}.ipxe").stdout
        token = re.search(r"layerpy.token=(\S+)", script)
        servers = re.search(r"layerpy.server=(\S+)", script)
        assert token and servers, script
        body = {"node": NODES[node - 1], "mac": f"52:54:00:66:00:{10 + node}", "ip": source,
                "boot_id": "b1", "seq": 1, "event": "hello", "busy": False,
                "protocol": PROTOCOL, "token": token.group(1)}  # fmt: skip
        result = self.segment.run(*curl, "-H", "Content-Type: application/json", "--data",
                                  json.dumps(body), f"{there}/api/v1/agent/report")  # fmt: skip
        return servers.group(1).split(","), json.loads(result.stdout)

    def owners(self) -> dict[str, str]:
        """node → owner, as this instance's cluster view says."""
        overview = self.json("/api/v1/cluster")
        return {node: entry["name"] for entry in overview["instances"] for node in entry["nodes"]}

    def stop(self, signum: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def heads(cluster: EtcdCluster, files: Callable[..., InstanceFile], count: int,
          rest: str = REST) -> Iterator[list[Head]]:  # fmt: skip
    """``count`` instances on one boot segment and the test's prefix, not started;
    ``rest`` is their node files' shared part."""
    segment = Netns("lpes")
    made: list[Head] = []
    try:
        segment.run("ip", "link", "add", "seg0", "type", "bridge")
        segment.run("ip", "link", "set", "seg0", "up")
        for node in range(len(NODES)):  # the nodes' addresses, for their agents' reports
            segment.run("ip", "addr", "add", f"{SEGMENT}.{11 + node}/24", "dev", "seg0")
        for index in range(count):
            instance = cluster.add_instance()
            address = f"{SEGMENT}.{index + 1}"
            head = Head(files(f"head{index + 1}", own_server(address), rest), instance, address)
            instance.connect(segment.name, "seg0", "boot0", f"{head.address}/24")
            made.append(head)
            # its links up before an instance runs there (it gives etcd 20 s, then refuses)
            until(functools.partial(reaches, instance, cluster.endpoints[0]),
                  f"{instance.address} reaching etcd")  # fmt: skip
        for head in made:
            head.segment = segment
        yield made
    finally:
        for head in made:
            head.stop(signal.SIGKILL)
        segment.close()


@pytest.fixture
def pair(cluster: EtcdCluster, instance_files: Callable[..., InstanceFile]
         ) -> Iterator[tuple[Head, Head]]:  # fmt: skip
    """Two instances serving, every node owned as both see it."""
    with heads(cluster, instance_files, 2) as (one, two):
        started(one, two)
        both = {one.name, two.name}
        until(lambda: all_owned(one, both) and all_owned(two, both),
              "every node owned, as both instances see it", logs=(one, two))  # fmt: skip
        yield one, two


def owning(one: Head, two: Head) -> None:
    """Wait until head1 owns nodes too (a kill or a cut of it then moves some)."""
    until(lambda: one.name in two.owners().values(), f"{one.name} owning nodes", logs=(one, two))


def reaches(instance: Instance, url: str) -> bool:
    """Whether an etcd member answers from the instance's namespace."""
    curl = instance.netns.run("curl", "-s", "-m", "1", f"{url}/version", check=False)
    return curl.returncode == 0


def until(condition: Callable[[], object], what: str, timeout: float = WAIT, logs=()) -> float:
    """Seconds until condition() is true; fails saying what was waited for."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            tails = "\n".join(f"--- {h.name}\n{h.log.read_text()[-3000:]}" for h in logs)
            pytest.fail(f"not within {timeout:g} s: {what}\n{tails}")
        time.sleep(0.1)
    return time.monotonic() - start


def started(*started_heads: Head) -> None:
    for head in started_heads:
        head.start()
    for head in started_heads:
        until(head.serving, f"{head.name} serving", logs=started_heads)


def all_owned(head: Head, by: set[str]) -> bool:
    owners = head.owners()
    return set(owners) == set(NODES) and set(owners.values()) <= by


def test_two_instances_share_one_file_and_a_third_that_differs_does_not_start(
    cluster: EtcdCluster, instance_files: Callable[..., InstanceFile]
) -> None:
    with heads(cluster, instance_files, 3) as (one, two, three):
        started(one, two)
        both = {one.name, two.name}
        until(lambda: all_owned(one, both) and all_owned(two, both),
              "every node owned, as both instances see it", logs=(one, two))  # fmt: skip
        assert one.owners() == two.owners()
        other = REST.replace('gateway = "10.66.0.1"', 'gateway = "10.66.0.2"')
        three.path.write_text(three.file.text(other))
        three.start()
        assert three.proc is not None
        assert three.proc.wait(WAIT) != 0
        said = three.log.read_text()
        assert "network.gateway" in said, said
        assert two.serving() and one.serving()


def test_a_reload_on_one_instance_applies_on_both(
    cluster: EtcdCluster, instance_files: Callable[..., InstanceFile]
) -> None:
    with heads(cluster, instance_files, 2) as (one, two):
        started(one, two)
        edited = REST + f'\n[nodes.cn007]\nip = "{SEGMENT}.17"\nmac = "52:54:00:66:00:17"\n'
        # the same rest on both hosts (the operator copies it), reloaded on one
        one.path.write_text(one.file.text(edited))
        result = one.cli("reload")
        assert result.returncode == 0, result.stdout + result.stderr
        for head in (one, two):
            until(lambda head=head: "applied revision 2" in head.log.read_text()
                  or "committed the node file as revision 2" in head.log.read_text(),
                  f"{head.name} on revision 2", logs=(one, two))  # fmt: skip
            assert "cn007" in {node["name"] for node in head.json("/api/v1/nodes")}
        # a file the other refuses (a path only one host has) changes nothing anywhere
        missing = edited.replace('kernel = "vmlinuz"', 'kernel = "vmlinuz-new"')
        (one.folder / "vmlinuz-new").write_bytes(b"k" * 1000)
        one.path.write_text(one.file.text(missing))
        refused = one.cli("reload")
        assert refused.returncode != 0
        assert "head2 refused it" in refused.stdout + refused.stderr, refused
        assert "revision 3" not in one.log.read_text() + two.log.read_text()


def test_status_and_cluster_through_either_show_every_node_with_its_owner(
    pair: tuple[Head, Head],
) -> None:
    one, two = pair
    both = {one.name, two.name}
    owners = one.owners()
    for head in (one, two):
        nodes = head.json("/api/v1/nodes")
        assert {node["name"]: node["owner"] for node in nodes} == owners
        shown = head.cli("cluster")
        assert shown.returncode == 0, shown.stderr
        assert one.name in shown.stdout and two.name in shown.stdout
        status = head.cli("status")
        assert status.returncode == 0, status.stderr
        assert "owner" in status.stdout
        for node, owner in owners.items():
            line = next(row for row in status.stdout.splitlines() if node in row)
            assert owner in line, (node, owner, status.stdout)
        metrics = head.call("/metrics")[1]
        for name in both:
            count = sum(owner == name for owner in owners.values())
            assert f'layerpy_cluster_owned_nodes{{instance="{name}"}} {count}.0' in metrics
        assert "layerpy_cluster_fence_open 1.0" in metrics


def test_an_agent_is_told_its_owner_first_by_either_instance(pair: tuple[Head, Head]) -> None:
    one, two = pair
    url = {one.name: f"http://{one.address}:8080", two.name: f"http://{two.address}:8080"}
    owners = one.owners()
    for index, node in enumerate(NODES, 1):
        for head in (one, two):
            cmdline, answer = head.boot(index)
            assert "servers" in answer, (node, head.name, answer)
            for servers in (cmdline, answer["servers"]):
                assert servers[0] == url[owners[node]], (node, head.name, servers)
                assert sorted(servers) == sorted(url.values())


def test_a_boot_token_from_one_instance_is_good_at_once_on_the_other(
    pair: tuple[Head, Head],
) -> None:
    """The agent says hello to its owner, which need not be the instance that gave it its
    boot script: the token is in etcd before the script goes out (and an owner that has not
    yet heard of it reads it again before refusing)."""
    one, two = pair
    for index, node in enumerate(NODES, 1):
        for script_from, hello_to in ((one, two), (two, one)):
            _, answer = script_from.boot(index, hello_to=hello_to)
            assert "error" not in answer, (node, script_from.name, hello_to.name, answer)


def test_a_killed_instances_nodes_are_taken_over_within_ten_seconds(
    pair: tuple[Head, Head],
) -> None:
    one, two = pair
    owning(one, two)
    one.stop(signal.SIGKILL)
    took = until(lambda: all_owned(two, {two.name}), "head2 owning every node",
                 timeout=TAKEOVER, logs=(two,))  # fmt: skip
    print(f"take-over after kill -9: {took:.1f} s")
    until(lambda: {node["owner"] for node in two.json("/api/v1/nodes")} == {two.name},
          "head2's node list naming it the owner of every node", logs=(two,))  # fmt: skip
    shown = two.json("/api/v1/cluster")
    assert [i["name"] for i in shown["instances"] if i["alive"]] == [two.name]
    text = two.cli("cluster").stdout
    assert "gone" in text, text


def test_a_clean_stop_hands_the_nodes_over_at_once(pair: tuple[Head, Head]) -> None:
    one, two = pair
    owning(one, two)
    stopping = time.monotonic()
    one.stop()
    until(lambda: all_owned(two, {two.name}), "head2 owning every node", timeout=4.0,
          logs=(one, two))  # fmt: skip
    print(f"hand-over after a clean stop: {time.monotonic() - stopping:.1f} s")
    assert "could not revoke" not in one.log.read_text()


def test_an_instance_cut_off_from_etcd_stops_acting_and_says_so(pair: tuple[Head, Head]) -> None:
    one, two = pair
    owning(one, two)
    node = next(node for node, owner in two.owners().items() if owner == one.name)
    one.instance.cut()
    try:
        closed = until(lambda: "layerpy_cluster_fence_open 0.0" in one.call("/metrics")[1],
                       "head1's fence closed", logs=(one,))  # fmt: skip
        print(f"fence closed {closed:.1f} s after the cut")
        shown = one.cli("cluster")
        assert "lost etcd: not acting" in shown.stdout, shown.stdout + shown.stderr
        off = json.dumps({"nodes": node, "action": "off"})
        code, body = one.call("/api/v1/power", "-X", "POST", "-H",
                              "Content-Type: application/json", "--data", off)  # fmt: skip
        assert code == 200, body
        until(lambda: "lost etcd" in str(one.json(f"/api/v1/nodes/{node}/explain")["held"]),
              f"explain of {node} on head1 saying it is held", logs=(one,))  # fmt: skip
        until(lambda: all_owned(two, {two.name}), "head2 owning every node",
              timeout=TAKEOVER, logs=(two,))  # fmt: skip
    finally:
        one.instance.restore(check=False)


def test_an_instance_that_reaches_no_etcd_member_does_not_start(
    cluster: EtcdCluster, instance_files: Callable[..., InstanceFile]
) -> None:
    with heads(cluster, instance_files, 1) as (one,):
        one.path.write_text(one.path.read_text().replace(
            ", ".join(f'"{url}"' for url in cluster.endpoints), '"http://10.79.0.250:2379"'
        ))  # fmt: skip
        one.start()
        assert one.proc is not None
        assert one.proc.wait(60)  # it tries for REACH_WITHIN (20 s) first != 0
        said = one.log.read_text()
        assert "no etcd member answered" in said and "http://10.79.0.250:2379" in said, said
        assert "start etcd's members" in said
