"""Who the nodes are: [groups.NAME] (many nodes from host lists) and [nodes.NAME] (one node,
or changes to one of a group), their BMCs, the [switches.NAME] they are located by, and the
checks across them (unique names, addresses and locations; images and switches that exist).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from layerpy import hostlist
from layerpy.config import commands, values
from layerpy.config.reading import Reader
from layerpy.config.records import (
    POWER_STATES,
    ImageConfig,
    NetworkConfig,
    NodeConfig,
    ServerConfig,
    SwitchConfig,
)
from layerpy.power.base import DRIVERS, PowerSpec

NODE_KEYS = {
    "ip", "mac", "power", "bmc", "image", "location", "vars", "persist_disk", "serial",
    "secure_boot",
}  # fmt: skip
GROUP_KEYS = NODE_KEYS | {"nodes"}
SWITCH_KEYS = {"chassis_id", "relay", "remote_id", "relay_sources"}
BMC_KEYS = {
    "driver", "address", "user", "password_file", "password_env", "verify_tls", "port", "console",
}  # fmt: skip
# a command gets its user, port and password as it is told, and has no TLS to verify
COMMAND_BMC_KEYS = (BMC_KEYS - {"verify_tls"}) | commands.KEYS


def switches(r: Reader, data: dict[str, Any]) -> dict[str, SwitchConfig]:
    """The switches a node's location may name, each known by LLDP or DHCP option 82."""
    switches = {}
    for name, prefix, get in r.named_tables(data, "switches", SWITCH_KEYS):
        switch = SwitchConfig(
            name,
            get("chassis_id", str, values.identifier),
            get("relay", str, values.ipv4),
            get("remote_id", str),
            get("relay_sources", list, values.ipv4_list, default=()),
        )
        if not (switch.chassis_id or switch.relay or switch.remote_id):
            r.problem(prefix, "needs chassis_id (LLDP), relay or remote_id (DHCP option 82)")
        if switch.relay_sources and switch.relay is None:
            r.problem(
                f"{prefix}.relay_sources",
                "names where the relay's datagrams come from: set relay (its giaddr) too",
            )
        switches[name] = switch
    return switches


def check_references(
    r: Reader,
    nodes: dict[str, NodeConfig],
    images: dict[str, ImageConfig],
    switches: dict[str, SwitchConfig],
) -> None:
    """Every location on a defined switch and taken once; every image defined."""
    taken: dict[tuple[str, str], str] = {}
    for node in nodes.values():
        if node.location is None:
            continue
        switch, port = node.location
        if switch not in switches:
            r.problem(
                f"{_where(node)}.location",
                f"{node.name}: no switch named {switch!r} (add a [switches.{switch}] table)",
            )
        elif node.location in taken:
            r.problem(
                f"{_where(node)}.location",
                f"{node.name}: {switch}:{port} is already {taken[node.location]}'s location",
            )
        taken.setdefault(node.location, node.name)
    for node in nodes.values():
        if node.image is not None and node.image not in images:
            r.problem(
                f"{_where(node)}.image",
                f"{node.name}: no image named {node.image!r} "
                f"(defined: {', '.join(images) or 'none'}; add an [images.{node.image}] table)",
            )


def _where(node: NodeConfig) -> str:
    """The table that defines a node, for problems about it."""
    return f"nodes.{node.name}" if node.group is None else f"groups.{node.group}"


def read(
    r: Reader, data: dict[str, Any], network: NetworkConfig | None, server: ServerConfig | None
) -> dict[str, NodeConfig]:
    """Groups expanded node by node, then [nodes.NAME] adding nodes or changing them."""
    nodes: dict[str, NodeConfig] = {}
    origin: dict[str, str] = {}
    # the site's DHCP server chooses addresses in proxy mode: `ip` is then only a check
    ip_required = server is None or server.dhcp != "proxy"
    groups = r.table(data, "groups", None)
    for group_name, table in groups.items():
        for node in _group(r, group_name, table, ip_required):
            _add(r, nodes, origin, node, f"groups.{group_name}.nodes")
    overrides = r.table(data, "nodes", None)
    for name, table in overrides.items():
        node = _override(r, name, table, nodes.get(name), ip_required)
        if node is not None:
            nodes[name] = node
            origin.setdefault(name, f"nodes.{name}")
    own_bmc = {
        name for name, table in overrides.items() if isinstance(table, dict) and "bmc" in table
    }
    commands.fill(r, nodes, own_bmc)  # now that each node's vars are known
    _check_unique(r, nodes, origin, network, server)
    return nodes


