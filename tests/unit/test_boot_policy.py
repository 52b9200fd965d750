"""What each kind of DHCP client gets from the boot policy, through the DHCP service's
handle() (policy verdict, RFC core, apply), and that a verdict alone writes nothing."""

from __future__ import annotations

import asyncio
import copy
import logging
from dataclasses import replace
from ipaddress import IPv4Address

import pytest

from layerpy import boot, logs
from layerpy.boot import DISCOVERY_LEASE, PER_PORT, firmware_of
from layerpy.config import load
from layerpy.logs import BURST
from layerpy.model import RunState
from layerpy.nodes import NodeStore
from layerpy.proto import dhcp
from layerpy.proto.leases import BOUND, DECLINED, OFFERED, QUARANTINE
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

from clock import Clock
from dhcp_requests import (
    ARM64,
    BIOS,
    HTTP_BOOT,
    IPXE,
    KNOWN,
    LOCATED,
    ON_SWP3,
    RELAY,
    SERVER,
    STRANGER,
    UEFI,
    ZERO,
    request,
)
from stores import local_policy


def make_service(config, clock: Clock | None = None) -> DhcpService:
    policy = local_policy(config, clock=clock or Clock())
    return DhcpService(policy, SERVER, Stats(), log_requests=False)


def handle(service: DhcpService, packet: dhcp.DhcpPacket, sender: str | None = None):
    """handle() of a packet sent by `sender`: by default its relay when relayed (giaddr),
    else a client without an address yet."""
    relay = str(packet.giaddr) if not packet.giaddr.is_unspecified else "0.0.0.0"
    return service.handle(packet, (sender or relay, 67 if relay != "0.0.0.0" else 68))


def answer(service: DhcpService, packet: dhcp.DhcpPacket) -> dhcp.DhcpPacket | None:
    return handle(service, packet)[1].reply


def with_discovery(make_config, more: str = ""):
    """The test node file with network.discover on (unknown machines boot from the pool)."""
    config = make_config(more=more)
    text = config.path.read_text().replace('pool = "', 'discover = true\npool = "', 1)
    config.path.write_text(text)
    return load(config.path)


@pytest.fixture
def service(make_config) -> DhcpService:
    return make_service(make_config())


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def discovery(make_config, clock) -> DhcpService:
    return make_service(with_discovery(make_config), clock)


@pytest.mark.parametrize(
    ("options", "firmware", "bootfile", "next_server"),
    [
        (BIOS, "bios", b"undionly.kpxe", "10.99.0.1"),
        (UEFI, "uefi", b"snponly.efi", "10.99.0.1"),
        (IPXE, "ipxe", b"http://10.99.0.1:8080/boot/cn001.ipxe", "0.0.0.0"),
        ({"o60": b"udhcp 1.35.0"}, "os", None, "0.0.0.0"),
        (HTTP_BOOT, "uefi-http", b"http://10.99.0.1:8080/ipxe/snponly.efi", "0.0.0.0"),
    ],
)
def test_offer_per_firmware(service, options, firmware, bootfile, next_server) -> None:
    discover = request(dhcp.DISCOVER, **options)
    assert firmware_of(discover) == firmware
    offer = answer(service, discover)
    assert offer.message_type == dhcp.OFFER
    assert offer.yiaddr == IPv4Address("10.99.0.11")
    assert offer.options.get(dhcp.OPT_BOOTFILE) == bootfile
    assert str(offer.siaddr) == next_server
    assert offer.options[dhcp.OPT_HOSTNAME] == b"cn001"
    assert (dhcp.OPT_IPXE in offer.options) == (firmware == "ipxe")
    if firmware in ("bios", "uefi"):  # PXE: vendor class echoed, and "boot this file"
        assert offer.options[dhcp.OPT_VENDOR_CLASS] == b"PXEClient"
        assert offer.options[dhcp.OPT_VENDOR_SPECIFIC] == bytes((6, 1, 8, 255))
    if firmware == "uefi-http":  # UEFI takes an HTTP boot offer only with option 60 echoed
        assert offer.options[dhcp.OPT_VENDOR_CLASS] == b"HTTPClient"
    node = service.booter.nodes.nodes["cn001"]
    assert node.run_state is (RunState.UNKNOWN if firmware == "os" else RunState.BOOTING)
    assert node.mac == KNOWN


