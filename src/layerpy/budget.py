"""The process's file descriptors, shared out once at start: each subsystem its own number.

Descriptors are one pool per process. When 1 000 stalled TFTP requests or 900 idle HTTP
connections took them all, agents' reports failed with "Too many open files" and the
operator API was refused with the boot network. Here the limit (``RLIMIT_NOFILE``, the
soft one raised to the hard one) is cut into shares declared once in :data:`SHARES`;
each subsystem admits work only within its own share, and a reserve stays unshared for
what no share foresees (threads' files, BMC tools' pipes, a burst of journal writes).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass


@dataclass(frozen=True)
class Share:
    """A part of the limit, in the units its subsystem admits."""

    part: float  # of the limit
    each: int  # descriptors one unit holds
    unit: str  # what the subsystem counts, for the log line and the docs


SHARES: dict[str, Share] = {
    # a connection holds its socket, and while it sends a boot file that file too
    "boot_http": Share(0.35, 2, "connections"),
    "operator_api": Share(0.08, 2, "connections"),
    # a transfer holds its own socket (its TID) and the file it reads
    "tftp": Share(0.12, 2, "transfers"),
    # a SOL session holds a UDP socket and its capture's log; other drivers as many
    "consoles": Share(0.20, 2, "sessions"),
    # state files and journals (nodes, boots, leases, tokens) and image pulls and unpacking
    "files": Share(0.10, 1, "files"),
}
DHCP_SOCKETS = 8  # ports 67 and 4011, the look for other servers: a fixed few
KNOWN_PART = 4  # a quarter of boot HTTP and TFTP is kept for known nodes' addresses
HTTP_PER_ADDRESS = 64  # connections one address may hold at most (iPXE and agents use one or two)
TFTP_PER_ADDRESS = 32  # transfers one address may run at most (a PXE ROM needs one)
SMALLEST = 4  # units a share never goes below, however low the limit


@dataclass(frozen=True)
class Plan:
    """What each subsystem may hold at once, out of ``limit`` descriptors."""

    limit: int
    boot_http: int  # connections on the boot network's HTTP listener
    boot_http_known: int  # of those, kept for addresses of known nodes
    boot_http_per_address: int
    operator_api: int  # connections on the operator API's TCP and TLS listeners
    operator_api_per_address: int
    tftp: int  # transfers at once
    tftp_known: int  # of those, kept for addresses of known nodes
    tftp_per_address: int
    consoles: int  # console sessions captured
    files: int  # descriptors for state files, journals and images
    dhcp: int  # DHCP sockets
    reserve: int  # descriptors no share may take

    def summary(self) -> str:
        """The plan in one log line."""
        return (
            f"descriptor plan for a limit of {self.limit}: boot HTTP {self.boot_http} "
            f"connections ({self.boot_http_known} kept for known nodes, "
            f"{self.boot_http_per_address} per address), operator API {self.operator_api} "
            f"connections, TFTP {self.tftp} transfers ({self.tftp_known} kept for known "
            f"nodes, {self.tftp_per_address} per address), consoles {self.consoles} sessions, "
            f"files {self.files}, DHCP {self.dhcp}, reserve {self.reserve}"
        )


def plan(limit: int) -> Plan:
    """The shares of `limit` descriptors (see SHARES)."""
    units = {name: max(SMALLEST, int(limit * s.part) // s.each) for name, s in SHARES.items()}
    used = sum(units[name] * s.each for name, s in SHARES.items()) + DHCP_SOCKETS
    http, tftp = units["boot_http"], units["tftp"]
    return Plan(
        limit=limit,
        boot_http=http,
        boot_http_known=max(1, http // KNOWN_PART),
        boot_http_per_address=max(2, min(HTTP_PER_ADDRESS, http // KNOWN_PART)),
        operator_api=units["operator_api"],
        operator_api_per_address=max(2, units["operator_api"] // 2),
        tftp=tftp,
        tftp_known=max(1, tftp // KNOWN_PART),
        tftp_per_address=max(1, min(TFTP_PER_ADDRESS, tftp // 8)),
        consoles=units["consoles"],
        files=units["files"],
        dhcp=DHCP_SOCKETS,
        reserve=limit - used,
    )


def raise_limit() -> int:
    """Lift the soft descriptor limit to the hard one; returns the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard
