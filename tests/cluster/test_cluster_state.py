"""The node store's state shared by two instances through real etcd (issue 27, point 2):
two NodeStores (and BootPolicies) on two EtcdBackends over a 3-member etcd (tests/etcd.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from ipaddress import IPv4Address

import pytest

from layerpy.boot import BootPolicy
from layerpy.catalog import Catalog
from layerpy.cluster.etcd import Etcd
from layerpy.config import Config, load
from layerpy.images import ImageStore
from layerpy.lifecycle import Lifecycle
from layerpy.model import Phase, PowerState, RunState
from layerpy.nodes import NodeStore
from layerpy.proto import dhcp
from layerpy.proto.agent import PROTOCOL
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

from dhcp_requests import BIOS, SERVER, request
from etcd import EtcdCluster, Instance, backend, first_contact

pytestmark = pytest.mark.netns

NODE, MAC = "cn001", "52:54:00:99:00:11"


def pooled(make_config, more: str = "") -> Config:
    """The test node file with a discovery pool of 231 addresses."""
    config = make_config(more=more)
    text = config.path.read_text().replace('pool = "10.99.0.200-', 'pool = "10.99.0.20-', 1)
    config.path.write_text(text.replace('pool = "', 'discover = true\npool = "', 1))
    return load(config.path)


@pytest.fixture
def config(make_config) -> Config:
    return pooled(make_config)


@asynccontextmanager
async def stores(
    cluster: EtcdCluster, config: Config, prefix: str, *names: str
) -> AsyncIterator[list[NodeStore]]:
    """One NodeStore per instance name, each on its own EtcdBackend (as `layerpy serve`)."""
    async with AsyncExitStack() as stack:
        opened = []
        for name in names:
            kept = await stack.enter_async_context(backend(cluster, name, prefix))
            opened.append(NodeStore(config, backend=kept))
        yield opened


async def until(condition, what: str, timeout: float = 20) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"waited {timeout} s for {what}") from None


def report(store: NodeStore, token: str, event: str = "heartbeat", seq: int = 1):
    payload = {"node": NODE, "token": token, "mac": MAC, "ip": "10.99.0.11", "boot_id": "b1",
               "seq": seq, "uptime": seq, "event": event, "protocol": PROTOCOL}  # fmt: skip
    return store.report(payload)


async def revision(cluster: EtcdCluster) -> int:
    etcd = Etcd(cluster.endpoints)
    await first_contact(etcd)
    try:
        return (await etcd.range("/lps-none/"))[1]
    finally:
        await etcd.close()


def test_a_token_issued_on_one_instance_is_accepted_by_another(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    """An agent that moves to another instance keeps its token; the instance it reports
    to is the one that hears it (heard_by), on both."""

    async def scenario() -> None:
        async with stores(cluster, config, prefix, "a", "b") as (a, b):
            token = a.issue_token(a.nodes[NODE])
            report(a, token, "hello")
            await until(lambda: b.holds_token(NODE, token), "b to accept a's token")
            assert not b.holds_token(NODE, "not-the-token")
            report(b, token, seq=2)  # the agent moved: b takes its report
            await until(lambda: a.nodes[NODE].heard_by == "b", "a to see that b hears cn001")
            assert b.nodes[NODE].run_state == RunState.READY
            assert a.nodes[NODE].run_state == RunState.READY

    instance.run(scenario)


def test_a_node_added_by_a_reload_shows_what_other_instances_know_of_it(
    cluster: EtcdCluster, instance: Instance, make_config, prefix: str
) -> None:
    """An instance that applies a reload later than another has missed the other's
    records of the new node meanwhile: it reads them when the node is added."""
    extra = '\n[nodes.cn009]\nip = "10.99.0.19"\n'
    old, new = pooled(make_config), pooled(make_config, extra)

    async def scenario() -> None:
        async with AsyncExitStack() as stack:
            ka = await stack.enter_async_context(backend(cluster, "a", prefix))
            kb = await stack.enter_async_context(backend(cluster, "b", prefix))
            a, b = NodeStore(new, backend=ka), NodeStore(old, backend=kb)
            token = a.issue_token(a.nodes["cn009"])
            a.saw_power("cn009", PowerState.ON)
            await ka.flush()
            await until(lambda: kb.get("observed", "cn009") is not None, "b's mirror to hear")
            b.apply_config(new)
            assert b.holds_token("cn009", token) and b.nodes["cn009"].power == PowerState.ON

    instance.run(scenario)


def test_a_binding_made_on_one_instance_holds_on_another(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    async def scenario() -> None:
        async with stores(cluster, config, prefix, "a", "b") as (a, b):
            new = "52:54:00:99:00:77"
            a.bind(NODE, new, "operator")
            await until(lambda: b.by_mac(new) is b.nodes[NODE], "b to find cn001 by its new MAC")
            assert b.nodes[NODE].mac == new
        async with stores(cluster, config, prefix, "c") as (c,):  # a later instance too
            assert c.by_mac(new) is c.nodes[NODE]

    instance.run(scenario)


def test_observed_changes_show_on_the_other_instance_and_heartbeats_write_nothing(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    async def scenario() -> None:
        async with stores(cluster, config, prefix, "a", "b") as (a, b):
            changes = b.feed.subscribe()
            a.saw_power(NODE, PowerState.ON)
            a.saw_boot_request(a.nodes[NODE], "ipxe")
            token = a.issue_token(a.nodes[NODE])
            report(a, token, "hello")
            report(a, token, seq=2)
            shown = b.nodes[NODE]
            await until(lambda: shown.run_state == RunState.READY, "b to show cn001 ready", 5)
            assert shown.power == PowerState.ON and shown.heard_by == "a"
            assert Phase.SCRIPT in shown.boot.phases and shown.boots == 1
            seen = [c.fields for c in changes.pending() if c.node == NODE]
            assert any(f.get("power") == PowerState.ON for f in seen)  # on b's feed too

            await a.backend.flush()
            before = await revision(cluster)
            for seq in range(3, 1003):
                report(a, token, seq=seq)
            await a.backend.flush()
            assert await revision(cluster) == before, "heartbeats wrote to etcd"
            a.check_lost()
            b.check_lost()
            assert shown.run_state == RunState.READY

    instance.run(scenario)


def test_only_the_instance_that_hears_a_node_declares_it_lost(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    async def scenario() -> None:
        now = [1000.0]
        clocked = {"clock": lambda: now[0]}
        async with AsyncExitStack() as stack:
            ka = await stack.enter_async_context(backend(cluster, "a", prefix))
            kb = await stack.enter_async_context(backend(cluster, "b", prefix))
            a = NodeStore(config, backend=ka, **clocked)
            b = NodeStore(config, backend=kb, **clocked)
            token = a.issue_token(a.nodes[NODE])
            report(a, token, "hello")
            report(a, token, seq=2)
            await until(lambda: b.nodes[NODE].heard_by == "a", "b to see cn001 report to a")
            report(b, token, seq=3)  # the agent moves to b
            await until(lambda: a.nodes[NODE].heard_by == "b", "a to see cn001 moved to b")
            now[0] += 10 * a.lost_limit  # nobody hears it any more
            a.check_lost()  # a heard it before: no longer its to judge
            await ka.flush()
            assert a.nodes[NODE].run_state == RunState.READY
            b.check_lost()
            await until(lambda: a.nodes[NODE].run_state == RunState.LOST, "a to show b's verdict")

    instance.run(scenario)


def lifecycle_of(store: NodeStore) -> Lifecycle:
    images = ImageStore(store.config.server.state_dir / "images")
    return Lifecycle(store, store.backend, Catalog(images, store.feed), 3600)


def test_assignments_and_overrides_made_on_one_instance_hold_on_another(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    """What the owner's engine assigned is what any instance tells the node's agent; an
    operator's override through any instance reaches the one that acts."""

    async def scenario() -> None:
        image = ("base", "sha256:" + "a" * 64)
        async with stores(cluster, config, prefix, "a", "b") as (a, b):
            la, lb = lifecycle_of(a), lifecycle_of(b)
            la.assign(NODE, image)
            await until(lambda: lb.assigned.get(NODE) == image, "b to carry a's assignment")
            lb.override("cn002", "off")
            await until(
                lambda: la.overrides.get("cn002") == {"power": "off"}, "a to take the override"
            )
            la.assign(NODE, None)  # a new boot: told afresh, everywhere
            await until(lambda: NODE not in lb.assigned, "b to drop the assignment")
            la.assign(NODE, image)
            await a.backend.flush()
        async with stores(cluster, config, prefix, "c") as (c,):  # a later instance too
            lc = lifecycle_of(c)
            assert lc.assigned == {NODE: image} and lc.overrides == {"cn002": {"power": "off"}}

    instance.run(scenario)


