"""Power drivers behind one async interface: IPMI (pyghmi), Redfish (aiohttp), QEMU (QMP),
commands (a PDU, a PoE switch, a smart plug) and none. ``make_driver`` builds the one a
node's spec names."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from layerpy.power.base import DRIVERS, PowerDriver, PowerError, PowerSpec

__all__ = ["NoneDriver", "PowerDriver", "PowerError", "PowerSpec", "close_all", "make_driver"]

log = logging.getLogger("layerpy.power")
CLOSING_AT_ONCE = 64  # drivers closed concurrently by close_all


class NoneDriver:
    """No power control (a person presses the button): every action succeeds and status
    reports the last one. It starts "on", since a node nobody can switch is assumed
    running; reporting "off" would only make the engine "power on" a machine it cannot."""

    def __init__(self) -> None:
        self.state = "on"

    async def status(self) -> str:
        return self.state

    async def on(self) -> None:
        self.state = "on"

    async def off(self) -> None:
        self.state = "off"

    async def cycle(self) -> None:
        self.state = "on"

    async def boot_network_once(self) -> None:
        pass

    async def close(self) -> None:
        pass


def make_driver(node: str, spec: PowerSpec) -> PowerDriver:
    """The driver for `node`; drivers are imported on use, so pyghmi loads only for IPMI."""
    if spec.driver not in DRIVERS:
        raise PowerError(f"{node}: unknown power driver {spec.driver!r} (one of {DRIVERS})")
    if spec.driver == "none":
        return NoneDriver()
    if spec.driver == "command":
        from layerpy.power.command import CommandDriver

        if spec.command is None:
            raise PowerError(f"{node}: power driver command needs its commands")
        return CommandDriver(node, spec)
    if not spec.address:
        raise PowerError(f"{node}: power driver {spec.driver} needs an address")
    if spec.driver == "ipmi":
        from layerpy.power.ipmi import IpmiDriver

        return IpmiDriver(node, spec)
    if spec.driver == "redfish":
        from layerpy.power.redfish import RedfishDriver

        return RedfishDriver(node, spec)
    from layerpy.power.qemu import QemuDriver

    return QemuDriver(node, spec)


async def close_all(drivers: Iterable[PowerDriver], timeout: float) -> None:
    """Close every driver, at most CLOSING_AT_ONCE at a time, and return within `timeout`
    seconds whatever the BMCs do: a shutdown (systemd kills after 90 s) must not wait for
    a thousand dead BMCs one after the other. Closing drops a driver's queued work; what
    is still running is abandoned (IPMI threads are daemons, never joined at exit)."""
    slots = asyncio.Semaphore(CLOSING_AT_ONCE)

    async def close(driver: PowerDriver) -> None:
        async with slots:
            await driver.close()

    tasks = [asyncio.create_task(close(driver)) for driver in drivers]
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:
        task.cancel()
    if pending:  # cancelled closes end at once (they only await), but never hang on one
        await asyncio.wait(pending, timeout=1.0)
    failed = [t for t in done if not t.cancelled() and t.exception() is not None]
    if pending or failed:
        log.warning(
            "power drivers closed: %d of %d not within %g s, %d failed",
            len(pending), len(tasks), timeout, len(failed),
        )  # fmt: skip