def _group(r: Reader, name: str, table: Any, ip_required: bool) -> Iterator[NodeConfig]:
    prefix = f"groups.{name}"
    if not r.is_table(table, prefix):
        return
    r.unknown_keys(table, prefix, GROUP_KEYS)
    get = r.getter(table, prefix)
    names = get("nodes", str, hostlist.expand, required=True)
    ips = get("ip", str, values.ipv4_range, required=ip_required)
    macs = get("mac", (list, str), values.mac_list)
    power = get("power", str, values.choice(POWER_STATES), default="on")
    image = get("image", str)
    locations = get("location", str, values.locations)
    variables = get("vars", dict, default={})  # one dict for the group's nodes
    disk = get("persist_disk", str, values.disk)
    serials = get("serial", list, values.serial_list)
    secure = get("secure_boot", bool, default=False)
    if names is None or (ips is None and ip_required):
        return
    bmcs = _bmcs(r, table.get("bmc"), f"{prefix}.bmc", names)
    checked = (("ip", ips), ("mac", macs), ("location", locations), ("serial", serials))
    for key, entries in checked:
        if entries is not None and not _one_each(r, f"{prefix}.{key}", entries, names):
            return
    for index, node_name in enumerate(names):
        if not values.LABEL.match(node_name):
            r.problem(f"{prefix}.nodes", f"{node_name!r} is not a valid host name")
            continue
        mac = macs[index] if macs else None
        bmc = bmcs[index] if bmcs else None
        location = locations[index] if locations else None
        ip = ips[index] if ips else None
        serial = serials[index] if serials else None
        yield NodeConfig(
            node_name,
            ip,
            mac,
            name,
            power or "on",
            bmc,
            image,
            location,
            variables,
            disk,
            serial,
            bool(secure),
        )


def _override(
    r: Reader, name: str, table: Any, base: NodeConfig | None, ip_required: bool
) -> NodeConfig | None:
    prefix = f"nodes.{name}"
    if not r.is_table(table, prefix):
        return None
    if not values.LABEL.match(name):
        r.problem(prefix, f"{name!r} is not a valid host name")
        return None
    r.unknown_keys(table, prefix, NODE_KEYS)
    get = r.getter(table, prefix)
    ip = get("ip", str, values.ipv4, required=base is None and ip_required)
    mac = get("mac", str, values.mac)
    power = get("power", str, values.choice(POWER_STATES))
    image = get("image", str)
    locations = get("location", str, values.locations)
    if locations is not None and len(locations) != 1:
        r.problem(f"{prefix}.location", "a node has one location, like sw1:swp3")
        locations = None
    location = locations[0] if locations else None
    bmcs = _bmcs(r, table.get("bmc"), f"{prefix}.bmc", [name])
    bmc = bmcs[0] if bmcs else None
    own = get("vars", dict)
    disk = get("persist_disk", str, values.disk)
    serial = get("serial", str, values.serial)
    secure = get("secure_boot", bool)
    if base is None:
        if ip is None and ip_required:
            return None
        return NodeConfig(name, ip, mac, None, power or "on", bmc, image, location, own or {},
                          disk, serial, bool(secure))  # fmt: skip
    return replace(
        base,
        ip=ip or base.ip,
        mac=mac or base.mac,
        power=power or base.power,
        bmc=bmc or base.bmc,
        image=image or base.image,
        location=location or base.location,
        vars={**base.vars, **own} if own else base.vars,
        persist_disk=disk or base.persist_disk,
        serial=serial or base.serial,
        secure_boot=base.secure_boot if secure is None else secure,
    )


