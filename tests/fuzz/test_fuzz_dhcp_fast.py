"""The DHCP fast path against the reference path, side by side (issue 29).

Two services on the same node file, each with a node store and state directory of its own
and the same clock: one answers from prepared replies where it can (services/dhcp_fast.py),
the other by the reference path alone (``prepared=False``). Both are fed the same
datagrams: requests as clients send them (every firmware class, relayed by the file's
relay, by a forged one or from outside the subnet, with option 82, SELECTING, INIT-REBOOT,
RENEWING, REBINDING, RELEASE, DECLINE, INFORM, right and wrong addresses, a client id to
echo, small maximum sizes), now and then with a byte changed or cut short, and the clock
moving between them (offers and leases lapse). After each, both must have sent the same
bytes to the same place and be in the same state: nodes, bindings, unknown machines, the
feed of changes, the pool's leases, every file of the state directory, the counters.
"""

from __future__ import annotations

import dataclasses
import tempfile
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.config import Config, load
from layerpy.proto import dhcp
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

from clock import Clock
from fuzzing import FUZZ, RELAY, SERVER, dhcp_datagrams
from nodefile import BOOT_SECTIONS, write_boot_files
from stores import local_policy

NODE_FILE = """\
[server]
interface = "br0"
address = "{server}"
state_dir = "state"

[network]
subnet = "10.99.0.0/24"
gateway = "{server}"
dns = ["{server}"]
domain = "lab"
pool = "10.99.0.200-10.99.0.204"
discover = true
{boot_sections}
[switches.sw1]
relay = "{relay}"

[groups.compute]
nodes = "cn[001-002]"
ip = "10.99.0.[11-12]"
mac = ["52:54:00:99:00:11", "52:54:00:99:00:12"]

[nodes.cn003]
ip = "10.99.0.13"
location = "sw1:swp3"

[nodes.cn004]
ip = "10.99.0.14"
mac = "52:54:00:99:00:14"
secure_boot = true
"""
NODES = ("52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:14")
STRANGERS = ("52:54:00:aa:00:01", "52:54:00:aa:00:02", "52:54:00:aa:00:03")
OTHER_SERVER = "10.99.0.2"
FIRMWARE = {
    "bios": {60: b"PXEClient:Arch:00000:UNDI:002001", 93: b"\x00\x00"},
    "old-pxe": {60: b"PXEClient:Arch:00000:UNDI:002001"},
    "uefi": {60: b"PXEClient:Arch:00007:UNDI:003016", 93: b"\x00\x07", 97: b"\0" + bytes(16)},
    "arm64": {60: b"PXEClient:Arch:00011:UNDI:003000", 93: b"\x00\x0b"},
    "http": {60: b"HTTPClient:Arch:00016:UNDI:003001", 93: b"\x00\x10"},
    "ipxe": {60: b"PXEClient:Arch:00000:UNDI:002001", 77: b"iPXE", 175: b"\xb1\x05\x01\x80"},
    "ipxe-arm64": {77: b"iPXE", 93: b"\x00\x0b"},
    "pi": {93: b"\x00\x00", 97: b"\0RPi4" + bytes(8) + bytes.fromhex("78563412")},
    "arch-42": {60: b"PXEClient:Arch:00042:UNDI:003000", 93: b"\x00\x2a"},
    "os": {60: b"udhcp 1.35.0", 12: b"cn001"},
    "bare": {},
}
STATES = ("discover", "selecting", "selecting-other", "init-reboot", "renewing", "rebinding",
          "release", "decline", "inform")  # fmt: skip
RELAYS = ("none", "relay", "relay-82", "forged-sender", "off-subnet")


def node_file(directory: Path) -> Config:
    write_boot_files(directory)
    path = directory / "nodes.toml"
    path.write_text(NODE_FILE.format(server=SERVER, relay=RELAY, boot_sections=BOOT_SECTIONS))
    return load(path)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Config:
    return node_file(tmp_path_factory.mktemp("fast-path"))


class Side:
    """One service as its socket drives it, with what it sent."""

    def __init__(self, config: Config, state_dir: Path, clock: Clock, prepared: bool) -> None:
        config = dataclasses.replace(
            config, server=dataclasses.replace(config.server, state_dir=state_dir)
        )
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        self.service = DhcpService(
            local_policy(config, clock=clock), IPv4Address(SERVER), Stats(), False,
            send=self.send, prepared=prepared,
        )  # fmt: skip

    def send(self, data: bytes, destination: tuple[str, int]) -> bool:
        self.sent.append((data, destination))
        return True

    def receive(self, data: bytes, sender: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]]:
        self.sent.clear()
        self.service.datagram_received(data, sender)
        return list(self.sent)

    def state(self) -> dict[str, Any]:
        """Everything a datagram could change."""
        service = self.service
        policy, store = service.booter, service.booter.nodes
        state_dir = policy.config.server.state_dir
        return {
            "nodes": dict(store.nodes),
            "bindings": dict(store.identities.bindings),
            "unknown": {mac: dataclasses.astuple(machine) for mac, machine in store.unknown.machines.items()},
            "feed": [(c.node, c.kind, c.fields, c.message) for c in store.feed.history],
            "leases": policy.leases.records() if policy.leases is not None else None,
            "files": {p.name: p.read_bytes() for p in sorted(state_dir.iterdir()) if p.is_file()},
            "counts": {key: (s.requests, s.failures) for key, s in service.stats.series.items()},
            "logged": dict(service._logged),
        }  # fmt: skip


def _ip(text: str) -> IPv4Address:
    return IPv4Address(text)


