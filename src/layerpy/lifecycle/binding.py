"""The state engine bound to the world: the node store's changes in, actions out.

The store is the only holder of what is observed: the engine reads a node's values from
its fields (``dsc``), and records its own conclusions there (``NodeStore.conclude``). One
subscription to the store's change feed tells the engine when to read again; BMC polls and
actions report to the store like every other observer. What is *desired* (the file, and
run-time overrides from operators) is kept here, and published on the same feed. Every
action on a node passes one gate, ``held``: the fence, when there is one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Set
from typing import TYPE_CHECKING, Any

from layerpy.catalog import Catalog
from layerpy.config import Config
from layerpy.engine import Engine, Graph, NoPath
from layerpy.files import Deliveries, RenderError
from layerpy.lifecycle.actions import ACTIONS
from layerpy.lifecycle.fence import Fence, Fenced
from layerpy.lifecycle.table import BOOT_TIMEOUT, VARIABLES, desired, mutations
from layerpy.logs import Throttle
from layerpy.model import ImageState, Node, PowerState, RunState
from layerpy.nodes import GAP, NodeStore
from layerpy.nodes.backend import ASSIGNED, OVERRIDES, Backend, Record
from layerpy.nodes.store import VARIABLE_FIELDS
from layerpy.power import PowerDriver, PowerError, close_all, make_driver
from layerpy.power.poller import Poller
from layerpy.proto.agent import FilesSpec, ImageSpec
from layerpy.proto.platform import DEFAULT as DEFAULT_PLATFORM
from layerpy.turns import in_turns

if TYPE_CHECKING:
    from layerpy.stats import Stats

log = logging.getLogger("layerpy.power")
images_log = logging.getLogger("layerpy.images")
files_log = Throttle(logging.getLogger("layerpy.files"))  # may fail at every report

# node fields the engine's variables are read from (the image digest tells "stale")
ENGINE_FIELDS = frozenset({*VARIABLE_FIELDS.values(), "image_digest"})
CLOSE_TIMEOUT = 3.0  # seconds for all power drivers to log out at shutdown


class Lifecycle:
    def __init__(
        self,
        store: NodeStore,
        backend: Backend,
        catalog: Catalog,
        poll_interval: float,
        stats: Stats | None = None,
        fence: Fence | None = None,
    ) -> None:
        """``backend``: the store's, where image assignments and overrides are kept (in a
        cluster, shared: what the owner's engine assigned is what any instance's answers to
        that node's agent carry). ``fence``: whether this instance may act on a node now
        (None: always, as a single server may); call ``fence_changed()`` when its answers
        may have changed."""
        self.store = store
        self.backend = backend
        self.fence = fence
        self.catalog = catalog
        self.overrides: dict[str, dict[str, str]] = {}
        self.drivers: dict[str, PowerDriver] = {}
        # node -> (image name, digest) its agent is told to run, until the engine assigns
        # another: a node whose wanted image fails to pull stays on this one. Kept across
        # restarts: a restarted server that told a running node "no image" would stop it.
        self.assigned = self._load_assigned()
        backend.on_change(self._changed_elsewhere)
        self.deliveries = Deliveries()
        server = store.config.server  # its keys are fixed until a restart
        # a node a restarted server has not heard from yet reports within a heartbeat
        table = mutations(max(BOOT_TIMEOUT, 2 * server.heartbeat))
        missing = {m.action for m in table if m.action and m.action not in ACTIONS}
        if missing:
            raise ValueError(f"the lifecycle table names unknown actions: {sorted(missing)}")
        rate = server.power_on_rate
        paces = {name: 1 / rate for name, action in ACTIONS.items() if action.boots and rate}
        self.engine = Engine(Graph(VARIABLES, table), self.act, observed=self._observed,
                             conclude=store.conclude, hold=self.held, on_action=self._published,
                             paces=paces)  # fmt: skip
        self.poller = Poller(self.drivers, self._polled, poll_interval, stats=stats)
        self.changes = store.feed.subscribe()  # before anything can change
        for node in store.nodes.values():
            self._add(node)
        if backend.instance is not None:  # overrides made through other instances
            for name, record in backend.load(OVERRIDES).items():
                self._changed_elsewhere(OVERRIDES, name, record)

    def _published(self, name: str, fields: dict[str, str]) -> None:
        """An action fired or ended: on the change feed (the event stream, the dashboard)."""
        why = f": {fields['why']}" if "why" in fields else ""
        message = f"{fields['mutation']} {fields['result']}{why}"
        self.store.feed.publish(name, "action", fields, message)

    def _add(self, node: Node) -> None:
        if node.config.bmc is not None:  # else not under layerpy's power control
            self.drivers[node.name] = make_driver(node.name, node.config.bmc)
        self.engine.add_node(node.name, desired(node.config))

    def _observed(self, name: str) -> dict[str, str]:
        """The engine's reader: a node's dsc from the store's fields (a node a reload has
        just removed reads as all unknown, until the engine hears of it too)."""
        node = self.store.nodes.get(name)
        return {} if node is None else self.dsc(node)

    def dsc(self, node: Node) -> dict[str, str]:
        values = {var: getattr(node, field) for var, field in VARIABLE_FIELDS.items()}
        values["image"] = self._image_state(node)
        return values

    def _image_state(self, node: Node) -> str:
        if node.image_state != ImageState.ACTIVE:
            return node.image_state
        wanted = self.catalog.digest(self.image_of(node.name), self.platform_of(node.name))
        return ImageState.STALE if wanted and node.image_digest != wanted else node.image_state

    def _observe(self, name: str) -> None:
        if name in self.store.nodes and self.engine.has(name):
            self.engine.news(name)

    # -- continuous work ---------------------------------------------------------------

    async def run(self) -> None:
        """The engine, the BMC polls and the change feed, until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.engine.run())
            tasks.create_task(self.poller.run())
            tasks.create_task(self.follow())

    async def follow(self) -> None:
        """Tell the engine what the store observed; a catalog change re-reads the nodes
        that want that image (whether what they run is still the wanted digest). A node's
        agent facts name its platform: its images are pulled for it from its hello on."""
        async for change in self.changes:
            if change is not GAP and change.kind == "observed" and "agent" in change.fields:
                self.catalog.want(self.platform_of(change.node))
            if change is GAP:
                for name in self.store.nodes:
                    self._observe(name)
            elif change.kind == "image":
                for name in self.store.nodes:
                    if self.image_of(name) == change.fields.get("image"):
                        self._observe(name)
            elif change.kind == "observed" and ENGINE_FIELDS & change.fields.keys():
                forgotten = change.fields.get("run_state") == RunState.UNKNOWN
                if forgotten and self.held(change.node) is None:  # the acting instance's
                    self.assign(change.node, None)  # a new boot is told afresh
                self._observe(change.node)

    def _polled(self, name: str, state: str | None, error: str | None) -> None:
        self.store.saw_power(name, None if state is None else PowerState(state), error)

    def held(self, name: str) -> str | None:
        """The one gate every action on a node passes: why this instance may not act on it
        now (None: it may)."""
        fence = self.fence
        if fence is None or fence.allows(name):
            return None
        return fence.why_not(name) or "the fence is closed"

    def fence_changed(self) -> None:
        """The fence may answer differently now: the nodes it held are looked at again."""
        self.engine.release()

    async def act(self, name: str, action: str) -> None:
        """Carry out one action (the engine's, or an operator's) unless the fence holds the
        node (``Fenced``); errors propagate to the engine."""
        if (why := self.held(name)) is not None:
            raise Fenced(f"{name}: {action} not done: {why}")
        try:
            await ACTIONS[action].run(self, name)
        except PowerError as error:
            self.store.saw_power(name, None, str(error))
            raise

    async def close(self) -> None:
        self.changes.close()
        await close_all(self.drivers.values(), CLOSE_TIMEOUT)

    # -- what the agents are told to run ----------------------------------------------

    def assign(self, name: str, image: tuple[str, str] | None) -> None:
        """Tell the node's agent to run (image name, digest) from its next answer on (None:
        nothing yet, as for a new boot); kept through the backend before the answer can
        say it."""
        if not self._assign(name, image):
            return
        wanted, digest = image or (None, None)
        try:
            self.backend.put(ASSIGNED, name, {"image": wanted, "digest": digest})
        except OSError as error:
            images_log.error("cannot save the image assigned to %s: %s", name, error.strerror)

    def _assign(self, name: str, image: tuple[str, str] | None) -> bool:
        """Whether that is news."""
        if self.assigned.get(name) == image:
            return False
        if image is None:
            del self.assigned[name]
        else:
            self.assigned[name] = image
        return True

    def _load_assigned(self) -> dict[str, tuple[str, str]]:
        found: dict[str, tuple[str, str]] = {}
        for name, record in self.backend.load(ASSIGNED).items():
            image = _assignment(record)
            if name in self.store.nodes and image is not None:
                found[name] = image
        return found

    def _changed_elsewhere(self, kind: str, name: str, record: Record | None) -> None:
        """Another instance's engine assigned an image, or an operator overrode a node's
        wish through another instance (the backend's ``on_change``): taken, not written
        back."""
        if name not in self.store.nodes:
            return
        if kind == ASSIGNED:
            self._assign(name, None if record is None else _assignment(record))
        elif kind == OVERRIDES:
            wish = {k: v for k, v in (record or {}).items()
                    if k in ("power", "image") and isinstance(v, str)}  # fmt: skip
            if wish != self.overrides.get(name, {}):
                if wish:
                    self.overrides[name] = wish
                else:
                    self.overrides.pop(name, None)
                self._wish_changed(name)

    # -- desired state -----------------------------------------------------------------

    def image_of(self, name: str) -> str | None:
        """The image a node should run: a run-time override, else the file's."""
        node = self.store.nodes.get(name)
        file_image = node.config.image if node else None
        return self.overrides.get(name, {}).get("image", file_image)

    def platform_of(self, name: str) -> str:
        """The node's OCI platform as its agent reports it (linux/amd64 until it has, and
        for agents older than protocol 1.3): which image of a multi-architecture index."""
        node = self.store.nodes.get(name)
        return (node.agent.get("platform") if node else None) or DEFAULT_PLATFORM

    def image_spec(self, name: str) -> ImageSpec | None:
        """What the node's agent is told to run: the image the engine assigned it."""
        if name not in self.assigned:
            return None
        image, digest = self.assigned[name]
        return self.catalog.spec(image, digest, self.store.config.server.url)

    def files_spec(self, name: str) -> FilesSpec | None:
        """The node's files, for the image its agent is told to run (they change with it);
        None when they cannot be made now (the agent keeps the ones it has)."""
        image = self.assigned[name][0] if name in self.assigned else None
        try:
            return self.deliveries.spec(self.store.config, name, image)
        except RenderError as error:
            files_log.log("not delivered", logging.ERROR, "%s: files not delivered: %s", name,
                          error)  # fmt: skip
            return None

    def answer_basis(self, name: str) -> tuple[object, ...]:
        """What the node's answer is made of (its image and files, each made once and kept;
        its own part of the node file): a beat compares it with what the node was last told
        (``services.beats``), so a reload that changes nothing of the node's answer costs
        no full report of it."""
        return (self.store.config.nodes[name], self.image_spec(name), self.files_spec(name))

    def file_content(self, name: str, digest: str) -> bytes | None:
        """The bytes of one of the node's files, by digest; None when it has no such file."""
        spec = self.files_spec(name)
        return None if spec is None else self.deliveries.content(spec, digest)

    def desired_of(self, name: str) -> dict[str, str | None]:
        return desired(self.store.nodes[name].config, self.overrides.get(name))

    def _wish_changed(self, name: str) -> None:
        wish = self.desired_of(name)
        self.engine.set_cfg(name, **wish)
        self.store.feed.publish(name, "desired", {k: v for k, v in wish.items() if v})
        self._observe(name)  # whether its running image is still the wanted one

    def override(self, name: str, power: str | None) -> None:
        """A runtime override of desired power (None clears all overrides of the node);
        lasts until cleared or the file changes."""
        if power is None:
            self.overrides.pop(name, None)
        else:
            self.overrides.setdefault(name, {})["power"] = power
        self._share_override(name)
        source = " (override)" if power else " (from the file)"
        log.info("%s: desired power %s%s", name, power or self.store.nodes[name].config.power,
                 source)  # fmt: skip
        self._wish_changed(name)

    def override_image(self, name: str, image: str) -> None:
        """Run `image` on the node until cleared or the file changes (a rolling update)."""
        if image not in self.catalog.entries:
            raise ValueError(f"no image named {image!r} in the node file")
        self.overrides.setdefault(name, {})["image"] = image
        self._share_override(name)
        images_log.info("%s: desired image %s (override)", name, image)
        self._wish_changed(name)

    def _share_override(self, name: str) -> None:
        """In a cluster, an operator's override reaches the instance that acts on the node
        (a single server keeps overrides in memory only, as before: a restart ends them)."""
        if self.backend.instance is not None:
            self.backend.put(OVERRIDES, name, dict(self.overrides.get(name, {})))

    async def cycle(self, name: str) -> None:
        """An operator's one-off power cycle (not a change of desired state)."""
        if name in self.drivers:
            try:
                await self.act(name, "power_cycle")
            except PowerError:  # recorded on the node by act()
                pass
            except Fenced as held:
                log.warning("%s", held)

    async def applied(self, config: Config, added: Set[str], removed: Set[str],
                      changed: Set[str]) -> None:  # fmt: skip
        """A reloaded file: overrides end, changed nodes get their new cfg and drivers.

        The work is the changed nodes' and the overridden ones', not the file's: the others'
        wish (their config) is the same. Removed and added nodes leave and join the engine
        in one step, as they do the store; the others are told in turns. Half-way, a node
        not yet told follows its old wish (and BMC) a moment longer, as if the reload had
        come that much later for it: the store serves its new config meanwhile, and no
        node is missing from the engine."""
        ended: set[str] = set()
        if added or removed or changed:
            ended = set(self.overrides) - removed
            self.overrides.clear()
            for name in ended:  # every instance ends them: the same record, written again
                self._share_override(name)
        old_drivers = []
        for name in removed:
            self.assign(name, None)  # a changed node runs its image until told anew
            old_drivers += self._remove(name)
        for name in added:
            self._add(self.store.nodes[name])
        async for name in in_turns(added | changed | ended):
            if name in changed:
                old_drivers += self._remove(name)
                self._add(self.store.nodes[name])
            self._wish_changed(name)
        for driver in old_drivers:
            await driver.close()

    def _remove(self, name: str) -> list[PowerDriver]:
        """The node out of the engine; its power driver, to be closed, if it had one."""
        self.engine.remove_node(name)
        driver = self.drivers.pop(name, None)
        return [] if driver is None else [driver]

    # -- reading -----------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        node = self.store.nodes[name]
        entry = self.catalog.entry(self.image_of(name), self.platform_of(name))
        files = self.files_spec(name)
        return {
            "location": node.location,  # evidence: source, switch, port, chassis, MAC, when
            "conflict": node.conflict,
            "binding": node.binding,  # the last change of its machine (replaced hardware)
            "rebind_pending": node.rebind_pending,  # a new machine waiting for `layerpy bind`
            "problem": node.problem,
            "console": node.console_problem,
            # the file's wish (the signed path only) and the firmware's word, by its agent
            "secure_boot": {"wanted": node.config.secure_boot, "reported": node.secure_boot},
            "image_wanted": self.image_of(name),
            "image_problem": entry.error if entry else None,
            "files": {  # the revision in place on the node, and the one it should have
                "running": node.files_revision,
                "wanted": files.revision if files else None,
                "error": node.files_error,
            },
            "power": node.power,
            "desired": self.desired_of(name).get("power"),
            "override": name in self.overrides,
            "controlled": name in self.drivers,
            "error": node.power_error,
        }

    def plan(self, name: str) -> dict[str, Any]:
        node = self.store.nodes[name]
        try:
            path: list[str] | str = self.engine.plan(name)
        except NoPath as blocked:
            path = f"blocked: {blocked}"
        return {
            "name": name,
            "dsc": self.dsc(node),
            "cfg": {k: v for k, v in self.desired_of(name).items() if v is not None},
            "path": path,
        }

    def explain(self, name: str) -> dict[str, Any]:
        return {"name": name, **self.status(name), **self.engine.explain(name)}


def _assignment(record: Record) -> tuple[str, str] | None:
    """(image, digest) of an ASSIGNED record; None: the node was told none."""
    image, digest = record.get("image"), record.get("digest")
    return (image, digest) if isinstance(image, str) and isinstance(digest, str) else None
