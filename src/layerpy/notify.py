"""The service manager's readiness protocol (sd_notify), with the standard library: under
systemd with ``Type=notify`` the unit is started only once the server listens, reloading
while a node file is re-read, and stopping from the first moment of a stop. Anywhere else
($NOTIFY_SOCKET unset) every call does nothing."""

from __future__ import annotations

import os
import socket
import time


def notify(*fields: str) -> bool:
    """Send ``KEY=value`` lines to the service manager; False when there is none (or it
    cannot be reached: readiness is worth a try, never a failure of the server)."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where.startswith(("/", "@")):
        return False
    address = "\0" + where[1:] if where.startswith("@") else where  # "@": abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(fields).encode(), address)
    except OSError:
        return False
    return True


def reloading() -> bool:
    """RELOADING=1 with the monotonic time systemd 253 asks for (``Type=notify-reload``)."""
    return notify(
        "RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
    )
