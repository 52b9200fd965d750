"""The state engine: path search, and nodes driven through a fake world on a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

import pytest

from layerpy.engine import Engine, Graph, Mutation, NoPath, Variable


def lifecycle_example() -> Graph:
    """A representative lifecycle table (the real one is declared by the server)."""
    variables = [
        Variable("power", ("unknown", "off", "on", "hang", "error")),
        Variable("run", ("unknown", "booting", "init", "ready", "lost", "error")),
        Variable("busy", ("unknown", "free", "busy")),
    ]
    mutations = [
        Mutation("power.on", {"power": ("off", "on")}, action="power_on", timeout=30,
                 fail_to={"power": "error"}),
        Mutation("power.off", {"power": ("on", "off")}, excludes={"busy": {"busy"}},
                 forgets=("run",), action="power_off", timeout=30, fail_to={"power": "error"}),
        Mutation("power.cycle", {"power": ("hang", "on")}, forgets=("run",),
                 action="power_cycle", timeout=30),
        # To the default: "find out". Done by whatever status is observed next.
        Mutation("power.retry", {"power": ("error", "unknown")}, action="power_status",
                 timeout=10, cost=10),
        # From any run value, so that booting/init reports along the way stay on course.
        Mutation("boot.wait", {"run": ("*", "ready")}, requires={"power": {"on"}}, timeout=120,
                 fail_to={"power": "hang"}),
        Mutation("boot.recover", {"run": ("lost", "ready")}, requires={"power": "on"},
                 timeout=10, fail_to={"power": "hang"}, cost=0.5),
    ]  # fmt: skip
    return Graph(variables, mutations)


OFF = {"power": "off", "run": "unknown", "busy": "free"}
UP = {"power": "on", "run": "ready", "busy": "free"}
WANT_UP = {"power": "on", "run": "ready"}


def names(mutations: list[Mutation]) -> list[str]:
    return [m.name for m in mutations]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class World:
    """A fake clock, a fake store of observed values (the engine reads them from there and
    concludes into it), and a fake ``act`` that records calls and plays scripted effects."""

    def __init__(self, **engine_options) -> None:
        self.clock = Clock()
        self.calls: list[tuple[str, str]] = []
        self.effects: dict[str, dict[str, str] | Exception] = {}
        self.hung: set[str] = set()  # actions that never return, like a BMC that hangs
        self.stuck: dict[str, asyncio.Future[None]] = {}  # node -> its hung action, to end
        self.facts: dict[str, dict[str, str]] = {}
        self.written: list[tuple[str, dict[str, str]]] = []  # what the engine concluded
        self.engine = Engine(lifecycle_example(), self.act, observed=self.facts.__getitem__,
                             conclude=self.conclude, clock=self.clock, **engine_options)  # fmt: skip

    def add(self, node: str, cfg: dict[str, str | None], dsc: dict[str, str]) -> None:
        self.facts[node] = dict(dsc)
        self.engine.add_node(node, cfg)

    def observe(self, node: str, **values: str) -> None:
        """An observer writes to the store, whose feed tells the engine."""
        self.facts[node].update(values)
        self.engine.news(node)

    def conclude(self, node: str, values: dict[str, str]) -> None:
        self.written.append((node, values))
        self.facts[node].update(values)

    async def act(self, node: str, action: str) -> None:
        self.calls.append((node, action))
        if action in self.hung:
            self.stuck[node] = asyncio.get_running_loop().create_future()
            await self.stuck[node]
        effect = self.effects.get(action)
        if isinstance(effect, Exception):
            raise effect
        if effect:
            self.observe(node, **effect)

    async def settle(self, advance: float = 0.0) -> None:
        """Move the clock, then step and let action tasks run until things are quiet."""
        self.clock.now += advance
        for _ in range(6):
            self.engine.step()
            while self.engine.pending():  # a busy machine can cut a pass short
                self.engine.step()
            await asyncio.sleep(0)

    def explain(self, node: str = "cn1") -> dict:
        return self.engine.explain(node)


def scenario(test):
    """Run an async test on a fresh loop (no pytest-asyncio here)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


# -- path search ----------------------------------------------------------------------


