import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerpy.hostlist import (
    MAX_BRACKETS,
    MAX_DIGITS,
    MAX_EXPANSION,
    MAX_LENGTH,
    MAX_TERMS,
    HostlistError,
    expand,
    fold,
)

# Examples per property test: a few hundred in CI (seconds), more by hand
# (LAYERPY_FUZZ_EXAMPLES=100000 .venv/bin/pytest tests/unit/test_hostlist.py).
FUZZ = settings(
    max_examples=int(os.environ.get("LAYERPY_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("cn[001-004]", ["cn001", "cn002", "cn003", "cn004"]),
        ("10.99.0.[11-13]", ["10.99.0.11", "10.99.0.12", "10.99.0.13"]),
        ("sw1:swp[1-2]", ["sw1:swp1", "sw1:swp2"]),
        ("cn[8-10]", ["cn8", "cn9", "cn10"]),
        ("cn[098-101]", ["cn098", "cn099", "cn100", "cn101"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("a[1,3-4],login", ["a1", "a3", "a4", "login"]),
        ("single", ["single"]),
        ("n[0]", ["n0"]),
    ],
)
def test_expand(expression: str, names: list[str]) -> None:
    assert expand(expression) == names


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("cn[1-", "'[' is never closed"),
        ("cn]", "']' without '['"),
        ("cn[a]", "must hold numbers or ranges"),
        ("cn[[1]]", "nested brackets"),
        ("cn[4-1]", "runs backwards"),
        ("a,,b", "empty name"),
        ("c[]", "must hold numbers"),
        ("n[0-99999999]", "too large"),
    ],
)
def test_errors(expression: str, message: str) -> None:
    with pytest.raises(HostlistError, match=message.replace("[", r"\[")):
        expand(expression)


def test_limit_counts_every_part_and_bracket() -> None:
    assert len(expand("n[1-100000]")) == MAX_EXPANSION
    assert len(expand("r[1-10]n[1-100],n[1-99000]")) == MAX_EXPANSION
    for expression in (
        "n[0-100000]",
        "a[1-60000],b[1-60000]",
        "r[1-2]n[1-50001]",
        "n[1-3,1-99998]",
    ):
        with pytest.raises(
            HostlistError, match=r"too large: 1[02]000\d names, the limit is 100000"
        ):
            expand(expression)
    assert expand("n[1-3]", limit=3) == ["n1", "n2", "n3"]
    with pytest.raises(HostlistError, match="too large: 4 names, the limit is 3"):
        expand("n[1-4]", limit=3)


# In a child with little address space: an expansion built before it is sized dies of
# MemoryError there (after seconds) instead of eating this machine's memory.
HUGE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
from layerpy.hostlist import MAX_EXPANSION, HostlistError, expand
try:
    expand("x[0-999][0-999][0-999]")
except HostlistError as error:
    print(error)
"""


def test_huge_expansion_is_refused_before_it_is_built() -> None:
    result = subprocess.run(
        [sys.executable, "-c", HUGE], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "'x[0-999][0-999][0-999]' is too large: 1000000000 names, the limit is 100000\n"
    )


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x" + "[0-1]" * 40_000, r"\(200001 characters\) is too long: the limit is 65536"),
        ("n" * (MAX_LENGTH + 1), r"\(65537 characters\) is too long: the limit is 65536"),
        ("n[" + "1," * MAX_TERMS + "1]", "has too many terms: 10002, the limit is 10000"),
        ("a," * MAX_TERMS + "a", "has too many terms: 10001, the limit is 10000"),
        ("x" + "[0-1]" * (MAX_BRACKETS + 1), "has 9 bracket groups, the limit is 8 in one name"),
        ("n[" + "1" * (MAX_DIGITS + 1) + "]", "a number in brackets has over 18 digits"),
        ("n[1-" + "9" * 5000 + "]", "a number in brackets has over 18 digits"),
        ("x" + "[0-999999999999999999]" * MAX_BRACKETS, "is too large: about 1e144 names"),
    ],
)
def test_limits_are_checked_before_anything_is_computed(expression: str, message: str) -> None:
    """Each refusal is a HostlistError (the API's 400), short, and says the limit; before
    the limits the first two were a ValueError from formatting a count of 12 000 digits,
    the fourth from int() of a 5 000-digit number."""
    with pytest.raises(HostlistError, match=message) as refused:
        expand(expression)
    assert len(str(refused.value)) < 200


def test_the_limits_themselves_are_allowed() -> None:
    assert expand("n" + "[1]" * MAX_BRACKETS) == ["n" + "1" * MAX_BRACKETS]
    assert expand("n[" + "9" * MAX_DIGITS + "]") == ["n" + "9" * MAX_DIGITS]
    at_most = "n[" + ",".join(str(i) for i in range(MAX_TERMS - 1)) + "]"
    assert len(expand(at_most)) == MAX_TERMS - 1
    longest = "n[1]" + "x" * (MAX_LENGTH - 4)
    assert expand(longest) == ["n1" + "x" * (MAX_LENGTH - 4)]


# In a child with a time limit: a quadratic split of the names (as the regular expression
# fold used made of digits that end in a letter) takes minutes there, this takes ms.
FOLD = """
from layerpy.hostlist import fold
names = ["1" * 200_000 + "a", "n" + "7" * 5000, "cn007", "cn008"]
print(fold(names))
"""


def test_fold_takes_time_in_proportion_to_the_names() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FOLD], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    long_digits = "n" + "7" * 5000  # kept as it is: more than MAX_DIGITS digits
    assert result.stdout == f"{'1' * 200_000}a,{long_digits},cn[007-008]\n"


# -- properties ------------------------------------------------------------------------------

numbers = st.integers(0, 10**MAX_DIGITS - 1)
items = st.one_of(
    numbers.map(str),
    st.tuples(numbers, st.integers(0, 50)).map(lambda pair: f"{pair[0]}-{pair[0] + pair[1]}"),
    st.integers(0, 999).map(lambda n: f"{n:04d}"),
)
brackets = st.lists(items, min_size=1, max_size=4).map(lambda parts: "[" + ",".join(parts) + "]")
names_with_brackets = st.lists(
    st.one_of(st.text("abcxyz-._:", min_size=1, max_size=4), brackets), min_size=1, max_size=12
).map("".join)
expressions = st.lists(names_with_brackets, min_size=1, max_size=6).map(",".join)
at_the_limits = st.one_of(  # each side of every limit, and far past it
    st.integers(1, 3 * MAX_BRACKETS).map(lambda n: "x" + "[0-1]" * n),
    st.integers(1, 20_000).map(lambda n: "x" + "[0-1]" * n),
    st.integers(1, 3 * MAX_DIGITS).map(lambda n: "n[" + "9" * n + "]"),
    st.integers(4_000, 6_000).map(lambda n: "n[1-" + "9" * n + "]"),
    st.integers(MAX_TERMS - 3, MAX_TERMS + 3).map(lambda n: "n[" + "1," * (n - 2) + "1]"),
    st.integers(MAX_LENGTH - 3, MAX_LENGTH + 3).map(lambda n: "n" * n),
    st.integers(MAX_EXPANSION - 3, MAX_EXPANSION + 3).map(lambda n: f"n[1-{n}]"),
)
garbage = st.one_of(
    at_the_limits,
    st.text(max_size=200),
    st.text("[]-,0123456789 ", max_size=300),
    st.lists(
        st.sampled_from(["[", "]", ",", "-", "0", "9", "x", "[0-1]", "[0-99999]"]), max_size=400
    ).map("".join),
)


@FUZZ
@given(st.one_of(expressions, garbage))
def test_any_text_expands_or_says_why(expression: str) -> None:
    """Valid, near the limits, or garbage: a list within the limit, or a HostlistError
    with a short message, never another exception."""
    try:
        names = expand(expression)
    except HostlistError as refused:
        assert len(str(refused)) < 200
    else:
        assert 1 <= len(names) <= MAX_EXPANSION


@FUZZ
@given(
    st.sets(
        st.tuples(st.sampled_from(["cn", "r1n", "gpu-", ""]), st.integers(0, 2000), st.booleans()),
        min_size=1,
        max_size=300,
    )
)
def test_fold_gives_back_the_names(numbered: set[tuple[str, int, bool]]) -> None:
    names = {f"{prefix}{n:04d}" if padded else f"{prefix}{n}" for prefix, n, padded in numbered}
    names = {name for name in names if name}
    assert sorted(expand(fold(names))) == sorted(names)
