"""What this host gives the server: its interfaces, their addresses and the ports it can
listen on.

Start-up, ``layerpy check`` and ``layerpy init`` ask here, so that a mistake in the node
file is named (the interface, the address, the port, the setting) instead of surfacing as
``[Errno 19] No such device``. Addresses come from the kernel over rtnetlink, with the
standard library only: ``layerpy.pyz`` runs on hosts without iproute2.
"""

from __future__ import annotations

import errno
import socket
import struct
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from layerpy.config import Config

_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port
_IFADDR = struct.Struct("=BBBBI")  # ifaddrmsg: family, prefix length, flags, scope, index
_ATTR = struct.Struct("=HH")  # rtattr: length, type
ARP_LIMIT = Path("/proc/sys/net/ipv4/neigh/default/gc_thresh3")


class StartRefused(Exception):
    """The server will not start here; the message says why and what to do."""


def interfaces() -> dict[str, list[IPv4Interface]]:
    """Every interface of this host (network namespace) with its IPv4 addresses."""
    found = _addresses()
    return {name: found.get(index, []) for index, name in sorted(socket.if_nameindex())}


def _addresses() -> dict[int, list[IPv4Interface]]:
    """IPv4 addresses by interface index, as the kernel lists them (RTM_GETADDR dump)."""
    request = _HEADER.pack(
        _HEADER.size + _IFADDR.size, _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
    ) + _IFADDR.pack(socket.AF_INET, 0, 0, 0, 0)
    found: dict[int, list[IPv4Interface]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(request)
        while True:
            data, at = sock.recv(1 << 16), 0
            while at + _HEADER.size <= len(data):
                length, kind = _HEADER.unpack_from(data, at)[:2]
                if kind == _NLMSG_DONE:
                    return found
                if kind == _NLMSG_ERROR or length < _HEADER.size:
                    raise OSError(errno.EIO, "the kernel refused to list the addresses")
                if kind == _RTM_NEWADDR:
                    family, prefix, _, _, index = _IFADDR.unpack_from(data, at + _HEADER.size)
                    attrs = _attributes(data, at + _HEADER.size + _IFADDR.size, at + length)
                    packed = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS)
                    if family == socket.AF_INET and packed and len(packed) == 4:
                        found.setdefault(index, []).append(
                            IPv4Interface((IPv4Address(packed), prefix))
                        )
                at += (length + 3) & ~3


def _attributes(data: bytes, at: int, end: int) -> dict[int, bytes]:
    attrs: dict[int, bytes] = {}
    while at + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, at)
        if length < _ATTR.size:
            break
        attrs[kind] = data[at + _ATTR.size : at + length]
        at += (length + 3) & ~3
    return attrs


def interface_problem(name: str, address: IPv4Address) -> str | None:
    """Why interface `name` cannot serve as `address`, or None when it can."""
    present = interfaces()
    if name not in present:
        return f"no such interface {name} (server.interface); this host has {', '.join(present)}"
    if not any(a.ip == address for a in present[name]):
        held = ", ".join(str(a) for a in present[name]) or "no IPv4 address"
        return f"{name} does not carry {address} (server.address); it has {held}"
    return None


def neighbour_warning(config: Config, limit: Path = ARP_LIMIT) -> str | None:
    """Why the kernel's ARP table may not hold an entry for every node on the boot
    segment, or None. Each reply the server sends a node on its own subnet (a DHCP
    unicast, TFTP, HTTP) needs one; past gc_thresh3 the kernel makes no new one and drops
    the reply ("neighbor table overflow!" in its log, nothing in ours), and the nodes it
    would have reached fail to boot. The table is the host's, shared by its namespaces."""
    subnet = config.network.subnet
    count = sum(1 for node in config.nodes.values() if node.ip is not None and node.ip in subnet)
    try:
        most = int(limit.read_text())
    except (OSError, ValueError):
        return None  # not Linux, or not readable: nothing to say
    if count <= most:
        return None
    return (
        f"{count} nodes on {subnet} need an ARP entry each, and this host's table holds "
        f"{most} (net.ipv4.neigh.default.gc_thresh3): the kernel would drop replies to the "
        f"rest. Raise it, e.g. sysctl -w net.ipv4.neigh.default.gc_thresh2={2 * count} "
        f"net.ipv4.neigh.default.gc_thresh3={4 * count} (and in /etc/sysctl.d/)"
    )


def listen_problem(
    service: str, error: OSError, port: int, *, address: str = "", interface: str = ""
) -> str:
    """What a failed bind means, in the node file's terms."""
    where = address or interface or "this host"
    if error.errno == errno.ENODEV:
        return f"cannot listen for {service} on {interface}: no such interface (server.interface)"
    if error.errno == errno.EADDRINUSE:
        return f"{service} port {port} on {where} is taken by another program"
    if error.errno in (errno.EACCES, errno.EPERM):
        return (
            f"cannot listen for {service} on port {port} of {where}: permission denied "
            "(run as root, or grant the service CAP_NET_BIND_SERVICE)"
        )
    if error.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen for {service} on {where}: no interface of this host has that address"
    return f"cannot listen for {service} on {where} port {port}: {error.strerror or error}"


def cannot_listen(
    service: str, error: OSError, port: int, *, address: str = "", interface: str = ""
) -> OSError:
    """The OSError start-up raises for a failed bind, its message from listen_problem()."""
    message = listen_problem(service, error, port, address=address, interface=interface)
    return OSError(message)


def port_problem(
    service: str, kind: socket.SocketKind, port: int, *, address: str = "", interface: str = ""
) -> str | None:
    """Whether `service` could listen there now (a trial bind, nothing sent): None if so."""
    with socket.socket(socket.AF_INET, kind) as sock:
        try:
            if interface:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
            sock.bind((address or "0.0.0.0", port))
        except OSError as error:
            return listen_problem(service, error, port, address=address, interface=interface)
    return None


def host_problems(config: Config) -> list[str]:
    """What stops this host from serving the node file now: the interface (missing, or
    without server.address), then each port the server would listen on (taken, or not
    ours to take). Nothing is sent anywhere."""
    server = config.server
    if server.interface is not None:
        problem = interface_problem(server.interface, server.address)
        if problem is not None:
            return [problem]  # every port test would fail for the same reason
    address, interface = str(server.address), server.interface or ""
    wanted: list[tuple[str, socket.SocketKind, int, str, str]] = []
    if server.dhcp != "off":
        wanted.append(("DHCP", socket.SOCK_DGRAM, 67, "", interface))
        if server.dhcp == "proxy":
            wanted.append(("ProxyDHCP", socket.SOCK_DGRAM, 4011, "", interface))
    wanted.append(("TFTP", socket.SOCK_DGRAM, server.tftp_port, address, interface))
    wanted.append(("HTTP", socket.SOCK_STREAM, server.http_port, address, ""))
    if server.beat_port:
        wanted.append(("heartbeat", socket.SOCK_DGRAM, server.beat_port, address, ""))
    wanted += [("the API", socket.SOCK_STREAM, p, str(a), "") for a, p in config.api.listen]
    found = (port_problem(s, k, p, address=a, interface=i) for s, k, p, a, i in wanted)
    return [problem for problem in found if problem is not None]
