"""Operator credentials: wrong tokens limited per source, tokens kept as digests."""

from __future__ import annotations

from pathlib import Path

from layerpy import digests
from layerpy.auth import Guesses, Scope, Tokens

from clock import Clock


def test_wrong_tokens_are_limited_per_source_and_forgiven_with_time() -> None:
    clock = Clock()
    guesses = Guesses(burst=3, every=5.0, clock=clock)
    told = [guesses.wrong("10.0.0.9") for _ in range(3)]
    assert told == [False, False, True]  # said once, when its guesses ran out
    assert guesses.wait("10.0.0.9") == 5
    assert guesses.wait("10.0.0.8") == 0  # another source is not held by it
    clock.now += 2
    assert guesses.wait("10.0.0.9") == 3
    clock.now += 3
    assert guesses.wait("10.0.0.9") == 0  # one guess earned back
    assert guesses.wrong("10.0.0.9") is False  # wrong again: refused again, not said again
    assert guesses.wait("10.0.0.9") == 5
    clock.now += 15
    assert guesses.wait("10.0.0.9") == 0  # refilled: forgotten, a new episode
    assert [guesses.wrong("10.0.0.9") for _ in range(3)][-1] is True


def test_many_guessing_sources_hold_bounded_memory() -> None:
    clock = Clock()
    guesses = Guesses(burst=1, sources=100, clock=clock)
    for number in range(10_000):
        guesses.wrong(f"10.{number >> 16 & 255}.{number >> 8 & 255}.{number & 255}")
    assert len(guesses._left) == 100
    assert guesses.wait("10.0.39.15") > 0  # the most recent are remembered


def test_operator_tokens_are_kept_as_digests(tmp_path: Path) -> None:
    tokens = Tokens(tmp_path)
    secret = tokens.create("ops", Scope.READ)
    assert secret not in (tmp_path / "tokens.json").read_text()
    assert digests.digest(secret) in (tmp_path / "tokens.json").read_text()
    assert tokens.check(secret).name == "ops" and tokens.check(secret + "x") is None
    assert digests.matches(digests.digest(secret), secret)
    assert not digests.matches(digests.digest(secret), "lpy_other")
    assert not digests.matches(None, secret)
