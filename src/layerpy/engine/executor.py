"""Continuous enforcement: every node walks its planned path, one observed edge at a time.

The engine holds no observed state of its own: it reads a node's values through
``observed`` (the node store's fields) whenever it plans, and what it concludes itself
(values forgotten on firing, fallen to on failure) goes through ``conclude`` to the same
store and is read back from there. Reading is cheap (bench/engine.py: about 1.5 us a read,
8 us more per node booted than with a copy kept here; a cache dropped by the feed saved
no measurable time), so nothing is cached beside the store. ``origin`` is no such copy:
it is the history of a decision (the state a mutation fired in, or the engine gave up in).

news() and set_cfg() only record and mark the node dirty; step() expires due timers
from one heap, plans the dirty nodes and fires their next edge. Actions run as tasks, at
most ``max_actions`` at once (a queue in front, not one waiting task per node), so a slow
BMC never holds up other nodes' planning or deadlines. run() sleeps between steps until
the next timer or a wake-up.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from layerpy.engine.graph import Goal, Graph, NoPath, State
from layerpy.engine.mutation import Mutation

SLICE = 0.001  # seconds of planning per pass before the event loop runs others
log = logging.getLogger("layerpy.engine")

HISTORY = 10  # failures kept per node for explain()


@dataclass(slots=True, eq=False)
class _Node:
    """Per-node bookkeeping, slotted: there may be 100 000 of these."""

    name: str
    goal: Goal
    current: Mutation | None = None
    # the state when current fired (tells progress from surprise), or when the engine gave
    # up (tells news from repetition)
    origin: State = ()
    fired: float = 0.0
    deadline: float | None = None
    task: asyncio.Task | None = None
    # Bumped whenever current starts or ends: timers, queued actions and action results
    # carry the epoch they were made in and are ignored once it has moved on.
    epoch: int = 0
    failures: deque[tuple[float, str, str]] | None = None
    attempts: int = 0  # failures since the node last converged or was reset
    failing_since: float = 0.0  # when the first of those failures happened
    retry_at: float = 0.0
    gave_up: str | None = None
    blocked: str | None = None
    held: str | None = None  # why the fence keeps the engine from acting on the node
    converged: bool = False


class Engine:
    """Drives nodes from dsc to cfg; ``act(node, action)`` performs a fired action."""

    def __init__(
        self,
        graph: Graph,
        act: Callable[[str, str], Awaitable[None]],
        *,
        observed: Callable[[str], Mapping[str, str]],
        conclude: Callable[[str, dict[str, str]], None],
        hold: Callable[[str], str | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_actions: int = 64,
        max_failures: int = 5,
        backoff: tuple[float, float] = (1.0, 60.0),
        on_action: Callable[[str, dict[str, str]], None] | None = None,
        paces: Mapping[str, float] | None = None,
    ) -> None:
        """``observed(node)`` reads the node's dsc values, every variable, from where they
        are kept; ``conclude(node, values)`` records the values the engine concludes itself
        there, synchronously (when it returns, ``observed`` reads them).
        ``hold(node)`` is the fence: why the engine may not act on the node now (None: it
        may). A held node fires nothing (no timeout runs, no failure counts) until
        ``release()`` finds the fence open; an action already started is not recalled.
        ``on_action(node, fields)`` hears each mutation fired and how it ended (``result``:
        fired, done, interrupted, cancelled, failed, gave_up), and once per hold ``held``,
        for the event stream.
        ``paces`` maps an action to the fewest seconds between two of its starts (a cold
        start powers nodes on at a rate PDUs and the boot network can take); the others
        wait their turn in order, their deadlines not yet running."""
        self.graph, self.act, self.clock = graph, act, clock
        self.observed, self.conclude, self.hold = observed, conclude, hold
        self.on_action = on_action
        self.paces = dict(paces or {})
        self._paced: dict[str, deque[tuple[_Node, int]]] = {a: deque() for a in self.paces}
        self._next_start = dict.fromkeys(self.paces, 0.0)
        self.max_actions, self.max_failures, self.backoff = max_actions, max_failures, backoff
        self._nodes: dict[str, _Node] = {}
        # to plan, oldest first (popped from the front in O(1): a dict would rescan the
        # holes its front leaves, quadratic for 100 000 nodes)
        self._dirty: OrderedDict[_Node, None] = OrderedDict()
        self._timers: list[tuple[float, int, _Node, int]] = []
        self._tie = itertools.count()
        self._queue: deque[tuple[_Node, int]] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._fenced: dict[_Node, None] = {}  # the held nodes, for release()
        self._wake = asyncio.Event()
        counts = ("converged", "in_flight", "blocked", "gave_up", "held", "failures")
        self._count = dict.fromkeys(counts, 0)

    # -- what the rest of layerpy calls ------------------------------------------------

    def add_node(self, node: str, cfg: Mapping[str, str | None]) -> None:
        """A node to drive to ``cfg``; what it is now is read through ``observed``."""
        if node in self._nodes:
            raise ValueError(f"node {node!r} is already in the engine")
        rec = _Node(node, self.graph.goal(cfg))
        self._nodes[node] = rec
        self._mark(rec)

    def has(self, node: str) -> bool:
        return node in self._nodes

    def remove_node(self, node: str) -> None:
        rec = self._nodes.pop(node)
        if rec.current is not None:
            self._end(rec, cancel=True)
        rec.epoch += 1
        self._dirty.pop(rec, None)
        self._fenced.pop(rec, None)
        for key in ("converged", "blocked", "gave_up", "held"):
            self._count[key] -= bool(getattr(rec, key))

    def set_cfg(self, node: str, **values: str | None) -> None:
        """The wish changed (file reload, API override); None means don't care."""
        rec = self._nodes[node]
        goal = self.graph.goal(values, rec.goal)
        if goal == rec.goal:
            return
        rec.goal = goal
        self._reset(rec, "the cfg changed")
        if rec.current is not None:
            try:
                keep = self.graph.steps(self._state(rec), goal)[:1] == (rec.current,)
            except NoPath:
                keep = False
            if not keep:
                log.info("%s: %s cancelled: cfg changed", rec.name, rec.current.name)
                self._tell(rec, rec.current, "cancelled", why="the cfg changed")
                self._end(rec, cancel=True)
        self._mark(rec)

    def news(self, node: str) -> None:
        """What is observed of the node changed (the store's feed says so): read it, then
        advance the mutation in flight, or re-plan."""
        rec = self._nodes[node]
        state = self._state(rec)
        if rec.gave_up and state != rec.origin:  # the world moved: worth another round
            news = (f"{v.name}={new}" for v, old, new in zip(
                self.graph.variables, rec.origin, state, strict=True) if old != new)  # fmt: skip
            self._reset(rec, f"{' '.join(news)} observed")
        mutation = rec.current
        if mutation is not None:
            if self.graph.done(mutation, rec.origin, state):
                elapsed = self.clock() - rec.fired
                log.info("%s: %s done in %.1f s", rec.name, mutation.name, elapsed)
                self._tell(rec, mutation, "done", seconds=f"{elapsed:.1f}")
                self._end(rec)
            elif why := self.graph.deviation(mutation, rec.origin, state):
                log.info("%s: %s interrupted by %s, re-planning", rec.name, mutation.name, why)
                self._tell(rec, mutation, "interrupted", why=why)
                self._end(rec, cancel=True)
            else:
                return  # still on course
        self._mark(rec)

    def plan(self, node: str) -> list[str]:
        """Mutation names from the current dsc to cfg; raises NoPath saying what blocks."""
        rec = self._nodes[node]
        return [m.name for m in self.graph.steps(self._state(rec), rec.goal)]

    def explain(self, node: str) -> dict[str, object]:
        """Why the node is where it is: wish, news, plan, what is in flight, what failed."""
        rec, now = self._nodes[node], self.clock()
        try:
            plan, blocked = self.plan(node), None
        except NoPath as exc:
            plan, blocked = [], str(exc)
        current = None
        if (m := rec.current) is not None:
            task = rec.task
            status = "queued" if m.action and task is None else "waiting"
            current = {
                "mutation": m.name,
                "action": m.action,
                "status": "acting" if task and not task.done() else status,
                "elapsed": round(now - rec.fired, 3),
                "deadline": None if rec.deadline is None else round(rec.deadline - now, 3),
            }
        return {
            "node": node,
            "cfg": self.graph.values(rec.goal),
            "dsc": self.graph.values(self._state(rec)),
            "converged": m is None and not plan and blocked is None,
            "plan": plan,
            "blocked": blocked,
            "held": rec.held,
            "current": current,
            "failures": [
                {"mutation": name, "reason": reason, "at": at, "ago": round(now - at, 3)}
                for at, name, reason in rec.failures or ()
            ],
            "attempts": rec.attempts,
            "retry_in": round(rec.retry_at - now, 3) if rec.retry_at > now else None,
            "gave_up": rec.gave_up,
        }

    def stats(self) -> dict[str, int]:
        """Counts, kept as they change so that polling them is free at any scale."""
        return {"nodes": len(self._nodes), "actions": len(self._tasks), **self._count}

    async def run(self) -> None:
        """The continuous loop; cancel it to stop (running actions are cancelled)."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._wake.clear()
                due = self.step()
                if self.pending():  # more than one slice of work: the others go first
                    await asyncio.sleep(0)
                    continue
                timer = None if due is None else loop.call_later(due - self.clock(), self._wake.set)
                await self._wake.wait()
                if timer is not None:
                    timer.cancel()
        finally:  # abandon what is in flight; a later run() plans afresh
            for rec in self._nodes.values():
                if rec.current is not None:
                    self._end(rec, cancel=True)
                    self._mark(rec)

    def step(self) -> float | None:
        """One pass of at most SLICE seconds: expire due timers, plan dirty nodes, start
        queued actions; what is left waits for the next pass (a reload or a start with
        100 000 nodes would otherwise hold the event loop, and every DHCP answer, for
        a second).

        Returns when the next timer is due. Tests with a fake clock call this directly
        (from inside a loop, since actions start as tasks).
        """
        now = self.clock()
        until = time.perf_counter() + SLICE
        timers = self._timers
        while timers and timers[0][0] <= now and time.perf_counter() < until:
            _, _, rec, epoch = heapq.heappop(timers)
            if rec.epoch != epoch:
                continue
            if rec.current is not None and rec.deadline is not None and rec.deadline <= now:
                mutation = rec.current
                self._fail(
                    rec, f"timed out after {mutation.timeout:g} s", mutation.fail_to, cancel=True
                )
            else:
                self._mark(rec)  # its backoff is over
        dirty = self._dirty
        while dirty and time.perf_counter() < until:
            rec, _ = dirty.popitem(last=False)
            self._advance(rec, now)
        paced = self._pump()
        due = [t for t in (timers[0][0] if timers else None, paced) if t is not None]
        return min(due) if due else None

    def release(self) -> None:
        """The fence changed: the held nodes it now allows are planned again (only they are
        looked at, not every node)."""
        for rec in list(self._fenced):
            why = self.hold(rec.name) if self.hold is not None else None
            if why is None:
                self._unhold(rec)
                self._mark(rec)
            else:
                rec.held = why

    def pending(self) -> bool:
        """Work the last pass left for the next: nodes to plan, timers already due."""
        return bool(self._dirty) or (bool(self._timers) and self._timers[0][0] <= self.clock())

    # -- internals ---------------------------------------------------------------------

    def _mark(self, rec: _Node) -> None:
        if rec.converged:
            rec.converged = False
            self._count["converged"] -= 1
        self._dirty[rec] = None
        self._wake.set()

    def _state(self, rec: _Node) -> State:
        """The node's dsc, read from where it is kept (never a copy of the engine's)."""
        return self.graph.state(self.observed(rec.name))

    def _advance(self, rec: _Node, now: float) -> None:
        if rec.current is not None or rec.gave_up or rec.retry_at > now:
            return
        state = self._state(rec)
        try:
            steps = self.graph.steps(state, rec.goal)
            blocked = None
        except NoPath as exc:
            steps, blocked = (), str(exc)
            if blocked != rec.blocked:
                # waiting for a first observation is normal at start-up: not worth a line each
                unobserved = any(
                    value == var.default
                    for var, value in zip(self.graph.variables, state, strict=True)
                )
                log.log(
                    logging.DEBUG if unobserved else logging.INFO,
                    "%s: waiting: %s",
                    rec.name,
                    blocked,
                )
        self._count["blocked"] += bool(blocked) - bool(rec.blocked)
        rec.blocked = blocked
        if not steps:
            self._unhold(rec)  # nothing to do: nothing held
        elif not self._holds(rec, steps[0]):
            self._fire(rec, steps[0], state, now)
        if not steps and not blocked:
            rec.converged, rec.attempts, rec.retry_at = True, 0, 0.0
            self._count["converged"] += 1

    def _holds(self, rec: _Node, mutation: Mutation) -> bool:
        """Whether the fence keeps ``mutation`` from firing or starting (said once a hold)."""
        why = self.hold(rec.name) if self.hold is not None else None
        if why is None:
            return False
        if rec.held is None:
            log.debug("%s: %s held: %s", rec.name, mutation.name, why)
            self._tell(rec, mutation, "held", why=why)
            self._fenced[rec] = None
            self._count["held"] += 1
        rec.held = why
        return True

    def _unhold(self, rec: _Node) -> None:
        if rec.held is not None:
            rec.held = None
            del self._fenced[rec]
            self._count["held"] -= 1

    def _fire(self, rec: _Node, mutation: Mutation, state: State, now: float) -> None:
        log.info("%s: fire %s", rec.name, mutation.name)
        self._tell(rec, mutation, "fired")
        rec.current, rec.origin, rec.fired = mutation, state, now
        rec.epoch += 1
        self._count["in_flight"] += 1
        self._write(rec, state, self.graph.forget(mutation, state))
        if mutation.action:
            self._queue.append((rec, rec.epoch))
        else:
            self._arm(rec, now)

    def _arm(self, rec: _Node, now: float) -> None:
        """Start the deadline: at firing, or when the action actually starts."""
        assert rec.current is not None
        if rec.current.timeout is not None:
            rec.deadline = now + rec.current.timeout
            self._push(rec.deadline, rec)

    def _pump(self) -> float | None:
        """Start queued actions while there are free slots, paced ones only in their turn;
        returns when the next paced one is due (None: none is waiting)."""
        now = self.clock()
        for action, held in self._paced.items():
            while held and now >= self._next_start[action] and len(self._tasks) < self.max_actions:
                if self._start(*held.popleft(), now):
                    self._next_start[action] = now + self.paces[action]
        while self._queue and len(self._tasks) < self.max_actions:
            rec, epoch = self._queue.popleft()
            action = rec.current.action if rec.current is not None else None
            paced = self._paced.get(action)
            if paced is not None and (paced or now < self._next_start[action]):
                paced.append((rec, epoch))  # its turn comes (FIFO)
            elif self._start(rec, epoch, now) and action in self.paces:
                self._next_start[action] = now + self.paces[action]
        waiting = [self._next_start[a] for a, held in self._paced.items() if held]
        return min(waiting) if waiting else None

    def _start(self, rec: _Node, epoch: int, now: float) -> bool:
        """Start a queued action unless it ended while it waited."""
        if rec.epoch != epoch:
            return False
        assert rec.current is not None
        rec.task = asyncio.create_task(self._perform(rec, rec.current, epoch))
        self._tasks.add(rec.task)
        rec.task.add_done_callback(self._finished)
        self._arm(rec, now)
        return True

    def _unfired(self, rec: _Node) -> bool:
        """Whether the fence closed since the node's action was fired; if so the mutation
        ends, neither failed nor timed out, and the node is held until released."""
        assert rec.current is not None
        if not self._holds(rec, rec.current):
            return False
        self._end(rec)
        self._mark(rec)  # planned again once released
        return True

    async def _perform(self, rec: _Node, mutation: Mutation, epoch: int) -> None:
        assert mutation.action is not None
        # asked again right before acting, in the same turn of the loop as the act starts:
        # the fence may have closed since the task was created
        if rec.epoch == epoch and self._unfired(rec):
            return
        try:
            await self.act(rec.name, mutation.action)
        except Exception as exc:
            reason = f"failed: {str(exc) or type(exc).__name__}"
            if rec.epoch == epoch:
                self._fail(rec, reason, self._error(mutation))
            else:
                log.warning(
                    "%s: %s %s after %s had ended", rec.name, mutation.action, reason, mutation.name
                )

    def _finished(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._pump()

    def _error(self, mutation: Mutation) -> Mapping[str, str]:
        """What a failed action leaves: fail_to, else "error" where the variable has one."""
        if mutation.fail_to:
            return mutation.fail_to
        variables = self.graph.variables
        return {
            var: "error"
            for var in mutation.changes
            if "error" in variables[self.graph.index[var]].values
        }

    def _end(self, rec: _Node, *, cancel: bool = False) -> None:
        """The mutation in flight is over. Its action, if still running, is cancelled only
        when asked: after a success it is left to return on its own."""
        if cancel and rec.task is not None:
            rec.task.cancel()
        rec.current, rec.deadline, rec.task = None, None, None
        rec.epoch += 1
        self._count["in_flight"] -= 1

    def _fail(
        self, rec: _Node, reason: str, values: Mapping[str, str], *, cancel: bool = False
    ) -> None:
        now, mutation = self.clock(), rec.current
        assert mutation is not None
        self._end(rec, cancel=cancel)
        state = self._state(rec)
        self._write(rec, state, self.graph.state(values, state))
        outcome = " ".join(f"{var}={value}" for var, value in values.items()) or "dsc unchanged"
        log.warning("%s: %s %s -> %s", rec.name, mutation.name, reason, outcome)
        self._tell(rec, mutation, "failed", why=reason, outcome=outcome)
        if rec.failures is None:
            rec.failures = deque(maxlen=HISTORY)
        rec.failures.append((now, mutation.name, reason))
        self._count["failures"] += 1
        if not rec.attempts:
            rec.failing_since = now
        rec.attempts += 1
        if rec.attempts >= self.max_failures:
            rec.gave_up = f"gave up after {rec.attempts} failures; last: {mutation.name} {reason}"
            rec.origin = self._state(rec)  # news is what differs from this
            self._count["gave_up"] += 1
            self._tell(rec, mutation, "gave_up", why=rec.gave_up)
            # Said once, and loudly: from here only news (a changed observation, such as a
            # BMC poll that answers again) or a new cfg makes the engine try this node again.
            log.error(
                "%s: %s (the first %.0f s ago); no more attempts until an observation "
                "or the cfg changes",
                rec.name, rec.gave_up, now - rec.failing_since,
            )  # fmt: skip
        else:
            first, cap = self.backoff
            rec.retry_at = now + min(cap, first * 2 ** (rec.attempts - 1))
            self._push(rec.retry_at, rec)
        self._mark(rec)

    def _tell(self, rec: _Node, mutation: Mutation, result: str, **more: str) -> None:
        if self.on_action is not None:
            fields = {"mutation": mutation.name, "action": mutation.action or "", "result": result}
            self.on_action(rec.name, fields | more)

    def _write(self, rec: _Node, before: State, state: State) -> None:
        """Record the engine's own conclusions where dsc is kept: what changed from before."""
        if state != before:
            old, new = self.graph.values(before), self.graph.values(state)
            self.conclude(rec.name, {var: v for var, v in new.items() if old.get(var) != v})

    def _reset(self, rec: _Node, why: str) -> None:
        """Forget the failure count: new wishes or news deserve fresh attempts."""
        rec.attempts, rec.retry_at = 0, 0.0
        if rec.gave_up:
            log.info("%s: trying again after giving up: %s", rec.name, why)
            rec.gave_up = None
            self._count["gave_up"] -= 1

    def _push(self, when: float, rec: _Node) -> None:
        timers = self._timers
        heapq.heappush(timers, (when, next(self._tie), rec, rec.epoch))
        if len(timers) > 2 * len(self._nodes) + 64:  # drop stale timers, in place
            timers[:] = [t for t in timers if t[2].epoch == t[3]]
            heapq.heapify(timers)
        self._wake.set()