class Wire:
    """A DHCP service of one instance and the replies it sent (in a cluster, a reply that
    commits a pool lease is sent once its transaction is kept, by a task of the service)."""

    def __init__(self, store: NodeStore, gate=None) -> None:
        self.policy = BootPolicy(store, store.backend, pool_gate=gate)
        self.service = DhcpService(self.policy, SERVER, Stats(), False, send=self._send)
        self.sent: list[dhcp.DhcpPacket] = []

    def _send(self, data: bytes, destination: tuple[str, int]) -> bool:
        self.sent.append(dhcp.decode(data))
        return True

    def refused(self) -> int:
        """Replies not sent: etcd refused their transaction (another instance was first)."""
        dhcp_stats = self.service.stats.as_json().get("dhcp", {})
        return dhcp_stats.get("not-kept", {}).get("requests", 0)

    async def ask(self, packet: dhcp.DhcpPacket) -> dhcp.DhcpPacket | None:
        sent, refused = len(self.sent), self.refused()
        _, decision = self.service.handle(packet)
        if decision.reply is None:
            return None
        await until(lambda: len(self.sent) > sent or self.refused() > refused,
                    "the reply to be sent or refused")  # fmt: skip
        return self.sent[sent] if len(self.sent) > sent else None

    async def lease(self, mac: str) -> IPv4Address | None:
        """DISCOVER then REQUEST: the address ACKed, or None."""
        offer = await self.ask(request(dhcp.DISCOVER, mac=mac, **BIOS))
        if offer is None:
            return None
        ask = request(dhcp.REQUEST, mac=mac, o50=offer.yiaddr.packed, o54=SERVER.packed, **BIOS)
        ack = await self.ask(ask)
        return ack.yiaddr if ack is not None and ack.message_type == dhcp.ACK else None


