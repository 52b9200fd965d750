"""Fuzzing the discovery pool's lease table: rebuilt from any journal records (only
ValueError, which the boot policy turns into an empty pool), then driven by any sequence
of the DHCP core's steps and of time; its indexes stay true and what it offers it gives."""

from __future__ import annotations

from ipaddress import IPv4Address

from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.proto.leases import BOUND, OFFERED, STATES, LeaseTable

from clock import Clock
from fuzzing import FUZZ

FIRST, LAST = IPv4Address("10.99.0.200"), IPv4Address("10.99.0.205")
clients = st.sampled_from(["52:54:00:00:00:01", "52:54:00:00:00:02", "52:54:00:00:00:03", ""])
pool_addresses = st.integers(int(FIRST) - 1, int(LAST) + 1).map(IPv4Address)
records = st.fixed_dictionaries(
    {},
    optional={
        "address": st.one_of(pool_addresses.map(str), st.sampled_from(["x", "", 7, None])),
        "client": st.one_of(clients, st.integers(), st.none()),
        "state": st.one_of(st.sampled_from(STATES), st.sampled_from(["gone", 1, None])),
        "expires": st.one_of(st.floats(0, 5000), st.sampled_from(["nan", "inf", "x", None, 1e400])),
    },
)
good_records = st.fixed_dictionaries(
    {
        "address": pool_addresses.map(str),
        "client": clients,
        "state": st.sampled_from(STATES),
        "expires": st.floats(0, 5000),
    }
)
journals = st.one_of(st.lists(good_records, max_size=8), st.lists(records, max_size=8))
"""Journals as the policy wrote them (in and out of the pool), or torn and edited by hand."""
steps = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["offer", "commit", "release", "decline"]), clients, pool_addresses
        ),
        st.tuples(st.just("withdraw"), clients),
        st.tuples(st.just("candidate"), clients, st.one_of(st.none(), pool_addresses)),
        st.tuples(st.just("expire"), st.floats(0, 1000)),
    ),
    max_size=25,
)


def check_indexes(table: LeaseTable, clock: Clock) -> None:
    """Each client in one record at most; a live lease is its client's; records round-trip."""
    rows = table.records()
    named = [row["client"] for row in rows if row["client"]]
    assert len(named) == len(set(named)), rows
    for row in rows:
        lease = table.lease_of(row["client"]) if row["client"] else None
        if row["state"] in (OFFERED, BOUND) and row["expires"] > clock.now and row["client"]:
            assert lease is not None and str(lease.address) == row["address"]
    again = LeaseTable.from_records(FIRST, LAST, rows, clock=clock)
    assert again.records() == rows


@FUZZ
@given(journals, steps)
def test_lease_table(journal, actions) -> None:
    clock = Clock()
    try:
        table = LeaseTable.from_records(FIRST, LAST, journal, clock=clock)
    except ValueError:
        event("journal refused")
        return
    event("journal taken")
    for action, *arguments in actions:
        if action == "expire":
            clock.now += arguments[0]
            table.expire()
        elif action == "candidate":
            client, requested = arguments
            address = table.candidate(client, requested)
            if address is not None and client:
                assert address in table
                assert table.offer(client, address) is not None, (client, address)
        elif action == "withdraw":
            table.withdraw(arguments[0])
        elif action == "commit":
            table.commit(*arguments, 300)
        else:
            getattr(table, action)(*arguments)
        check_indexes(table, clock)
