"""What every fuzz test shares: the Hypothesis settings of this run, and strategies.

Two profiles: "ci" (the default) is bounded and the same on every run; "long" is for a run
by hand, ``LAYERPY_FUZZ=long`` (see README.md here). ``LAYERPY_FUZZ_EXAMPLES`` sets the
number of examples of either. Applied per test (``@FUZZ``), never as the global default,
so other property tests in the suite keep their own settings.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
PROFILE = os.environ.get("LAYERPY_FUZZ", "ci")
_EXAMPLES = os.environ.get("LAYERPY_FUZZ_EXAMPLES")

# Bounded and reproducible: a fixed sequence of examples (derandomize) and no example
# database, so a CI failure is the same failure on a second run and on a laptop.
settings.register_profile(
    "layerpy-ci",
    max_examples=int(_EXAMPLES or 150),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=_QUIET,
    print_blob=True,
)
# By hand: many more random examples; failures are kept in .hypothesis/ and replayed first.
settings.register_profile(
    "layerpy-long",
    max_examples=int(_EXAMPLES or 20_000),
    deadline=None,
    suppress_health_check=_QUIET,
    print_blob=True,
)
if PROFILE not in ("ci", "long"):
    raise ValueError(f"LAYERPY_FUZZ={PROFILE!r}: use ci (the default) or long")
FUZZ = settings.get_profile(f"layerpy-{PROFILE}")
"""The decorator every fuzz test carries: ``@FUZZ`` over ``@given(...)``."""

text_or_junk = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\0", "\n", "..", "/", "\x1b[31m", "é", "\ud800"]),
    st.integers(1000, 6000).map(lambda n: "0" * n),
)
"""Strings as an attacker or a careless operator writes them: short, odd, or huge."""


# -- DHCP ------------------------------------------------------------------------------------

SERVER = "10.99.0.1"
RELAY = "10.99.0.254"
NODE_MACS = ("52:54:00:99:00:11", "52:54:00:99:00:12", "52:54:00:99:00:13")
"""cn001, cn002 (in the test node file) and a machine no node has."""

addresses = st.one_of(
    st.sampled_from(["0.0.0.0", SERVER, RELAY, "10.99.0.11", "10.99.0.13", "10.99.0.200",
                     "10.99.0.250", "10.99.1.1", "255.255.255.255", "127.0.0.1"]),
    st.ip_addresses(v=4).map(str),
)  # fmt: skip
"""IPv4 addresses that matter to the test node file (its server, relay, nodes, pool), or any."""
clients = st.one_of(st.sampled_from(["10.99.0.11", "10.99.0.13", "10.99.0.200"]), addresses)
"""Addresses a client has or wants: mostly those of the test node file's nodes and pool."""
unset_mostly = st.one_of(st.just("0.0.0.0"), st.just("0.0.0.0"), clients)


CLIENT_KINDS = (1, 3, 4, 7, 8)  # DISCOVER, REQUEST, DECLINE, RELEASE, INFORM
rarely = st.sampled_from([False] * 9 + [True])
"""True one time in ten (False first: Hypothesis favours the first, simplest choice)."""


def option(code: int, value: bytes) -> bytes:
    """One option as the wire carries it: split into 255-byte pieces (RFC 3396)."""
    if not value:
        return bytes((code, 0))
    return b"".join(
        bytes((code, len(value[at : at + 255]))) + value[at : at + 255]
        for at in range(0, len(value), 255)
    )


@st.composite
def sub_options(draw: st.DrawFn, codes: list[int]) -> bytes:
    """Option 43, 82 or 175's sub-options: TLVs (mostly of the known codes), maybe cut short."""
    pairs = draw(
        st.lists(
            st.tuples(
                st.one_of(st.sampled_from(codes), st.integers(0, 255)),
                st.one_of(st.sampled_from([b"swp3", b"swp1", b"sw1", b"\x01", b"\0" * 3]),
                          st.binary(max_size=70)),
            ),
            max_size=4,
        )
    )  # fmt: skip
    data = b"".join(bytes((code, len(value))) + value for code, value in pairs)
    if data and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # a length that runs past the end
    return data


def _ip_option(value: str) -> bytes:
    return bytes(int(part) for part in value.split("."))