def test_path_is_cheapest_and_honours_dont_care():
    graph = lifecycle_example()
    assert names(graph.path(OFF, WANT_UP)) == ["power.on", "boot.wait"]
    assert names(graph.path({**UP, "run": "lost"}, WANT_UP)) == ["boot.recover"]
    assert names(graph.path({**OFF, "power": "hang"}, WANT_UP)) == ["power.cycle", "boot.wait"]
    assert names(graph.path({**OFF, "run": "ready"}, {"power": "on"})) == ["power.on"]
    # Nothing leads from error to on: the plan ends by finding the power state out.
    assert names(graph.path({**OFF, "power": "error"}, {"power": "on"})) == ["power.retry"]


def test_path_when_there_is_empty_and_memoised():
    graph = lifecycle_example()
    assert graph.path(UP, WANT_UP) == []
    assert graph.path(UP, {}) == []
    state, goal = graph.state(OFF), graph.goal(WANT_UP)
    assert graph.steps(state, goal) is graph.steps(graph.state(OFF), graph.goal(WANT_UP))


def test_unreachable_target_says_why():
    graph = lifecycle_example()
    with pytest.raises(NoPath, match="no mutations lead from run=unknown to run=booting"):
        graph.path(OFF, {"run": "booting"})
    with pytest.raises(NoPath, match="power=unknown to power=on"):
        graph.path({}, {"power": "on"})
    with pytest.raises(NoPath, match=r"power\.off is blocked by busy=busy"):
        graph.path({**UP, "busy": "busy"}, {"power": "off"})


def test_declarations_are_validated():
    power = Variable("power", ("unknown", "off", "on"))
    with pytest.raises(ValueError, match="mutation 'x': unknown variable 'pwr'"):
        Graph([power], [Mutation("x", {"pwr": ("off", "on")})])
    with pytest.raises(
        ValueError, match=r"mutation 'x': power has no value 'up' \(values: unknown, off, on\)"
    ):
        Graph([power], [Mutation("x", {"power": ("off", "up")})])
    with pytest.raises(ValueError, match="mutation 'x': power has no value 'hang'"):
        Graph([power], [Mutation("x", {"power": ("off", "on")}, fail_to={"power": "hang"})])
    with pytest.raises(ValueError, match="changed variable cannot also be guarded"):
        Graph([power], [Mutation("x", {"power": ("off", "on")}, requires={"power": "off"})])
    with pytest.raises(ValueError, match="declared twice"):
        Graph([power], [Mutation("x", {"power": ("off", "on")})] * 2)
    with pytest.raises(ValueError, match="default 'unknown' is not a value"):
        Variable("power", ("off", "on"))
    with pytest.raises(ValueError, match="changes nothing"):
        Mutation("x", {})
    graph = Graph([power], [])
    with pytest.raises(ValueError, match="power has no value 'up'"):
        graph.state({"power": "up"})


# -- driving nodes --------------------------------------------------------------------


@scenario
async def test_advance_fires_next_edge_when_the_change_is_observed(caplog):
    caplog.set_level(logging.INFO, "layerpy.engine")
    world = World()
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    assert world.calls == [("cn1", "power_on")]
    assert world.explain()["current"] == {
        "mutation": "power.on", "action": "power_on", "status": "waiting",
        "elapsed": 0.0, "deadline": 30.0,
    }  # fmt: skip
    assert world.engine.plan("cn1") == ["power.on", "boot.wait"]

    world.clock.now += 2.1
    world.observe("cn1", power="on")
    await world.settle()
    assert world.explain()["current"]["mutation"] == "boot.wait"
    world.observe("cn1", run="booting")  # on course: no change of plan
    world.clock.now += 5
    world.observe("cn1", run="ready")
    await world.settle()
    info = world.explain()
    assert info["converged"] and info["current"] is None and info["plan"] == []
    assert world.engine.stats() == {
        "nodes": 1, "actions": 0, "converged": 1, "in_flight": 0, "blocked": 0,
        "gave_up": 0, "held": 0, "failures": 0,
    }  # fmt: skip
    assert caplog.messages == [
        "cn1: fire power.on",
        "cn1: power.on done in 2.1 s",
        "cn1: fire boot.wait",
        "cn1: boot.wait done in 5.0 s",
    ]


