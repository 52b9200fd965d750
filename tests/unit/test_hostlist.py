import subprocess
import sys

import pytest

from layerpy.hostlist import MAX_EXPANSION, HostlistError, expand


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
