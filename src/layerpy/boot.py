"""Boot policy: *what* each machine gets, kept apart from *how* the protocols carry it.

The DHCP service asks :meth:`BootPolicy.offer` and the HTTP service asks
:meth:`BootPolicy.script`; neither knows about node files, firmware types or tokens.
"""

from __future__ import annotations

import secrets
from ipaddress import IPv4Address

from layerpy.config import Config
from layerpy.inventory import DISCOVERY, Inventory
from layerpy.model import Node
from layerpy.proto.dhcp import DISCOVER, DhcpPacket, Offer

# RFC 4578 / IANA processor architecture types (DHCP option 93).
ARCH_BIOS = 0
ARCH_UEFI_X64 = (7, 9)
DISCOVERY_LEASE = 300  # seconds: a discovery address is only held until the node is known


def firmware_of(request: DhcpPacket) -> str:
    """A short name for what is asking: ``ipxe``, ``bios``, ``uefi`` or ``os`` (no PXE)."""
    if request.is_ipxe:
        return "ipxe"
    if not request.is_pxe_client:
        return "os"
    arch = request.client_arch
    if arch in (None, ARCH_BIOS):
        return "bios"
    if arch in ARCH_UEFI_X64:
        return "uefi"
    return f"arch-{arch}"


class BootPolicy:
    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.pool: dict[str, IPv4Address] = {}  # discovery leases: MAC -> address

    @property
    def config(self) -> Config:
        """Always the node file in force (it changes on reload)."""
        return self.inventory.config

    @property
    def base_url(self) -> str:
        return self.config.server.url

    def offer(self, request: DhcpPacket) -> Offer | None:
        """The lease and boot instructions for a DHCP request, or None to stay silent."""
        firmware = firmware_of(request)
        node = self._located(request) or self.inventory.by_mac(request.mac)
        if node is None:
            vendor = request.options.get(60, b"").decode("ascii", "replace") or None
            self.inventory.saw_unknown(request.mac, firmware, vendor)
            return self._discovery(request.mac, firmware)
        node.mac = request.mac
        if firmware != "os" and request.message_type == DISCOVER:
            self.inventory.saw_boot_request(node, firmware)
        return self._offer_for(node, firmware)

    def _located(self, request: DhcpPacket) -> Node | None:
        """The node at the switch port a relay agent names (option 82): the switch by its
        remote id, else by the relay's address; the port is the circuit id."""
        relay = request.relay_agent
        if 1 not in relay:
            return None
        remote = relay.get(2, b"").decode(errors="replace")
        switch = next(
            (s.name for s in self.config.switches.values()
             if (remote and s.remote_id == remote) or s.relay == request.giaddr),
            None,
        )  # fmt: skip
        if switch is None:
            return None
        port = relay[1].decode(errors="replace")
        return self.inventory.locate(request.mac, (switch, port), "dhcp-option-82")

    def _discovery(self, mac: str, firmware: str) -> Offer | None:
        """A machine no node claims (yet) boots the minOS from the pool, so its agent can
        tell where it is plugged in; without a pool it gets nothing."""
        address = self._pool_address(mac)
        if address is None:
            return None
        server, network = self.config.server, self.config.network
        offer = Offer(
            address=address,
            server_id=server.address,
            subnet_mask=network.subnet.netmask,
            lease_time=DISCOVERY_LEASE,
            router=network.gateway,
            dns=network.dns,
        )
        if firmware == "ipxe":
            offer.bootfile = f"{self.base_url}/boot/discover/{mac}.ipxe"
            offer.ipxe_no_pxedhcp = True
        elif firmware in ("bios", "uefi"):
            offer.bootfile = self.config.ipxe.bios if firmware == "bios" else self.config.ipxe.uefi
            offer.next_server = server.address
        return offer

    def _pool_address(self, mac: str) -> IPv4Address | None:
        pool = self.config.network.pool
        if pool is None or not self.config.network.discover:
            return None
        if mac not in self.pool:
            taken = set(self.pool.values())
            free = (IPv4Address(n) for n in range(int(pool[0]), int(pool[1]) + 1))
            address = next((a for a in free if a not in taken), None)
            if address is None:
                return None
            self.pool[mac] = address
        return self.pool[mac]

    def discovery_script(self, mac: str) -> str:
        machine = self.inventory.unknown.get(mac)
        assert machine is not None
        machine.token = secrets.token_urlsafe(18)
        return self._script(DISCOVERY, machine.token, mac)

    def acknowledged(self, request: DhcpPacket) -> None:
        """The lease was confirmed; part of the boot timeline when firmware asked."""
        node = self.inventory.by_mac(request.mac)
        if node is not None and firmware_of(request) != "os":
            self.inventory.mark(node, "dhcp_ack")

    def _offer_for(self, node: Node, firmware: str) -> Offer:
        server, network, ipxe = self.config.server, self.config.network, self.config.ipxe
        boot: dict[str, object] = {}
        if firmware == "ipxe":
            boot = {"bootfile": self.script_url(node), "ipxe_no_pxedhcp": True}
        elif firmware in ("bios", "uefi"):
            bootfile = ipxe.bios if firmware == "bios" else ipxe.uefi
            boot = {"bootfile": bootfile, "next_server": server.address}
        return Offer(
            address=node.config.ip,
            server_id=server.address,
            subnet_mask=network.subnet.netmask,
            lease_time=network.lease_time,
            router=network.gateway,
            dns=network.dns,
            domain=network.domain,
            hostname=node.name,
            **boot,  # type: ignore[arg-type]
        )

    def script_url(self, node: Node) -> str:
        return f"{self.base_url}/boot/{node.name}.ipxe"

    def script(self, node: Node) -> str:
        """The iPXE script that loads the minOS with this boot's token."""
        token = self.inventory.issue_token(node)
        return self._script(node.name, token, node.mac or node.config.mac or "")

    def _script(self, name: str, token: str, mac: str) -> str:
        minos = self.config.minos
        args = [
            "initrd=minos",
            minos.cmdline,
            f"layerpy.server={self.base_url}",
            f"layerpy.node={name}",
            f"layerpy.token={token}",
            f"layerpy.heartbeat={self.config.server.heartbeat:g}",
            "BOOTIF=01-" + mac.replace(":", "-"),
        ]
        cmdline = " ".join(arg for arg in args if arg)
        return (
            "#!ipxe\n"
            f"echo layerpy: booting {name} into the minOS\n"
            f"kernel {self.base_url}/minos/kernel {cmdline}\n"
            f"initrd --name minos {self.base_url}/minos/initrd\n"
            "boot\n"
        )

    def node_for_fetch(self, remote: str) -> Node | None:
        """The node a boot-file request comes from, known by its address."""
        try:
            return self.inventory.by_ip(IPv4Address(remote))
        except ValueError:
            return None
