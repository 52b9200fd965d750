"""Log lines a flood cannot multiply."""

from __future__ import annotations

import logging

import pytest

from layerpy.logs import BURST, WINDOW, Throttle

from clock import Clock


def test_a_few_lines_per_source_then_one_that_says_the_rest_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    quiet = Throttle(logging.getLogger("test.quiet"), clock)
    with caplog.at_level(logging.INFO, "test.quiet"):
        for i in range(100):
            quiet.log("10.0.0.9", logging.INFO, "refused %d", i)
        quiet.log("10.0.0.8", logging.INFO, "another source")
        clock.now += WINDOW + 1
        quiet.log("10.0.0.9", logging.INFO, "after the window")
    lines = [record.getMessage() for record in caplog.records]
    assert lines[:BURST] == [f"refused {i}" for i in range(BURST)]
    assert lines[BURST].startswith("10.0.0.9: more like this in the next ")
    assert lines[BURST + 1 :] == ["another source", "after the window"]
