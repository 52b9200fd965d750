"""The BMC poller with stand-in drivers, on a short interval: who is polled when, for ever.

Real BMCs (slow, late, dead) are polled in tests/proto/test_power.py; these pin down the
schedule. Every wait is for a condition, with a generous limit that names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

import pytest

from layerpy.power import PowerError
from layerpy.power.poller import Poller

INTERVAL = 0.05


def scenario(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


class Bmc:
    """A stand-in driver: answers `state`, fails while `failing`, hangs while `hung`."""

    def __init__(self, state: str = "on") -> None:
        self.state = state
        self.failing = False
        self.hung = False
        self.calls: list[float] = []
        self.running = 0
        self.gate = asyncio.Event()

    async def status(self) -> str:
        self.calls.append(time.monotonic())
        self.running += 1
        try:
            if self.hung:
                await self.gate.wait()
            else:
                await asyncio.sleep(0)
            if self.failing:
                raise PowerError("BMC unreachable (no answer in 12 s)")
            return self.state
        finally:
            self.running -= 1

    async def on(self) -> None: ...
    async def off(self) -> None: ...
    async def cycle(self) -> None: ...
    async def boot_network_once(self) -> None: ...
    async def close(self) -> None: ...


class Reports:
    def __init__(self) -> None:
        self.items: list[tuple[str, str | None, str | None]] = []

    def __call__(self, name: str, state: str | None, error: str | None) -> None:
        self.items.append((name, state, error))

    def of(self, name: str) -> list[tuple[str | None, str | None]]:
        return [(state, error) for n, state, error in self.items if n == name]


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def running(poller: Poller):
    task = asyncio.create_task(poller.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@scenario
async def test_each_bmc_is_polled_every_interval_and_reported() -> None:
    bmcs = {"cn1": Bmc("on"), "cn2": Bmc("off")}
    reports = Reports()
    async with running(Poller(bmcs, reports, INTERVAL)):
        await until(lambda: len(bmcs["cn1"].calls) >= 5 and len(bmcs["cn2"].calls) >= 5, "polls")
    assert set(reports.of("cn1")) == {("on", None)} and set(reports.of("cn2")) == {("off", None)}
    gaps = [b - a for a, b in zip(bmcs["cn1"].calls, bmcs["cn1"].calls[1:], strict=False)]
    assert min(gaps) > INTERVAL * 0.8, gaps  # one rhythm per BMC, not faster


@scenario
async def test_a_hung_bmc_is_skipped_and_delays_no_one() -> None:
    bmcs = {"dead": Bmc(), "live": Bmc()}
    bmcs["dead"].hung = True
    reports = Reports()
    async with running(Poller(bmcs, reports, INTERVAL)):
        await until(lambda: len(bmcs["live"].calls) >= 10, "ten polls of the live BMC")
        assert len(bmcs["dead"].calls) == 1  # its first poll still runs: not asked again
        bmcs["dead"].hung = False
        bmcs["dead"].gate.set()
        await until(lambda: len(bmcs["dead"].calls) >= 3, "the dead BMC polled again")
    assert reports.of("dead")[0] == ("on", None)


@scenario
async def test_a_failing_bmc_backs_off_and_is_never_given_up() -> None:
    bmc = Bmc("off")
    bmc.failing = True
    reports = Reports()
    poller = Poller({"cn1": bmc}, reports, 10.0, backoff=(0.01, 0.08))
    async with running(poller):
        await until(lambda: len(bmc.calls) >= 12, "twelve attempts (far past any give-up)")
        assert poller.failures("cn1") >= 11
        gaps = [b - a for a, b in zip(bmc.calls, bmc.calls[1:], strict=False)]
        assert gaps[0] < gaps[3], gaps  # growing: 0.01, 0.02, 0.04, 0.08 ...
        assert max(gaps) < 1.0, gaps  # ... capped at 0.08, far below the 10 s interval
        bmc.failing = False
        await until(lambda: reports.of("cn1")[-1] == ("off", None), "the BMC answering again")
        assert poller.failures("cn1") == 0  # back to its interval
        answered = len(bmc.calls)
        await asyncio.sleep(0.3)  # a quiet spell: nothing is due before 10 s
        assert len(bmc.calls) == answered
    errors = [error for state, error in reports.of("cn1") if state is None]
    assert len(errors) >= 11 and all("unreachable" in e for e in errors)


@scenario
async def test_never_more_polls_in_flight_than_the_limit() -> None:
    bmcs = {f"dead{i}": Bmc() for i in range(10)} | {"live": Bmc()}
    for name, bmc in bmcs.items():
        bmc.hung = name != "live"
    most = 0

    def report(name: str, state: str | None, error: str | None) -> None:
        nonlocal most
        most = max(most, sum(bmc.running for bmc in bmcs.values()))

    poller = Poller(bmcs, report, INTERVAL, limit=4)
    async with running(poller):
        await until(lambda: poller.in_flight() == 4, "four polls in flight")
        await until(lambda: sum(len(b.calls) for b in bmcs.values()) >= 4, "polls started")
        assert sum(bmc.running for bmc in bmcs.values()) <= 4
        for bmc in bmcs.values():  # the dead come back: the rest get their turn
            bmc.hung = False
            bmc.gate.set()
        await until(lambda: all(len(b.calls) >= 2 for b in bmcs.values()), "every BMC, twice")
    assert most <= 4


@scenario
async def test_a_healthy_bmc_is_polled_while_dead_ones_fill_their_share() -> None:
    """Failing BMCs never take the last slots: a live one is still read on time."""
    bmcs = {f"dead{i}": Bmc() for i in range(10)} | {"live": Bmc()}
    for name, bmc in bmcs.items():
        bmc.failing = name != "live"
    reports = Reports()
    poller = Poller(bmcs, reports, INTERVAL, limit=4, backoff=(0.001, 0.002))
    async with running(poller):
        await until(lambda: all(poller.failures(f"dead{i}") for i in range(10)), "dead known")
        for name, bmc in bmcs.items():
            bmc.hung = name != "live"  # from now on the dead ones never answer at all
        await until(lambda: poller.in_flight() >= 3, "dead polls filling their share")
        polled = len(bmcs["live"].calls)
        await until(lambda: len(bmcs["live"].calls) >= polled + 5, "five more live polls")
        for bmc in bmcs.values():
            bmc.gate.set()


@scenario
async def test_nodes_added_removed_or_replaced_are_followed() -> None:
    drivers: dict[str, Bmc] = {"cn1": Bmc("on")}
    reports = Reports()
    async with running(Poller(drivers, reports, INTERVAL)):
        await until(lambda: reports.of("cn1"), "cn1 polled")
        drivers["cn2"] = Bmc("off")
        await until(lambda: reports.of("cn2"), "the added cn2 polled")
        old = drivers.pop("cn1")
        calls = len(old.calls)
        replaced = drivers["cn2"] = Bmc("on")  # a reload gave cn2 another BMC
        await until(lambda: reports.of("cn2")[-1] == ("on", None), "cn2's new BMC polled")
        await until(lambda: len(replaced.calls) >= 3, "cn2's new BMC polled again")
        assert len(old.calls) == calls  # the removed one no more


@scenario
async def test_a_driver_or_report_that_raises_stops_nothing() -> None:
    class Broken(Bmc):
        async def status(self) -> str:
            self.calls.append(time.monotonic())
            raise KeyError("pyghmi internals")

    drivers = {"cn1": Broken(), "cn2": Bmc()}
    seen = Reports()

    def report(name: str, state: str | None, error: str | None) -> None:
        seen(name, state, error)
        if name == "cn2":
            raise RuntimeError("a subscriber failed")

    async with running(Poller(drivers, report, INTERVAL, backoff=(0.01, 0.02))):
        await until(lambda: len(seen.of("cn1")) >= 3 and len(seen.of("cn2")) >= 3, "polls")
    assert seen.of("cn1")[0] == (None, "cn1: power status: KeyError: 'pyghmi internals'")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="interval"):
        Poller({}, Reports(), 0)


@scenario
async def test_a_cancel_as_the_poller_wakes_still_stops_it() -> None:
    """3.11's wait_for swallows a cancel that arrives as what it waits for completes: the
    poller then ran on for ever, and whoever awaited it (shutdown, a test) hung."""
    for _ in range(50):
        poller = Poller({"cn1": Bmc()}, Reports(), INTERVAL)
        task = asyncio.create_task(poller.run())
        await asyncio.sleep(0)  # it runs up to its wait
        poller._wake.set()  # a poll ends (as _done() does) ...
        task.cancel()  # ... just as the server stops
        done, _ = await asyncio.wait([task], timeout=30)
        assert done, "the poller ignored its cancellation"