@pytest.mark.parametrize(
    ("options", "firmware"),
    [
        (ARM64, "uefi-arm64"),  # known, but the file names no arm64 binary
        ({"o60": b"PXEClient:Arch:00042:UNDI:003000", "o93": b"\x00\x2a"}, "arch-42"),
        ({"o60": b"HTTPClient:Arch:00000", "o93": b"\x00\x00"}, "arch-0"),  # no BIOS HTTP
    ],
)
def test_firmware_without_a_binary_is_refused_and_logged(
    service, options, firmware, caplog: pytest.LogCaptureFixture
) -> None:
    discover = request(dhcp.DISCOVER, **options)
    assert firmware_of(discover) == firmware
    boot.quiet.end("unbootable firmware")  # a fresh window: earlier modules' refusals used it
    with caplog.at_level(logging.WARNING, "layerpy.dhcp"):
        assert answer(service, discover) is None
    assert caplog.messages == [
        f"cn001: not answered: firmware {firmware} (option 93): no iPXE binary for it in [ipxe]"
    ]


def test_arm64_gets_the_binary_the_file_names(make_config) -> None:
    path = make_config().path
    (path.parent / "ipxe" / "snp-arm64.efi").write_bytes(b"\x90")
    path.write_text(
        path.read_text().replace('dir = "ipxe"', 'dir = "ipxe"\narm64 = "snp-arm64.efi"')
    )
    offer = answer(make_service(load(path)), request(dhcp.DISCOVER, **ARM64))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"snp-arm64.efi"


def arm64_loaders(directory) -> None:
    """Stand-ins for Debian's signed arm64 shim and GRUB, beside the x86 ones."""
    (directory / "signed").mkdir(exist_ok=True)
    for name in ("shimaa64.efi", "grubaa64.efi"):
        (directory / "signed" / name).write_bytes(b"MZ" * 100)


def test_arm64_firmware_boots_the_arm64_minos_on_every_path(make_config, tmp_path) -> None:
    """The node's boot firmware (DHCP option 93) picks the minOS: the GRUB config the
    signed loaders fetch, an iPXE script, and the files by TFTP and HTTP names."""
    arm64_loaders(tmp_path)
    service = make_service(make_config())
    offer = answer(service, request(dhcp.DISCOVER, **ARM64))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"shimaa64.efi"  # no arm64 iPXE: the loaders
    booter = service.booter
    grub = asyncio.run(booter.grub_config("10.99.0.11")).splitlines()
    assert grub[1].startswith("linux (tftp,10.99.0.1)/minos/arm64/kernel 'console=ttyS0' ")
    assert grub[2] == "initrd (tftp,10.99.0.1)/minos/arm64/initrd"
    for _ in range(3):  # a script fetched again is a new boot of the same machine
        script = asyncio.run(booter.script("cn001", "10.99.0.11"))
        assert "kernel http://10.99.0.1:8080/minos/arm64/kernel initrd=minos " in script
        assert "/minos/kernel" not in script
    cn002 = "52:54:00:99:00:12"
    answer(service, request(dhcp.DISCOVER, cn002, **UEFI))
    grub_x86 = asyncio.run(booter.grub_config("10.99.0.12"))
    assert "(tftp,10.99.0.1)/minos/kernel " in grub_x86
    # iPXE asking first (a NIC's own iPXE, or after a restart) still says its CPU
    fresh = make_service(make_config())
    offer = answer(fresh, request(dhcp.DISCOVER, cn002, **{**IPXE, "o93": b"\x00\x0b"}))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"http://10.99.0.1:8080/boot/cn002.ipxe"
    assert fresh.booter.nodes.nodes["cn002"].boot.firmware == "ipxe-arm64"
    assert "/minos/arm64/kernel " in asyncio.run(fresh.booter.script("cn002", "10.99.0.12"))

    def look(name: str):
        return asyncio.run(booter.loader_file(name, "10.99.0.11"))

    assert look("minos/arm64/kernel") == tmp_path / "vmlinuz-arm64"
    assert look("/minos/arm64/initrd") == tmp_path / "initrd-arm64"
    assert look("minos/kernel") == tmp_path / "vmlinuz"


