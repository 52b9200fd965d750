"""What every power driver shares: the spec it is built from, its interface, its error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

DRIVERS = ("ipmi", "redfish", "qemu", "command", "none")
MAX_SESSIONS = 16  # IPMI worker threads, and power commands running at once
POLL_TIMEOUT = 60.0  # seconds: a poll a driver never ends counts as failed (drivers bound it)


class PowerError(Exception):
    """A power operation failed; ``str(error)`` is the reason to show a person, naming the
    node and the BMC, never a password."""


@dataclass(frozen=True)
class CommandSpec:
    """One node's power commands (driver "command"): each an argument list, its
    placeholders already filled in for this node by the node file's reader; never a
    shell line. An empty ``cycle`` is off, then on; an empty ``boot_network`` is nothing
    (a machine powered by an outlet boots from the network by its own settings).

    Status: with ``status_exit`` (exit code -> "on" or "off"), the exit code decides;
    without, the command must exit 0 and its output is searched for the ``status_on``
    and ``status_off`` patterns (Python regular expressions), exactly one of which must
    match.
    """

    on: tuple[str, ...]
    off: tuple[str, ...]
    status: tuple[str, ...]
    cycle: tuple[str, ...] = ()
    boot_network: tuple[str, ...] = ()
    status_on: str = r"(?i)^\s*on\s*$"
    status_off: str = r"(?i)^\s*off\s*$"
    status_exit: tuple[tuple[int, str], ...] = ()
    # seconds a command may run before its process group is killed: an action runs up to
    # three (boot_network, off, on), all within the 30 s the engine gives a power action,
    # so that what is shown is this error, naming the command (MAX_COMMAND_TIMEOUT)
    timeout: float = 8.0


MAX_COMMAND_TIMEOUT = 9.0  # 3 commands of a power action in the engine's 30 s, with room


@dataclass(frozen=True)
class PowerSpec:
    """One node's power control as the node file gives it.

    ``address`` is the BMC's host or IP (ipmi), its base URL ``https://host[:port]``,
    optionally with a system's path, as in ``…/redfish/v1/Systems/1`` (redfish), or the
    VM's QMP unix socket (qemu), or what the commands' ``{address}`` stands for (command).
    The password is already resolved and is never shown (a command gets it in its
    environment, ``LAYERPY_BMC_PASSWORD``, never in its arguments).
    ``console`` is where its serial console is read: "sol" (IPMI Serial-over-LAN through
    this BMC) or the path of a Unix socket that is the serial line (QEMU's chardev).
    """

    driver: str  # one of DRIVERS
    address: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    verify_tls: bool = True
    port: int | None = None
    console: str | None = None
    command: CommandSpec | None = None  # driver "command" only


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
