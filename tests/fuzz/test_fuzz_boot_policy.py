"""Fuzzing the whole DHCP path of the boot policy on a small node file: decode, screen,
``BootPolicy.verdict``, the protocol core, ``BootPolicy.apply`` (the DHCP service's
``handle``), authoritative with a discovery pool and ProxyDHCP on ports 67 and 4011, from
any sender. Nothing but DhcpError escapes, and a refused datagram changes nothing: not the
node store, not the lease table, not a file in the state directory."""

from __future__ import annotations

import dataclasses
import tempfile
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.boot import Verdict
from layerpy.config import Config, load
from layerpy.proto import dhcp
from layerpy.proto.dhcp_server import Decision
from layerpy.proto.proxy_dhcp import BOOT_SERVER_PORT
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

from clock import Clock
from fuzzing import FUZZ, NODE_MACS, RELAY, SERVER, any_datagram, clients
from nodefile import BOOT_SECTIONS, write_boot_files
from stores import local_policy

NODE_FILE = """\
[server]
interface = "br0"
address = "{server}"
state_dir = "state"
heartbeat = 2
{mode}
[network]
subnet = "10.99.0.0/24"
gateway = "{server}"
{pool}
{boot_sections}
[switches.sw1]
relay = "{relay}"

[groups.compute]
nodes = "cn[001-002]"
{addresses}
mac = ["{mac1}", "{mac2}"]

[nodes.cn003]
{address3}
location = "sw1:swp3"
"""


def node_file(directory: Path, proxy: bool) -> Config:
    """cn001 and cn002 by MAC, cn003 by its port behind the relay; authoritative with a
    discovery pool, or ProxyDHCP (cn003 without an address of its own)."""
    write_boot_files(directory)
    path = directory / ("proxy.toml" if proxy else "nodes.toml")
    path.write_text(
        NODE_FILE.format(
            server=SERVER,
            relay=RELAY,
            mode='dhcp = "proxy"\n' if proxy else "",
            pool="" if proxy else 'pool = "10.99.0.200-10.99.0.250"\ndiscover = true\n',
            boot_sections=BOOT_SECTIONS,
            addresses='ip = "10.99.0.[11-12]"',
            address3="" if proxy else 'ip = "10.99.0.13"',
            mac1=NODE_MACS[0],
            mac2=NODE_MACS[1],
        )
    )
    return load(path)


@pytest.fixture(scope="module")
def node_files(tmp_path_factory) -> dict[bool, Config]:
    directory = tmp_path_factory.mktemp("fuzz-policy")
    return {proxy: node_file(directory, proxy) for proxy in (False, True)}


def fresh_service(config: Config, state_dir: Path, port: int) -> DhcpService:
    """A DHCP service (without a socket) on a fresh state directory: every example starts
    from the same state, so a failure replays and shrinks."""
    server = dataclasses.replace(config.server, state_dir=state_dir)
    config = dataclasses.replace(config, server=server)
    policy = local_policy(config, clock=Clock())
    proxy = config.server.dhcp == "proxy"
    return DhcpService(policy, IPv4Address(SERVER), Stats(), False, port=port, proxy=proxy)


def snapshot(service: DhcpService) -> dict[str, Any]:
    """Everything a datagram could change (nodes, bindings, unknown machines, the feed of
    changes, the pool's leases, the files in the state directory) but the sighting itself:
    which MAC asked (a node's ``mac``, an unknown machine's entry and counters) is recorded
    for the operator whatever the answer, as the node store's docs say."""
    policy, store = service.booter, service.booter.nodes
    state_dir = policy.config.server.state_dir
    return {
        "nodes": {name: dataclasses.replace(node, mac=None) for name, node in store.nodes.items()},
        "bindings": dict(store.identities.bindings),
        "unknown": {
            machine.mac: (machine.conflict, machine.claim, machine.token_digest)
            for machine in store.unknown.values()
            if machine.conflict or machine.claim or machine.token_digest
        },
        "feed": [
            (c.node, c.kind, c.fields, c.message)
            for c in store.feed.history
            if set(c.fields) != {"mac"}
        ],
        "leases": policy.leases.records() if policy.leases is not None else None,
        "files": {p.name: p.read_bytes() for p in sorted(state_dir.iterdir()) if p.is_file()},
    }


def changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [key for key in before if before[key] != after[key]]


class Recorder:
    """The service as the socket drives it (``datagram_received``), with what it decided
    and what it sent on the side: whatever the service refuses before deciding (undecodable,
    screened, or dropped by a check of its own) shows as no decision at all."""

    def __init__(self, service: DhcpService) -> None:
        self.service = service
        self.decided: list[tuple[Verdict, Decision]] = []
        self.failed: list[BaseException] = []
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        self._handle = service.handle
        service.handle = self.handle  # type: ignore[method-assign]
        service.send = self.send

    def handle(self, request: dhcp.DhcpPacket, sender: tuple[str, int]) -> tuple[Verdict, Decision]:
        try:
            result = self._handle(request, sender)
        except BaseException as error:  # the service logs and swallows it: keep it here
            self.failed.append(error)
            raise
        self.decided.append(result)
        return result

    def send(self, data: bytes, destination: tuple[str, int]) -> bool:
        self.sent.append((data, destination))
        return True

    def receive(self, data: bytes, sender: tuple[str, int]) -> tuple[Verdict, Decision] | None:
        """One datagram through the whole path; its verdict and decision, if any."""
        self.decided.clear()
        self.sent.clear()
        self.service.datagram_received(data, sender)
        assert not self.failed, f"the DHCP service failed on {data!r} from {sender}: {self.failed}"
        return self.decided[-1] if self.decided else None


