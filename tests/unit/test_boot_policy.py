"""What each kind of DHCP client gets from the boot policy and the DHCP service's answer()."""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest

from layerpy.boot import BootPolicy, firmware_of
from layerpy.inventory import Inventory
from layerpy.model import RunState
from layerpy.proto import dhcp
from layerpy.services.dhcp import DhcpService
from layerpy.stats import Stats

KNOWN = "52:54:00:99:00:11"
SERVER = IPv4Address("10.99.0.1")


def request(message: int, mac: str = KNOWN, **options: bytes) -> dhcp.DhcpPacket:
    chaddr = bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0")
    zero = IPv4Address(0)
    opts = {dhcp.OPT_MESSAGE_TYPE: bytes((message,))}
    opts.update({int(code[1:]): value for code, value in options.items()})
    return dhcp.DhcpPacket(
        1, 1, 6, 0, 0x42, 0, 0, zero, zero, zero, zero, chaddr, bytes(64), bytes(128), opts
    )


BIOS = {"o60": b"PXEClient:Arch:00000:UNDI:002001", "o93": b"\x00\x00"}
UEFI = {"o60": b"PXEClient:Arch:00007:UNDI:003016", "o93": b"\x00\x07"}
IPXE = {
    "o60": b"PXEClient:Arch:00000:UNDI:002001",
    "o77": b"iPXE",
    "o175": b"\xb1\x05\x01\x80\x86\x10\x0e",
}


@pytest.fixture
def service(make_config) -> DhcpService:
    config = make_config()
    policy = BootPolicy(Inventory(config))
    return DhcpService(policy, SERVER, Stats(), log_requests=False)


@pytest.mark.parametrize(
    ("options", "firmware", "bootfile", "next_server"),
    [
        (BIOS, "bios", b"undionly.kpxe", "10.99.0.1"),
        (UEFI, "uefi", b"snponly.efi", "10.99.0.1"),
        (IPXE, "ipxe", b"http://10.99.0.1:8080/boot/cn001.ipxe", "0.0.0.0"),
        ({"o60": b"udhcp 1.35.0"}, "os", None, "0.0.0.0"),
    ],
)
def test_offer_per_firmware(service, options, firmware, bootfile, next_server) -> None:
    discover = request(dhcp.DISCOVER, **options)
    assert firmware_of(discover) == firmware
    offer = service.answer(discover)
    assert offer.message_type == dhcp.OFFER
    assert offer.yiaddr == IPv4Address("10.99.0.11")
    assert offer.options.get(dhcp.OPT_BOOTFILE) == bootfile
    assert str(offer.siaddr) == next_server
    assert offer.options[dhcp.OPT_HOSTNAME] == b"cn001"
    assert (dhcp.OPT_IPXE in offer.options) == (firmware == "ipxe")
    if firmware in ("bios", "uefi"):  # PXE: vendor class echoed, and "boot this file"
        assert offer.options[dhcp.OPT_VENDOR_CLASS] == b"PXEClient"
        assert offer.options[dhcp.OPT_VENDOR_SPECIFIC] == bytes((6, 1, 8, 255))
    node = service.policy.inventory.nodes["cn001"]
    assert node.run_state is (RunState.UNKNOWN if firmware == "os" else RunState.BOOTING)


def test_request_for_the_right_address_is_acked_and_timed(service) -> None:
    ack = service.answer(
        request(dhcp.REQUEST, o50=bytes([10, 99, 0, 11]), o54=SERVER.packed, **IPXE)
    )
    assert ack.message_type == dhcp.ACK
    assert "dhcp_ack" in service.policy.inventory.nodes["cn001"].boot.phases


def test_request_for_another_address_is_nakked(service) -> None:
    nak = service.answer(request(dhcp.REQUEST, o50=bytes([10, 99, 0, 77])))
    assert nak.message_type == dhcp.NAK
    assert nak.options[dhcp.OPT_MESSAGE] == b"use 10.99.0.11"


def test_request_to_another_server_is_ignored(service) -> None:
    assert (
        service.answer(request(dhcp.REQUEST, o50=bytes([10, 99, 0, 11]), o54=bytes([10, 99, 0, 2])))
        is None
    )


def test_unknown_machine_gets_nothing(service) -> None:
    assert service.answer(request(dhcp.DISCOVER, mac="52:54:00:00:00:01", **BIOS)) is None
    assert list(service.policy.inventory.unknown) == ["52:54:00:00:00:01"]


def test_release_and_decline_are_not_answered(service) -> None:
    assert service.answer(request(dhcp.RELEASE)) is None
    assert service.answer(request(dhcp.DECLINE)) is None