@st.composite
def profiles(draw: st.DrawFn) -> dict[str, Any]:
    """How a client asks: its firmware, relay, client id, maximum size and parameter list,
    the same from one request to the next (so that shapes repeat, as they do)."""
    mac = draw(st.sampled_from(NODES + STRANGERS))
    relay = draw(st.sampled_from(RELAYS))
    options: dict[int, bytes] = dict(FIRMWARE[draw(st.sampled_from(sorted(FIRMWARE)))])
    if draw(st.booleans()):
        options[61] = b"\x01" + bytes.fromhex(mac.replace(":", ""))
    elif draw(st.integers(0, 9)) == 0:
        options[61] = bytes(range(200))  # too long for some maximum sizes: fitted
    size = draw(st.sampled_from([None, None, 576, 1500, 300]))
    if size is not None:
        options[57] = size.to_bytes(2)
    wanted = draw(st.permutations([1, 3, 6, 12, 15, 43, 60, 66, 67, 175]))
    options[55] = bytes(wanted[: draw(st.integers(0, 10))])
    flags = draw(st.sampled_from([0, dhcp.BROADCAST_FLAG]))
    return {"mac": mac, "relay": relay, "options": options, "flags": flags}


@st.composite
def client_requests(
    draw: st.DrawFn, clients: list[dict[str, Any]], given: dict[str, IPv4Address]
) -> tuple[bytes, str]:
    """A request as one of `clients` sends it in some state, and who sends it; `given`
    holds the address each MAC was last offered or acknowledged (what it would ask for)."""
    client = draw(st.sampled_from(clients))
    if draw(st.integers(0, 4)) == 0:
        client = draw(profiles())  # now and then one of another kind
    mac, relay, flags = client["mac"], client["relay"], client["flags"]
    options = dict(client["options"])
    state = draw(st.sampled_from(STATES + ("discover", "selecting", "renewing") * 3))
    own = given.get(mac, _ip("10.99.0.11"))
    address = draw(st.sampled_from([own, own, own, _ip("10.99.0.201"), _ip("10.99.0.77"),
                                    _ip("10.98.0.5")]))  # fmt: skip
    ciaddr = dhcp.ANY
    kind = {"release": dhcp.RELEASE, "decline": dhcp.DECLINE, "inform": dhcp.INFORM,
            "discover": dhcp.DISCOVER}.get(state, dhcp.REQUEST)  # fmt: skip
    if state in ("selecting", "decline"):
        options[54], options[50] = _ip(SERVER).packed, address.packed
    elif state == "selecting-other":
        options[54], options[50] = _ip(OTHER_SERVER).packed, address.packed
    elif state == "init-reboot":
        options[50] = address.packed
    elif state in ("renewing", "rebinding", "release", "inform"):
        ciaddr = address
        flags = 0 if state == "renewing" else flags
        if state == "release":
            options[54] = _ip(SERVER).packed
    elif draw(st.booleans()):  # a DISCOVER that names the address it had
        options[50] = address.packed
    giaddr, sender = dhcp.ANY, "0.0.0.0" if ciaddr == dhcp.ANY else str(ciaddr)
    if relay != "none":
        giaddr = _ip("10.98.0.1") if relay == "off-subnet" else _ip(RELAY)
        sender = "10.99.0.99" if relay == "forged-sender" else str(giaddr)
        if relay == "relay-82":
            options[82] = b"\x01\x04swp3"
    hops = 1 if relay != "none" else 0
    packet = dhcp.DhcpPacket(
        1, 1, 6, hops, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 5)), flags,
        ciaddr, dhcp.ANY, dhcp.ANY, giaddr,
        bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0"), bytes(64), bytes(128),
        {53: bytes((kind,)), **options},
    )  # fmt: skip
    data = dhcp.encode(packet)
    mutation = draw(st.integers(0, 19))
    if mutation == 0:  # a byte changed
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes((draw(st.integers(0, 255)),)) + data[at + 1 :]
    elif mutation == 1:  # cut short
        data = data[: draw(st.integers(0, len(data)))]
    event(f"{state} {relay}")
    return data, sender


steps = st.lists(
    st.tuples(st.sampled_from([0, 0, 0, 1, 30, 61, 301]), st.integers(0, 9), st.data()),
    min_size=10,
    max_size=40,
)


@FUZZ
@given(st.lists(profiles(), min_size=1, max_size=3), steps)
def test_both_paths_answer_and_do_the_same(config, clients, steps) -> None:
    with tempfile.TemporaryDirectory() as fast_dir, tempfile.TemporaryDirectory() as ref_dir:
        clock = Clock()
        fast = Side(config, Path(fast_dir), clock, prepared=True)
        reference = Side(config, Path(ref_dir), clock, prepared=False)
        assert fast.service.fast is not None and reference.service.fast is None
        given: dict[str, IPv4Address] = {}
        for wait, which, data in steps:
            clock.now += wait
            if which == 0:  # anything at all, mostly malformed
                datagram = data.draw(dhcp_datagrams())
                sender = data.draw(st.sampled_from(["0.0.0.0", RELAY, "10.99.0.11"]))
            else:
                datagram, sender = data.draw(client_requests(clients, given))
            port = 67 if sender == RELAY or sender.startswith("10.98") else 68
            ours = fast.receive(datagram, (sender, port))
            theirs = reference.receive(datagram, (sender, port))
            assert ours == theirs, f"different answers to {datagram.hex()} from {sender}"
            assert fast.state() == reference.state(), f"different effects of {datagram.hex()}"
            for reply, _ in theirs:
                answer = dhcp.decode(reply)
                if (
                    answer.message_type in (dhcp.OFFER, dhcp.ACK)
                    and not answer.yiaddr.is_unspecified
                ):
                    given[answer.mac] = answer.yiaddr
        hits = fast.service.fast.hits
        event(f"answered from prepared replies: {'none' if not hits else 'some'}")
        event(f"answered from prepared replies: {hits // 5 * 5}+")
