"""DHCP client messages as boot firmware and OS clients send them, for the unit tests of
the boot policy and the ProxyDHCP server (built directly, without a wire round trip)."""

from __future__ import annotations

from ipaddress import IPv4Address

from layerpy.proto import dhcp

KNOWN = "52:54:00:99:00:11"
STRANGER = "52:54:00:00:00:01"
SERVER = IPv4Address("10.99.0.1")
RELAY = IPv4Address("10.99.0.254")
ZERO = IPv4Address(0)
LOCATED = '\n[switches.sw1]\nrelay = "10.99.0.254"\n\n[nodes.cn003]\nip = "10.99.0.13"\nlocation = "sw1:swp3"\n'


def request(message: int, mac: str = KNOWN, *, ciaddr=ZERO, giaddr=ZERO, **options: bytes):
    chaddr = bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0")
    opts = {dhcp.OPT_MESSAGE_TYPE: bytes((message,))}
    opts.update({int(code[1:]): value for code, value in options.items()})
    return dhcp.DhcpPacket(
        1, 1, 6, 0, 0x42, 0, 0, ciaddr, ZERO, ZERO, giaddr, chaddr, bytes(64), bytes(128), opts
    )


BIOS = {"o60": b"PXEClient:Arch:00000:UNDI:002001", "o93": b"\x00\x00"}
UEFI = {"o60": b"PXEClient:Arch:00007:UNDI:003016", "o93": b"\x00\x07"}
IPXE = {
    "o60": b"PXEClient:Arch:00000:UNDI:002001",
    "o77": b"iPXE",
    "o175": b"\xb1\x05\x01\x80\x86\x10\x0e",
}
HTTP_BOOT = {"o60": b"HTTPClient:Arch:00016:UNDI:003001", "o93": b"\x00\x10"}
ARM64 = {"o60": b"PXEClient:Arch:00011:UNDI:003000", "o93": b"\x00\x0b"}
ON_SWP3 = {"o82": b"\x01\x04swp3"}  # option 82, circuit id "swp3", as dhcrelay sends it
