"""Boot policy: *what* each machine gets, kept apart from *how* the protocols carry it.

The boot services see only :class:`Booter` (pixiecore's ``Booter`` is the model): what a
machine is to boot, and what it fetched. DHCP asks :meth:`Booter.verdict` what a request
deserves (a pure reading of the node file, the node store and the discovery pool), lets
the protocol core in :mod:`layerpy.proto.dhcp_server` decide the reply, and then calls
:meth:`Booter.apply` with the core's effects: observations and lease changes are written
there and only there. HTTP asks for scripts and, with TFTP, says what was fetched
(:meth:`Booter.fetched`). No service knows the node store, firmware or tokens.
:class:`BootPolicy` is the one Booter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Protocol

from layerpy.config import Config
from layerpy.config.records import EFI_ARCHES, MINOS_ARCHES
from layerpy.logs import Throttle
from layerpy.model import Node, Phase, RunState
from layerpy.nodes import DISCOVERY, Ack, NodeStore, ReportRejected
from layerpy.nodes.backend import CLIENTS, LEASES, TOKENS, Backend, Record, Unreachable
from layerpy.proto import rpi, tftp
from layerpy.proto.agent import Cmdline
from layerpy.proto.dhcp import ANY, DISCOVER, OPT_VENDOR_CLASS, DhcpPacket, Offer
from layerpy.proto.dhcp_server import Action, Effect, Grant
from layerpy.proto.leases import BOUND, DECLINED, FREE, Lease, LeaseTable

log = logging.getLogger("layerpy.dhcp")
quiet = Throttle(log)  # what a client causes on every retry: a few lines a minute
RECHECK = 1.0  # seconds: how often a node's boot token may be read again from etcd
TOKEN_WAIT = 2.0  # seconds a boot script waits for its token to reach etcd (a cluster)
CMDLINE_KEEP = 300.0  # seconds a Pi's cmdline.txt (and its token) serves the same boot


@dataclass(frozen=True)
class Firmware:
    """A kind of boot firmware: which iPXE binary of ``[ipxe]`` it is sent, and how; which
    of Debian's signed loaders (shim, then GRUB) it can run instead; or, for firmware that
    loads no iPXE, the PXE menu item it looks for (its files by TFTP)."""

    name: str  # in logs and boot timelines
    binary: str  # the [ipxe] key naming the binary ("" with a menu)
    http: bool = False  # UEFI HTTP boot: the binary by http:// URL (no TFTP)
    menu: str | None = None  # option 43's boot menu item instead of a binary
    efi_arch: str | None = None  # shim's name for its architecture (config.EFI_ARCHES)
    arch: str = "amd64"  # the CPU it runs on: which minOS it boots (MINOS_ARCHES)


def arch_of(firmware: str | None) -> str:
    """The CPU architecture of a boot firmware's name (x86-64 when not known)."""
    kind = FIRMWARE.get(firmware or "")
    return "amd64" if kind is None else kind.arch


def node_arch(node: Node) -> str:
    """The CPU architecture of the firmware that started the node's boot."""
    return arch_of(node.boot.firmware if node.boot is not None else None)


def minos_dir(arch: str) -> str:
    """Where a minOS's files are served (TFTP and HTTP): minos/ for x86-64, else minos/<arch>."""
    return "minos" if arch == "amd64" else f"minos/{arch}"


# IANA "Processor Architecture Types" (DHCP option 93, RFC 4578 and later); anything else
# is refused and logged, not guessed at.
ARCHITECTURES = {
    0: Firmware("bios", "bios"),
    7: Firmware("uefi", "uefi", efi_arch="x64"),
    9: Firmware("uefi", "uefi", efi_arch="x64"),
    11: Firmware("uefi-arm64", "arm64", efi_arch="aa64", arch="arm64"),
    16: Firmware("uefi-http", "uefi", http=True, efi_arch="x64"),
    19: Firmware("uefi-arm64-http", "arm64", http=True, efi_arch="aa64", arch="arm64"),
}
# A Raspberry Pi 4/5 bootloader says arch 0 like a BIOS; its option 97 tells it apart.
RPI = Firmware("rpi", "", menu=rpi.MENU, arch="arm64")
# iPXE itself asking (user class iPXE): it gets its script; on arm64 (option 93 = 11) it is
# told apart, so that a boot iPXE began, or an unknown machine last seen as iPXE, still
# gets the minOS of its CPU.
IPXE, IPXE_ARM64 = "ipxe", "ipxe-arm64"
FIRMWARE = {
    firmware.name: firmware
    for firmware in (*ARCHITECTURES.values(), RPI, Firmware(IPXE_ARM64, "", arch="arm64"))
}
# Debian 12's signed netboot GRUB (grubnet<arch>.efi): built with the prefix "/grub" on the
# TFTP server it came from and a memdisk grub.cfg that sources $prefix/<platform>/grub.cfg
# if it exists, else $prefix/grub.cfg; it has TFTP but no HTTP (docs/secure-boot.md).
GRUB_CONFIG = "grub/grub.cfg"
# The minOS's files by name (TFTP for GRUB, HTTP for iPXE): the x86-64 one under minos/,
# the others under minos/<arch>/.
PI_FILES = {rpi.KERNEL: Phase.KERNEL, rpi.INITRD: Phase.INITRD}  # config.txt names them
MINOS_FILES = {
    f"{minos_dir(arch)}/{phase.value}": (arch, phase)
    for arch in MINOS_ARCHES
    for phase in (Phase.KERNEL, Phase.INITRD)
}
KEPT = (BOUND, DECLINED, FREE)  # lease states kept: an offer is no promise
DISCOVERY_LEASE = 300  # seconds: a discovery address is only held until the node is known
PER_PORT = 4  # discovery addresses the machines behind one relay port may hold at once


