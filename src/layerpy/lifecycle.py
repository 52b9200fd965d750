"""The node lifecycle as data, and the binding of the state engine to the world.

Three variables per node: ``power`` (from BMC polls), ``run`` (from the boot services and
agent reports) and ``busy`` (from agent reports). The mutations below are the only ways
layerpy changes a node; ``layerpy plan`` and ``layerpy explain`` read the same table.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from layerpy.catalog import Catalog
from layerpy.config import Config, NodeConfig
from layerpy.engine import ANY, Engine, Graph, Mutation, NoPath, Variable
from layerpy.inventory import Inventory
from layerpy.model import Node, RunState
from layerpy.power import PowerDriver, PowerError, make_driver

log = logging.getLogger("layerpy.power")
images_log = logging.getLogger("layerpy.images")

VARIABLES = (
    Variable("power", ("unknown", "off", "on", "hang", "error")),
    Variable("run", ("unknown", "booting", "init", "ready", "lost", "error")),
    Variable("busy", ("unknown", "free", "busy")),
    # as the agent reports it; "stale" is active with another digest than the file wants
    Variable("image", ("unknown", "none", "pulling", "active", "updating", "error", "stale")),
)

ON = frozenset({"on"})
FORGOTTEN_ON_POWER = ("run", "busy", "image")
BOOT_TIMEOUT = 120.0


def mutations(boot_timeout: float = BOOT_TIMEOUT) -> tuple[Mutation, ...]:
    """The lifecycle table: what can change, when, how long it may take, and what a
    timeout means."""
    return (
        Mutation("power.on", {"power": ("off", "on")}, action="power_on",
                 timeout=30, fail_to={"power": "error"}),
        Mutation("power.off", {"power": ("on", "off")}, action="power_off",
                 excludes={"busy": frozenset({"busy"})}, forgets=FORGOTTEN_ON_POWER,
                 timeout=30, fail_to={"power": "error"}),
        Mutation("power.cycle", {"power": ("hang", "on")}, action="power_cycle",
                 forgets=FORGOTTEN_ON_POWER, timeout=30, fail_to={"power": "error"}),
        Mutation("power.off_hung", {"power": ("hang", "off")}, action="power_off",
                 forgets=FORGOTTEN_ON_POWER, timeout=30, fail_to={"power": "error"}),
        Mutation("power.retry", {"power": ("error", "unknown")}, action="power_status",
                 timeout=30, fail_to={"power": "error"}, cost=5),
        Mutation("boot.wait", {"run": (ANY, "ready")}, requires={"power": ON},
                 timeout=boot_timeout, fail_to={"power": "hang"}, cost=2),
        Mutation("boot.recover", {"run": ("lost", "ready")}, requires={"power": ON},
                 timeout=10, fail_to={"power": "hang"}),
        # the agent switches without a reboot once told; a busy node is drained first
        Mutation("image.activate", {"image": (ANY, "active")}, action="image_assign",
                 requires={"run": frozenset({"ready"})}, excludes={"busy": frozenset({"busy"})},
                 timeout=300, fail_to={"image": "error"}),
    )  # fmt: skip


def desired(node: NodeConfig, override: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """cfg for a node, every variable named (None: don't care): the file's power (or a
    run-time override), a powered node ready and running its image. Without a BMC,
    power is not layerpy's to want."""
    wanted: dict[str, str | None] = dict.fromkeys((v.name for v in VARIABLES), None)
    if (override or {}).get("image", node.image):
        wanted["image"] = "active"
    if node.bmc is None:
        return wanted
    if (override or {}).get("power", node.power) == "off":
        return {**wanted, "power": "off", "image": None}
    return {**wanted, "power": "on", "run": "ready"}


class Lifecycle:
    """Feeds observations to the engine and carries out the actions it fires."""

    def __init__(self, inventory: Inventory, catalog: Catalog, poll_interval: float) -> None:
        self.inventory = inventory
        self.catalog = catalog
        self.poll_interval = poll_interval
        self.overrides: dict[str, dict[str, str]] = {}
        self.drivers: dict[str, PowerDriver] = {}
        self.errors: dict[str, str] = {}
        self.assigned: dict[str, str] = {}  # node -> image digest its agent is told to run
        self.engine = Engine(Graph(VARIABLES, mutations()), self.act, on_write=self._concluded)
        for node in inventory.nodes.values():
            self._add(node)
        inventory.on_change = self.observed
        inventory.instructions = self.instructions

    @property
    def managed(self) -> list[Node]:
        return [n for n in self.inventory.nodes.values() if n.config.name in self.drivers]

    def _add(self, node: Node) -> None:
        if node.config.bmc is not None:  # else not under layerpy's power control
            self.drivers[node.name] = make_driver(node.name, node.config.bmc)
        self.engine.add_node(node.name, desired(node.config), self._dsc(node))

    def _dsc(self, node: Node) -> dict[str, str]:
        return {"power": node.power, "run": str(node.run_state), "busy": node.busy,
                "image": self._image_state(node)}  # fmt: skip

    def _image_state(self, node: Node) -> str:
        state = node.image_state
        wanted = self.catalog.digest(self.image_of(node))
        if state == "active" and wanted is not None and node.image_digest != wanted:
            return "stale"
        return state

    # -- observations ------------------------------------------------------------------

    def _concluded(self, name: str, values: dict[str, str]) -> None:
        """The engine's own conclusions (a node hangs; a run state is forgotten), mirrored
        so the API shows them and a BMC poll saying "on" does not undo a hang."""
        node = self.inventory.nodes[name]
        if "power" in values:
            node.power = values["power"]
        if values.get("run") == "unknown":
            self.inventory.forget(node, "forgotten on a power change")
            self.assigned.pop(name, None)

    def observed(self, node: Node) -> None:
        """The inventory saw a change (run state, busy, image) on a node."""
        self.engine.observe(node.name, run=str(node.run_state), busy=node.busy,
                            image=self._image_state(node))  # fmt: skip

    def image_ready(self, name: str) -> None:
        """An image has a new digest (first pull, or a moved tag after a reload)."""
        for node in self.inventory.nodes.values():
            if self.image_of(node) == name:
                self.observed(node)

    def instructions(self, node: Node) -> dict[str, Any]:
        """What the agent is told in the answer to its report: the image to run."""
        digest = self.assigned.get(node.name)
        name = self.image_of(node)
        spec = (
            self.catalog.spec(name, digest, self.inventory.config.server.url)
            if name and digest
            else None
        )
        return {"image": spec}

    def saw_power(self, node: Node, state: str) -> None:
        # hang is the engine's own conclusion about a node that is "on": a BMC saying
        # "on" again does not clear it; only a change of state does.
        if node.power == "hang" and state == "on":
            return
        if state == "off" and node.run_state is not RunState.UNKNOWN:
            self.inventory.forget(node, "powered off")
        if node.power != state:
            log.info("%s: power %s -> %s", node.name, node.power, state)
        node.power = state
        self.engine.observe(node.name, power=state)

    async def _poll(self, node: Node) -> None:
        try:
            state = await self.drivers[node.name].status()
        except Exception as error:  # any driver failure is this node's error, not ours
            self._failed(node, error)
            return
        self.errors.pop(node.name, None)
        self.saw_power(node, state)

    def _failed(self, node: Node, error: BaseException) -> None:
        reason = str(error) if isinstance(error, PowerError) else f"{type(error).__name__}: {error}"
        if self.errors.get(node.name) != reason:
            log.error("%s: %s", node.name, reason)
        self.errors[node.name] = reason
        node.power = "error"
        self.engine.observe(node.name, power="error")

    async def watch(self) -> None:
        """Poll every BMC each interval, in one batch; a BMC still busy with the last
        poll (a dead one takes seconds to time out) is skipped, so it delays no one."""
        polling: dict[str, asyncio.Task[None]] = {}
        while True:
            for node in self.managed:
                if node.name not in polling:
                    task = asyncio.create_task(self._poll(node))
                    polling[node.name] = task
                    task.add_done_callback(lambda _, name=node.name: polling.pop(name, None))
            await asyncio.sleep(self.poll_interval)

    # -- actions -----------------------------------------------------------------------

    async def act(self, name: str, action: str) -> None:
        """Carry out one action the engine fired; errors propagate to the engine."""
        node = self.inventory.nodes[name]
        if action == "image_assign":
            wanted = self.image_of(node)
            image = self.catalog.current(wanted or "")
            self.assigned[name] = image.digest
            images_log.info("%s: assigned image %s %s", name, wanted, image.digest[:19])
            return
        driver = self.drivers[name]
        log.info("%s: %s", name, action.replace("_", " "))
        try:
            if action == "power_on":
                await driver.boot_network_once()
                await driver.on()
                self.saw_power(node, "on")
            elif action == "power_off":
                await driver.off()
                self.saw_power(node, "off")
            elif action == "power_cycle":
                await driver.boot_network_once()
                await driver.cycle()
                node.power = "on"
                self.engine.observe(name, power="on")
            elif action == "power_status":
                self.saw_power(node, await driver.status())
            else:
                raise ValueError(f"unknown action {action!r}")
        except PowerError as error:
            self.errors[name] = str(error)
            raise
        self.errors.pop(name, None)

    # -- desired state -----------------------------------------------------------------

    def image_of(self, node: Node) -> str | None:
        """The image a node should run: a run-time override, else the file's."""
        return self.overrides.get(node.name, {}).get("image", node.config.image)

    def override(self, name: str, power: str | None) -> None:
        """A runtime override of desired power (None clears all overrides of the node);
        lasts until cleared or the file changes."""
        node = self.inventory.nodes[name]
        if power is None:
            self.overrides.pop(name, None)
        else:
            self.overrides.setdefault(name, {})["power"] = power
        log.info("%s: desired power %s%s", name, power or node.config.power,
                 " (override)" if power else " (from the file)")  # fmt: skip
        self._wish_changed(node)

    def override_image(self, name: str, image: str) -> None:
        """Run `image` on the node until cleared or the file changes (a rolling update)."""
        if image not in self.catalog.entries:
            raise ValueError(f"no image named {image!r} in the node file")
        self.overrides.setdefault(name, {})["image"] = image
        images_log.info("%s: desired image %s (override)", name, image)
        self._wish_changed(self.inventory.nodes[name])

    def _wish_changed(self, node: Node) -> None:
        self.engine.set_cfg(node.name, **desired(node.config, self.overrides.get(node.name)))
        self.observed(node)  # whether its running image is still the wanted one

    def desired_of(self, name: str) -> dict[str, str | None]:
        return desired(self.inventory.nodes[name].config, self.overrides.get(name))

    async def cycle(self, name: str) -> None:
        """An operator's one-off power cycle (not a change of desired state)."""
        if name not in self.drivers:
            return
        try:
            await self.act(name, "power_cycle")
        except PowerError as error:
            self._failed(self.inventory.nodes[name], error)

    # -- reading -----------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        node = self.inventory.nodes[name]
        entry = self.catalog.entries.get(self.image_of(node) or "")
        return {
            "location": node.location,  # evidence: source, switch, port, chassis, MAC, when
            "conflict": node.conflict,
            "image_wanted": self.image_of(node),
            "image_problem": entry.error if entry else None,
            "power": node.power,
            "desired": self.desired_of(name).get("power"),
            "override": name in self.overrides,
            "controlled": name in self.drivers,
            "error": self.errors.get(name),
        }

    def plan(self, name: str) -> dict[str, Any]:
        node = self.inventory.nodes[name]
        return {
            "name": name,
            "dsc": self._dsc(node),
            "cfg": {k: v for k, v in self.desired_of(name).items() if v is not None},
            "path": self._path(name),
        }

    def _path(self, name: str) -> list[str] | str:
        try:
            return self.engine.plan(name)
        except NoPath as blocked:
            return f"blocked: {blocked}"

    def explain(self, name: str) -> dict[str, Any]:
        return {"name": name, **self.status(name), **self.engine.explain(name)}

    async def applied(self, config: Config, added: set[str], removed: set[str],
                      changed: set[str]) -> None:  # fmt: skip
        """A reloaded file: overrides end, changed nodes get their new cfg and drivers."""
        if added or removed or changed:
            self.overrides.clear()
        for name in removed | changed:
            self.engine.remove_node(name)
            driver = self.drivers.pop(name, None)
            if driver is not None:
                await driver.close()
        for name in added | changed:
            self._add(self.inventory.nodes[name])
        for name in config.nodes:
            self.engine.set_cfg(name, **desired(config.nodes[name]))
            self.observed(self.inventory.nodes[name])  # the wanted digest may differ now

    async def close(self) -> None:
        for driver in self.drivers.values():
            await driver.close()
