"""What the node file says, as typed records, and how reading it can fail."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from layerpy import bundle
from layerpy.images.source import ImageSource
from layerpy.power.base import PowerSpec
from layerpy.proto.agent import HEARTBEAT
from layerpy.text import printable

# authoritative: addresses and boot information; proxy: boot information only, beside the
# site's DHCP server (ProxyDHCP, port 67 and 4011); off: no DHCP at all.
DHCP_MODES = ("authoritative", "proxy", "off")
OTHER_DHCP = ("refuse", "expected")  # another DHCP server on the segment: refuse to start?
# What may name a machine as a node (docs/security.md has the threat model of each):
# mac: the MAC alone; location: also DHCP option 82 from a configured relay, and an
# agent's LLDP claim once that or an operator confirms it; location-trusted: also an
# agent's LLDP claim on its own (a lab, or a boot network with no hostile machine).
IDENTITY_MODES = ("mac", "location", "location-trusted")
# A new machine at a node's location that already has one: auto: it is the node from now on
# (replaced hardware); confirm: it waits for `layerpy bind` (docs/location.md).
REBIND_MODES = ("auto", "confirm")
POWER_STATES = ("on", "off")
RENDERED = 2000  # characters of one problem's line, however long the value it quotes


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    line: int | None = None


class ConfigError(Exception):
    """The node file is unusable; ``problems`` lists every reason."""

    def __init__(self, path: Path, problems: list[Problem]) -> None:
        self.path = path
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        """One line per problem, printable: values quoted from the file may hold control
        characters (escape sequences, carriage returns) that must not reach a terminal."""
        lines = []
        for problem in self.problems:
            where = f"{self.path}:{problem.line}" if problem.line else str(self.path)
            key = f" {problem.key}:" if problem.key else ""
            lines.append(printable(f"{where}:{key} {problem.message}", RENDERED))
        return "\n".join(lines)


class ReloadRefused(Exception):
    """A new node file was not applied (the old one stays in force); ``problems`` says why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ServerConfig:
    address: IPv4Address
    interface: str | None = None
    http_port: int = 8080
    tftp_port: int = 69
    dhcp: str = "authoritative"
    state_dir: Path = Path("/var/lib/layerpy")
    heartbeat: float = HEARTBEAT
    lost_after: int = 3
    power_poll: float = 10.0
    power_on_rate: float = 0.0  # nodes powered on (or cycled) per second; 0: as fast as able
    log_requests: bool = False
    identity: str = "location"
    rebind: str = "auto"
    other_dhcp: str = "refuse"
    dhcp_probe: float = 4.0  # seconds to listen for other DHCP servers (0: never look)
    send_timeout: float = 60.0  # seconds a file transfer may find no room to send (nginx's)
    beat_port: int = 8080  # UDP port of datagram heartbeats (by default http_port's); 0: off

    @cached_property
    def url(self) -> str:
        """Made once: every boot script (three times), answer and heartbeat asks for it."""
        return f"http://{self.address}:{self.http_port}"


@dataclass(frozen=True)
class ApiConfig:
    """Where operators reach the server: a Unix socket (file permissions decide who) and
    TCP listeners that want a bearer token, over TLS unless on loopback or told otherwise."""

    socket: Path | None = None  # None: api.sock in the state directory
    socket_group: str | None = None  # members may use the socket (mode 0660), else 0600
    listen: tuple[tuple[IPv4Address, int], ...] = ((IPv4Address("127.0.0.1"), 8081),)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    plain_http: bool = False  # allow plain HTTP on a non-loopback address
    origins: tuple[str, ...] = ()  # web origins besides the dashboard's own (consoles)

    def socket_path(self, state_dir: Path) -> Path:
        return self.socket or state_dir / "api.sock"


@dataclass(frozen=True)
class NetworkConfig:
    subnet: IPv4Network
    gateway: IPv4Address | None = None
    dns: tuple[IPv4Address, ...] = ()
    domain: str | None = None
    lease_time: int = 3600
    pool: tuple[IPv4Address, IPv4Address] | None = None
    discover: bool = False  # unknown machines boot the minOS from the pool, to be located


@dataclass(frozen=True)
class MinosConfig:
    """The minOS nodes boot: the x86-64 one, and the arm64 one arm64 firmware gets."""

    kernel: Path
    initrd: Path
    cmdline: str = ""
    arm64: tuple[Path, Path] | None = None  # (kernel, initrd) of the arm64 minOS, if any

    def files(self, arch: str) -> tuple[Path, Path] | None:
        """(kernel, initrd) of the minOS for a CPU architecture (MINOS_ARCHES), if there is one."""
        return (self.kernel, self.initrd) if arch == "amd64" else self.arm64


@dataclass(frozen=True)
class IpxeConfig:
    directory: Path = Path("/usr/lib/ipxe")
    bios: str = "undionly.kpxe"
    uefi: str = "snponly.efi"
    arm64: str | None = None  # by default ARM64_IPXE, when the directory has it


ARM64_IPXE = "ipxe-arm64.efi"  # Debian's name for it (package ipxe, Debian 13 and later)


# The CPU architectures a minOS is built for (minos/build.sh --arch), in Debian's names.
MINOS_ARCHES = ("amd64", "arm64")
# The EFI architectures of Debian's signed loaders, by shim's own name for each: shim
# loads "grub<arch>.efi" from the directory it was loaded from.
EFI_ARCHES = ("x64", "aa64")


