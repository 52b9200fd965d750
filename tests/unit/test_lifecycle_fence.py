"""The fence in front of every action the lifecycle takes: a held node is not acted on
(neither by the engine nor by an operator), says so once in explain and on the event
stream, and is acted on again when the fence opens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from layerpy.catalog import Catalog
from layerpy.images import ImageStore
from layerpy.lifecycle import Lifecycle
from layerpy.model import PowerState
from layerpy.power import NoneDriver

from stores import local_store

CN009 = '\n[nodes.cn009]\nip = "10.99.0.19"\nbmc = { driver = "none" }\n'


class CountingBmc(NoneDriver):
    """A BMC that writes down every command that changes power, as the lab BMCs log; it
    carries out a power on when ``answer`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "off"
        self.commands: list[str] = []
        self.answer = asyncio.Event()
        self.answer.set()

    async def on(self) -> None:
        self.commands.append("on")
        await self.answer.wait()
        await super().on()

    async def off(self) -> None:
        self.commands.append("off")
        await super().off()

    async def cycle(self) -> None:
        self.commands.append("cycle")
        await super().cycle()


class FlipFence:
    """Closed for the nodes in ``closed``, with the reason given there."""

    def __init__(self) -> None:
        self.closed: dict[str, str] = {}

    def allows(self, name: str) -> bool:
        return name not in self.closed

    def why_not(self, name: str) -> str | None:
        return self.closed.get(name)


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.005)


def fenced(config) -> tuple[Lifecycle, FlipFence, CountingBmc]:
    store = local_store(config)
    catalog = Catalog(ImageStore(store.config.server.state_dir / "images"), store.feed)
    fence = FlipFence()
    lifecycle = Lifecycle(store, store.backend, catalog, poll_interval=3600, fence=fence)
    bmc = lifecycle.drivers["cn009"] = CountingBmc()
    return lifecycle, fence, bmc


def test_a_fenced_node_is_not_acted_on_until_the_fence_opens(make_config) -> None:
    async def scenario() -> None:
        lifecycle, fence, bmc = fenced(make_config(more=CN009))
        store = lifecycle.store
        fence.closed["cn009"] = "owned by instance b"
        running = asyncio.create_task(lifecycle.run())
        store.saw_power("cn009", PowerState.OFF)  # wanted on: the engine would power it on
        await until(lambda: lifecycle.explain("cn009")["held"] == "owned by instance b",
                    "cn009 held by the fence")  # fmt: skip
        lifecycle.override("cn009", "on")  # news, looked at again: still held, not re-told
        await lifecycle.cycle("cn009")  # an operator's action passes the same gate
        lifecycle.fence_changed()  # still closed
        await asyncio.sleep(0.05)
        assert bmc.commands == []
        info = lifecycle.explain("cn009")
        assert info["current"] is None and info["failures"] == [] and info["power"] == "off"
        assert lifecycle.engine.stats()["held"] == 1
        del fence.closed["cn009"]
        lifecycle.fence_changed()
        await until(lambda: store.nodes["cn009"].power == PowerState.ON, "cn009 powered on")
        assert bmc.commands == ["on"] and lifecycle.explain("cn009")["held"] is None
        changes = store.feed.history
        held = [c for c in changes if c.kind == "action" and c.fields["result"] == "held"]
        assert [(c.node, c.fields["mutation"], c.message) for c in held] == [
            ("cn009", "power.on", "power.on held: owned by instance b")
        ]
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await lifecycle.close()

    asyncio.run(scenario())


def test_a_power_on_sent_before_the_fence_closed_is_sent_once(make_config) -> None:
    """One decision, at most one power command: closing and opening the fence while the
    BMC works on it sends nothing again."""

    async def scenario() -> None:
        lifecycle, fence, bmc = fenced(make_config(more=CN009))
        store = lifecycle.store
        bmc.answer.clear()  # the BMC takes its time
        running = asyncio.create_task(lifecycle.run())
        store.saw_power("cn009", PowerState.OFF)
        await until(lambda: bmc.commands == ["on"], "power on sent to cn009's BMC")
        for _ in range(3):
            fence.closed["cn009"] = "etcd lease lost"
            lifecycle.fence_changed()
            await asyncio.sleep(0.02)
            del fence.closed["cn009"]
            lifecycle.fence_changed()
            await asyncio.sleep(0.02)
        fence.closed["cn009"] = "etcd lease lost"
        bmc.answer.set()  # the machine comes on: the next step is held
        await until(lambda: lifecycle.explain("cn009")["held"] == "etcd lease lost",
                    "cn009's next step held")  # fmt: skip
        info = lifecycle.explain("cn009")
        assert bmc.commands == ["on"] and info["power"] == "on" and info["failures"] == [], info
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await lifecycle.close()

    asyncio.run(scenario())
