"""Value converters for the typed getters: each turns a TOML value into what the records
hold, or raises ValueError with a message the user can act on."""

from __future__ import annotations

import math
import posixpath
import re
import socket
from collections.abc import Callable
from ipaddress import IPv4Address, IPv4Network
from typing import Any

from layerpy import hostlist
from layerpy.proto import agent

_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
_ORIGIN = re.compile(r"(https?)://([a-z0-9.-]{1,253}|\[[0-9a-f:.]{2,45}\])(?::([0-9]{1,5}))?")
_DEFAULT_PORTS = {"http": 80, "https": 443}
LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a host name's one part
_ETCD_URL = re.compile(r"(https?)://([a-z0-9.-]{1,253}|\[[0-9a-f:.]{2,45}\]):([0-9]{1,5})")
_KEY_PREFIX = re.compile(r"(/[A-Za-z0-9._-]+)+")
MAX_ETCD_MEMBERS = 7  # etcd's own advice: more members only slow its writes


def ipv4(value: str) -> IPv4Address:
    """Plain dotted decimal is read by the C library (a 100 000-node file has as many
    addresses); anything else goes to ipaddress, which says no to what is not plain."""
    try:
        packed = socket.inet_aton(value)
        if socket.inet_ntoa(packed) == value:
            return IPv4Address(packed)
    except (OSError, ValueError):
        pass
    try:
        return IPv4Address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 address") from None


def ipv4_list(values: list[Any]) -> tuple[IPv4Address, ...]:
    if not all(isinstance(v, str) for v in values):
        raise ValueError("must be a list of IPv4 address strings")
    return tuple(ipv4(v) for v in values)


def ipv4_range(value: str) -> list[IPv4Address]:
    try:
        return [ipv4(item) for item in hostlist.expand(value)]
    except hostlist.HostlistError as error:
        raise ValueError(str(error)) from None


def subnet(value: str) -> IPv4Network:
    try:
        return IPv4Network(value)
    except ValueError as error:
        raise ValueError(f"{value!r} is not an IPv4 subnet like 10.99.0.0/24 ({error})") from None


def pool(value: str) -> tuple[IPv4Address, IPv4Address]:
    first, dash, last = value.partition("-")
    if not dash:
        raise ValueError(f"{value!r} must be a range like 10.99.0.200-10.99.0.250")
    low, high = ipv4(first.strip()), ipv4(last.strip())
    if high < low:
        raise ValueError(f"{value!r} runs backwards")
    return low, high


def mac(value: str) -> str:
    mac = value.strip().lower().replace("-", ":")
    if not _MAC.match(mac):
        raise ValueError(f"{value!r} is not a MAC address like 52:54:00:12:34:56")
    return mac


MAX_MAC_RANGE = 1_000_000
_SERIAL = re.compile(r"^([0-9a-f]{8})?([0-9a-f]{8})$")


def serial(value: str) -> str:
    """A Raspberry Pi's serial number as its bootloader names its TFTP directory: 8 hex
    digits, the low 32 bits of the 16 that /proc/cpuinfo shows (``10000000abcd1234`` is
    ``abcd1234``)."""
    found = _SERIAL.match(value.strip().lower())
    if found is None:
        raise ValueError(
            f"{value!r} is not a Raspberry Pi serial number like 9ffefdef or 100000009ffefdef"
        )
    return found.group(2)


def serial_list(value: list[Any]) -> list[str]:
    if not all(isinstance(item, str) for item in value):
        raise ValueError("must be a list of serial number strings, one per node")
    return [serial(item) for item in value]


def mac_list(value: list[Any] | str) -> list[str]:
    """A list of MACs, one MAC, or a range ``FIRST-LAST`` of consecutive MACs (a big
    group's NICs often come in order: one line instead of a thousand)."""
    if isinstance(value, str):
        return (
            mac_range(value) if value.count("-") == 1 and value.count(":") == 10 else [mac(value)]
        )
    if not all(isinstance(item, str) for item in value):
        raise ValueError("must be a list of MAC address strings")
    return [mac(item) for item in value]


