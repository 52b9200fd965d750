"""What the mutation table's actions do, as a map from name to coroutine: adding an action
or a power driver touches this map and nothing else. An action reports what it achieved to
the node store like any other observation; a failure raises (the engine backs off)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple, Protocol

from layerpy.catalog import Catalog
from layerpy.model import PowerState
from layerpy.nodes import NodeStore
from layerpy.power import PowerDriver, PowerError

log = logging.getLogger("layerpy.power")
images_log = logging.getLogger("layerpy.images")


class Context(Protocol):
    """What an action may use (the Lifecycle provides it)."""

    store: NodeStore
    catalog: Catalog
    drivers: Mapping[str, PowerDriver]

    def image_of(self, name: str) -> str | None: ...

    def platform_of(self, name: str) -> str: ...

    def assign(self, name: str, image: tuple[str, str] | None) -> None: ...


def _driver(ctx: Context, name: str, what: str) -> PowerDriver:
    driver = ctx.drivers.get(name)
    if driver is None:
        raise PowerError(f"{name}: no longer under power control (the node file changed)")
    log.info("%s: %s", name, what)
    return driver


async def power_on(ctx: Context, name: str) -> None:
    driver = _driver(ctx, name, "power on")
    await driver.boot_network_once()
    await driver.on()
    ctx.store.saw_power(name, PowerState.ON)


async def power_off(ctx: Context, name: str) -> None:
    await _driver(ctx, name, "power off").off()
    ctx.store.saw_power(name, PowerState.OFF)


async def power_cycle(ctx: Context, name: str) -> None:
    driver = _driver(ctx, name, "power cycle")
    await driver.boot_network_once()
    await driver.cycle()
    ctx.store.conclude(name, {"power": PowerState.ON})  # also ends a hang: it was cycled


async def power_status(ctx: Context, name: str) -> None:
    ctx.store.saw_power(name, PowerState(await _driver(ctx, name, "power status").status()))


async def image_assign(ctx: Context, name: str) -> None:
    """The digest the node's agent is told to run from its next answer on."""
    wanted = ctx.image_of(name)
    image = ctx.catalog.current(wanted or "", ctx.platform_of(name))
    ctx.assign(name, (wanted or "", image.digest))
    images_log.info("%s: assigned image %s %s", name, wanted, image.digest[:19])


class Action(NamedTuple):
    does: str  # for people: docs/lifecycle.md and explain
    run: Callable[[Context, str], Awaitable[None]]
    boots: bool = False  # starts a machine: paced by [server] power_on_rate


ACTIONS: dict[str, Action] = {
    "power_on": Action("network boot once, power on", power_on, boots=True),
    "power_off": Action("power off", power_off),
    "power_cycle": Action("network boot once, power cycle", power_cycle, boots=True),
    "power_status": Action("ask the BMC again (with backoff)", power_status),
    "image_assign": Action("tell the agent the image's digest", image_assign),
}