def test_arm64_firmware_without_an_arm64_minos_is_refused_with_why(
    make_config, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    arm64_loaders(tmp_path)
    config = make_config()
    text = config.path.read_text()
    section = '[minos.arm64]\nkernel = "vmlinuz-arm64"\ninitrd = "initrd-arm64"\n'
    config.path.write_text(text.replace(section, ""))
    service = make_service(replace(load(config.path), minos=replace(config.minos, arm64=None)))
    boot.quiet.end("unbootable firmware")  # a fresh window: earlier modules' refusals used it
    with caplog.at_level(logging.WARNING, "layerpy.dhcp"):
        assert answer(service, request(dhcp.DISCOVER, **ARM64)) is None
        assert answer(service, request(dhcp.DISCOVER, **UEFI)) is not None  # x86 boots on
    assert caplog.messages == [
        "cn001: not answered: firmware uefi-arm64: no arm64 minOS to load (build it with "
        "minos/build.sh --arch arm64, or name it in [minos.arm64])"
    ]


def test_request_for_the_right_address_is_acked_and_timed(service) -> None:
    ack = answer(
        service, request(dhcp.REQUEST, o50=bytes([10, 99, 0, 11]), o54=SERVER.packed, **IPXE)
    )
    assert ack.message_type == dhcp.ACK
    assert "dhcp_ack" in service.booter.nodes.nodes["cn001"].boot.phases


def test_an_os_ack_is_not_a_boot_phase(service) -> None:
    assert (
        answer(service, request(dhcp.REQUEST, o50=bytes([10, 99, 0, 11]))).message_type == dhcp.ACK
    )
    assert service.booter.nodes.nodes["cn001"].boot is None


def test_request_for_another_address_is_nakked(service) -> None:
    nak = answer(service, request(dhcp.REQUEST, o50=bytes([10, 99, 0, 77])))
    assert nak.message_type == dhcp.NAK
    assert b"10.99.0.11" in nak.options[dhcp.OPT_MESSAGE]


def test_datagrams_are_counted_by_message_and_answer(service) -> None:
    for packet in (request(dhcp.REQUEST, o50=bytes([10, 99, 0, 77])), request(dhcp.DISCOVER)):
        service.datagram_received(dhcp.encode(packet), ("0.0.0.0", 68))
    service.datagram_received(dhcp.encode(request(dhcp.OFFER)), ("10.99.0.2", 67))
    counts = {k: v["requests"] for k, v in service.stats.as_json()["dhcp"].items()}
    assert counts == {"request": 1, "nak": 1, "discover": 1, "offer": 1, "ignored": 1}


def test_request_to_another_server_is_ignored(service) -> None:
    chose_other = request(dhcp.REQUEST, o50=bytes([10, 99, 0, 11]), o54=bytes([10, 99, 0, 2]))
    assert answer(service, chose_other) is None


def test_unknown_machine_gets_nothing_without_discovery(service) -> None:
    assert answer(service, request(dhcp.DISCOVER, mac=STRANGER, **BIOS)) is None
    assert list(service.booter.nodes.unknown) == [STRANGER]
    assert service.booter.leases is None


def test_release_and_decline_of_a_fixed_address_keep_it(service) -> None:
    assert answer(service, request(dhcp.RELEASE, ciaddr=IPv4Address("10.99.0.11"))) is None
    assert answer(service, request(dhcp.DECLINE, o50=bytes([10, 99, 0, 11]))) is None
    assert answer(service, request(dhcp.DISCOVER)).yiaddr == IPv4Address("10.99.0.11")


def snapshot(inventory: NodeStore):
    """Everything a DHCP request may change in the inventory, as comparable values."""
    nodes = {
        n.name: (n.mac, n.run_state, copy.deepcopy(n.boot), n.location)
        for n in inventory.nodes.values()
    }
    unknown = {m: copy.copy(u) for m, u in inventory.unknown.machines.items()}
    return nodes, unknown, dict(inventory.identities.bindings), inventory.feed.seq


@pytest.mark.parametrize(
    ("mac", "extra"),
    [(KNOWN, IPXE), (STRANGER, BIOS), ("52:54:00:aa:00:03", {**BIOS, **ON_SWP3})],
    ids=["known", "stranger", "located"],
)
def test_a_verdict_writes_nothing_and_apply_writes_it(make_config, mac, extra) -> None:
    service = make_service(with_discovery(make_config, LOCATED))
    policy = service.booter
    discover = request(dhcp.DISCOVER, mac=mac, giaddr=RELAY if "o82" in extra else ZERO, **extra)
    before, leases = snapshot(policy.nodes), policy.leases.records()
    verdict = policy.verdict(discover, str(discover.giaddr))
    assert verdict.grant is not None
    assert snapshot(policy.nodes) == before and policy.leases.records() == leases
    policy.apply(verdict, ())
    assert snapshot(policy.nodes) != before


def test_relay_names_the_node_by_its_port(make_config) -> None:
    service = make_service(with_discovery(make_config, LOCATED))
    mac = "52:54:00:aa:00:03"
    discover = request(dhcp.DISCOVER, mac=mac, giaddr=RELAY, **BIOS, **ON_SWP3)
    verdict, decision = handle(service, discover)
    assert verdict.node.name == "cn003" and verdict.location == ("sw1", "swp3")
    assert decision.reply.yiaddr == IPv4Address("10.99.0.13")
    assert decision.destination == ("10.99.0.254", 67)
    assert decision.reply.options[dhcp.OPT_RELAY_AGENT] == b"\x01\x04swp3"
    inventory = service.booter.nodes
    assert inventory.by_mac(mac).name == "cn003"
    assert inventory.nodes["cn003"].location["source"] == "dhcp-option-82"


@pytest.mark.parametrize(
    ("giaddr", "identity"),
    [(ZERO, "location"), (IPv4Address("10.99.0.77"), "location"), (RELAY, "mac")],
    ids=["no relay at all", "a relay the file does not name", "identity by mac only"],
)
def test_option_82_counts_only_from_a_named_relay(make_config, giaddr, identity) -> None:
    """Anyone can put option 82 in a DISCOVER; one with giaddr 0 once rebound a located
    node to the sender's MAC for good."""
    config = with_discovery(make_config, LOCATED)
    text = config.path.read_text().replace("[server]\n", f'[server]\nidentity = "{identity}"\n')
    config.path.write_text(text)
    service = make_service(load(config.path))
    mac = "52:54:00:aa:00:03"
    verdict, _ = handle(service, request(dhcp.DISCOVER, mac=mac, giaddr=giaddr, **BIOS, **ON_SWP3))
    assert verdict.node is None and verdict.location is None
    assert service.booter.nodes.by_mac(mac) is None
    assert service.booter.nodes.identities.bindings == {}


def test_a_relayed_packet_is_believed_only_from_its_relay(make_config) -> None:
    """Issue 26: a host that writes the relay's address in giaddr and a node's port in
    option 82 took that node's identity. From anyone but the relay it is dropped and
    counted, and nothing is written; from the relay itself it still names the node."""
    service = make_service(with_discovery(make_config, LOCATED))
    policy, mac = service.booter, "52:54:00:aa:00:03"
    forged = request(dhcp.DISCOVER, mac=mac, giaddr=RELAY, **BIOS, **ON_SWP3)
    before, leases = snapshot(policy.nodes), policy.leases.records()
    verdict, decision = handle(service, forged, sender="10.99.0.99")
    assert verdict.untrusted and verdict.node is None and decision.reply is None
    assert (
        verdict.why == "names relay 10.99.0.254 but was sent from 10.99.0.99, not from that relay"
    )
    service.datagram_received(dhcp.encode(forged), ("10.99.0.99", 67))
    assert service.stats.series["dhcp", "untrusted-relay"].requests == 1
    assert snapshot(policy.nodes) == before and policy.leases.records() == leases
    verdict, decision = handle(service, forged)  # from 10.99.0.254, the relay
    assert verdict.node.name == "cn003" and decision.reply is not None
    assert policy.nodes.by_mac(mac).name == "cn003"


def test_a_relay_may_send_from_other_addresses(make_config) -> None:
    """relay_sources: where the relay's datagrams leave from, instead of its giaddr."""
    sources = LOCATED.replace(
        'relay = "10.99.0.254"\n', 'relay = "10.99.0.254"\nrelay_sources = ["10.99.0.253"]\n'
    )
    service = make_service(with_discovery(make_config, sources))
    forged = request(dhcp.DISCOVER, mac="52:54:00:aa:00:03", giaddr=RELAY, **BIOS, **ON_SWP3)
    assert handle(service, forged, sender="10.99.0.254")[0].untrusted
    verdict, _ = handle(service, forged, sender="10.99.0.253")
    assert not verdict.untrusted and verdict.node.name == "cn003"


def test_only_relays_the_file_names_are_answered(make_config) -> None:
    """A reply goes to the giaddr: a made-up one would aim it at any address."""
    service = make_service(with_discovery(make_config, LOCATED))
    stranger = IPv4Address("10.99.0.77")
    for mac in (KNOWN, STRANGER):
        verdict, decision = handle(
            service, request(dhcp.DISCOVER, mac=mac, giaddr=stranger, **BIOS)
        )
        assert decision.reply is None, mac
        assert verdict.why == "relayed by 10.99.0.77, not a relay the node file names"
    assert answer(service, request(dhcp.DISCOVER, mac=KNOWN, giaddr=RELAY, **BIOS)) is not None


def test_a_port_held_by_a_live_machine_is_not_given_away(make_config) -> None:
    service = make_service(with_discovery(make_config, LOCATED))
    inventory = service.booter.nodes
    node = inventory.locate("52:54:00:aa:00:01", ("sw1", "swp3"), "lldp")
    node.run_state = RunState.READY  # alive: its agent reports
    newcomer = request(dhcp.DISCOVER, mac="52:54:00:aa:00:02", giaddr=RELAY, **BIOS, **ON_SWP3)
    verdict, decision = handle(service, newcomer)
    assert verdict.node is None and verdict.why == "discovery pool"
    assert decision.reply.yiaddr == IPv4Address("10.99.0.200")
    assert "belongs to cn003" in inventory.unknown["52:54:00:aa:00:02"].conflict  # locate agreed


# --- the discovery pool ----------------------------------------------------------------


def test_strangers_get_pool_addresses_held_then_bound(discovery) -> None:
    policy = discovery.booter
    offer = answer(discovery, request(dhcp.DISCOVER, mac=STRANGER, **IPXE))
    assert offer.yiaddr == IPv4Address("10.99.0.200")
    assert (
        offer.options[dhcp.OPT_BOOTFILE]
        == f"http://10.99.0.1:8080/boot/discover/{STRANGER}.ipxe".encode()
    )
    assert policy.leases.lease_of(STRANGER).state == OFFERED
    other = answer(discovery, request(dhcp.DISCOVER, mac="52:54:00:00:00:02", **BIOS))
    assert other.yiaddr == IPv4Address("10.99.0.201")
    ack = answer(
        discovery, request(dhcp.REQUEST, mac=STRANGER, o50=offer.yiaddr.packed, o54=SERVER.packed)
    )
    assert ack.message_type == dhcp.ACK
    assert ack.options[dhcp.OPT_LEASE_TIME] == DISCOVERY_LEASE.to_bytes(4)
    assert policy.leases.lease_of(STRANGER).state == BOUND
    assert policy.discovery_address(STRANGER) == IPv4Address("10.99.0.200")
    # the machine reboots: its firmware asks again and gets the same address
    assert answer(discovery, request(dhcp.DISCOVER, mac=STRANGER, **BIOS)).yiaddr == offer.yiaddr


def test_an_offer_taken_elsewhere_is_withdrawn(discovery) -> None:
    answer(discovery, request(dhcp.DISCOVER, mac=STRANGER))
    chose_other = request(
        dhcp.REQUEST, mac=STRANGER, o50=bytes([10, 99, 0, 200]), o54=bytes([10, 99, 0, 2])
    )
    assert answer(discovery, chose_other) is None
    assert discovery.booter.discovery_address(STRANGER) is None
    assert answer(discovery, request(dhcp.DISCOVER, mac="52:54:00:00:00:02")).yiaddr == IPv4Address(
        "10.99.0.201"
    )


def test_unrenewed_leases_lapse(discovery, clock) -> None:
    answer(discovery, request(dhcp.DISCOVER, mac=STRANGER))
    answer(
        discovery,
        request(dhcp.REQUEST, mac=STRANGER, o50=bytes([10, 99, 0, 200]), o54=SERVER.packed),
    )
    clock.now += DISCOVERY_LEASE / 2
    renew = request(dhcp.REQUEST, mac=STRANGER, ciaddr=IPv4Address("10.99.0.200"))
    assert answer(discovery, renew).message_type == dhcp.ACK
    clock.now += DISCOVERY_LEASE - 1
    assert discovery.booter.tick() == []
    clock.now += 1
    [lapsed] = discovery.booter.tick()
    assert (lapsed.client, lapsed.state) == (STRANGER, BOUND)
    assert discovery.booter.discovery_address(STRANGER) is None


def test_a_declined_address_is_quarantined(discovery, clock) -> None:
    answer(discovery, request(dhcp.DISCOVER, mac=STRANGER))
    decline = request(dhcp.DECLINE, mac=STRANGER, o50=bytes([10, 99, 0, 200]), o54=SERVER.packed)
    assert answer(discovery, decline) is None
    assert discovery.booter.leases.records()[0]["state"] == DECLINED
    assert answer(discovery, request(dhcp.DISCOVER, mac=STRANGER)).yiaddr == IPv4Address(
        "10.99.0.201"
    )
    clock.now += QUARANTINE
    assert [lease.state for lease in discovery.booter.tick()] == [OFFERED, DECLINED]  # by time


def test_one_relay_port_holds_a_bounded_share_of_the_pool(make_config, clock) -> None:
    """Made-up MACs behind one switch port (swp9: no node there) take PER_PORT addresses;
    the other ports still get theirs, and a lapsed offer makes room again."""
    service = make_service(with_discovery(make_config, LOCATED), clock)
    on_swp9 = {"o82": b"\x01\x04swp9"}

    def discover(mac: str, port: dict) -> dhcp.DhcpPacket | None:
        return answer(service, request(dhcp.DISCOVER, mac=mac, giaddr=RELAY, **BIOS, **port))

    offers = [discover(f"52:54:00:bb:00:{i:02x}", on_swp9) for i in range(10)]
    assert sum(offer is not None for offer in offers) == PER_PORT
    verdict = service.booter.verdict(
        request(dhcp.DISCOVER, mac="52:54:00:bb:00:20", giaddr=RELAY, **BIOS, **on_swp9), str(RELAY)
    )
    assert verdict.why == f"unknown machine, sw1:swp9 holds {PER_PORT} discovery addresses"
    assert discover("52:54:00:bb:00:30", {"o82": b"\x01\x05swp10"}) is not None
    assert discover(f"52:54:00:bb:00:{PER_PORT - 1:02x}", on_swp9) is not None  # holders: again
    clock.now += 61  # the offers were never taken up
    assert discover("52:54:00:bb:00:21", on_swp9) is not None


def test_a_released_address_comes_back_to_its_machine(discovery) -> None:
    answer(discovery, request(dhcp.DISCOVER, mac=STRANGER))
    answer(
        discovery,
        request(dhcp.REQUEST, mac=STRANGER, o50=bytes([10, 99, 0, 200]), o54=SERVER.packed),
    )
    release = request(
        dhcp.RELEASE, mac=STRANGER, ciaddr=IPv4Address("10.99.0.200"), o54=SERVER.packed
    )
    assert answer(discovery, release) is None
    assert discovery.booter.discovery_address(STRANGER) is None
    assert answer(discovery, request(dhcp.DISCOVER, mac=STRANGER)).yiaddr == IPv4Address(
        "10.99.0.200"
    )


def test_the_pool_follows_a_reload_and_keeps_its_leases(discovery, make_config) -> None:
    policy = discovery.booter
    answer(discovery, request(dhcp.DISCOVER, mac=STRANGER))
    answer(
        discovery,
        request(dhcp.REQUEST, mac=STRANGER, o50=bytes([10, 99, 0, 200]), o54=SERVER.packed),
    )
    config = with_discovery(make_config)
    config.path.write_text(config.path.read_text().replace("200-10.99.0.250", "200-10.99.0.210"))
    policy.nodes.apply_config(load(config.path))
    assert policy.leases.range[1] == IPv4Address("10.99.0.250")  # not before the explicit tick
    policy.tick()
    assert policy.leases.range == (IPv4Address("10.99.0.200"), IPv4Address("10.99.0.210"))
    assert policy.discovery_address(STRANGER) == IPv4Address("10.99.0.200")


def lease(service: DhcpService, mac: str) -> IPv4Address:
    """DISCOVER, then REQUEST what was offered: the address bound."""
    offered = answer(service, request(dhcp.DISCOVER, mac=mac)).yiaddr
    ack = answer(service, request(dhcp.REQUEST, mac=mac, o50=offered.packed, o54=SERVER.packed))
    assert ack.message_type == dhcp.ACK, ack
    return offered


def test_pool_leases_survive_a_restart(make_config, clock) -> None:
    """Each lease is journalled before its ACK; a new server on the same state directory
    gives nobody an address another client holds, and each client its own back."""
    config = with_discovery(make_config)
    first = make_service(config, clock)
    held = {mac: lease(first, mac) for mac in ("52:54:00:cc:00:01", "52:54:00:cc:00:02")}
    release = request(dhcp.RELEASE, mac="52:54:00:cc:00:02",
                      ciaddr=held["52:54:00:cc:00:02"], o54=SERVER.packed)  # fmt: skip
    answer(first, release)
    again = make_service(config, clock)  # as after kill -9: nothing was closed
    assert again.booter.discovery_address("52:54:00:cc:00:01") == held["52:54:00:cc:00:01"]
    assert again.booter.discovery_address("52:54:00:cc:00:02") is None  # released
    newcomer = lease(again, "52:54:00:cc:00:03")
    assert newcomer != held["52:54:00:cc:00:01"]
    assert lease(again, "52:54:00:cc:00:01") == held["52:54:00:cc:00:01"]


def test_the_journal_is_rewritten_when_mostly_dead_and_skips_a_torn_line(
    make_config, clock
) -> None:
    config = with_discovery(make_config)
    service = make_service(config, clock)
    journal = config.server.state_dir / "leases.jsonl"  # the format of earlier releases
    mac = "52:54:00:cc:00:09"
    for _ in range(600):  # one client renewing: the journal grows, then is rewritten
        lease(service, mac)
    assert len(journal.read_text().splitlines()) <= 4 * 1 + 1024
    with journal.open("a") as out:
        out.write('{"address": "10.99.0.2')  # a power cut mid-line
    restored = make_service(config, clock)
    assert restored.booter.discovery_address(mac) == IPv4Address("10.99.0.200")


def test_a_reply_the_kernel_refuses_is_counted_as_dropped(make_config) -> None:
    policy = local_policy(make_config(), clock=Clock())
    sent: list[tuple[bytes, tuple[str, int]]] = []
    refusing = DhcpService(policy, SERVER, Stats(), False, send=lambda *reply: False)
    accepting = DhcpService(
        policy, SERVER, Stats(), False, send=lambda *reply: sent.append(reply) or True
    )
    for service in (refusing, accepting):
        service.datagram_received(dhcp.encode(request(dhcp.DISCOVER, **BIOS)), ("0.0.0.0", 68))
    dropped = refusing.stats.as_json()["dhcp"]["dropped"]
    assert dropped["requests"] == dropped["failures"] == 1
    assert "dropped" not in accepting.stats.as_json()["dhcp"]
    assert len(sent) == 1 and dhcp.decode(sent[0][0]).message_type == dhcp.OFFER
    assert sent[0][1] == ("255.255.255.255", dhcp.CLIENT_PORT)


def test_a_flood_of_informs_from_made_up_addresses_is_a_few_lines(service, caplog) -> None:
    """Issue 26: 26 000 INFORMs with random ciaddr were 25 705 lines, since each told of
    another address; now a few lines of that kind, the rest counted."""
    caplog.set_level(logging.INFO, "layerpy.dhcp")
    for i in range(1000):
        ciaddr = IPv4Address(f"10.99.{i // 250 + 1}.{i % 250 + 1}")
        inform = dhcp.encode(request(dhcp.INFORM, KNOWN, ciaddr=ciaddr, **IPXE))
        service.datagram_received(inform, (str(ciaddr), 68))
    assert 0 < len(caplog.records) <= BURST, [r.getMessage() for r in caplog.records]
    assert logs.suppressed["dhcp", "inform silent"] >= 1000 - BURST


def test_a_nodes_agent_is_given_its_owner_first(make_config) -> None:
    """In a cluster the instance owning a node judges its heartbeats: its boot script and
    its answers name that instance first, then the others of the segment, once each."""
    policy = local_policy(make_config(), clock=Clock())
    here, other = "http://10.99.0.1:8080", "http://10.99.0.2:8080"
    assert policy.servers_of("cn001") == (here,)  # a single server: itself
    policy.peers = (other,)
    policy.owner_url = {"cn002": other}.get
    assert policy.servers_of("cn001") == (here, other)  # no owner yet: this one first
    assert policy.servers_of("cn002") == (other, here)
    script = asyncio.run(policy.script("cn002", "10.99.0.12"))
    assert script is not None and f"layerpy.server={other},{here} " in script


def test_arm64_ipxe_is_the_default_where_the_ipxe_dir_has_it(make_config, tmp_path) -> None:
    assert make_config().ipxe.arm64 is None  # Debian 12's ipxe package has none
    (tmp_path / "ipxe" / "ipxe-arm64.efi").write_bytes(b"MZ" * 100)
    config = make_config()
    assert config.ipxe.arm64 == "ipxe-arm64.efi"
    offer = answer(make_service(config), request(dhcp.DISCOVER, **ARM64))
    assert offer.options[dhcp.OPT_BOOTFILE] == b"ipxe-arm64.efi"
