"""Which requests the DHCP fast path answers from prepared replies (the differential test in
tests/fuzz/test_fuzz_dhcp_fast.py shows the answers are the reference path's), and which
datagrams the service sheds unread past saturation."""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest
from test_boot_policy import with_discovery

from layerpy.proto import dhcp
from layerpy.services.dhcp import DISCOVER_WAIT, REQUEST_WAIT, DhcpService
from layerpy.stats import Stats

from clock import Clock
from dhcp_requests import BIOS, IPXE, KNOWN, LOCATED, RELAY, SERVER, STRANGER, request
from stores import local_policy


class Wire:
    """A service that sends, as on its socket, and what it sent."""

    def __init__(self, config) -> None:
        self.sent: list[tuple[bytes, tuple[str, int]]] = []
        policy = local_policy(config, clock=Clock())
        self.service = DhcpService(policy, SERVER, Stats(), False, send=self.send)

    def send(self, data: bytes, destination: tuple[str, int]) -> bool:
        self.sent.append((data, destination))
        return True

    def ask(self, packet: dhcp.DhcpPacket, sender: str = "0.0.0.0") -> dhcp.DhcpPacket:
        """The answer to one request, and whether the fast path gave it."""
        self.sent.clear()
        self.service.datagram_received(dhcp.encode(packet), (sender, 68))
        assert len(self.sent) == 1, f"one answer to {packet}, not {self.sent}"
        return dhcp.decode(self.sent[0][0])

    @property
    def hits(self) -> int:
        assert self.service.fast is not None
        return self.service.fast.hits


@pytest.fixture
def wire(make_config) -> Wire:
    return Wire(with_discovery(make_config, LOCATED))  # with a relay


def test_a_known_node_is_answered_from_prepared_replies(wire) -> None:
    """Its first DISCOVER teaches the fast path; the next ones, its REQUEST, a renewal and
    a rebinding are answered from the template, and so is iPXE once it has asked once."""
    offer = wire.ask(request(dhcp.DISCOVER, **BIOS, o61=b"\x01id"))
    assert wire.hits == 0 and offer.yiaddr == IPv4Address("10.99.0.11")
    wire.ask(request(dhcp.DISCOVER, **BIOS, o61=b"\x01id"))
    selecting = {"o54": SERVER.packed, "o50": offer.yiaddr.packed, "o61": b"\x01id"}
    ack = wire.ask(request(dhcp.REQUEST, **BIOS, **selecting))
    assert ack.message_type == dhcp.ACK and ack.options[dhcp.OPT_CLIENT_ID] == b"\x01id"
    renew = request(dhcp.REQUEST, **BIOS, o61=b"\x01id", ciaddr=offer.yiaddr)
    assert wire.ask(renew, str(offer.yiaddr)).ciaddr == offer.yiaddr
    assert wire.hits == 3
    wire.ask(request(dhcp.DISCOVER, **IPXE))
    wire.ask(request(dhcp.DISCOVER, **IPXE))
    assert wire.hits == 4
    node = wire.service.booter.nodes.nodes["cn001"]
    assert node.mac == KNOWN and node.boot is not None  # the same effects as ever


def test_pool_clients_share_a_template_and_get_their_own_address(wire) -> None:
    """One pool client's DORA teaches the fast path its shape; another's of the same shape
    is answered from it with that client's own address, held, then committed and kept."""

    def dora(mac: str, relayed: bool = False) -> IPv4Address:
        via = {"giaddr": RELAY} if relayed else {}
        sender = str(RELAY) if relayed else "0.0.0.0"
        offer = wire.ask(request(dhcp.DISCOVER, mac, **BIOS, **via), sender)
        selecting = {"o54": SERVER.packed, "o50": offer.yiaddr.packed}
        ack = wire.ask(request(dhcp.REQUEST, mac, **BIOS, **selecting, **via), sender)
        assert ack.yiaddr == offer.yiaddr
        return ack.yiaddr

    first = dora(STRANGER)
    assert wire.hits == 1  # its REQUEST: the DISCOVER's template, the other type
    second = dora("52:54:00:00:00:02")
    assert wire.hits == 3 and second != first
    leases = wire.service.booter.leases
    assert leases is not None and leases.lease_of("52:54:00:00:00:02").address == second
    journal = wire.service.booter.config.server.state_dir / "leases.jsonl"
    assert str(second) in journal.read_text()  # journalled before it was promised
    dora("52:54:00:00:00:03", relayed=True)  # a relayed shape is a shape of its own
    assert wire.hits == 4


def test_what_is_not_common_goes_the_reference_way(wire) -> None:
    """A NAK, a request for another server's offer and a DECLINE are never prepared."""
    wire.ask(request(dhcp.DISCOVER, **BIOS))
    wrong = request(dhcp.REQUEST, **BIOS, o54=SERVER.packed, o50=IPv4Address("10.99.0.77").packed)
    assert wire.ask(wrong).message_type == dhcp.NAK
    wire.sent.clear()
    other = request(dhcp.REQUEST, **BIOS, o54=IPv4Address("10.99.0.2").packed, o50=b"\nc\0\x0b")
    wire.service.datagram_received(dhcp.encode(other), ("0.0.0.0", 68))
    assert wire.sent == [] and wire.hits == 0


def test_stale_discovers_are_shed_first(make_config) -> None:
    """Past saturation: a DISCOVER that waited longer than DISCOVER_WAIT is dropped unread
    (its client asks again); other requests only once their client has surely moved on."""
    service = Wire(make_config()).service
    discover = dhcp.encode(request(dhcp.DISCOVER, **BIOS))
    selecting = dhcp.encode(request(dhcp.REQUEST, **BIOS, o54=SERVER.packed))
    assert not service.shed(discover, DISCOVER_WAIT / 2)
    assert service.shed(discover, DISCOVER_WAIT * 2)
    assert not service.shed(selecting, DISCOVER_WAIT * 2)
    assert service.shed(selecting, REQUEST_WAIT + 0.1)
    assert not service.shed(b"", DISCOVER_WAIT * 2)  # not DHCP: the reference path says so
    assert service.stats.series["dhcp", "shed"].requests == 2
