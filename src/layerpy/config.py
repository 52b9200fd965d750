"""The node file: TOML in, a typed and validated :class:`Config` out.

This is the only module that reads the file. Every problem is collected (not just the
first) and reported with the file, the line where it can be found, the key path and what
is wrong, so ``layerpy check`` can say everything in one go.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from layerpy import hostlist
from layerpy.images.source import ImageSource, parse_source
from layerpy.power.base import DRIVERS, PowerSpec

SECTIONS = ("server", "network", "minos", "ipxe", "images", "switches", "groups", "nodes")
DHCP_MODES = ("authoritative", "off")
NODE_KEYS = {"ip", "mac", "power", "bmc", "image", "location"}
SWITCH_KEYS = {"chassis_id", "relay", "remote_id"}
GROUP_KEYS = NODE_KEYS | {"nodes"}
IMAGE_KEYS = {"source", "insecure", "systemd", "command", "user", "password_file", "password_env"}
POWER_STATES = ("on", "off")
BMC_KEYS = {"driver", "address", "user", "password_file", "password_env", "verify_tls", "port"}
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


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
        lines = []
        for problem in self.problems:
            where = f"{self.path}:{problem.line}" if problem.line else str(self.path)
            key = f" {problem.key}:" if problem.key else ""
            lines.append(f"{where}:{key} {problem.message}")
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
    heartbeat: float = 5.0
    lost_after: int = 3
    power_poll: float = 10.0
    log_requests: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.http_port}"


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
    kernel: Path
    initrd: Path
    cmdline: str = ""


@dataclass(frozen=True)
class IpxeConfig:
    directory: Path = Path("/usr/lib/ipxe")
    bios: str = "undionly.kpxe"
    uefi: str = "snponly.efi"


@dataclass(frozen=True)
class ImageConfig:
    """A system image: where to find it and how to run it."""

    name: str
    source: ImageSource
    systemd: bool = False
    command: tuple[str, ...] | None = None


@dataclass(frozen=True)
class SwitchConfig:
    """A switch nodes are named by: its LLDP chassis id, and for DHCP option 82 the
    address of its relay agent (giaddr) or the remote id it sends."""

    name: str
    chassis_id: str | None = None
    relay: IPv4Address | None = None
    remote_id: str | None = None


@dataclass(frozen=True)
class NodeConfig:
    name: str
    ip: IPv4Address
    mac: str | None = None
    group: str | None = None
    power: str = "on"
    bmc: PowerSpec | None = None
    image: str | None = None
    location: tuple[str, str] | None = None  # (switch, port)


@dataclass(frozen=True)
class Config:
    path: Path
    server: ServerConfig
    network: NetworkConfig
    minos: MinosConfig
    ipxe: IpxeConfig
    images: dict[str, ImageConfig] = field(default_factory=dict)
    switches: dict[str, SwitchConfig] = field(default_factory=dict)
    nodes: dict[str, NodeConfig] = field(default_factory=dict)


def load(path: str | Path) -> Config:
    """Read and validate a node file; raise :class:`ConfigError` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(path, [Problem("", f"cannot read the file: {error.strerror}")]) from None
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        problem = Problem("", f"not UTF-8 text (byte {error.object[error.start]:#x})", line)
        raise ConfigError(path, [problem]) from None
    return parse(text, path)


def parse(text: str, path: Path) -> Config:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        line = _line_of_syntax_error(str(error))
        raise ConfigError(path, [Problem("", f"TOML syntax error: {error}", line)]) from None
    reader = _Reader(path, text)
    config = reader.config(data)
    if reader.problems or config is None:
        raise ConfigError(path, reader.problems)
    return config


def _line_of_syntax_error(message: str) -> int | None:
    match = re.search(r"at line (\d+)", message)
    return int(match.group(1)) if match else None


