"""A router advertisement responder for the lab bridge.

iPXE runs its IPv6 configurator beside DHCP and waits ~13 s for a router advertisement
before giving up. This answers every router solicitation at once (and repeats itself every
few seconds) with an advertisement that says nothing: router lifetime 0 (not a default
router), no prefix, M=O=0 (no DHCPv6). iPXE's configurator then finishes immediately and no
node learns an IPv6 route or address beyond its link-local one.

Run it inside the lab namespace only: ``ra.py br0``. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import select
import socket
import struct
import sys
import time
from pathlib import Path

ROUTER_SOLICITATION = 133
ROUTER_ADVERTISEMENT = 134
ICMP6_FILTER = 1  # <netinet/icmp6.h>; the socket module does not export it
ALL_NODES = "ff02::1"
ALL_ROUTERS = "ff02::2"


def advertisement(mac: bytes) -> bytes:
    """An RA with lifetime 0, no flags, no prefix; the kernel fills in the checksum."""
    header = struct.pack("!BBHBBHII", ROUTER_ADVERTISEMENT, 0, 0, 0, 0, 0, 0, 0)
    source_lladdr = struct.pack("!BB6s", 1, 1, mac)  # option 1, length 1 x 8 octets
    return header + source_lladdr


def solicitations_only() -> bytes:
    """An ICMP6_FILTER that blocks every type but router solicitation (a set bit blocks)."""
    words = [0xFFFFFFFF] * 8
    words[ROUTER_SOLICITATION >> 5] &= ~(1 << (ROUTER_SOLICITATION & 31))
    return struct.pack("=8I", *words)


def open_socket(ifname: str) -> socket.socket:
    """A raw ICMPv6 socket bound to one interface, hop limit 255 as RFC 4861 requires."""
    index = socket.if_nametoindex(ifname)
    sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
    sock.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, solicitations_only())
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, index)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, 0)
    group = socket.inet_pton(socket.AF_INET6, ALL_ROUTERS) + struct.pack("=I", index)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, group)
    return sock


def serve(ifname: str, interval: float) -> None:
    """Advertise at start, on every solicitation, and every `interval` seconds."""
    mac = bytes.fromhex(Path(f"/sys/class/net/{ifname}/address").read_text().replace(":", ""))
    packet = advertisement(mac)
    destination = (ALL_NODES, 0, 0, socket.if_nametoindex(ifname))
    with open_socket(ifname) as sock:
        next_at = 0.0
        while True:
            ready, _, _ = select.select([sock], [], [], max(0.0, next_at - time.monotonic()))
            if ready:
                sock.recv(1500)  # the filter lets only solicitations through
            if ready or time.monotonic() >= next_at:
                try:
                    sock.sendto(packet, destination)
                except OSError as exc:
                    if exc.errno != errno.ENETUNREACH:  # no carrier yet: nobody to tell
                        print(f"ra: send on {ifname}: {exc}", file=sys.stderr, flush=True)
                next_at = time.monotonic() + interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("interface")
    parser.add_argument("--interval", type=float, default=3.0, help="unsolicited RA period (s)")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.interface, args.interval)


if __name__ == "__main__":
    main()