@scenario
async def test_surprise_cancels_and_replans(caplog):
    caplog.set_level(logging.INFO, "layerpy.engine")
    world = World()
    world.hung.add("power_on")
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    world.observe("cn1", power="hang")  # neither off nor on: power.on is moot
    await world.settle()
    assert "cn1: power.on interrupted by power=hang, re-planning" in caplog.messages
    assert world.calls == [("cn1", "power_on"), ("cn1", "power_cycle")]
    assert world.explain()["current"]["mutation"] == "power.cycle"
    assert world.explain()["failures"] == []
    assert world.engine.stats()["actions"] == 0  # the hung power_on was cancelled


@scenario
async def test_broken_requirement_is_a_surprise():
    world = World()
    world.add("cn1", WANT_UP, {**UP, "run": "unknown"})
    await world.settle()
    assert world.explain()["current"]["mutation"] == "boot.wait"
    world.observe("cn1", power="off")  # boot.wait requires power=on
    await world.settle()
    assert world.explain()["current"]["mutation"] == "power.on"


@scenario
async def test_unrelated_observation_keeps_course():
    world = World()
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    world.observe("cn1", busy="busy")
    await world.settle(1)
    current = world.explain()["current"]
    assert current["mutation"] == "power.on" and current["deadline"] == 29.0
    assert world.calls == [("cn1", "power_on")]


@scenario
async def test_timeout_falls_to_fail_to_and_recovers_by_cycling(caplog):
    world = World()
    world.effects["power_cycle"] = {"power": "on"}
    world.add("cn1", WANT_UP, {**UP, "run": "unknown"})
    await world.settle()
    assert world.explain()["current"]["mutation"] == "boot.wait"
    await world.settle(119)
    assert world.explain()["current"]["deadline"] == 1.0
    await world.settle(1)
    info = world.explain()
    assert info["dsc"]["power"] == "hang"
    assert info["failures"] == [
        {"mutation": "boot.wait", "reason": "timed out after 120 s", "at": 120.0, "ago": 0.0}
    ]
    assert info["retry_in"] == 1.0 and info["plan"] == ["power.cycle", "boot.wait"]
    assert "cn1: boot.wait timed out after 120 s -> power=hang" in caplog.messages
    await world.settle(1)  # backoff over: cycle, whose observed power=on leads to boot.wait
    assert world.calls == [("cn1", "power_cycle")]
    assert world.explain()["current"]["mutation"] == "boot.wait"
    world.observe("cn1", run="ready")
    await world.settle()
    assert world.explain()["converged"] and world.explain()["attempts"] == 0


@scenario
async def test_action_failure_backs_off_exponentially_then_gives_up():
    world = World(max_failures=3)
    world.effects = {"power_on": RuntimeError("BMC unreachable"), "power_status": {"power": "off"}}
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    info = world.explain()
    assert info["dsc"]["power"] == "error" and info["retry_in"] == 1.0
    assert info["failures"][0]["reason"] == "failed: BMC unreachable"
    await world.settle(0.5)
    assert len(world.calls) == 1  # still backing off
    await world.settle(0.5)  # retry: status says off, power on fails again
    assert [a for _, a in world.calls] == ["power_on", "power_status", "power_on"]
    assert world.explain()["retry_in"] == 2.0
    await world.settle(2)
    info = world.explain()
    assert info["gave_up"] == "gave up after 3 failures; last: power.on failed: BMC unreachable"
    assert info["attempts"] == 3 and len(info["failures"]) == 3 and info["retry_in"] is None
    await world.settle(3600)
    assert len(world.calls) == 5
    assert world.engine.stats()["gave_up"] == 1

    world.engine.set_cfg("cn1", run=None)  # a cfg change resets the give-up
    await world.settle()
    assert world.explain()["gave_up"] is None and world.engine.stats()["gave_up"] == 0
    assert [a for _, a in world.calls][5:] == ["power_status", "power_on"]


@scenario
async def test_fresh_observation_resets_the_give_up():
    world = World(max_failures=1)
    world.effects["power_on"] = RuntimeError("BMC unreachable")
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    assert world.explain()["gave_up"]
    world.observe("cn1", power="error")  # no news
    await world.settle()
    assert world.explain()["gave_up"]
    world.observe("cn1", power="off")
    await world.settle()
    assert world.calls == [("cn1", "power_on")] * 2