option_values = {
    53: st.one_of(st.integers(1, 8).map(lambda n: bytes((n,))), st.binary(max_size=2)),
    60: st.one_of(
        st.sampled_from(
            [
                b"PXEClient:Arch:00000:UNDI:002001",
                b"PXEClient:Arch:00007:UNDI:003016",
                b"HTTPClient:Arch:00016:UNDI:003001",
                b"PXEClient",
                b"udhcp 1.35.0",
            ]
        ),
        st.binary(max_size=40),
    ),
    93: st.one_of(
        st.sampled_from([0, 7, 9, 11, 16, 19, 6]).map(lambda n: n.to_bytes(2)),
        st.binary(max_size=5),
    ),
    77: st.one_of(st.just(b"iPXE"), st.binary(max_size=20)),
    50: st.one_of(clients.map(_ip_option), st.binary(max_size=6)),
    54: st.one_of(addresses.map(_ip_option), st.binary(max_size=6)),
    57: st.one_of(st.integers(0, 0xFFFF).map(lambda n: n.to_bytes(2)), st.binary(max_size=3)),
    55: st.binary(max_size=60),
    61: st.binary(max_size=600),  # a long one crosses the 255-byte pieces
    12: st.binary(max_size=300),
    43: sub_options([1, 6, 8, 9, 10, 71, 255]),
    82: sub_options([1, 2, 5, 9, 11, 151]),
    175: sub_options([1, 2, 3, 19, 176, 177, 181]),
}


@st.composite
def option_area(draw: st.DrawFn, room: int | None = None) -> bytes:
    """A run of options (known codes with plausible or odd values, and any code at all),
    with pads, maybe ended; at most `room` bytes (sname and file are fixed fields)."""
    codes = draw(
        st.lists(st.one_of(st.sampled_from(sorted(option_values)), st.integers(1, 254)),
                 max_size=10)
    )  # fmt: skip
    parts = []
    for code in codes:
        strategy = option_values.get(code, st.binary(max_size=300))
        parts.append(option(code, draw(strategy)))
        if draw(rarely):
            parts.append(b"\0" * draw(st.integers(1, 3)))  # pads between options
    if room is not None:  # whole options that fit, mostly; sometimes one cut short
        kept = b""
        for part in parts:
            if len(kept) + len(part) > room:
                break
            kept += part
        parts = [kept]
        if draw(rarely):
            parts = [b"".join(parts)[:room]]
    data = b"".join(parts) + (b"\xff" if draw(st.booleans()) else b"")
    return data if room is None else data[:room]


@st.composite
def dhcp_datagrams(draw: st.DrawFn) -> bytes:
    """A BOOTP/DHCP datagram that is well formed often enough to reach every decision:
    header fields that matter here, chaddr a known MAC or not, options (long ones split,
    sub-options of 43, 82 and 175), overloaded sname and file (option 52), then maybe
    mutated: bytes flipped, cut short, or junk added."""
    mac = draw(st.one_of(st.sampled_from(NODE_MACS), st.binary(min_size=6, max_size=6).map(
        lambda b: b.hex(":"))))  # fmt: skip
    chaddr = draw(st.one_of(
        st.just(bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0")),
        st.binary(min_size=16, max_size=16),
    ))  # fmt: skip
    overload = draw(st.one_of(st.none(), st.none(), st.integers(1, 3), st.integers(0, 4)))
    sname = draw(option_area(64)) if overload in (2, 3) else draw(st.binary(max_size=64))
    file = draw(option_area(128)) if overload in (1, 3) else draw(st.binary(max_size=128))
    header = (
        bytes((draw(st.sampled_from([2, 0, 3])) if draw(rarely) else 1, 1,
               draw(st.sampled_from([0, 16, 17, 255])) if draw(rarely) else 6,
               draw(st.integers(0, 255))))
        + draw(st.binary(min_size=4, max_size=4))  # xid
        + draw(st.binary(min_size=2, max_size=2))  # secs
        + draw(st.sampled_from([b"\0\0", b"\x80\0", b"\xff\xff"]))
        + _ip_option(draw(unset_mostly))  # ciaddr
        + _ip_option(draw(unset_mostly)) * 2  # yiaddr, siaddr (ignored)
        + _ip_option(draw(st.one_of(st.just("0.0.0.0"), st.just(RELAY), addresses)))  # giaddr
        + chaddr
        + sname.ljust(64, b"\0")
        + file.ljust(128, b"\0")
        + bytes.fromhex("63825363")
    )  # fmt: skip
    options = draw(option_area())
    if not draw(rarely):  # most carry a message type, of a kind a server answers
        kind = draw(st.integers(0, 255)) if draw(rarely) else draw(st.sampled_from(CLIENT_KINDS))
        wanted = (option(50, _ip_option(draw(clients))) if draw(st.booleans()) else b"") + (
            option(54, _ip_option(draw(st.sampled_from([SERVER, "10.99.0.2"]))))
            if draw(st.booleans()) else b""
        )  # fmt: skip
        options = option(53, bytes((kind,))) + wanted + options
    if overload is not None:
        options = option(52, bytes((overload,))) + options
    data = header + options
    for _ in range(draw(st.integers(1, 3)) if draw(rarely) else 0):
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes((draw(st.integers(0, 255)),)) + data[at + 1 :]
    if draw(rarely):
        data = data[: draw(st.integers(0, len(data)))]
    if draw(rarely):
        data += draw(st.binary(max_size=64))
    return data


any_datagram = st.one_of(*[dhcp_datagrams()] * 4, st.binary(max_size=600))
"""Mostly well-formed DHCP datagrams (most decisions need one), sometimes any bytes."""
