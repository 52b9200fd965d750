"""ProxyDHCP: what each kind of boot client gets on port 67 and 4011 beside a site's DHCP
server (boot information, never an address), through the DHCP service's handle()."""

from __future__ import annotations

import logging
from ipaddress import IPv4Address

import pytest

from layerpy.boot import BootPolicy
from layerpy.config import ConfigError, load
from layerpy.model import Phase
from layerpy.proto import dhcp
from layerpy.proto.proxy_dhcp import BOOT_SERVER_PORT
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

from clock import Clock
from dhcp_requests import (
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

IP = IPv4Address
SITE_ADDRESS = IP("10.99.0.57")  # what the site's server gave cn001
FROM_SITE_ADDRESS = (str(SITE_ADDRESS), dhcp.CLIENT_PORT)
BROADCAST = ("0.0.0.0", dhcp.CLIENT_PORT)
RESERVED = '\n[nodes.cn002]\nip = "10.99.0.12"\n'  # the site's server reserves this for it


def proxy_file(make_config, more: str = "") -> object:
    """The test node file as a ProxyDHCP server's: no pool, and no addresses for the group."""
    config = make_config()
    text = config.path.read_text() + more.replace("dhcp_probe", "x")
    text = text.replace("heartbeat = 2\n", 'heartbeat = 2\ndhcp = "proxy"\n', 1)
    text = text.replace(f'pool = "{config.network.pool[0]}-{config.network.pool[1]}"\n', "")
    text = text.replace('ip = "10.99.0.[11-12]"\n', "")
    config.path.write_text(text)
    return load(config.path)


@pytest.fixture
def policy(make_config) -> BootPolicy:
    return local_policy(proxy_file(make_config, RESERVED), clock=Clock())


def port(policy: BootPolicy, number: int) -> DhcpService:
    return DhcpService(policy, SERVER, Stats(), log_requests=False, port=number, proxy=True)


def boot_request(mac: str = KNOWN, ciaddr: IPv4Address = SITE_ADDRESS, **options: bytes):
    """A REQUEST to port 4011 from a client that has its address from the site's server."""
    return request(dhcp.REQUEST, mac, ciaddr=ciaddr, **({"o54": SERVER.packed} | options))


def test_node_file_without_addresses_is_only_valid_for_proxy(make_config) -> None:
    config = proxy_file(make_config)
    assert config.nodes["cn001"].ip is None
    text = config.path.read_text().replace('dhcp = "proxy"\n', "")
    config.path.write_text(text)
    with pytest.raises(ConfigError, match=r"groups\.compute\.ip: is required"):
        load(config.path)
    text = text.replace("[network]\n", '[network]\npool = "10.99.0.200-10.99.0.250"\n')
    config.path.write_text(text.replace("heartbeat = 2\n", 'heartbeat = 2\ndhcp = "proxy"\n'))
    with pytest.raises(ConfigError, match='hands out the addresses when dhcp = "proxy"'):
        load(config.path)


@pytest.mark.parametrize(
    ("firmware", "bootfile", "siaddr", "vendor_class"),
    [
        (BIOS, b"undionly.kpxe", SERVER, b"PXEClient"),
        (UEFI, b"snponly.efi", SERVER, b"PXEClient"),
        (HTTP_BOOT, b"http://10.99.0.1:8080/ipxe/snponly.efi", ZERO, b"HTTPClient"),
        # no boot server for iPXE: it asks again on port 4011, showing its address
        (IPXE, b"http://10.99.0.1:8080/boot/cn001.ipxe", ZERO, b"PXEClient"),
    ],
    ids=["bios", "uefi", "uefi-http", "ipxe"],
)
def test_port_67_offers_what_to_boot_and_no_address(
    policy, firmware, bootfile, siaddr, vendor_class
) -> None:
    verdict, decision = port(policy, 67).handle(
        request(dhcp.DISCOVER, o55=b"\x01\x03\x06\x33", **firmware)
    )
    offer = decision.reply
    assert offer is not None and offer.message_type == dhcp.OFFER
    assert (offer.yiaddr, offer.siaddr, offer.server_id) == (ZERO, siaddr, SERVER)
    assert offer.options[dhcp.OPT_BOOTFILE] == bootfile
    assert offer.options[dhcp.OPT_VENDOR_CLASS] == vendor_class
    assert offer.file.rstrip(b"\0") == bootfile
    # no lease, no mask, no router, no DNS, no names: the site's server gives those
    for code in (dhcp.OPT_LEASE_TIME, dhcp.OPT_SUBNET_MASK, dhcp.OPT_ROUTER, dhcp.OPT_DNS,
                 dhcp.OPT_HOSTNAME, dhcp.OPT_IPXE):  # fmt: skip
        assert code not in offer.options
    assert decision.destination == ("255.255.255.255", dhcp.CLIENT_PORT)
    assert verdict.boot_request and policy.nodes.nodes["cn001"].boot is not None


def test_port_67_leaves_everything_else_to_the_site_server(policy, caplog) -> None:
    service = port(policy, 67)
    site = IP("10.99.0.2").packed
    for packet in (
        request(dhcp.REQUEST, o54=site, o50=SITE_ADDRESS.packed, **IPXE),
        request(dhcp.INFORM, ciaddr=SITE_ADDRESS, **IPXE),
        request(dhcp.RELEASE, ciaddr=SITE_ADDRESS, o54=site, **IPXE),
        request(dhcp.DISCOVER),  # an OS's DHCP client, not boot firmware
        request(dhcp.DISCOVER, STRANGER, **IPXE),  # nobody we serve
    ):
        assert service.handle(packet)[1].reply is None
    assert policy.nodes.nodes["cn001"].ip is None
    caplog.set_level(logging.INFO, "layerpy.dhcp")
    service.datagram_received(dhcp.encode(request(dhcp.REQUEST, o54=site, **IPXE)), BROADCAST)
    assert "site" not in caplog.text  # the normal course of a boot: not logged


def test_port_4011_acks_the_script_and_learns_the_address(policy) -> None:
    nodes = policy.nodes
    node = nodes.nodes["cn001"]
    assert nodes.by_ip(SITE_ADDRESS) is None and policy.address_of(node) is None
    port(policy, 67).handle(request(dhcp.DISCOVER, **IPXE))
    decision = port(policy, BOOT_SERVER_PORT).handle(boot_request(**IPXE), FROM_SITE_ADDRESS)[1]
    ack = decision.reply
    assert ack is not None and ack.message_type == dhcp.ACK
    assert (ack.yiaddr, ack.ciaddr) == (ZERO, SITE_ADDRESS)
    assert ack.siaddr == SERVER  # iPXE drops a ProxyDHCP ACK that names no boot server
    assert ack.options[dhcp.OPT_BOOTFILE] == b"http://10.99.0.1:8080/boot/cn001.ipxe"
    assert decision.destination == FROM_SITE_ADDRESS  # unicast back to the asker
    assert node.ip == SITE_ADDRESS and nodes.by_ip(SITE_ADDRESS) is node
    assert policy.address_of(node) == SITE_ADDRESS
    assert Phase.DHCP_ACK in node.boot.timeline()
    # the next boot, the site's server gives it another address: the old one is forgotten
    moved = IP("10.99.0.58")
    port(policy, BOOT_SERVER_PORT).handle(boot_request(ciaddr=moved, **IPXE), (str(moved), 68))
    assert nodes.by_ip(moved) is node and nodes.by_ip(SITE_ADDRESS) is None


def test_port_4011_firmware_gets_its_binary_from_the_boot_server(policy) -> None:
    decision = port(policy, BOOT_SERVER_PORT).handle(boot_request(**UEFI), FROM_SITE_ADDRESS)[1]
    ack = decision.reply
    assert ack is not None and (ack.siaddr, ack.file.rstrip(b"\0")) == (SERVER, b"snponly.efi")
    assert ack.options[dhcp.OPT_VENDOR_SPECIFIC] == dhcp.PXE_BOOT_OFFERED_FILE


@pytest.mark.parametrize(
    ("packet", "sender", "why"),
    [
        (boot_request(ciaddr=ZERO, **IPXE), FROM_SITE_ADDRESS, "without its address"),
        (boot_request(**IPXE), ("10.99.0.66", 68), "is not the sender's address"),
        (boot_request(ciaddr=IP("192.0.2.7"), **IPXE), ("192.0.2.7", 68), "outside"),
        (request(dhcp.DISCOVER, ciaddr=SITE_ADDRESS, **IPXE), FROM_SITE_ADDRESS, "only REQUESTs"),
        (boot_request(o54=IP("10.99.0.2").packed, **IPXE), FROM_SITE_ADDRESS, "boot server 10.99"),
        (
            boot_request("52:54:00:99:00:12", **IPXE),
            FROM_SITE_ADDRESS,
            "the node file says 10.99.0.12",
        ),
    ],
    ids=["no-ciaddr", "spoofed-ciaddr", "other-subnet", "discover", "other-server", "reserved"],
)
def test_port_4011_refuses_what_does_not_add_up(policy, packet, sender, why) -> None:
    verdict, decision = port(policy, BOOT_SERVER_PORT).handle(packet, sender)
    assert decision.reply is None and why in decision.reason
    assert verdict.node is not None and verdict.node.ip is None


def test_the_boot_script_goes_only_to_the_address_shown(policy) -> None:
    node = policy.nodes.nodes["cn002"]
    assert policy.address_of(node) == IP("10.99.0.12")  # the file's address wins
    port(policy, BOOT_SERVER_PORT).handle(
        boot_request("52:54:00:99:00:12", ciaddr=IP("10.99.0.12"), **IPXE), ("10.99.0.12", 68)
    )
    assert node.ip == IP("10.99.0.12")


def test_a_forged_relay_gets_no_boot_on_either_port(make_config) -> None:
    """Issue 26: a DISCOVER naming the relay and a node's port, sent by another host, then
    a REQUEST on 4011 from that host's address: silence on both, nothing learned."""
    located = LOCATED.replace('ip = "10.99.0.13"\n', "")
    policy = local_policy(proxy_file(make_config, located), clock=Clock())
    mac, attacker = "52:54:00:aa:00:66", (str(SITE_ADDRESS), 67)
    forged = request(dhcp.DISCOVER, mac, giaddr=RELAY, **IPXE, **ON_SWP3)
    for number in (67, BOOT_SERVER_PORT):
        verdict, decision = port(policy, number).handle(forged, attacker)
        assert verdict.untrusted and decision.reply is None
    decision = port(policy, BOOT_SERVER_PORT).handle(boot_request(mac, **IPXE), attacker)[1]
    assert decision.reply is None
    node = policy.nodes.nodes["cn003"]
    assert policy.nodes.by_mac(mac) is None and node.ip is None and node.boot is None


def test_a_relayed_discover_names_the_node_by_its_port(make_config) -> None:
    """Behind a relay that forwards to the site's server and to layerpy: the port in option
    82 names the node, the offer goes back to the relay, and port 4011 then knows its MAC."""
    located = LOCATED.replace('ip = "10.99.0.13"\n', "")
    policy = local_policy(proxy_file(make_config, located), clock=Clock())
    mac = "52:54:00:aa:00:03"
    discover = request(dhcp.DISCOVER, mac, giaddr=RELAY, **IPXE, **ON_SWP3)
    verdict, decision = port(policy, 67).handle(discover, (str(RELAY), 67))
    assert verdict.node.name == "cn003" and decision.destination == (str(RELAY), 67)
    assert decision.reply.yiaddr == ZERO
    assert decision.reply.options[dhcp.OPT_BOOTFILE].endswith(b"/boot/cn003.ipxe")
    decision = port(policy, BOOT_SERVER_PORT).handle(boot_request(mac, **IPXE), FROM_SITE_ADDRESS)[
        1
    ]
    assert decision.reply is not None and policy.nodes.nodes["cn003"].ip == SITE_ADDRESS