@scenario
async def test_finding_out_is_done_by_any_news(caplog):
    caplog.set_level(logging.INFO, "layerpy.engine")
    world = World()
    world.add("cn1", WANT_UP, {**OFF, "power": "error"})
    await world.settle()
    assert world.calls == [("cn1", "power_status")]
    world.observe("cn1", power="error")  # no news: still finding out
    assert world.explain()["current"]["mutation"] == "power.retry"
    world.observe("cn1", power="on")
    await world.settle()
    assert "cn1: power.retry done in 0.0 s" in caplog.messages
    assert world.explain()["current"]["mutation"] == "boot.wait"


@scenario
async def test_firing_forgets_what_can_no_longer_be_known():
    world = World()
    world.add("cn1", {"power": "off"}, UP)
    await world.settle()
    info = world.explain()
    assert info["current"]["mutation"] == "power.off"
    assert info["dsc"] == {"power": "on", "run": "unknown", "busy": "free"}


@scenario
async def test_the_engine_concludes_into_the_store():
    world = World()
    world.add("cn1", {"power": "off"}, UP)
    await world.settle()
    assert world.written == [("cn1", {"run": "unknown"})]  # forgotten when power.off fired
    world.engine.set_cfg("cn1", power="on", run="ready")
    world.observe("cn1", power="on", run="unknown")
    await world.settle()  # boot.wait fires
    await world.settle(120)  # and times out
    assert world.written[-1] == ("cn1", {"power": "hang"})
    assert world.explain()["dsc"]["power"] == "hang"


@scenario
async def test_the_engine_plans_from_what_the_store_holds_not_from_what_it_concluded():
    world = World()
    world.add("cn1", WANT_UP, {**UP, "run": "unknown"})
    await world.settle()
    world.facts["cn1"]["run"] = "booting"  # a report the store took; its feed is not read yet
    assert world.explain()["dsc"]["run"] == "booting"
    world.engine.conclude = lambda node, values: None  # a store that keeps nothing the engine says
    await world.settle(120)  # boot.wait times out: the engine concludes a hang...
    info = world.explain()  # ...which the store does not hold: the engine plans from the store
    assert info["dsc"] == {"power": "on", "run": "booting", "busy": "free"}, info
    assert info["plan"] == ["boot.wait"], info


@scenario
async def test_busy_excludes_power_off_until_free(caplog):
    caplog.set_level(logging.INFO, "layerpy.engine")
    world = World()
    world.add("cn1", {"power": "off"}, {**UP, "busy": "busy"})
    await world.settle(5)
    with pytest.raises(NoPath, match=r"power\.off is blocked by busy=busy"):
        world.engine.plan("cn1")
    info = world.explain()
    assert info["blocked"] == "power.off is blocked by busy=busy" and not info["converged"]
    assert world.calls == [] and world.engine.stats()["blocked"] == 1
    assert caplog.messages == ["cn1: waiting: power.off is blocked by busy=busy"]
    world.observe("cn1", busy="free")
    await world.settle()
    assert world.calls == [("cn1", "power_off")] and world.engine.stats()["blocked"] == 0


@scenario
async def test_paced_actions_start_in_turn_without_their_deadlines_running():
    world = World(paces={"power_on": 0.5})  # two power-ons a second
    world.effects["power_on"] = {"power": "on"}
    for i in range(5):
        world.add(f"cn{i}", WANT_UP, OFF)
    due = world.engine.step()
    await world.settle()
    assert [node for node, action in world.calls] == ["cn0"]
    assert due == 0.5  # when the next one may start: the run loop wakes then
    assert world.explain("cn4")["current"]["status"] == "queued"
    world.engine.remove_node("cn1")  # one waiting its turn leaves: the next takes the turn
    for second in (0.5, 1.0, 1.5):
        world.clock.now = second
        await world.settle()
    assert [node for node, _ in world.calls] == ["cn0", "cn2", "cn3", "cn4"]
    assert not any(world.explain(f"cn{i}")["failures"] for i in (0, 2, 3, 4))