modes = st.sampled_from([(False, 67), (True, 67), (True, BOOT_SERVER_PORT)])
senders = st.tuples(st.one_of(clients, st.just(RELAY)), st.sampled_from([67, 68, 4011, 40000]))


@FUZZ
@given(modes, st.lists(st.tuples(any_datagram, senders), min_size=1, max_size=4))
def test_policy_path(node_files, mode: tuple[bool, int], datagrams) -> None:
    """Known gaps, left out of the check here and tested on their own below: the location a
    relay names (option 82) and a boot firmware's DISCOVER are taken as observations even
    when the request is refused."""
    proxy, port = mode
    with tempfile.TemporaryDirectory() as state:
        service = Recorder(fresh_service(node_files[proxy], Path(state), port))
        for data, sender in datagrams:
            before = snapshot(service.service)
            decided = service.receive(data, sender)
            after = snapshot(service.service)
            if decided is None:
                event("refused before a decision")
                assert not service.sent
                assert not changes(before, after)
                continue
            verdict, decision = decided
            event(f"proxy={proxy} port {port}: {decision.answer}")
            assert bool(service.sent) == (decision.reply is not None)
            if decision.answer != "silent" or decision.effects:
                continue
            if verdict.location is not None or verdict.boot_request:
                event("refused, but a location or a boot request seen (not checked here)")
                continue
            assert not changes(before, after), (verdict, decision)


def relayed(kind: int, mac: str, circuit: bytes, vendor: bytes) -> bytes:
    """A request as a relay agent forwards it: giaddr the relay's, option 82 its port."""
    chaddr = bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0")
    options = {dhcp.OPT_MESSAGE_TYPE: bytes((kind,)), dhcp.OPT_RELAY_AGENT: circuit}
    if vendor:
        options[dhcp.OPT_VENDOR_CLASS] = vendor
    if kind == dhcp.REQUEST:
        options[dhcp.OPT_REQUESTED_IP] = IPv4Address("10.99.0.13").packed
    zero = dhcp.ANY
    packet = dhcp.DhcpPacket(1, 1, 6, 1, 7, 0, 0, zero, zero, zero, IPv4Address(RELAY), chaddr,
                             bytes(64), bytes(128), options)  # fmt: skip
    return dhcp.encode(packet)


forged = st.builds(
    relayed,
    st.sampled_from([dhcp.DISCOVER, dhcp.REQUEST, dhcp.INFORM]),
    st.one_of(st.sampled_from(NODE_MACS), st.binary(min_size=6, max_size=6).map(bytes.hex)),
    st.sampled_from([b"\x01\x04swp3", b"\x01\x04swp3\x02\x03sw1", b"\x01\x04swp9"]),
    st.sampled_from([b"", b"PXEClient:Arch:00000:UNDI:002001"]),
)


@FUZZ
@given(modes, st.lists(st.tuples(forged, senders.filter(lambda s: s[0] != RELAY)), max_size=3))
def test_forged_relay_changes_nothing(node_files, mode: tuple[bool, int], datagrams) -> None:
    """A relayed datagram from an address that is not the relay's is dropped: no answer, and
    no binding, boot, lease or file changes (issue 26 point 1)."""
    proxy, port = mode
    with tempfile.TemporaryDirectory() as state:
        service = Recorder(fresh_service(node_files[proxy], Path(state), port))
        for data, sender in datagrams:
            before = snapshot(service.service)
            service.receive(data, sender)
            assert not service.sent, f"answered a forged relayed datagram from {sender}"
            assert not changes(before, snapshot(service.service))


@pytest.mark.parametrize(
    ("port", "vendor"),
    [(BOOT_SERVER_PORT, b"PXEClient:Arch:00000:UNDI:002001"), (BOOT_SERVER_PORT, b""), (67, b"")],
)
def test_refused_discover_starts_no_boot(node_files, port: int, vendor: bytes) -> None:
    """A DISCOVER from boot firmware (iPXE, option 175) that gets no answer is no boot: the
    cases the fuzzing found, in ProxyDHCP."""
    mac = NODE_MACS[0]
    chaddr = bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0")
    options = {dhcp.OPT_MESSAGE_TYPE: bytes((dhcp.DISCOVER,)), dhcp.OPT_IPXE: b"\x13\x01\x01"}
    if vendor:
        options[dhcp.OPT_VENDOR_CLASS] = vendor
    zero = dhcp.ANY
    packet = dhcp.DhcpPacket(1, 1, 6, 0, 7, 0, 0, zero, zero, zero, zero, chaddr, bytes(64),
                             bytes(128), options)  # fmt: skip
    with tempfile.TemporaryDirectory() as state:
        service = Recorder(fresh_service(node_files[True], Path(state), port))
        before = snapshot(service.service)
        decided = service.receive(dhcp.encode(packet), ("10.99.0.11", 68))
        assert decided is not None and decided[1].answer == "silent"
        assert not changes(before, snapshot(service.service)), decided
