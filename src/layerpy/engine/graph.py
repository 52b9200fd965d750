"""Cheapest paths over the product of the declared variables' values.

That space is small (power x run x busy is 90 states), so every (state, goal) pair is
searched once and memoised: planning 100 000 nodes is dict lookups. States and goals are
tuples in variable order; a goal holds None for a variable the cfg does not care about.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping

from layerpy.engine.mutation import ANY, Mutation, Variable

State = tuple[str, ...]
Goal = tuple[str | None, ...]


class NoPath(ValueError):
    """The goal cannot be reached from the state; the message says what is in the way."""


class Graph:
    """Variables and mutations, validated once when built."""

    def __init__(self, variables: Iterable[Variable], mutations: Iterable[Mutation]) -> None:
        self.variables = tuple(variables)
        self.index = {var.name: i for i, var in enumerate(self.variables)}
        if len(self.index) != len(self.variables):
            raise ValueError("variable names must be distinct")
        self.mutations: dict[str, Mutation] = {}
        for mutation in mutations:
            if mutation.name in self.mutations:
                raise ValueError(f"mutation {mutation.name!r} is declared twice")
            self._check(mutation)
            self.mutations[mutation.name] = mutation
        self.default: State = tuple(var.default for var in self.variables)
        self._interned: dict[tuple, tuple] = {}
        self._assigned: dict[tuple, tuple] = {}
        self._edges: dict[tuple[State, bool], list[tuple[Mutation, State]]] = {}
        self._paths: dict[tuple[State, Goal], tuple[Mutation, ...] | str] = {}

    # -- states ------------------------------------------------------------------------

    def state(self, values: Mapping[str, str], base: State | None = None) -> State:
        """A validated state: ``base`` (default: all defaults) with ``values`` set."""
        return self._assign(base or self.default, values, unset=False)

    def goal(self, values: Mapping[str, str | None], base: Goal | None = None) -> Goal:
        """A validated goal; a value of None means "don't care"."""
        return self._assign(base or (None,) * len(self.variables), values, unset=True)

    def values(self, state: State | Goal) -> dict[str, str]:
        return {var.name: v for var, v in zip(self.variables, state, strict=True) if v is not None}

    def forget(self, mutation: Mutation, state: State) -> State:
        """The state once the mutation fired: what it makes unknowable reads as default."""
        new = list(state)
        for var in mutation.forgets:
            i = self.index[var]
            new[i] = self.variables[i].default
        return self._intern(tuple(new))

    def apply(self, mutation: Mutation, state: State) -> State:
        """Where the mutation leads when it succeeds."""
        new = list(self.forget(mutation, state))
        for var, (_, to) in mutation.changes.items():
            new[self.index[var]] = to
        return self._intern(tuple(new))

    def done(self, mutation: Mutation, origin: State, state: State) -> bool:
        """Every change observed; a change *to* the default ("find out") by any news."""
        return all(
            (v := state[i]) == to or (to == self.default[i] and v != origin[i])
            for i, to in ((self.index[var], to) for var, (_, to) in mutation.changes.items())
        )

    def finds_out(self, mutation: Mutation) -> bool:
        return any(to == self.default[self.index[var]] for var, (_, to) in mutation.changes.items())

    def blocker(self, mutation: Mutation, state: State, *, fired: bool = False) -> str | None:
        """Why the mutation's guards forbid it in this state, or None. Once it has fired,
        the variables it forgets are none of its business any more."""
        skip = mutation.forgets if fired else ()
        for var, allowed in mutation.requires.items():
            if var not in skip and (value := state[self.index[var]]) not in allowed:
                need = "|".join(sorted(allowed))
                return f"{mutation.name} requires {var}={need}, but {var}={value}"
        for var, denied in mutation.excludes.items():
            if var not in skip and (value := state[self.index[var]]) in denied:
                return f"{mutation.name} is blocked by {var}={value}"
        return None

    def deviation(self, mutation: Mutation, origin: State, state: State) -> str | None:
        """What in ``state`` leaves the mutation's course since it fired at ``origin``.

        A changed variable may still hold its old value or already the new one; any other
        value, or a broken guard, means the expected change will not come this way.
        """
        for var, (frm, to) in mutation.changes.items():
            i = self.index[var]
            if state[i] not in (to, origin[i]) and frm != ANY and to != self.default[i]:
                return f"{var}={state[i]}"
        return self.blocker(mutation, state, fired=True)

    # -- paths -------------------------------------------------------------------------

    def path(self, dsc: Mapping[str, str], cfg: Mapping[str, str | None]) -> list[Mutation]:
        """The cheapest mutations from dsc to cfg ([] when there); raises NoPath."""
        return list(self.steps(self.state(dsc), self.goal(cfg)))

    def steps(self, state: State, goal: Goal) -> tuple[Mutation, ...]:
        """Memoised path search on validated tuples: what the engine calls per node.

        When nothing reaches the goal yet, a path may end with a mutation that finds a
        value out (error -> unknown): the rest is planned once the news is observed.
        """
        key = (state, goal)
        found = self._paths.get(key)
        if found is None:
            found = self._search(state, goal, guarded=True)
            if found is None:
                found = self._search(state, goal, guarded=True, partial=True)
            self._paths[key] = found = self._why(state, goal) if found is None else found
        if isinstance(found, str):
            raise NoPath(found)
        return found

    def _search(
        self, start: State, goal: Goal, *, guarded: bool, partial: bool = False
    ) -> tuple[Mutation, ...] | None:
        """Dijkstra; ties are broken by declaration order, so plans are stable."""
        best = {start: 0.0}
        came: dict[State, tuple[State, Mutation]] = {}
        tie = itertools.count()
        queue = [(0.0, next(tie), start)]
        while queue:
            cost, _, state = heapq.heappop(queue)
            if cost > best[state]:
                continue
            if all(g is None or g == v for v, g in zip(state, goal, strict=True)) or (
                partial and state in came and self.finds_out(came[state][1])
            ):
                path = []
                while state in came:
                    state, mutation = came[state]
                    path.append(mutation)
                return tuple(reversed(path))
            for mutation, nxt in self._neighbours(state, guarded):
                total = cost + mutation.cost
                if total < best.get(nxt, math.inf):
                    best[nxt], came[nxt] = total, (state, mutation)
                    heapq.heappush(queue, (total, next(tie), nxt))
        return None

    def _neighbours(self, state: State, guarded: bool) -> list[tuple[Mutation, State]]:
        key = (state, guarded)
        edges = self._edges.get(key)
        if edges is None:
            edges = self._edges[key] = []
            for mutation in self.mutations.values():
                if any(
                    frm not in (ANY, state[self.index[var]])
                    for var, (frm, _) in mutation.changes.items()
                ) or (guarded and self.blocker(mutation, state)):
                    continue
                if (nxt := self.apply(mutation, state)) != state:
                    edges.append((mutation, nxt))
        return edges

    def _why(self, state: State, goal: Goal) -> str:
        """The first guard in the way on the path that ignores guards, else what is missing."""
        here = state
        for mutation in self._search(state, goal, guarded=False) or ():
            if reason := self.blocker(mutation, here):
                return reason
            here = self.apply(mutation, here)
        pairs = zip(self.index, state, goal, strict=True)
        wanted = [(n, v, g) for n, v, g in pairs if g not in (None, v)]
        have = " ".join(f"{n}={v}" for n, v, _ in wanted)
        want = " ".join(f"{n}={g}" for n, _, g in wanted)
        return f"no mutations lead from {have} to {want}"

    # -- validation --------------------------------------------------------------------

    def _assign(self, base: tuple, values: Mapping[str, str | None], *, unset: bool) -> tuple:
        """`base` with `values` set, validated; remembered, since a thousand nodes of one
        group ask the same (the state space is small, so is what is remembered)."""
        key = (base, tuple(values.items()), unset)
        if (known := self._assigned.get(key)) is not None:
            return known
        new = list(base)
        for var, value in values.items():
            if value is None and unset:
                new[self._var(var)] = None
            else:
                new[self._value(var, value)] = value
        self._assigned[key] = result = self._intern(tuple(new))
        return result

    def _intern(self, values: tuple) -> tuple:
        """One tuple per distinct state, shared by every node in it."""
        return self._interned.setdefault(values, values)

    def _var(self, var: str, where: str = "") -> int:
        if (i := self.index.get(var)) is None:
            raise ValueError(f"{where}unknown variable {var!r} (declared: {', '.join(self.index)})")
        return i

    def _value(self, var: str, value: object, where: str = "") -> int:
        i = self._var(var, where)
        if value not in self.variables[i].values:
            known = ", ".join(self.variables[i].values)
            raise ValueError(f"{where}{var} has no value {value!r} (values: {known})")
        return i

    def _check(self, m: Mutation) -> None:
        where = f"mutation {m.name!r}: "
        for var, (frm, to) in m.changes.items():
            self._value(var, to, where)
            if frm != ANY:
                self._value(var, frm, where)
        for var, values in (*m.requires.items(), *m.excludes.items()):
            for value in values:
                self._value(var, value, where)
        for var, value in m.fail_to.items():
            self._value(var, value, where)
        for var in m.forgets:
            self._var(var, where)
        # A guard on a variable the mutation changes would trip as soon as it progresses.
        if m.changes.keys() & {*m.forgets, *m.requires, *m.excludes}:
            raise ValueError(f"{where}a changed variable cannot also be guarded or forgotten")