@scenario
async def test_actions_are_bounded_and_a_slow_node_holds_up_no_other():
    world = World(max_actions=2)
    world.hung.add("power_on")
    for i in range(4):
        world.add(f"cn{i}", WANT_UP, OFF)
    world.add("up", WANT_UP, {**UP, "run": "lost"})
    await world.settle()
    assert len(world.calls) == 2 and world.engine.stats()["actions"] == 2
    assert world.explain("cn3")["current"] | {"elapsed": 0} == {
        "mutation": "power.on", "action": "power_on", "status": "queued",
        "elapsed": 0, "deadline": None,
    }  # fmt: skip
    assert world.explain("cn0")["current"]["status"] == "acting"
    world.observe("up", run="ready")  # the node without an action goes on alone
    await world.settle()
    assert world.explain("up")["converged"]
    await world.settle(100)  # the running ones time out, which frees their slots;
    assert [f["mutation"] for f in world.explain("cn0")["failures"]] == ["power.on"]
    assert world.explain("cn3")["failures"] == []  # queued ones had no deadline yet
    assert world.explain("cn3")["current"]["status"] == "acting"


@scenario
async def test_cfg_change_cancels_the_mutation_only_if_the_plan_changes():
    world = World()
    world.add("cn1", {"power": "on"}, OFF)
    await world.settle()
    world.engine.set_cfg("cn1", run="ready")  # power.on still comes first
    await world.settle()
    assert world.explain()["current"]["mutation"] == "power.on"
    world.engine.set_cfg("cn1", power="off", run=None)
    await world.settle()
    assert world.explain()["converged"] and world.engine.stats()["in_flight"] == 0


@scenario
async def test_removing_a_node_cancels_its_action():
    world = World()
    world.hung.add("power_on")
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    world.engine.remove_node("cn1")
    await world.settle()
    assert world.engine.stats() == dict.fromkeys(
        ("nodes", "actions", "converged", "in_flight", "blocked", "gave_up", "held", "failures"), 0
    )


@scenario
async def test_run_sleeps_until_the_next_event():
    world = World()
    steps = 0
    step = world.engine.step

    def counted():
        nonlocal steps
        steps += 1
        return step()

    world.engine.step = counted  # type: ignore[method-assign]
    world.add("cn1", WANT_UP, {**UP, "run": "unknown"})
    runner = asyncio.create_task(world.engine.run())
    await asyncio.sleep(0.05)
    assert world.explain()["current"]["mutation"] == "boot.wait"
    assert steps <= 3
    world.observe("cn1", run="ready")
    await asyncio.sleep(0.01)
    assert world.explain()["converged"]

    world.hung.add("power_off")
    world.engine.set_cfg("cn1", power="off", run=None)
    await asyncio.sleep(0.01)
    assert world.explain()["current"]["status"] == "acting"
    runner.cancel()  # stopping abandons what is in flight, so a new run() plans afresh
    with contextlib.suppress(asyncio.CancelledError):
        await runner
    await asyncio.sleep(0)
    assert world.engine.stats()["actions"] == 0
    assert world.explain()["current"] is None and world.explain()["plan"] == ["power.off"]


@scenario
async def test_ten_thousand_nodes_converge_quickly():
    nodes = [f"cn{i:05}" for i in range(10_000)]
    loop = asyncio.get_running_loop()
    running = peak = 0

    async def act(node: str, action: str) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0)
        running -= 1
        observe(node, power="on")
        loop.call_soon(functools.partial(observe, node, run="ready"))  # agent reports

    def observe(node: str, **values: str) -> None:
        facts[node].update(values)
        engine.news(node)

    facts = {node: dict(OFF) for node in nodes}
    engine = Engine(lifecycle_example(), act, max_actions=64, observed=facts.__getitem__,
                    conclude=lambda node, values: facts[node].update(values))  # fmt: skip
    start = time.perf_counter()
    for node in nodes:
        engine.add_node(node, WANT_UP)
    runner = asyncio.create_task(engine.run())
    while engine.stats()["converged"] < len(nodes):
        await asyncio.sleep(0.01)
        assert time.perf_counter() - start < 10
    elapsed = time.perf_counter() - start
    runner.cancel()
    assert elapsed < 3, f"{elapsed:.2f} s"
    assert peak <= 64
    assert engine.stats()["failures"] == 0 and engine.explain(nodes[-1])["dsc"] == UP