def _bmcs(r: Reader, table: Any, prefix: str, names: list[str]) -> list[PowerSpec] | None:
    """One power spec per node; ``address`` is a hostlist matching the nodes, one
    address for all, or a template with ``{node}`` (e.g. a QMP socket path). The power
    commands of driver "command" are still templates: ``commands.fill`` fills them."""
    if table is None or not r.is_table(table, prefix):
        return None
    get = r.getter(table, prefix)
    driver = get("driver", str, values.choice(DRIVERS), required=True)
    r.unknown_keys(table, prefix, COMMAND_BMC_KEYS if driver == "command" else BMC_KEYS)
    address = get("address", str)
    password = r.password(get, prefix)
    command = commands.read(r, get, prefix) if driver == "command" else None
    if driver is None or (driver == "command" and command is None):
        return None
    if address is None and driver not in ("none", "command"):
        r.problem(f"{prefix}.address", f"is required for driver {driver!r}")
        return None
    if address is None or "{node}" in address:
        addresses = [_per_node(address, n) for n in names]
    else:
        try:
            addresses = hostlist.expand(address)
        except hostlist.HostlistError as error:
            r.problem(f"{prefix}.address", str(error))
            return None
        if len(addresses) == 1:
            addresses *= len(names)
        if not _one_each(r, f"{prefix}.address", addresses, names):
            return None
    common = {
        "driver": driver,
        "user": get("user", str),
        "password": password,
        "verify_tls": get("verify_tls", bool, default=True),
        "port": get("port", int, values.port),
        "command": command,  # templates until commands.fill
    }
    console = get("console", str, values.console)
    if console == "sol" and driver != "ipmi":
        r.problem(f"{prefix}.console", f'"sol" needs driver "ipmi", not {driver!r}')
        console = None
    for key, template in (("address", address), ("console", console)):
        if template and set("{}") & set(template.replace("{node}", "")):
            r.problem(f"{prefix}.{key}", f"{template!r}: the only placeholder is {{node}}")
            return None
    consoles = [_per_node(console, n) for n in names]
    return [
        PowerSpec(address=address, console=console, **common)
        for address, console in zip(addresses, consoles, strict=True)
    ]


def _per_node(template: str | None, node: str) -> str | None:
    return template.replace("{node}", node) if template else template


def _one_each(r: Reader, key: str, entries: list[Any], names: list[str]) -> bool:
    """Whether a range has one entry per node; if not, that is a problem."""
    if len(entries) == len(names):
        return True
    r.problem(
        key,
        f"has {len(entries)} entries for {len(names)} nodes; ranges must have the same length",
    )
    return False


def _add(
    r: Reader, nodes: dict[str, NodeConfig], origin: dict[str, str], node: NodeConfig, key: str
) -> None:
    if node.name in nodes:
        r.problem(key, f"node {node.name} is already defined by {origin[node.name]}")
        return
    nodes[node.name] = node
    origin[node.name] = key


def _check_unique(
    r: Reader,
    nodes: dict[str, NodeConfig],
    origin: dict[str, str],
    network: NetworkConfig | None,
    server: ServerConfig | None,
) -> None:
    seen_ip: dict[int, str] = {}  # by int: an IPv4Address hashes slowly, and there may be 100 000
    seen_mac: dict[str, str] = {}
    seen_serial: dict[str, str] = {}
    subnet = network.subnet if network is not None else None
    first, last = (int(subnet.network_address), int(subnet.broadcast_address)) if subnet else (0, 0)
    pool = (int(network.pool[0]), int(network.pool[1])) if network and network.pool else None
    own = int(server.address) if server is not None else None
    for node in nodes.values():
        key = origin[node.name]
        if node.mac and node.mac in seen_mac:
            r.problem(key, f"{node.name} has MAC {node.mac}, already used by {seen_mac[node.mac]}")
        if node.mac:
            seen_mac.setdefault(node.mac, node.name)
        if node.serial and node.serial in seen_serial:
            r.problem(key, f"{node.name} has serial {node.serial}, already used by "
                      f"{seen_serial[node.serial]}")  # fmt: skip
        if node.serial:
            seen_serial.setdefault(node.serial, node.name)
        if node.ip is None:
            continue
        ip = int(node.ip)
        if ip in seen_ip:
            r.problem(key, f"{node.name} has IP {node.ip}, already used by {seen_ip[ip]}")
        seen_ip.setdefault(ip, node.name)
        if subnet is not None:
            if not first <= ip <= last:
                r.problem(key, f"{node.name}'s IP {node.ip} is outside network.subnet {subnet}")
            elif ip in (first, last):
                r.problem(
                    key,
                    f"{node.name}'s IP {node.ip} is the subnet's network or broadcast address",
                )
            elif pool and pool[0] <= ip <= pool[1]:
                r.problem(key, f"{node.name}'s IP {node.ip} lies inside network.pool")
        if ip == own:
            r.problem(key, f"{node.name}'s IP {node.ip} is the server's own address")
