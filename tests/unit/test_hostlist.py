import pytest

from layerpy.hostlist import HostlistError, expand


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