@scenario
async def test_a_lost_bmc_is_given_up_out_loud_and_taken_up_again_on_news(caplog):
    """Issue 9: a lab BMC answered nothing for minutes; the engine fired power.retry five
    times in 40 s (backoff 1, 2, 4, 8 s) and stopped for good, its one line at the fifth
    failure lost among the poll errors, saying neither how long it had tried nor what
    would make it try again, and nothing when it did. It says all of that now."""
    caplog.set_level(logging.INFO, "layerpy.engine")
    world = World()  # the defaults: five failures, backoff from 1 s
    world.effects["power_status"] = RuntimeError("BMC 10.99.1.11 unreachable (no answer in 6 s)")
    world.add("cn1", WANT_UP, {**OFF, "power": "error"})  # a failed poll
    for _ in range(8):  # 1 + 2 + 4 + 8 s of backoff, and then some
        await world.settle(8.0)
    assert world.calls == [("cn1", "power_status")] * 5
    gave_up = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in gave_up] == [
        "cn1: gave up after 5 failures; last: power.retry failed: BMC 10.99.1.11 unreachable "
        "(no answer in 6 s) (the first 32 s ago); no more attempts until an observation or "
        "the cfg changes"
    ]
    await world.settle(3600)
    world.observe("cn1", power="error")  # the BMC poller: still no answer, no news
    await world.settle()
    assert len(world.calls) == 5 and world.explain()["gave_up"]

    caplog.clear()
    world.observe("cn1", power="off")  # the BMC answers again
    await world.settle()
    assert world.calls[5:] == [("cn1", "power_on")]
    assert caplog.messages[:2] == [
        "cn1: trying again after giving up: power=off observed",
        "cn1: fire power.on",
    ]


@scenario
async def test_a_pass_plans_for_a_slice_of_time_and_leaves_the_rest():
    """20 000 nodes planned at once would hold the event loop (and every DHCP answer) for
    far longer than a slice; each pass stops at SLICE and the run loop yields between."""
    world = World()
    for i in range(20_000):
        world.add(f"cn{i}", {"power": "off"}, OFF)
    world.engine.step()
    assert world.engine.pending() and world.engine.stats()["converged"] < 20_000
    passes = 1
    while world.engine.pending():
        world.engine.step()
        passes += 1
    assert world.engine.stats()["converged"] == 20_000 and passes > 2


@scenario
async def test_every_action_fired_and_how_it_ended_is_told():
    heard: list[tuple[str, str, str]] = []
    world = World(on_action=lambda node, f: heard.append((node, f["mutation"], f["result"])))
    world.effects["power_on"] = RuntimeError("BMC said no")
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    world.effects["power_status"] = {"power": "off"}  # asked again: off, so on again
    world.effects["power_on"] = {"power": "on"}
    for _ in range(4):
        await world.settle(2)  # each backoff over
    world.engine.set_cfg("cn1", power="off")  # boot.wait, in flight, is no longer wanted
    await world.settle()
    assert heard[:2] == [("cn1", "power.on", "fired"), ("cn1", "power.on", "failed")]
    later = heard[2:]
    for told in (("cn1", "power.retry", "fired"), ("cn1", "power.on", "done"),
                 ("cn1", "boot.wait", "fired"), ("cn1", "boot.wait", "cancelled")):  # fmt: skip
        assert told in later, heard
        later = later[later.index(told) + 1 :]


# -- the fence --------------------------------------------------------------------------


class Fence:
    """A fence the test opens and closes: the reason it holds a node, or None."""

    def __init__(self) -> None:
        self.closed: dict[str, str] = {}

    def __call__(self, node: str) -> str | None:
        return self.closed.get(node)


def fenced_world(**options) -> tuple[World, Fence, list[tuple[str, str, str]]]:
    fence, heard = Fence(), []
    world = World(hold=fence, on_action=lambda node, f: heard.append(
        (node, f["mutation"], f["result"])), **options)  # fmt: skip
    return world, fence, heard