def mac_range(value: str) -> list[str]:
    """``52:54:00:99:00:fe-52:54:00:99:01:01`` -> the four MACs from one to the other."""
    first, last = (int(mac(part).replace(":", ""), 16) for part in value.split("-"))
    if last < first:
        raise ValueError(f"{value!r} runs backwards")
    if last - first >= MAX_MAC_RANGE:
        raise ValueError(f"{value!r} holds {last - first + 1} MACs, the limit is {MAX_MAC_RANGE}")
    return [_colons(f"{n:012x}") for n in range(first, last + 1)]


def _colons(digits: str) -> str:
    d = digits
    return f"{d[0:2]}:{d[2:4]}:{d[4:6]}:{d[6:8]}:{d[8:10]}:{d[10:12]}"


def locations(value: str) -> list[tuple[str, str]]:
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


def identifier(value: str) -> str:
    """A chassis id as LLDP renders it: MACs lowercase with colons, anything else as is."""
    mac = value.strip().lower().replace("-", ":")
    return mac if _MAC.match(mac) else value.strip()


def string_list(value: list[Any]) -> tuple[str, ...]:
    if not value or not all(isinstance(item, str) for item in value):
        raise ValueError("must be a non-empty list of strings")
    return tuple(value)


def endpoint(value: str) -> tuple[IPv4Address, int]:
    """``10.0.0.1:8081`` -> (address, port)."""
    host, colon, number = value.rpartition(":")
    if not colon or not number.isdigit():
        raise ValueError(f"{value!r} must be an address and a port, like 127.0.0.1:8081")
    return ipv4(host), port(int(number))


def endpoints(value: list[Any]) -> tuple[tuple[IPv4Address, int], ...]:
    if not all(isinstance(item, str) for item in value):
        raise ValueError('must be a list of strings like "127.0.0.1:8081"')
    return tuple(endpoint(item) for item in value)


def origin(value: str) -> str:
    """A web origin as a browser sends it in ``Origin``: scheme, host and a port only
    when it is not the scheme's default (``https://ops.example.com:8443``), lowercase."""
    found = _ORIGIN.fullmatch(value.strip().lower().removesuffix("/"))
    if found is None:
        raise ValueError(
            f"{value[:100]!r} is not an origin: give scheme, host and port only, like "
            '"https://ops.example.com:8443" (no path)'
        )
    scheme, host, number = found.groups()
    if number is None or int(number) == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port(int(number))}"


def origins(value: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(item, str) for item in value):
        raise ValueError('must be a list of strings like "https://ops.example.com"')
    return tuple(origin(item) for item in value)


def port(value: int) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{value} is not a port number (1-65535)")
    return value


def port_or_off(value: int) -> int:
    """A port number, or 0 for a service turned off."""
    return value if value == 0 else port(value)


def positive(value: float) -> float:
    if _finite(value) <= 0:
        raise ValueError(f"{value} must be greater than zero")
    return value


def not_negative(value: float) -> float:
    if _finite(value) < 0:
        raise ValueError(f"{value} must not be negative")
    return value


def _finite(value: float) -> float:
    """The number as a float, which every setting becomes: nan, inf and integers beyond
    a float's range (TOML allows all three) are no number of seconds or anything else."""
    try:
        number = float(value)
    except OverflowError:
        raise ValueError("is too large") from None
    if not math.isfinite(number):
        raise ValueError(f"must be a finite number, not {value}")
    return number


def lease_time(value: int) -> int:
    """DHCP carries a lease time in 32 bits (RFC 2132 option 51)."""
    if not 0 < positive(value) <= 0xFFFFFFFF:
        raise ValueError(f"{value} is not a lease time in seconds (1 to {0xFFFFFFFF})")
    return value


def plain_file_name(value: str) -> str:
    if "/" in value or value in ("", ".", ".."):
        raise ValueError(f"{value!r} must be a file name inside ipxe.dir")
    return value


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def check(value: str) -> str:
        if value not in options:
            raise ValueError(f"{value!r} is not one of: {', '.join(options)}")
        return value

    return check