def firmware_of(request: DhcpPacket) -> str:
    """What is asking: ``ipxe`` (``ipxe-arm64``), ``os`` (no PXE, no HTTP boot), a name of
    ``FIRMWARE``, or ``arch-N`` for an architecture nobody knows."""
    if request.is_ipxe:
        return IPXE_ARM64 if request.client_arch in (11, 19) else IPXE
    guid = request.rpi_guid  # a Pi's REQUEST has no option 60: ask before it
    if guid is not None and guid[0] is not None and not request.is_http_client:
        return RPI.name
    if not (request.is_pxe_client or request.is_http_client):
        return "os"
    arch = request.client_arch
    if arch is None:  # old PXE ROMs send no option 93: they are BIOS
        return "bios"
    known = ARCHITECTURES.get(arch)
    if known is None or known.http != request.is_http_client:
        return f"arch-{arch}"
    return known.name


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__,
# 3.5x the cost, and DHCP makes one of these per packet
@dataclass(slots=True)
class Verdict:
    """What one DHCP request shows and deserves, before anything is written."""

    mac: str
    firmware: str
    vendor_class: str | None
    node: Node | None  # the node this machine is, by the port a relay names, else by MAC
    location: tuple[str, str] | None  # (switch, port) from option 82, to bind in apply()
    boot_request: bool  # a DISCOVER from boot firmware: offered, a boot of a known node starts
    grant: Grant | None
    why: str  # whose grant this is, or why there is none (for logs)
    unbootable: bool = False  # boot firmware we have no binary for (logged in apply())
    untrusted: bool = False  # relayed, not by a relay we know: dropped, nothing written
    xid: int | None = None  # the request's transaction: a retransmission starts no new boot


class Refused(Exception):
    """A boot script asked for from an address it is not for; the message says whose it is."""


class SignedOnly(Exception):
    """An iPXE script asked for a node that boots only by the signed path (secure_boot)."""


def phase_of(name: str) -> Phase:
    """The boot phase a file fetched by TFTP is: the minOS's kernel or initrd (by its
    name for GRUB, or a Pi's), else TFTP."""
    arch_phase = MINOS_FILES.get(name.lstrip("/"))
    if arch_phase is not None:
        return arch_phase[1]
    asked = rpi.parse_path(name)
    return PI_FILES.get(asked.name, Phase.TFTP) if asked is not None else Phase.TFTP


def grub_words(cmdline: str) -> str:
    """A kernel command line as GRUB script words, each single-quoted (GRUB joins a linux
    command's words with spaces, and would expand $ or split at ; in them otherwise)."""
    return " ".join("'" + word.replace("'", "'\\''") + "'" for word in cmdline.split())


class Booter(Protocol):
    """The boot services' one door to the nodes: what a machine is to boot, and what it
    fetched (and the agent's report, which ends a boot). Nothing else of the node store."""

    @property
    def config(self) -> Config:
        """The node file in force."""
        ...

    @property
    def servers(self) -> tuple[str, ...]:
        """Every instance an agent of this segment may report to, this one first."""
        ...

    def servers_of(self, node: str) -> tuple[str, ...]:
        """The servers for ``node``'s agent, the one that owns it first."""
        ...

    def tick(self) -> list[Lease]: ...
    def verdict(self, request: DhcpPacket, sender: str) -> Verdict: ...
    def apply(self, verdict: Verdict, effects: Iterable[Effect]) -> None: ...
    def keeping(self) -> Awaitable[bool] | None: ...

    # what DHCP's prepared replies ask (services/dhcp_fast.py)
    @property
    def solo(self) -> bool: ...
    @property
    def leases(self) -> LeaseTable | None: ...
    def machine(self, mac: str) -> Node | None: ...
    def lasting(self, verdict: Verdict) -> bool: ...

    async def script(self, name: str, remote: str) -> str | None: ...
    def script_now(self, name: str, remote: str) -> str | None: ...
    async def loader_file(self, name: str, remote: str) -> bytes | Path | None: ...
    def discovery_script(self, mac: str, remote: str) -> str | None: ...
    def fetched(self, remote: str, phase: Phase) -> None: ...
    def known(self, address: str) -> bool: ...
    async def report(self, payload: Any) -> Ack: ...
    def report_now(self, payload: Any) -> Ack | None: ...
    def holds_token(self, name: str, token: str) -> bool: ...


class PortShares:
    """Which discovery pool holders sit behind which relay port, counted per port at once
    (a scan of every holder per DISCOVER would cost what the pool is large)."""

    def __init__(self) -> None:
        self._port_of: dict[str, tuple[str, str]] = {}
        self._holders: dict[tuple[str, str], set[str]] = {}

    def hold(self, mac: str, port: tuple[str, str]) -> None:
        self.drop(mac)
        self._port_of[mac] = port
        self._holders.setdefault(port, set()).add(mac)

    def drop(self, mac: str) -> None:
        port = self._port_of.pop(mac, None)
        if port is not None:
            holders = self._holders[port]
            holders.discard(mac)
            if not holders:
                del self._holders[port]

    def others(self, port: tuple[str, str], mac: str) -> int:
        """Holders behind `port` other than `mac`."""
        holders = self._holders.get(port, set())
        return len(holders) - (mac in holders)


