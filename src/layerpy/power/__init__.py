"""Power drivers behind one async interface: IPMI (pyghmi), Redfish (aiohttp), QEMU (QMP)
and none. ``make_driver`` builds the one a node's spec names."""

from __future__ import annotations

from layerpy.power.base import DRIVERS, PowerDriver, PowerError, PowerSpec

__all__ = ["NoneDriver", "PowerDriver", "PowerError", "PowerSpec", "make_driver"]


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