@dataclass(frozen=True)
class SignedConfig:
    """Debian's signed shim and netboot GRUB (the Secure Boot path): the directory holding
    them as ``shim<arch>.efi`` and ``grub<arch>.efi`` (vm-lab/signed-loaders.sh fills it)."""

    directory: Path = field(default_factory=bundle.signed_dir)

    @staticmethod
    def shim(arch: str) -> str:
        return f"shim{arch}.efi"

    @staticmethod
    def grub(arch: str) -> str:
        return f"grub{arch}.efi"

    def has(self, arch: str) -> bool:
        """Whether both loaders of an EFI architecture are there (checked when asked: the
        set-up may fetch them after the file was read)."""
        return all((self.directory / name).is_file() for name in (self.shim(arch), self.grub(arch)))


@dataclass(frozen=True)
class RpiConfig:
    """Raspberry Pi network boot ([rpi]): the firmware directory TFTP serves to Pis, the
    kernel and initramfs they boot (the arm64 minOS), and what config.txt and cmdline.txt
    carry besides what layerpy writes."""

    directory: Path
    kernel: Path
    initrd: Path
    cmdline: str = ""
    config: str = ""


@dataclass(frozen=True)
class ImageConfig:
    """A system image: where to find it and how to run it."""

    name: str
    source: ImageSource
    systemd: bool = False
    command: tuple[str, ...] | None = None
    persist: tuple[str, ...] = ()  # paths the node keeps across image changes


@dataclass(frozen=True)
class SwitchConfig:
    """A switch nodes are named by: its LLDP chassis id, and for DHCP option 82 the
    address of its relay agent (giaddr) or the remote id it sends, and the addresses the
    relay's datagrams come from (``relay`` itself unless ``relay_sources`` says others)."""

    name: str
    chassis_id: str | None = None
    relay: IPv4Address | None = None
    remote_id: str | None = None
    relay_sources: tuple[IPv4Address, ...] = ()

    @property
    def senders(self) -> tuple[IPv4Address, ...]:
        """Where this switch's relayed datagrams may come from."""
        if self.relay is None:
            return ()
        return self.relay_sources or (self.relay,)


@dataclass(frozen=True)
class NodeConfig:
    name: str
    ip: IPv4Address | None  # None only with dhcp = "proxy": the site's server chooses
    mac: str | None = None
    group: str | None = None
    power: str = "on"
    bmc: PowerSpec | None = None
    image: str | None = None
    location: tuple[str, str] | None = None  # (switch, port)
    # the user's variables for its files' templates: its group's, then its own (shared
    # between a group's nodes until a node sets its own)
    vars: dict[str, Any] = field(default_factory=dict, hash=False)
    persist_disk: str | None = None  # the node's disk for persistent paths, else its RAM
    serial: str | None = None  # a Raspberry Pi's serial number (8 hex digits)
    secure_boot: bool = False  # booted only by the signed path (shim, GRUB, signed kernel)


@dataclass(frozen=True)
class FileConfig:
    """A file nodes get inside their system image: a Jinja2 template rendered per node, or
    a secret file's bytes; for every node, or those of some images, groups or names."""

    path: str  # absolute and normalised, inside the image
    source: Path  # the template or the secret on the server
    secret: bool
    mode: int
    owner: str  # "user:group" (names are looked up in the image) or "uid:gid"
    apply: str | None = None  # a command run in the node's container after a change
    images: frozenset[str] | None = None
    groups: frozenset[str] | None = None
    nodes: frozenset[str] | None = None

    def for_node(self, node: NodeConfig) -> bool:
        """Whether `node` gets it by its group and name (whatever image it runs)."""
        return (self.groups is None or node.group in self.groups) and (
            self.nodes is None or node.name in self.nodes
        )

    def for_image(self, image: str | None) -> bool:
        return self.images is None or image in self.images


@dataclass(frozen=True)
class ClusterConfig:
    """This instance's place in a cluster of instances sharing state through etcd: the
    members to reach, how (TLS, credentials), its own name and boot segment, and where
    under etcd's key space layerpy's keys live. The password is never shown."""

    etcd: tuple[str, ...]  # member URLs, http:// or https://
    name: str  # this instance's, unique in the cluster
    segment: str  # the subnet of the nodes it serves, as text (default: network.subnet)
    prefix: str = "/layerpy/v1"
    lease_ttl: int = 5  # seconds an instance's etcd lease outlives its last keep-alive
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Config:
    path: Path
    server: ServerConfig
    network: NetworkConfig
    minos: MinosConfig
    ipxe: IpxeConfig
    api: ApiConfig = field(default_factory=ApiConfig)
    images: dict[str, ImageConfig] = field(default_factory=dict)
    switches: dict[str, SwitchConfig] = field(default_factory=dict)
    nodes: dict[str, NodeConfig] = field(default_factory=dict)
    files: dict[str, FileConfig] = field(default_factory=dict)
    cluster: ClusterConfig | None = None  # None: one instance on its own, no etcd
    rpi: RpiConfig | None = None  # None: Raspberry Pis are not booted
    signed: SignedConfig = field(default_factory=SignedConfig)

    @cached_property
    def serials(self) -> dict[str, str]:
        """Raspberry Pi serial number -> node name (worked out once per file)."""
        return {node.serial: name for name, node in self.nodes.items() if node.serial}

    @cached_property
    def relays(self) -> dict[IPv4Address, frozenset[IPv4Address]]:
        """The DHCP relay agents the switches name (giaddr), each with the addresses its
        datagrams may come from: the only relayed requests believed and answered (worked
        out once per file, not per packet)."""
        senders: dict[IPv4Address, frozenset[IPv4Address]] = {}
        for switch in self.switches.values():
            if switch.relay is not None:
                senders[switch.relay] = senders.get(switch.relay, frozenset()) | set(switch.senders)
        return senders