class BootPolicy:
    """The :class:`Booter` of ``layerpy serve``: the node file, the node store and the
    discovery pool decide what each machine boots."""

    def __init__(
        self, nodes: NodeStore, backend: Backend, pool_gate: Callable[[], bool] | None = None
    ) -> None:
        """``backend``: where the discovery pool's leases are kept (the store's).
        ``pool_gate``: whether this instance answers unknown machines from the discovery
        pool now (a cluster: only the segment's pool holder does; None: always)."""
        self.nodes = nodes
        self.backend = backend
        self.pool_gate = pool_gate
        self._shared = self.backend.instance is not None  # a cluster's pool, in etcd
        # a cluster: the lease and client records this instance's decisions assume, and
        # the writes apply() made that keeping() is to send, in one transaction
        self._view: dict[tuple[str, str], Record | None] = {}
        self._staged: dict[tuple[str, str], tuple[Record, Record | None]] = {}
        self._sending = asyncio.Lock()
        self._leases: LeaseTable | None = None
        self._leases = self._pool_table()
        self._ports = PortShares()  # pool holders behind relay ports
        self.peers: tuple[str, ...] = ()  # the other instances' URLs on this segment
        self._servers: tuple[object, tuple[str, ...]] = ((), ())  # (made of, servers)
        self.owner_url: Callable[[str], str | None] = lambda node: None  # its owner's URL
        self._rechecked: dict[str, float] = {}  # node -> when its token was read again
        # node (or discover/MAC) -> (when, token, command line) handed out by TFTP (GRUB's
        # config, a Pi's cmdline.txt), read more than once a boot; oldest first, none
        # older than CMDLINE_KEEP kept
        self._cmdlines: OrderedDict[str, tuple[float, str, str]] = OrderedDict()
        if self._shared:
            self.backend.on_change(self._leased_elsewhere)

    @property
    def config(self) -> Config:
        """Always the node file in force (it changes on reload)."""
        return self.nodes.config

    @property
    def base_url(self) -> str:
        return self.config.server.url

    @property
    def servers(self) -> tuple[str, ...]:
        """Every instance serving the boot segment, this one first: the agents' servers
        (the same tuple while they stay: a heartbeat compares it by identity)."""
        made_of = (self.base_url, self.peers)
        if self._servers[0] != made_of:
            servers = (self.base_url, *(url for url in self.peers if url != self.base_url))
            self._servers = (made_of, servers)
        return self._servers[1]

    def servers_of(self, node: str) -> tuple[str, ...]:
        """A node's agent's servers: its owner first (its heartbeats are the owner's to
        judge), then the others."""
        servers, owner = self.servers, self.owner_url(node)
        if owner is None or owner == servers[0]:
            return servers
        return (owner, *(url for url in servers if url != owner))

    @property
    def leases(self) -> LeaseTable | None:
        """The discovery pool's leases as of the last tick(); None without network.discover."""
        return self._leases

    def tick(self) -> list[Lease]:
        """Upkeep, an explicit step before deciding: follow a reloaded pool, and free the
        leases whose time has passed (returned, for the log)."""
        self._leases = self._pool_table()
        lapsed = self._leases.expire() if self._leases is not None else []
        for lease in lapsed:
            self._ports.drop(lease.client)
        if lapsed:
            self._persist()
        return lapsed

    def _pool_table(self) -> LeaseTable | None:
        network = self.config.network
        if network.pool is None or not network.discover:
            return None
        old = self._leases
        if old is not None and old.range == network.pool:
            return old
        if old is not None:
            records = old.records()
        else:
            records = [{"address": a, **r} for a, r in self.backend.load(LEASES).items()]
        try:
            table = LeaseTable.from_records(*network.pool, records, clock=self.nodes.clock)
        except ValueError as error:
            log.error("discovery pool leases: %s; the pool starts empty", error)
            table = LeaseTable(*network.pool, clock=self.nodes.clock)
        if old is None and len(table):
            log.info("restored %d discovery pool leases", len(table))
        elif old is not None and not self._shared:  # a reload changed the pool
            for record in records:  # what is outside it is kept no longer
                if IPv4Address(record["address"]) not in table:
                    self.backend.delete(LEASES, record["address"])
        return table

    def _persist(self) -> None:
        """Keep what the pool table wrote, through the store's backend. One server: at
        once (raises OSError: then nothing may be answered as if it were kept). A cluster:
        staged for keeping(), and only by the pool's holder. An offer is no promise (the
        REQUEST may still be NAKed), so it is not kept: half the writes, and a restart
        forgets only offers, as Kea does."""
        table = self._leases
        if table is None:
            return
        changes = table.changes(KEPT)
        if not self._shared:
            for lease in changes:
                self.backend.put(LEASES, str(lease.address), _record(lease))
            return
        if not self._holds_pool():
            return  # the holder keeps the pool; this one only follows it
        for lease in changes:
            address = str(lease.address)
            self._stage(LEASES, address, _record(lease))
            if lease.state == BOUND and lease.client:  # one address a client, at most
                self._stage(CLIENTS, lease.client, {"address": address})

    def _holds_pool(self) -> bool:
        return self.pool_gate is None or self.pool_gate()

    # -- a cluster's shared pool ----------------------------------------------------------

    def _stage(self, kind: str, key: str, record: Record) -> None:
        """A write for the next keeping(), against the record this decision assumed."""
        where = (kind, key)
        expected = self._view[where] if where in self._view else self.backend.get(kind, key)
        if where in self._staged:
            expected = self._staged[where][1]  # still the one etcd is to hold before
        self._staged[where] = (record, expected)
        self._view[where] = record

    def keeping(self) -> Awaitable[bool] | None:
        """After apply(): the transaction that keeps what it wrote, to be awaited before
        the reply goes out (True: send it; False: another instance got there first, send
        nothing, the client asks again). None: kept already (one server, or nothing new)."""
        if not self._staged:
            return None
        staged, self._staged = self._staged, {}
        return self._keep(staged)

    async def _keep(self, staged: dict[tuple[str, str], tuple[Record, Record | None]]) -> bool:
        writes = [(kind, key, record, expected) for (kind, key), (record, expected)
                  in staged.items()]  # fmt: skip
        async with self._sending:  # in the order decided
            try:
                if await self.backend.replace_all(writes):
                    return True
            except Exception as error:  # etcd away: promise nothing
                quiet.log("pool", logging.WARNING, "discovery pool leases not kept: %s", error)
            for kind, key in staged:  # back to what etcd holds
                self._view.pop((kind, key), None)
                if kind == LEASES:
                    self._adopt(key, self.backend.get(kind, key))
            return False

    def _leased_elsewhere(self, kind: str, key: str, record: Record | None) -> None:
        """Another instance kept a lease (the backend's ``on_change``): this table follows,
        so a new pool holder continues from the pool as it is."""
        if kind in (LEASES, CLIENTS):
            self._view[kind, key] = record
        if kind == LEASES:
            self._adopt(key, record)

    def _adopt(self, address: str, record: Record | None) -> None:
        table = self._leases
        if table is None:
            return
        kept = record or {"client": "", "state": FREE, "expires": 0}
        try:
            table.adopt({**kept, "address": address})
        except ValueError as error:
            quiet.log("pool", logging.WARNING, "discovery pool: ignored %s", error)

    def verdict(self, request: DhcpPacket, sender: str) -> Verdict:
        """What this request, which came from the address `sender`, deserves; nothing is
        written here (see apply())."""
        mac, firmware = request.mac, firmware_of(request)
        vendor = request.options.get(OPT_VENDOR_CLASS, b"").decode("ascii", "replace") or None
        if not request.giaddr.is_unspecified:
            refused = self._untrusted_relay(request.giaddr, sender)
            if refused is not None:
                return Verdict(mac, firmware, vendor, None, None, False, None, refused,
                               untrusted=True)  # fmt: skip
        location = self._relay_location(request)
        located = self.nodes.who_is(mac, location) if location is not None else None
        node = located or self.nodes.by_mac(mac)
        node, firmware = self._pi(request, node, firmware)
        loads = self._loads(firmware, node)
        if isinstance(loads, str):  # boot firmware we have nothing for: refused, not guessed at
            return Verdict(mac, firmware, vendor, node, location, False, None, loads, True)
        if node is not None:
            grant: Grant | None = Grant(self._offer_for(node, firmware, loads))
            why = node.name
        else:
            grant, why = self._discovery(request, firmware, location, loads)
        boot_request = node is not None and firmware != "os" and request.message_type == DISCOVER
        return Verdict(mac, firmware, vendor, node, location, boot_request, grant, why,
                       xid=request.xid)  # fmt: skip

    def machine(self, mac: str) -> Node | None:
        """The node a MAC is, as verdict() finds it where no relay names a location."""
        return self.nodes.by_mac(mac)

    @property
    def solo(self) -> bool:
        """One server: no cluster's pool to keep in etcd or to leave to its holder."""
        return not self._shared and self.pool_gate is None

    def lasting(self, verdict: Verdict) -> bool:
        """Whether this verdict's grant is what every request of the same shape from the
        same machine (a pool grant: from any machine no node claims, but for the address)
        is granted until the node file changes, so that an answer may be prepared from it
        (services/dhcp_fast.py). Not a signed loader's, whose files are looked for on disk
        each time, nor an iPXE's discovery script, named by the machine's MAC, nor a grant
        that depends on where a relay says the machine is."""
        grant, firmware = verdict.grant, verdict.firmware
        if grant is None or verdict.unbootable or verdict.untrusted or verdict.location:
            return False
        if grant.pooled:
            return firmware not in (IPXE, IPXE_ARM64)
        node, kind = verdict.node, FIRMWARE.get(firmware)
        if node is None or kind is None or not kind.binary:  # an OS, iPXE, a Pi: no loader
            return node is not None
        return not node.config.secure_boot and getattr(self.config.ipxe, kind.binary) is not None

    def _pi(self, request: DhcpPacket, node: Node | None, firmware: str) -> tuple[Node | None, str]:
        """A Raspberry Pi bootloader is known by its serial (option 97) where its MAC is not
        in the file; one that sends the old GUID (the serial four times, which anything
        could send) is a Pi only when that serial is the node's."""
        guid = request.rpi_guid
        if guid is None:
            return node, firmware
        model, serial = guid
        if node is None and model is not None:
            name = self.config.serials.get(serial)
            node = self.nodes.nodes.get(name) if name is not None else None
        elif node is not None and model is None and node.config.serial == serial:
            firmware = RPI.name if firmware == "bios" else firmware
        return node, firmware

    def apply(self, verdict: Verdict, effects: Iterable[Effect]) -> None:
        """Write what a request showed, then what the answer to it commits, journalled
        before the answer goes out (OSError if it cannot be: then send nothing)."""
        nodes = self.nodes
        if verdict.unbootable:
            who = verdict.node.name if verdict.node is not None else verdict.mac
            quiet.log("unbootable firmware", logging.WARNING, "%s: not answered: %s", who,
                      verdict.why)  # fmt: skip
        if verdict.location is not None:
            nodes.locate(verdict.mac, verdict.location, "dhcp-option-82")
        if verdict.node is None:
            nodes.saw_unknown(verdict.mac, verdict.firmware, verdict.vendor_class)
        else:
            nodes.saw_mac(verdict.node, verdict.mac)
        for effect in effects:
            self._apply(verdict, effect)
        self._persist()

    def _apply(self, verdict: Verdict, effect: Effect) -> None:
        """One effect of a decision: a boot phase, or a change to the discovery pool."""
        if effect.action is Action.OFFERED:  # a DISCOVER left unanswered starts no boot
            if verdict.boot_request and verdict.node is not None:
                self.nodes.saw_boot_request(verdict.node, verdict.firmware, verdict.xid)
                self._cmdlines.pop(verdict.node.name, None)  # a new boot: a new command line
            return
        if effect.action is Action.ACKED:
            if verdict.node is not None and verdict.firmware != "os":
                self.nodes.mark(verdict.node, Phase.DHCP_ACK)
            return
        if effect.action is Action.LEARNED:
            if verdict.node is not None:
                self.nodes.saw_address(verdict.node, effect.address)
            return
        table = self._leases
        if not effect.pooled or table is None:
            return  # a fixed address is never held, freed or quarantined
        client, address = effect.client, effect.address
        if effect.action in (Action.HOLD, Action.COMMIT) and verdict.location is not None:
            self._ports.hold(client, verdict.location)
        elif effect.action in (Action.WITHDRAW, Action.RELEASE, Action.DECLINE):
            self._ports.drop(client)
        if effect.action is Action.WITHDRAW:
            table.withdraw(client)
        elif effect.action is Action.RELEASE:
            table.release(client, address)
        elif effect.action is Action.DECLINE:
            table.decline(client, address)
        elif effect.action is Action.HOLD:
            self._taken(effect, table.offer(client, address))
        else:
            debug = log.isEnabledFor(logging.DEBUG)
            before = table.lease_of(client) if debug else None
            lease = self._taken(effect, table.commit(client, address, effect.lease_time))
            if debug and lease is not None and (before is None or before.state != BOUND):
                log.debug("%s: discovery lease %s for %d s", client, address, effect.lease_time)

    @staticmethod
    def _taken(effect: Effect, lease: Lease | None) -> Lease | None:
        """A hold or commit the table refused: a bug, since it was decided from this table."""
        if lease is None:
            log.error(
                "%s: lease table refused to %s %s", effect.client, effect.action, effect.address
            )
        return lease

    def _untrusted_relay(self, giaddr: IPv4Address, sender: str) -> str | None:
        """Why a relayed request is not believed, or None when it came from its relay.

        A relay is who sent the datagram: anyone can write a relay's address in giaddr
        and option 82 of a packet of their own, so giaddr must name a relay of
        ``[switches]`` and the datagram must come from that relay's address (``relay``,
        or its ``relay_sources``)."""
        senders = self.config.relays.get(giaddr)
        if senders is None:
            return f"relayed by {giaddr}, not a relay the node file names"
        try:
            if IPv4Address(sender) in senders:
                return None
        except ValueError:
            pass
        return f"names relay {giaddr} but was sent from {sender}, not from that relay"

    def _relay_location(self, request: DhcpPacket) -> tuple[str, str] | None:
        """The switch port a relay agent names (option 82): the switch by its remote id,
        else by the relay's address; the port is the circuit id.

        Only from a relay the node file names, as verdict() checked (giaddr in
        ``switches.*.relay``, sent from that relay): only the relay is trusted to have
        stripped a client's option 82 and written its own. Not at all under
        ``identity = "mac"``."""
        relay = request.relay_agent
        if 1 not in relay or request.giaddr.is_unspecified or self.config.server.identity == "mac":
            return None
        remote = relay.get(2, b"").decode(errors="replace")
        switch = next(
            (s.name for s in self.config.switches.values()
             if (remote and s.remote_id == remote) or s.relay == request.giaddr),
            None,
        )  # fmt: skip
        port = relay[1].decode(errors="replace")
        if switch is None or not (port.isprintable() and 0 < len(port) <= 64):
            return None
        return switch, port

    def _discovery(
        self,
        request: DhcpPacket,
        firmware: str,
        port: tuple[str, str] | None,
        loads: dict[str, Any],
    ) -> tuple[Grant | None, str]:
        """A machine no node claims (yet) boots the minOS from the pool, so its agent can
        tell where it is plugged in; without a pool it gets nothing. Behind a relay port,
        at most PER_PORT machines at once: made-up MACs from one port cannot take the pool."""
        table = self._leases
        if table is None:
            return None, "unknown machine, network.discover is off"
        if not self._holds_pool():
            return None, "unknown machine, another instance holds the discovery pool"
        mac = request.mac
        if port is not None and table.lease_of(mac) is None:
            held = self._ports.others(port, mac)
            if held >= PER_PORT:
                return (
                    None,
                    f"unknown machine, {port[0]}:{port[1]} holds {held} discovery addresses",
                )
        wanted = request.requested_ip or (None if request.ciaddr.is_unspecified else request.ciaddr)
        address = table.candidate(mac, wanted)
        if address is None:
            return None, "unknown machine, the discovery pool is exhausted"
        server, network = self.config.server, self.config.network
        if firmware in (IPXE, IPXE_ARM64):
            loads = {"bootfile": f"{self.base_url}/boot/discover/{mac}.ipxe",
                     "ipxe_no_pxedhcp": True}  # fmt: skip
        offer = Offer(
            address=address,
            server_id=server.address,
            subnet_mask=network.subnet.netmask,
            lease_time=DISCOVERY_LEASE,
            router=network.gateway,
            dns=network.dns,
            **loads,
        )
        return Grant(offer, pooled=True), "discovery pool"

    def discovery_address(self, mac: str) -> IPv4Address | None:
        """The pool address a machine holds now: its discovery boot script is for it only."""
        lease = self._leases.lease_of(mac) if self._leases is not None else None
        return lease.address if lease is not None else None

    def discovery_script(self, mac: str, remote: str) -> str | None:
        """The minOS for a machine no node claims yet, at the pool address it holds (None:
        no such machine; Refused: `remote` is not its address)."""
        address = self.discovery_address(mac)
        if address is None or mac not in self.nodes.unknown:
            return None
        if remote != str(address):
            raise Refused(str(address))
        token = self.nodes.discovery_token(mac)
        if token is None:
            return None
        arch = arch_of(self.nodes.unknown[mac].firmware)
        return self._script(DISCOVERY, arch, self._cmdline(DISCOVERY, token, mac))

    def _offer_for(self, node: Node, firmware: str, loads: dict[str, Any]) -> Offer:
        """Authoritative: the node's address and what to boot. Proxy: what to boot, and
        the address the node file expects (0.0.0.0: any)."""
        server, network = self.config.server, self.config.network
        if firmware in (IPXE, IPXE_ARM64):
            loads = {"bootfile": self.script_url(node), "ipxe_no_pxedhcp": True}
            if server.dhcp == "proxy":  # iPXE takes a ProxyDHCP ACK only if it names one
                loads["next_server"] = server.address
        return Offer(
            address=node.config.ip or ANY,
            server_id=server.address,
            subnet_mask=network.subnet.netmask,
            lease_time=network.lease_time,
            router=network.gateway,
            dns=network.dns,
            domain=network.domain,
            hostname=node.name,
            **loads,
        )

    def _loads(self, firmware: str, node: Node | None) -> dict[str, Any] | str:
        """What a client of this firmware is told to load (Offer fields): nothing more for
        an OS or iPXE (the caller adds the script), for boot firmware the iPXE binary or
        Debian's signed shim (which loads the signed GRUB), for a Raspberry Pi's bootloader
        the PXE menu it looks for (its files come by TFTP); or why it gets nothing.

        The signed path is the only one for a node with ``secure_boot``, and the one for a
        node whose firmware [ipxe] has no binary for (arm64) where the signed loaders are
        there. Not for a machine no node claims: GRUB's config is a node's."""
        secure = node is not None and node.config.secure_boot
        ipxe = firmware in (IPXE, IPXE_ARM64)
        if firmware == "os" or (ipxe and not secure):
            return {}
        if ipxe:
            return "iPXE asks, but the node has secure_boot = true: it gets the signed path only"
        kind = FIRMWARE.get(firmware)
        no_binary = f"firmware {firmware} (option 93): no iPXE binary for it in [ipxe]"
        if kind is None:
            return no_binary
        if kind.menu is not None:
            if secure:
                return ("a Raspberry Pi bootloader (option 97) verifies nothing, and the node "
                        "has secure_boot = true: it gets the signed path only")  # fmt: skip
            if self.config.rpi is None:
                return "a Raspberry Pi bootloader (option 97): the node file has no [rpi]"
            return {"pxe_menu": kind.menu, "next_server": self.config.server.address}
        binary = getattr(self.config.ipxe, kind.binary)
        if secure:
            loads = self._signed_loads(kind)
        elif binary is None:
            signed = self._signed_loads(kind) if node is not None else no_binary
            loads = no_binary if isinstance(signed, str) else signed
        elif kind.http:
            loads = {"bootfile": f"{self.base_url}/ipxe/{binary}"}
        else:
            loads = {"bootfile": binary, "next_server": self.config.server.address}
        if isinstance(loads, dict) and self.config.minos.files(kind.arch) is None:
            arch = kind.arch
            return (f"firmware {kind.name}: no {arch} minOS to load (build it with "
                    f"minos/build.sh --arch {arch}, or name it in [minos.{arch}])")  # fmt: skip
        return loads

    def _signed_loads(self, kind: Firmware) -> dict[str, Any] | str:
        """Debian's signed shim by TFTP (shim then fetches GRUB beside it, GRUB its config
        and the minOS, all by TFTP from the same server), or why not."""
        signed = self.config.signed
        if kind.efi_arch is None:
            return f"firmware {kind.name}: no signed loader runs on it (secure_boot needs UEFI)"
        if not signed.has(kind.efi_arch):
            missing = f"{signed.shim(kind.efi_arch)} and {signed.grub(kind.efi_arch)}"
            return f"firmware {kind.name}: no {missing} in {signed.directory} (signed.dir)"
        if kind.http:  # tried: shim loads GRUB by HTTP, and GRUB stops at its shell
            return (f"firmware {kind.name}: UEFI HTTP boot, but Debian 12's signed GRUB, "
                    "started that way, finds no config; let the machine boot by PXE")  # fmt: skip
        return {"bootfile": signed.shim(kind.efi_arch), "next_server": self.config.server.address}

    def script_url(self, node: Node) -> str:
        return f"{self.base_url}/boot/{node.name}.ipxe"

    async def script(self, name: str, remote: str) -> str | None:
        """The iPXE script that loads the minOS with a fresh boot token, for node `name`
        asking from `remote` (None: no such node; Refused: `remote` is not its address;
        SignedOnly: the node boots by the signed path only)."""
        node = self._scripted(name, remote)
        if node is None:
            return None
        return self._script(node.name, node_arch(node), await self._boot_cmdline(node))

    def script_now(self, name: str, remote: str) -> str | None:
        """script(), when it is ready at once and given: the boot listener's shortcut. None
        where script() would refuse, find no node, or wait (a cluster's token goes to etcd
        first): the general path then answers, and says why."""
        if self._shared:
            return None
        try:
            node = self._scripted(name, remote)
        except (Refused, SignedOnly):
            return None
        if node is None:
            return None
        return self._script(node.name, node_arch(node), self._new_cmdline(node))

    def _scripted(self, name: str, remote: str) -> Node | None:
        """The node whose script `remote` may have (None: no such node; Refused, SignedOnly
        as for script)."""
        node = self.nodes.nodes.get(name)
        if node is None:
            return None
        address = self.address_of(node)
        if address is None or remote != str(address):
            raise Refused(str(address or "the address it shows the ProxyDHCP server (none yet)"))
        if node.config.secure_boot:
            raise SignedOnly(name)
        return node

    async def grub_config(self, remote: str) -> str | None:
        """The GRUB config that loads the minOS with the boot's token, for the node at
        `remote`: GRUB asks for the same file name from every machine, so the asking address
        is what names the node, and a machine gets only its own (None: no node there;
        Refused: its boot is not waiting for one, _tftp_cmdline)."""
        node = self.nodes.by_ip(remote)
        if node is None:
            return None
        files = f"(tftp,{self.config.server.address})/{minos_dir(node_arch(node))}"
        cmdline = await self._tftp_cmdline(node)
        return (
            f"echo 'layerpy: booting {node.name} into the minOS'\n"
            f"linux {files}/kernel {grub_words(cmdline)}\n"
            f"initrd {files}/initrd\n"
            "boot\n"
        )

    async def loader_file(self, name: str, remote: str) -> bytes | Path | None:
        """A file TFTP serves by name beside its root's, for the machine at `remote`: a
        Raspberry Pi's (rpi_file); or one the signed path fetches: a signed loader, the
        node's GRUB config (Refused: no node at that address) or the minOS's kernel or
        initrd; None: not one of those (an iPXE binary, or nothing)."""
        if (pi := await self.rpi_file(name, remote)) is not None:
            return pi
        name = name.lstrip("/")
        signed, minos = self.config.signed, self.config.minos
        if name in {f(arch) for arch in EFI_ARCHES for f in (signed.shim, signed.grub)}:
            return signed.directory / name
        if name == GRUB_CONFIG:
            config = await self.grub_config(remote)
            if config is None:
                raise Refused(f"{GRUB_CONFIG} goes only to a node, at its own address")
            return config.encode()
        if name in MINOS_FILES:
            arch, phase = MINOS_FILES[name]
            files = minos.files(arch)
            return None if files is None else files[phase is Phase.INITRD]
        return None

    async def rpi_file(self, name: str, remote: str) -> bytes | Path | None:
        """A Raspberry Pi's TFTP file (docs/hardware.md): for the node at `remote` when it
        boots as a Pi, or the unknown Pi holding that discovery pool address, when the node
        file has [rpi]; None when the request is no Pi's (the TFTP root then answers it, as
        for iPXE). FileNotFoundError: a Pi's request outside its map, or under another
        Pi's directory, or a firmware file that is none, or is outside [rpi] dir."""
        settings = self.config.rpi
        node = self.nodes.by_ip(remote) if settings is not None else None
        mac = self._discovering_pi(remote) if settings is not None and node is None else None
        if settings is None or (node is None and mac is None):
            return None
        if node is not None and not self._is_pi(node):
            return None
        asked = rpi.parse_path(name)
        serial = node.config.serial if node is not None else None
        if node is not None:
            mac = node.mac or node.config.mac
        if asked is None or (
            asked.prefix and serial and asked.prefix not in rpi.prefixes(serial, mac)
        ):
            raise FileNotFoundError(name)
        if asked.name == rpi.CONFIG:
            return rpi.config_txt(node.name if node else DISCOVERY, settings.config).encode()
        if asked.name == rpi.CMDLINE:
            return await self._pi_cmdline(node, mac or "")
        if asked.name in PI_FILES:  # marked once sent, as every file (phase_of)
            return settings.kernel if asked.name == rpi.KERNEL else settings.initrd
        try:  # a firmware file: inside the directory only, a link in it to elsewhere refused
            return await asyncio.to_thread(tftp.safe_path, settings.directory, asked.name)
        except tftp.TftpError:
            raise FileNotFoundError(name) from None

    def _is_pi(self, node: Node) -> bool:
        """Whether a node boots as a Pi: the file gives its serial, or its boot began with
        a Pi bootloader's DHCP."""
        boot = node.boot
        return bool(node.config.serial) or (boot is not None and boot.firmware == RPI.name)

    def _discovering_pi(self, remote: str) -> str | None:
        """The MAC of the unknown Pi holding the discovery pool address `remote`, if one
        does: it boots the minOS to be located, as an unknown PC does through iPXE."""
        table = self._leases
        mac = table.holder(remote) if table is not None else None
        machine = self.nodes.unknown.get(mac) if mac is not None else None
        return mac if machine is not None and machine.firmware == RPI.name else None

    async def _pi_cmdline(self, node: Node | None, mac: str) -> bytes:
        """cmdline.txt: the iPXE script's command line (a node's, or a discovery boot's),
        then ``[rpi] cmdline``."""
        if node is not None:
            cmdline = await self._tftp_cmdline(node)
        else:
            key = f"{DISCOVERY}/{mac}"
            kept = self._kept_cmdline(key)
            if kept is not None and self.nodes.unknown.check_token(mac, kept[0]) is not None:
                cmdline = kept[1]
            else:
                token = self.nodes.discovery_token(mac)
                if token is None:
                    raise FileNotFoundError(rpi.CMDLINE)
                cmdline = self._keep_cmdline(key, token, self._cmdline(DISCOVERY, token, mac))
        settings = self.config.rpi
        extra = settings.cmdline if settings is not None else ""
        return (" ".join(arg for arg in (cmdline, extra) if arg) + "\n").encode()

    async def _tftp_cmdline(self, node: Node) -> str:
        """The minOS command line a node's loader reads by TFTP (the signed GRUB's config,
        a Pi's cmdline.txt). Its token is issued once a boot and kept CMDLINE_KEEP seconds:
        loaders read the file more than once (a Pi: probe, read, and again from
        start4.elf; GRUB: a test, then the read). A TFTP request's source address is easily
        forged, so a read issues a token only while the node's boot waits for one (it is
        booting, from DHCP its firmware sent, and no script or config went out yet); else
        it is Refused: a forged datagram cannot end a running node's token or start a boot."""
        kept = self._kept_cmdline(node.name)
        if kept is not None and self.nodes.holds_token(node.name, kept[0]):
            return kept[1]
        boot = node.boot
        if node.run_state is not RunState.BOOTING or boot is None or Phase.SCRIPT in boot.phases:
            raise Refused(
                f"{node.name}'s boot waits for no command line now (its firmware's DHCP "
                "starts a boot that does)"
            )
        cmdline = await self._boot_cmdline(node)
        return self._keep_cmdline(node.name, Cmdline.parse(cmdline).token, cmdline)

    def _kept_cmdline(self, key: str) -> tuple[str, str] | None:
        """(token, command line) handed out by TFTP under `key` less than CMDLINE_KEEP ago."""
        kept = self._cmdlines.get(key)
        if kept is None or time.monotonic() - kept[0] >= CMDLINE_KEEP:
            return None
        return kept[1], kept[2]

    def _keep_cmdline(self, key: str, token: str, cmdline: str) -> str:
        now = time.monotonic()
        self._cmdlines[key] = (now, token, cmdline)
        self._cmdlines.move_to_end(key)
        while now - next(iter(self._cmdlines.values()))[0] >= CMDLINE_KEEP:
            self._cmdlines.popitem(last=False)
        return cmdline

    async def _boot_cmdline(self, node: Node) -> str:
        """_new_cmdline; in a cluster, returned once the token is in etcd (TOKEN_WAIT at
        most): the agent says hello to the node's owner, which may be another instance."""
        cmdline = self._new_cmdline(node)
        if self._shared:
            try:
                await asyncio.wait_for(self.backend.written(TOKENS, node.name), TOKEN_WAIT)
            except TimeoutError:
                quiet.log("token not in etcd", logging.WARNING, "%s: its boot token is not in "
                          "etcd after %g s; it goes anyway", node.name, TOKEN_WAIT)  # fmt: skip
        return cmdline

    def _new_cmdline(self, node: Node) -> str:
        """A new boot token for `node`, and the minOS command line that carries it."""
        token = self.nodes.issue_token(node)
        mac = node.mac or node.config.mac or ""
        return self._cmdline(node.name, token, mac, node.config.persist_disk or "")

    def _cmdline(self, name: str, token: str, mac: str, persist: str = "") -> str:
        """The minOS kernel's command line: the node file's [minos] cmdline, then layerpy's
        arguments (one source for the iPXE script, the GRUB config and a Pi's cmdline.txt)."""
        heartbeat = self.config.server.heartbeat
        layerpy = Cmdline(self.base_url, name, token, mac, heartbeat, persist=persist,
                          servers=self.servers_of(name))  # fmt: skip
        return " ".join(arg for arg in (self.config.minos.cmdline, layerpy.format()) if arg)

    def _script(self, name: str, arch: str, cmdline: str) -> str:
        files = f"{self.base_url}/{minos_dir(arch)}"
        return (
            "#!ipxe\n"
            f"echo layerpy: booting {name} into the minOS\n"
            f"kernel {files}/kernel initrd=minos {cmdline}\n"
            f"initrd --name minos {files}/initrd\n"
            "boot\n"
        )

    @staticmethod
    def address_of(node: Node) -> IPv4Address | None:
        """Where the node's boot requests must come from: its address in the node file,
        else (proxy) the one it showed on port 4011. Its boot script goes there only."""
        return node.config.ip or node.ip

    def fetched(self, remote: str, phase: Phase) -> None:
        """A boot file (iPXE binary, kernel, initrd) went to `remote`: a phase of the boot
        of the node at that address, if one is."""
        node = self.nodes.by_ip(remote)
        if node is not None:
            self.nodes.mark(node, phase)

    def known(self, address: str) -> bool:
        """Whether a boot-network address is a node's: in the node file (or shown by a
        node in proxy mode), or leased from the discovery pool."""
        if self.nodes.by_ip(address) is not None:
            return True
        return self._leases is not None and self._leases.leased(address)

    async def report(self, payload: Any) -> Ack:
        """An agent's report, admitted or refused (ReportRejected) by the node store. In a
        cluster a refusal for the boot token is read again from etcd first: another
        instance may have issued a token this one had not yet heard of."""
        try:
            return self.nodes.report(payload)
        except ReportRejected as rejected:
            if not await self._caught_up(rejected):
                raise
        return self.nodes.report(payload)

    def report_now(self, payload: Any) -> Ack | None:
        """report(), when no read from etcd can change its outcome (the boot listener's
        shortcut); None when one might: report() then has it (a refusal for the token
        changed nothing yet)."""
        try:
            return self.nodes.report(payload)
        except ReportRejected as rejected:
            if self._may_catch_up(rejected):
                return None
            raise

    def _may_catch_up(self, rejected: ReportRejected) -> bool:
        """Whether a refusal for the boot token is to be read again from etcd: in a
        cluster, a node's at most once a RECHECK, so wrong tokens cost etcd no more."""
        name = rejected.token_of
        if not self._shared or name is None or name not in self.nodes.nodes:
            return False
        return time.monotonic() - self._rechecked.get(name, -RECHECK) >= RECHECK

    async def _caught_up(self, rejected: ReportRejected) -> bool:
        """Whether the node's token changed in etcd since the refusal."""
        if not self._may_catch_up(rejected):
            return False
        name = rejected.token_of
        assert name is not None
        self._rechecked[name] = time.monotonic()
        before = self.backend.get(TOKENS, name)
        try:
            await self.backend.fresh(TOKENS, name)
        except Unreachable as error:  # the refusal stands, the agent asks again
            quiet.log("token", logging.WARNING, "%s: boot token not read again: %s", name, error)
            return False
        return self.backend.get(TOKENS, name) != before

    def holds_token(self, name: str, token: str) -> bool:
        """Whether `token` is node `name`'s boot token (its own files and images)."""
        return self.nodes.holds_token(name, token)


def _record(lease: Lease) -> Record:
    """A lease as the backend keeps it (its address is the key)."""
    return {"client": lease.client, "state": lease.state, "expires": lease.expires}