def macs(count: int) -> list[str]:
    return [f"52:54:00:ee:{i // 256:02x}:{i % 256:02x}" for i in range(count)]


def test_two_pool_allocators_racing_never_share_an_address_or_split_a_client(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    """Both gates open (as when a pool holder hands over): each commit is a transaction,
    so two instances never give one address to two machines nor two to one machine."""

    async def scenario() -> None:
        async with stores(cluster, config, prefix, "a", "b") as (a, b):
            wires = [Wire(a), Wire(b)]
            clients = macs(200)
            acked: list[tuple[str, IPv4Address]] = []

            async def allocate(wire: Wire, order: list[str]) -> None:
                for mac in order:
                    for _ in range(10):  # a client asks again when it got nothing
                        address = await wire.lease(mac)
                        if address is not None:
                            acked.append((mac, address))
                            break
                    await asyncio.sleep(0)

            await asyncio.gather(allocate(wires[0], clients), allocate(wires[1], clients[::-1]))
            by_address: dict[IPv4Address, set[str]] = {}
            by_mac: dict[str, set[IPv4Address]] = {}
            for mac, address in acked:
                by_address.setdefault(address, set()).add(mac)
                by_mac.setdefault(mac, set()).add(address)
            assert wires[0].refused() + wires[1].refused() > 0, "the allocators never raced"
            assert len(by_mac) == 200, "every client got an address"
            assert all(len(m) == 1 for m in by_address.values()), "an address went to two MACs"
            assert all(len(m) == 1 for m in by_mac.values()), "a MAC got two addresses"
            await until(lambda: sum(1 for r in a.backend.load("leases").values()
                                    if r["state"] == "bound") == 200,
                        "etcd to hold 200 bound leases")  # fmt: skip
            held = {r["client"] for r in a.backend.load("leases").values()}
            assert held == set(clients)

    instance.run(scenario)


def test_a_new_pool_holder_continues_from_the_leases_in_etcd(
    cluster: EtcdCluster, instance: Instance, config: Config, prefix: str
) -> None:
    async def scenario() -> None:
        holder = ["a"]
        async with stores(cluster, config, prefix, "a", "b") as (a, b):
            first = Wire(a, lambda: holder[0] == "a")
            second = Wire(b, lambda: holder[0] == "b")
            early = macs(20)
            given = {mac: await first.lease(mac) for mac in early}
            assert None not in given.values()
            assert await second.lease("52:54:00:ee:ff:ff") is None  # not its pool (yet)
            await until(lambda: all(second.policy.discovery_address(m) == given[m] for m in early),
                        "b to follow a's leases")  # fmt: skip
            holder[0] = "b"  # a hands the pool over (a's fence closed)
            assert await first.lease("52:54:00:ee:ff:fe") is None
            again = {mac: await second.lease(mac) for mac in early}
            assert again == given, "a client kept its address across the hand-over"
            newcomer = await second.lease("52:54:00:ee:ff:ff")
            assert newcomer is not None and newcomer not in given.values()
        async with stores(cluster, config, prefix, "c") as (c,):  # a holder started later
            third = Wire(c)
            assert {mac: await third.lease(mac) for mac in early} == given

    instance.run(scenario)
