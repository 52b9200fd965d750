"""What every power driver shares: the spec it is built from, its interface, its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

DRIVERS = ("ipmi", "redfish", "qemu", "none")
MAX_SESSIONS = 16  # IPMI worker threads: concurrent sessions with BMCs


class PowerError(Exception):
    """A power operation failed; ``str(error)`` is the reason to show a person, naming the
    node and the BMC, never a password."""


@dataclass(frozen=True)
class PowerSpec:
    """One node's power control as the node file gives it.

    ``address`` is the BMC's host or IP (ipmi), its base URL ``https://host[:port]``,
    optionally with a system's path, as in ``…/redfish/v1/Systems/1`` (redfish), or the
    VM's QMP unix socket (qemu). The password is already resolved and is never shown.
    ``console`` is where its serial console is read: "sol" (IPMI Serial-over-LAN through
    this BMC) or the path of a Unix socket that is the serial line (QEMU's chardev).
    """

    driver: str  # "ipmi" | "redfish" | "qemu" | "none"
    address: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    verify_tls: bool = True
    port: int | None = None
    console: str | None = None


def scrub(text: str, password: str | None) -> str:
    """`text` without the password: a safety net for messages built from a library's."""
    return text.replace(password, "***") if password else text


class PowerDriver(Protocol):
    async def status(self) -> str:
        """Either "on" or "off"."""
        ...

    async def on(self) -> None: ...

    async def off(self) -> None: ...

    async def cycle(self) -> None:
        """Restart the machine; power it on if it is off."""
        ...

    async def boot_network_once(self) -> None:
        """Make the next boot a network boot."""
        ...

    async def close(self) -> None: ...
