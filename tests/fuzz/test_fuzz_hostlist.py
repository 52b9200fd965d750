"""Fuzzing hostlist expressions, which come from node files and from every operator
request: expand() returns at most its limit of names or raises HostlistError (nothing
else), and fold() writes names that expand() gives back."""

from __future__ import annotations

from hypothesis import event, example, given
from hypothesis import strategies as st

from layerpy.hostlist import MAX_EXPANSION, HostlistError, expand, fold

from fuzzing import FUZZ, text_or_junk

numbers = st.one_of(
    st.integers(0, 120).map(str),
    st.sampled_from(["000", "007", "099", "100", "65535"]),
    st.integers(1, 6000).map(lambda n: "9" * n),  # past Python's 4300-digit int() limit
)
ranges = st.one_of(numbers, st.builds("{}-{}".format, numbers, numbers), st.text(max_size=4))
brackets = st.lists(ranges, min_size=1, max_size=4).map(lambda items: "[" + ",".join(items) + "]")
literals = st.one_of(st.sampled_from(["cn", "10.99.0.", "sw1:swp", "x", "", " ", ",", "-"]),
                     st.text(alphabet="abc019.-:[], ", max_size=6))  # fmt: skip
patterns = st.lists(st.one_of(literals, brackets), min_size=1, max_size=6).map("".join)
expressions = st.one_of(
    st.lists(patterns, min_size=1, max_size=3).map(",".join),
    text_or_junk,
    st.integers(1, 50_000).map(lambda n: "x" + "[0-1]" * n),  # the count overflows the limit
)


@FUZZ
@given(expressions)
@example("x" + "[0-1]" * 40_000)  # the issue's own, every run
@example("cn[" + "9" * 5000 + "]")
def test_expand_raises_only_hostlist_error(expression: str) -> None:
    try:
        names = expand(expression)
    except HostlistError as error:
        assert str(error)
        event("refused")
        return
    event("expanded")
    assert 0 < len(names) <= MAX_EXPANSION


names = st.text(alphabet="abcxyz0123456789-.:", min_size=1, max_size=12)


@FUZZ
@given(st.lists(names, max_size=30))
def test_fold_gives_back_the_names(given_names: list[str]) -> None:
    folded = fold(given_names)
    if not given_names:
        assert folded == ""
        return
    assert sorted(expand(folded)) == sorted(set(given_names))