RUNTIME_PATHS = ("/proc", "/sys", "/dev", "/run", "/tmp")  # a container mounts its own there


def image_path(value: str) -> str:
    """A path inside a system image: absolute, normalised, not where the runtime mounts."""
    if not value.startswith("/") or posixpath.normpath(value) != value or value == "/":
        raise ValueError(f"{value!r} must be an absolute, normalised path, like /etc/hosts")
    if not value.isprintable() or len(value) > 255 or "\\" in value:
        raise ValueError(f"{value!r} must be printable and at most 255 characters")
    if any(value == top or value.startswith(top + "/") for top in RUNTIME_PATHS):
        tops = ", ".join(RUNTIME_PATHS)
        raise ValueError(f"{value} is under {tops}, which the node's runtime mounts")
    return value


def disk(value: str) -> str:
    """A node's block device, by name or by its file system's label."""
    if not agent.is_disk(value):
        raise ValueError(f"{value!r} must be a device like /dev/vdb or a label like LABEL=state")
    return value


def command_line(value: str) -> str:
    """One printable line (a command the node runs), at most 1 000 characters."""
    if not value.strip() or not value.isprintable() or len(value) > 1000:
        raise ValueError("must be one printable line of at most 1 000 characters")
    return value


def console(value: str) -> str:
    """Where a node's serial console is read: "sol", or an absolute Unix socket path
    (``{node}`` stands for the node's name)."""
    if value == "sol":
        return value
    if not value.startswith("/") or not value.isprintable() or len(value) > 200:
        raise ValueError(
            f'{value!r} must be "sol" (IPMI Serial-over-LAN) or the absolute path of the '
            "console's Unix socket, like /run/lab/{node}.console"
        )
    return value


def label(value: str) -> str:
    """A name that may stand in a host name or an etcd key: one DNS label."""
    if not LABEL.match(value):
        raise ValueError(
            f"{value[:100]!r} must be 1 to 63 lowercase letters, digits and hyphens, "
            "not starting or ending with a hyphen (like a host name)"
        )
    return value


def etcd_url(value: str) -> str:
    """An etcd member's client URL: scheme, host and port, nothing else, lowercase."""
    found = _ETCD_URL.fullmatch(value.strip().lower().removesuffix("/"))
    if found is None:
        raise ValueError(
            f"{value[:100]!r} is not an etcd member's URL: give http:// or https://, host "
            'and port, like "http://10.0.0.5:2379" (no path)'
        )
    scheme, host, number = found.groups()
    return f"{scheme}://{host}:{port(int(number))}"


def etcd_urls(value: list[Any]) -> tuple[str, ...]:
    if not all(isinstance(item, str) for item in value):
        raise ValueError('must be a list of strings like "http://10.0.0.5:2379"')
    if not 1 <= len(value) <= MAX_ETCD_MEMBERS:
        raise ValueError(f"names {len(value)} members: give 1 to {MAX_ETCD_MEMBERS}")
    urls = tuple(etcd_url(item) for item in value)
    twice = sorted({url for url in urls if urls.count(url) > 1})
    if twice:
        raise ValueError(f"names {', '.join(twice)} twice")
    return urls


def key_prefix(value: str) -> str:
    """Where in etcd's key space a cluster's keys live: /-separated plain parts."""
    if len(value) > 200 or not _KEY_PREFIX.fullmatch(value):
        raise ValueError(
            f"{value[:100]!r} must be an etcd key prefix like /layerpy/v1: parts of letters, "
            "digits, '.', '_' and '-', each after a /, none after the last part"
        )
    return value


def lease_ttl(value: int) -> int:
    """Seconds an instance's etcd lease outlives it: the fence's delay and the take-over's."""
    if not 2 <= value <= 30:
        raise ValueError(f"{value} is not between 2 and 30 seconds")
    return value
