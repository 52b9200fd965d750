"""Log lines a flood cannot multiply: bounded by kind, whatever the text carries."""

from __future__ import annotations

import asyncio
import logging

import pytest

from layerpy import logs
from layerpy.logs import BURST, WINDOW, Throttle
from layerpy.stats import Stats

from clock import Clock


def test_a_few_lines_per_kind_then_one_that_sums_up_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every line carries another address (as forged packets do); the kind alone counts."""
    clock = Clock()
    quiet = Throttle(logging.getLogger("layerpy.testquiet"), clock)
    with caplog.at_level(logging.INFO, "layerpy.testquiet"):
        for i in range(100):
            quiet.log("refused", logging.INFO, "refused 10.0.%d.9", i)
            clock.now += 0.5
        quiet.log("other kind", logging.INFO, "another kind")
        quiet.flush()  # the window is not over: nothing to sum up yet
        assert len(caplog.records) == BURST + 1
        clock.now += WINDOW - 50 + 1  # 61 s after the first line
        quiet.flush()
        quiet.log("refused", logging.INFO, "after the window")
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        *(f"refused 10.0.{i}.9" for i in range(BURST)),
        "another kind",
        "refused: … 95 more like this in the last 61 s",
        "after the window",
    ]
    assert logs.suppressed["testquiet", "refused"] == 95
    assert ("testquiet", "other kind") not in logs.suppressed


def test_a_window_is_summed_up_at_the_next_line_of_its_kind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    quiet = Throttle(logging.getLogger("layerpy.testnext"), clock, burst=1, window=10)
    with caplog.at_level(logging.INFO, "layerpy.testnext"):
        for _ in range(3):
            quiet.log("kind", logging.WARNING, "line")
        clock.now += 10
        quiet.log("kind", logging.INFO, "line")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "line"),
        (logging.WARNING, "kind: … 2 more like this in the last 10 s"),
        (logging.INFO, "line"),
    ]


def test_lines_below_the_level_are_not_counted(caplog: pytest.LogCaptureFixture) -> None:
    quiet = Throttle(logging.getLogger("layerpy.testdebug"), Clock())
    with caplog.at_level(logging.INFO, "layerpy.testdebug"):
        for _ in range(50):
            quiet.log("chatter", logging.DEBUG, "per packet")
    assert caplog.records == [] and ("testdebug", "chatter") not in logs.suppressed


def test_lines_held_back_are_in_the_metrics(caplog: pytest.LogCaptureFixture) -> None:
    quiet = Throttle(logging.getLogger("layerpy.testmetric"), Clock())
    with caplog.at_level(logging.INFO, "layerpy.testmetric"):
        for _ in range(BURST + 7):
            quiet.log("bad request", logging.INFO, "no")
    text = asyncio.run(Stats().exposition()).decode()
    assert 'layerpy_log_suppressed_total{kind="bad request",subsystem="testmetric"} 7.0' in text


def test_an_outage_is_a_line_when_it_starts_a_summary_a_window_and_a_line_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A retry every 0.5 s for three windows: not a line per retry; a second outage is
    news again at once."""
    clock = Clock()
    outage = logs.Outage(logging.getLogger("layerpy.testoutage"), "etcd watch of /x/", clock)
    with caplog.at_level(logging.INFO, "layerpy.testoutage"):
        outage.ok()  # nothing to say: no outage
        for _ in range(int(3 * WINDOW / 0.5)):
            outage.failed("no etcd member answered")
            clock.now += 0.5
            logs.flush_all()
        outage.ok()
        # flush_all also flushes what earlier tests' throttles still hold back
        said = [r.getMessage() for r in caplog.records if r.name == "layerpy.testoutage"]
        assert said[0] == "etcd watch of /x/: no etcd member answered; retrying"
        assert len(said) == 1 + 2 + 1, said  # begun, a summary a window, over (with the count)
        assert all("more like this in the last 60 s" in line for line in said[1:3]), said
        assert said[-1] == f"etcd watch of /x/: back after {3 * WINDOW:.1f} s (360 failed attempts)"
        caplog.clear()
        outage.failed("refused")
        assert [r.getMessage() for r in caplog.records] == ["etcd watch of /x/: refused; retrying"]


def test_one_failure_that_the_next_attempt_mends_is_no_outage_when_told_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A watch moves on to another member by itself: one failure is a failover, not news."""
    clock = Clock()
    outage = logs.Outage(logging.getLogger("layerpy.testfailover"), "watch", clock, after=2)
    with caplog.at_level(logging.INFO, "layerpy.testfailover"):
        outage.failed("member gone")
        outage.ok()
        assert caplog.records == []
        outage.failed("member gone")
        outage.failed("no member")
        outage.ok()
        assert [r.getMessage() for r in caplog.records] == [
            "watch: no member; retrying",
            "watch: back after 0.0 s (2 failed attempts)",
        ]