class _Reader:
    """Walks the parsed TOML, converting values and collecting problems."""

    def __init__(self, path: Path, text: str) -> None:
        self.file = path
        self.base = path.parent
        self.lines = _key_lines(text)
        self.problems: list[Problem] = []

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message, self._line(key)))

    def _line(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    # -- typed access -----------------------------------------------------------------

    def table(self, data: dict[str, Any], key: str, allowed: set[str] | None) -> dict[str, Any]:
        """A top-level table; with ``allowed``, any other key in it is a problem."""
        value = data.get(key, {})
        if not isinstance(value, dict):
            self.problem(key, f"must be a table, not {_kind(value)}")
            return {}
        if allowed is not None:
            self.unknown_keys(value, key, allowed)
        return value

    def get(
        self,
        table: dict[str, Any],
        key: str,
        kind: type | tuple[type, ...],
        convert: Callable[[Any], Any] | None = None,
        *,
        default: Any = None,
        required: bool = False,
        prefix: str,
    ) -> Any:
        full = f"{prefix}.{key}"
        if key not in table:
            if required:
                self.problem(full, "is required")
            return default
        value = table[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            expected = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            self.problem(full, f"must be {_article(expected)}, not {_kind(value)}")
            return default
        if convert is None:
            return value
        try:
            return convert(value)
        except ValueError as error:
            self.problem(full, str(error))
            return default

    def path(self, value: str) -> Path:
        return Path(os.path.normpath(self.base / Path(value).expanduser()))

    # -- sections ---------------------------------------------------------------------

    def config(self, data: dict[str, Any]) -> Config | None:
        for unknown in sorted(set(data) - set(SECTIONS)):
            self.problem(unknown, f"unknown section (known: {', '.join(SECTIONS)})")
        network = self.network(data)
        server = self.server(data, network)
        minos = self.minos(data)
        ipxe = self.ipxe(data, server)
        images = self.images(data)
        switches = self.switches(data)
        nodes = self.nodes(data, network, server)
        self._check_locations(nodes, switches)
        for node in nodes.values():
            if node.image is not None and node.image not in images:
                where = f"nodes.{node.name}" if node.group is None else f"groups.{node.group}"
                self.problem(
                    f"{where}.image",
                    f"{node.name}: no image named {node.image!r} "
                    f"(defined: {', '.join(images) or 'none'}; add an [images.{node.image}] table)",
                )
        if None in (server, network, minos) or self.problems:
            return None
        return Config(self.file, server, network, minos, ipxe, images, switches, nodes)  # type: ignore[arg-type]

    def switches(self, data: dict[str, Any]) -> dict[str, SwitchConfig]:
        switches = {}
        for name, prefix, get in self.named_tables(data, "switches", SWITCH_KEYS):
            switch = SwitchConfig(
                name,
                get("chassis_id", str, _identifier),
                get("relay", str, _ipv4),
                get("remote_id", str),
            )
            if not (switch.chassis_id or switch.relay or switch.remote_id):
                self.problem(prefix, "needs chassis_id (LLDP), relay or remote_id (DHCP option 82)")
            switches[name] = switch
        return switches

    def _check_locations(
        self, nodes: dict[str, NodeConfig], switches: dict[str, SwitchConfig]
    ) -> None:
        taken: dict[tuple[str, str], str] = {}
        for node in nodes.values():
            if node.location is None:
                continue
            where = f"nodes.{node.name}" if node.group is None else f"groups.{node.group}"
            switch, port = node.location
            if switch not in switches:
                self.problem(
                    f"{where}.location",
                    f"{node.name}: no switch named {switch!r} (add a [switches.{switch}] table)",
                )
            elif node.location in taken:
                self.problem(
                    f"{where}.location",
                    f"{node.name}: {switch}:{port} is already {taken[node.location]}'s location",
                )
            taken.setdefault(node.location, node.name)

    def images(self, data: dict[str, Any]) -> dict[str, ImageConfig]:
        images = {}
        for name, prefix, get in self.named_tables(data, "images", IMAGE_KEYS):
            insecure = get("insecure", bool, default=False)
            source = get("source", str, partial(parse_source, insecure=insecure), required=True)
            command = get("command", list, _string_list)
            password = self.password(get, prefix)
            if source is None:
                continue
            if source.kind != "registry" and insecure:
                self.problem(f"{prefix}.insecure", "applies to registry sources only")
            user = get("user", str)
            if user or password:
                source = replace(source, user=user, password=password)
            if source.kind != "registry":  # a path, relative to the node file like all paths
                source = replace(source, location=str(self.path(source.location)))
            images[name] = ImageConfig(name, source, get("systemd", bool, default=False), command)
        return images

    def server(self, data: dict[str, Any], network: NetworkConfig | None) -> ServerConfig | None:
        keys = {
            "address",
            "interface",
            "http_port",
            "tftp_port",
            "dhcp",
            "state_dir",
            "heartbeat",
            "lost_after",
            "power_poll",
            "log_requests",
        }
        table = self.table(data, "server", keys)
        get = self._getter(table, "server")
        address = get("address", str, _ipv4, required=True)
        dhcp = get("dhcp", str, _choice(DHCP_MODES), default="authoritative")
        interface = get("interface", str)
        if dhcp != "off" and interface is None and "server" in data:
            self.problem("server.interface", f"is required when dhcp = {dhcp!r}")
        if address and network and address not in network.subnet:
            self.problem("server.address", f"{address} is outside network.subnet {network.subnet}")
        if address is None:
            return None
        return ServerConfig(
            address=address,
            interface=interface,
            http_port=get("http_port", int, _port, default=8080),
            tftp_port=get("tftp_port", int, _port, default=69),
            dhcp=dhcp or "authoritative",
            state_dir=self.path(get("state_dir", str, default="/var/lib/layerpy")),
            heartbeat=float(get("heartbeat", (int, float), _positive, default=5.0)),
            lost_after=get("lost_after", int, _positive, default=3),
            power_poll=float(get("power_poll", (int, float), _positive, default=10.0)),
            log_requests=get("log_requests", bool, default=False),
        )

    def network(self, data: dict[str, Any]) -> NetworkConfig | None:
        keys = {"subnet", "gateway", "dns", "domain", "lease_time", "pool", "discover"}
        table = self.table(data, "network", keys)
        get = self._getter(table, "network")
        subnet = get("subnet", str, _subnet, required=True)
        gateway = get("gateway", str, _ipv4)
        dns = get("dns", list, _ipv4_list, default=())
        pool = get("pool", str, _pool)
        discover = get("discover", bool, default=False)
        if discover and pool is None:
            self.problem(
                "network.discover", "needs network.pool: discovery boots use its addresses"
            )
        if subnet:
            if gateway and gateway not in subnet:
                self.problem("network.gateway", f"{gateway} is outside network.subnet {subnet}")
            if pool and not (pool[0] in subnet and pool[1] in subnet):
                self.problem("network.pool", f"{pool[0]}-{pool[1]} is not inside {subnet}")
        if subnet is None:
            return None
        return NetworkConfig(
            subnet=subnet,
            gateway=gateway,
            dns=dns,
            domain=get("domain", str),
            lease_time=get("lease_time", int, _positive, default=3600),
            pool=pool,
            discover=discover,
        )

    def minos(self, data: dict[str, Any]) -> MinosConfig | None:
        table = self.table(data, "minos", {"kernel", "initrd", "cmdline"})
        get = self._getter(table, "minos")
        kernel = get("kernel", str, self._existing_file, required=True)
        initrd = get("initrd", str, self._existing_file, required=True)
        cmdline = get("cmdline", str, default="")
        if kernel is None or initrd is None:
            return None
        return MinosConfig(kernel, initrd, cmdline)

    def ipxe(self, data: dict[str, Any], server: ServerConfig | None) -> IpxeConfig:
        table = self.table(data, "ipxe", {"dir", "bios", "uefi"})
        get = self._getter(table, "ipxe")
        defaults = IpxeConfig()
        directory = get("dir", str, self.path, default=defaults.directory)
        ipxe = IpxeConfig(
            directory,
            get("bios", str, _plain_file_name, default=defaults.bios),
            get("uefi", str, _plain_file_name, default=defaults.uefi),
        )
        if server and server.dhcp != "off":
            for key, name in (("bios", ipxe.bios), ("uefi", ipxe.uefi)):
                path = directory / name
                if not path.is_file():
                    self.problem(
                        f"ipxe.{key}",
                        f"{path} does not exist (install Debian's ipxe package or set ipxe.dir)",
                    )
                elif not path.resolve().is_relative_to(directory.resolve()):
                    self.problem(
                        f"ipxe.{key}",
                        f"{path} links to {path.resolve()}, outside ipxe.dir, and TFTP serves "
                        "only what is inside it (pick another file or point ipxe.dir there)",
                    )
        return ipxe

    def nodes(
        self, data: dict[str, Any], network: NetworkConfig | None, server: ServerConfig | None
    ) -> dict[str, NodeConfig]:
        nodes: dict[str, NodeConfig] = {}
        origin: dict[str, str] = {}
        groups = self.table(data, "groups", None)
        for group_name, table in groups.items():
            for node in self.group(group_name, table):
                self._add(nodes, origin, node, f"groups.{group_name}.nodes")
        overrides = self.table(data, "nodes", None)
        for name, table in overrides.items():
            node = self.override(name, table, nodes.get(name))
            if node is not None:
                nodes[name] = node
                origin.setdefault(name, f"nodes.{name}")
        self._check_unique(nodes, origin, network, server)
        return nodes

    def group(self, name: str, table: Any) -> Iterator[NodeConfig]:
        prefix = f"groups.{name}"
        if not isinstance(table, dict):
            self.problem(prefix, f"must be a table, not {_kind(table)}")
            return
        self.unknown_keys(table, prefix, GROUP_KEYS)
        get = self._getter(table, prefix)
        names = get("nodes", str, hostlist.expand, required=True)
        ips = get("ip", str, _ipv4_range, required=True)
        macs = get("mac", (list, str), _mac_list)
        power = get("power", str, _choice(POWER_STATES), default="on")
        image = get("image", str)
        locations = get("location", str, _locations)
        if names is None or ips is None:
            return
        bmcs = self.bmcs(table.get("bmc"), f"{prefix}.bmc", names)
        for key, values in (("ip", ips), ("mac", macs), ("location", locations)):
            if values is not None and len(values) != len(names):
                self.problem(
                    f"{prefix}.{key}",
                    f"has {len(values)} entries for {len(names)} nodes; ranges must have "
                    "the same length",
                )
                return
        for index, node_name in enumerate(names):
            if not _NAME.match(node_name):
                self.problem(f"{prefix}.nodes", f"{node_name!r} is not a valid host name")
                continue
            mac = macs[index] if macs else None
            bmc = bmcs[index] if bmcs else None
            location = locations[index] if locations else None
            yield NodeConfig(node_name, ips[index], mac, name, power or "on", bmc, image, location)

    def override(self, name: str, table: Any, base: NodeConfig | None) -> NodeConfig | None:
        prefix = f"nodes.{name}"
        if not isinstance(table, dict):
            self.problem(prefix, f"must be a table, not {_kind(table)}")
            return None
        if not _NAME.match(name):
            self.problem(prefix, f"{name!r} is not a valid host name")
            return None
        self.unknown_keys(table, prefix, NODE_KEYS)
        get = self._getter(table, prefix)
        ip = get("ip", str, _ipv4, required=base is None)
        mac = get("mac", str, _mac)
        power = get("power", str, _choice(POWER_STATES))
        image = get("image", str)
        locations = get("location", str, _locations)
        if locations is not None and len(locations) != 1:
            self.problem(f"{prefix}.location", "a node has one location, like sw1:swp3")
            locations = None
        location = locations[0] if locations else None
        bmcs = self.bmcs(table.get("bmc"), f"{prefix}.bmc", [name])
        bmc = bmcs[0] if bmcs else None
        if base is None:
            if ip is None:
                return None
            return NodeConfig(name, ip, mac, None, power or "on", bmc, image, location)
        return replace(
            base,
            ip=ip or base.ip,
            mac=mac or base.mac,
            power=power or base.power,
            bmc=bmc or base.bmc,
            image=image or base.image,
            location=location or base.location,
        )

    def bmcs(self, table: Any, prefix: str, names: list[str]) -> list[PowerSpec] | None:
        """One power spec per node; ``address`` is a hostlist matching the nodes, one
        address for all, or a template with ``{node}`` (e.g. a QMP socket path)."""
        if table is None:
            return None
        if not isinstance(table, dict):
            self.problem(prefix, f"must be a table, not {_kind(table)}")
            return None
        self.unknown_keys(table, prefix, BMC_KEYS)
        get = self._getter(table, prefix)
        driver = get("driver", str, _choice(DRIVERS), required=True)
        address = get("address", str)
        password = self.password(get, prefix)
        if driver is None:
            return None
        if address is None and driver != "none":
            self.problem(f"{prefix}.address", f"is required for driver {driver!r}")
            return None
        if address is None or "{node}" in address:
            addresses = [address.format(node=n) if address else None for n in names]
        else:
            try:
                addresses = hostlist.expand(address)
            except hostlist.HostlistError as error:
                self.problem(f"{prefix}.address", str(error))
                return None
            if len(addresses) == 1:
                addresses *= len(names)
            if len(addresses) != len(names):
                self.problem(
                    f"{prefix}.address",
                    f"has {len(addresses)} entries for {len(names)} nodes; ranges must have "
                    "the same length",
                )
                return None
        common = {
            "driver": driver,
            "user": get("user", str),
            "password": password,
            "verify_tls": get("verify_tls", bool, default=True),
            "port": get("port", int, _port),
        }
        return [PowerSpec(address=address, **common) for address in addresses]

    def password(self, get: Callable[..., Any], prefix: str) -> str | None:
        path = get("password_file", str, self.path)
        variable = get("password_env", str)
        if path and variable:
            self.problem(prefix, "give password_file or password_env, not both")
        if path is not None:
            try:
                return path.read_text().strip()
            except OSError as error:
                self.problem(f"{prefix}.password_file", f"cannot read {path}: {error.strerror}")
        if variable is not None:
            if variable not in os.environ:
                self.problem(
                    f"{prefix}.password_env", f"environment variable {variable} is not set"
                )
            return os.environ.get(variable)
        return None

    def named_tables(
        self, data: dict[str, Any], section: str, known: set[str]
    ) -> Iterator[tuple[str, str, Callable[..., Any]]]:
        """``[section.NAME]`` tables: each name, its key prefix and a getter for its keys."""
        for name, table in self.table(data, section, None).items():
            prefix = f"{section}.{name}"
            if not isinstance(table, dict):
                self.problem(prefix, f"must be a table, not {_kind(table)}")
                continue
            self.unknown_keys(table, prefix, known)
            yield name, prefix, self._getter(table, prefix)

    def unknown_keys(self, table: dict[str, Any], prefix: str, known: set[str]) -> None:
        for unknown in sorted(set(table) - known):
            self.problem(
                f"{prefix}.{unknown}", f"unknown key (known keys: {', '.join(sorted(known))})"
            )

    def _add(
        self, nodes: dict[str, NodeConfig], origin: dict[str, str], node: NodeConfig, key: str
    ) -> None:
        if node.name in nodes:
            self.problem(key, f"node {node.name} is already defined by {origin[node.name]}")
            return
        nodes[node.name] = node
        origin[node.name] = key

    def _check_unique(
        self,
        nodes: dict[str, NodeConfig],
        origin: dict[str, str],
        network: NetworkConfig | None,
        server: ServerConfig | None,
    ) -> None:
        seen_ip: dict[IPv4Address, str] = {}
        seen_mac: dict[str, str] = {}
        for node in nodes.values():
            key = origin[node.name]
            if node.ip in seen_ip:
                self.problem(
                    key, f"{node.name} has IP {node.ip}, already used by {seen_ip[node.ip]}"
                )
            seen_ip.setdefault(node.ip, node.name)
            if node.mac and node.mac in seen_mac:
                self.problem(
                    key, f"{node.name} has MAC {node.mac}, already used by {seen_mac[node.mac]}"
                )
            if node.mac:
                seen_mac.setdefault(node.mac, node.name)
            if network is not None:
                subnet = network.subnet
                if node.ip not in subnet:
                    self.problem(
                        key, f"{node.name}'s IP {node.ip} is outside network.subnet {subnet}"
                    )
                elif node.ip in (subnet.network_address, subnet.broadcast_address):
                    self.problem(
                        key,
                        f"{node.name}'s IP {node.ip} is the subnet's network or broadcast address",
                    )
                elif network.pool and network.pool[0] <= node.ip <= network.pool[1]:
                    self.problem(key, f"{node.name}'s IP {node.ip} lies inside network.pool")
            if server is not None and node.ip == server.address:
                self.problem(key, f"{node.name}'s IP {node.ip} is the server's own address")

    def _getter(self, table: dict[str, Any], prefix: str) -> Callable[..., Any]:
        def get(key: str, kind: Any, convert: Any = None, **options: Any) -> Any:
            return self.get(table, key, kind, convert, prefix=prefix, **options)

        return get

    def _existing_file(self, value: str) -> Path:
        path = self.path(value)
        if not path.is_file():
            raise ValueError(f"{path} does not exist (build the minOS with minos/build.sh)")
        return path


# -- value converters: raise ValueError with a message the user can act on -----------------


def _ipv4(value: str) -> IPv4Address:
    try:
        return IPv4Address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 address") from None


def _ipv4_list(values: list[Any]) -> tuple[IPv4Address, ...]:
    if not all(isinstance(v, str) for v in values):
        raise ValueError("must be a list of IPv4 address strings")
    return tuple(_ipv4(v) for v in values)


def _ipv4_range(value: str) -> list[IPv4Address]:
    try:
        return [_ipv4(item) for item in hostlist.expand(value)]
    except hostlist.HostlistError as error:
        raise ValueError(str(error)) from None


def _subnet(value: str) -> IPv4Network:
    try:
        return IPv4Network(value)
    except ValueError as error:
        raise ValueError(f"{value!r} is not an IPv4 subnet like 10.99.0.0/24 ({error})") from None


def _pool(value: str) -> tuple[IPv4Address, IPv4Address]:
    first, dash, last = value.partition("-")
    if not dash:
        raise ValueError(f"{value!r} must be a range like 10.99.0.200-10.99.0.250")
    low, high = _ipv4(first.strip()), _ipv4(last.strip())
    if high < low:
        raise ValueError(f"{value!r} runs backwards")
    return low, high


def _mac(value: str) -> str:
    mac = value.strip().lower().replace("-", ":")
    if not _MAC.match(mac):
        raise ValueError(f"{value!r} is not a MAC address like 52:54:00:12:34:56")
    return mac


def _mac_list(value: list[Any] | str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not all(isinstance(item, str) for item in items):
        raise ValueError("must be a list of MAC address strings")
    return [_mac(item) for item in items]


def _locations(value: str) -> list[tuple[str, str]]:
    """``sw1:swp[1-4]`` -> [("sw1", "swp1"), …]."""
    try:
        expanded = hostlist.expand(value)
    except hostlist.HostlistError as error:
        raise ValueError(str(error)) from None
    locations = []
    for item in expanded:
        switch, colon, port = item.partition(":")
        if not (colon and switch and port):
            raise ValueError(f"{item!r} is not a location like sw1:swp3 (switch:port)")
        locations.append((switch, port))
    return locations


def _identifier(value: str) -> str:
    """A chassis id as LLDP renders it: MACs lowercase with colons, anything else as is."""
    mac = value.strip().lower().replace("-", ":")
    return mac if _MAC.match(mac) else value.strip()


def _string_list(value: list[Any]) -> tuple[str, ...]:
    if not value or not all(isinstance(item, str) for item in value):
        raise ValueError("must be a non-empty list of strings")
    return tuple(value)


def _port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{value} is not a port number (1-65535)")
    return value


def _positive(value: float) -> float:
    if value <= 0:
        raise ValueError(f"{value} must be greater than zero")
    return value


def _plain_file_name(value: str) -> str:
    if "/" in value or value in ("", ".", ".."):
        raise ValueError(f"{value!r} must be a file name inside ipxe.dir")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in options:
            raise ValueError(f"{value!r} is not one of: {', '.join(options)}")
        return value

    return check


def _kind(value: Any) -> str:
    names = {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a table",
    }
    return names.get(type(value), type(value).__name__)


def _article(name: str) -> str:
    words = {
        "str": "a string",
        "int": "an integer",
        "float": "a number",
        "bool": "a boolean",
        "list": "a list",
        "dict": "a table",
    }
    return " or ".join(words.get(part, part) for part in name.split(" or "))


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted key paths to the line that defines them (best effort, for messages)."""
    lines: dict[str, int] = {}
    table = ""
    header = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    assignment = re.compile(r"^\s*([A-Za-z0-9_.\"' -]+?)\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        if match := header.match(line):
            table = _normalise_key(match.group(1))
            lines.setdefault(table, number)
        elif match := assignment.match(line):
            key = _normalise_key(match.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines


def _normalise_key(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))