@scenario
async def test_a_held_node_fires_nothing_says_so_once_and_resumes_when_released():
    world, fence, heard = fenced_world()
    world.effects["power_on"] = {"power": "on"}
    fence.closed["cn1"] = "not the owner"
    world.add("cn1", {"power": "on"}, OFF)
    world.add("cn2", {"power": "on"}, OFF)  # not fenced: goes on alone
    await world.settle()
    for advance in (31, 200):  # no timeout runs, nothing fails, nothing is said again
        world.observe("cn1", busy="free")  # news: looked at again, still held
        await world.settle(advance)
        info = world.explain()
        assert world.calls == [("cn2", "power_on")], world.calls
        assert info["held"] == "not the owner" and info["current"] is None, info
        assert info["failures"] == [] and info["retry_in"] is None, info
        assert world.engine.stats()["held"] == 1 and world.engine.stats()["failures"] == 0
    assert [h for h in heard if h[0] == "cn1"] == [("cn1", "power.on", "held")]
    world.engine.release()  # still closed: still held, not told again
    await world.settle()
    assert world.calls == [("cn2", "power_on")] and len(heard) == 3, heard
    del fence.closed["cn1"]
    world.engine.release()
    await world.settle()
    assert world.calls == [("cn2", "power_on"), ("cn1", "power_on")]
    assert world.explain()["held"] is None and world.engine.stats()["held"] == 0


@scenario
async def test_an_action_in_flight_when_the_fence_closes_is_sent_once():
    """A BMC command cannot be unsent: it runs its course, and closing and opening the
    fence meanwhile does not send it again (one decision, at most one power command)."""
    world, fence, heard = fenced_world()
    world.hung.add("power_on")
    world.add("cn1", WANT_UP, OFF)
    await world.settle()
    assert world.calls == [("cn1", "power_on")] and "cn1" in world.stuck
    fence.closed["cn1"] = "etcd lease lost"
    world.engine.release()
    await world.settle(1)
    del fence.closed["cn1"]
    world.engine.release()
    await world.settle(1)
    fence.closed["cn1"] = "etcd lease lost"
    world.engine.release()
    await world.settle(1)
    assert world.calls == [("cn1", "power_on")]
    assert world.explain()["current"]["status"] == "acting"
    world.stuck["cn1"].set_result(None)  # the BMC answers; the machine comes up
    world.observe("cn1", power="on")
    await world.settle()
    info = world.explain()  # power.on done; boot.wait is the next decision, held
    assert info["held"] == "etcd lease lost" and info["current"] is None, info
    del fence.closed["cn1"]
    world.engine.release()
    await world.settle()
    assert world.explain()["current"]["mutation"] == "boot.wait"
    assert world.calls == [("cn1", "power_on")]
    assert ("cn1", "power.on", "done") in heard and world.engine.stats()["failures"] == 0


@scenario
async def test_a_queued_action_does_not_start_once_the_fence_closes():
    world, fence, heard = fenced_world(paces={"power_on": 10.0})
    world.add("cn1", WANT_UP, OFF)
    world.add("cn2", WANT_UP, OFF)
    await world.settle()
    assert world.calls == [("cn1", "power_on")]  # cn2 waits its turn
    fence.closed["cn2"] = "not the owner"
    await world.settle(10)  # its turn: held instead, its mutation ended without failing
    info = world.explain("cn2")
    assert world.calls == [("cn1", "power_on")]
    assert info["held"] == "not the owner" and info["current"] is None, info
    assert world.engine.stats()["in_flight"] == 1 and world.engine.stats()["failures"] == 0
    assert ("cn2", "power.on", "held") in heard
    del fence.closed["cn2"]
    world.engine.release()
    await world.settle(10)
    assert world.calls == [("cn1", "power_on"), ("cn2", "power_on")]


@scenario
async def test_the_fence_is_asked_again_right_before_the_action():
    """Closed between the action's start and its task's first turn: not acted."""
    world, fence, _ = fenced_world()
    world.add("cn1", WANT_UP, OFF)
    world.engine.step()  # power_on's task is created, not yet run
    fence.closed["cn1"] = "etcd lease lost"
    await world.settle()
    await world.settle(30)
    info = world.explain()
    assert world.calls == [] and info["held"] == "etcd lease lost", info
    assert info["current"] is None and info["failures"] == [], info
