"""The pool's lease table: allocation order, holds, commits, release, decline, expiry, records."""

from __future__ import annotations

from ipaddress import IPv4Address

import pytest

from layerpy.proto.leases import BOUND, DECLINED, FREE, HOLD, OFFERED, QUARANTINE, LeaseTable

from clock import Clock

IP = IPv4Address
A, B, C = "52:54:00:00:00:0a", "52:54:00:00:00:0b", "52:54:00:00:00:0c"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def table(clock: Clock, first: str = "10.0.0.10", last: str = "10.0.0.12") -> LeaseTable:
    return LeaseTable(IP(first), IP(last), clock=clock)


def bind(leases: LeaseTable, client: str, lease_time: float = 300) -> IPv4Address:
    """What a DISCOVER, OFFER, REQUEST, ACK exchange does to the table."""
    address = leases.candidate(client)
    assert address is not None
    assert leases.offer(client, address) is not None
    assert leases.commit(client, address, lease_time) is not None
    return address


def test_candidate_is_a_question_and_offer_the_answer(clock) -> None:
    leases = table(clock)
    assert leases.candidate(A) == leases.candidate(A) == IP("10.0.0.10")
    assert leases.records() == [] and leases.lease_of(A) is None
    lease = leases.offer(A, IP("10.0.0.10"))
    assert (lease.state, lease.expires) == (OFFERED, 1000 + HOLD)
    assert leases.lease_of(A) == lease
    assert leases.candidate(A) == IP("10.0.0.10")  # its own, again
    assert leases.candidate(B) == IP("10.0.0.11")


def test_never_used_addresses_first_then_the_longest_free(clock) -> None:
    leases = table(clock)
    assert [bind(leases, c) for c in (A, B, C)] == [
        IP("10.0.0.10"),
        IP("10.0.0.11"),
        IP("10.0.0.12"),
    ]
    assert leases.candidate("52:54:00:00:00:0d") is None  # exhausted
    leases.release(B, IP("10.0.0.11"))
    leases.release(A, IP("10.0.0.10"))
    assert leases.candidate("52:54:00:00:00:0d") == IP("10.0.0.11")


def test_a_client_gets_its_last_address_back_unless_someone_took_it(clock) -> None:
    leases = table(clock)
    mine = bind(leases, A)
    assert leases.release(A, mine).state == FREE
    assert leases.lease_of(A) is None
    assert leases.candidate(A) == mine
    leases = table(clock, last="10.0.0.10")  # one address: it must go to the next client
    bind(leases, A)
    leases.release(A, IP("10.0.0.10"))
    bind(leases, B)
    assert leases.candidate(A) is None


def test_a_requested_address_is_honoured_when_free_and_in_the_pool(clock) -> None:
    leases = table(clock)
    assert leases.candidate(A, IP("10.0.0.12")) == IP("10.0.0.12")
    leases.offer(A, IP("10.0.0.12"))
    assert leases.candidate(B, IP("10.0.0.12")) == IP("10.0.0.10")  # held by A
    assert leases.candidate(B, IP("10.0.0.99")) == IP("10.0.0.10")  # outside the pool
    assert [bind(leases, c) for c in (B, C)] == [
        IP("10.0.0.10"),
        IP("10.0.0.11"),
    ]  # cursor skips .12


def test_nobody_takes_an_address_held_by_another(clock) -> None:
    leases = table(clock)
    leases.offer(A, IP("10.0.0.10"))
    assert leases.offer(B, IP("10.0.0.10")) is None
    assert leases.commit(B, IP("10.0.0.10"), 300) is None
    assert leases.offer(B, IP("10.0.0.99")) is None  # outside the pool
    assert leases.lease_of(A).client == A


def test_one_address_per_client(clock) -> None:
    leases = table(clock)
    leases.commit(A, IP("10.0.0.10"), 300)
    leases.commit(A, IP("10.0.0.11"), 300)
    assert leases.lease_of(A).address == IP("10.0.0.11")
    assert [r["state"] for r in leases.records()] == [FREE, BOUND]
    assert leases.candidate(B) == IP("10.0.0.12")  # never used beats recycled
    assert leases.candidate(B, IP("10.0.0.10")) == IP("10.0.0.10")  # nobody's any more


def test_an_offer_lapses_unless_committed(clock) -> None:
    leases = table(clock)
    leases.offer(A, IP("10.0.0.10"))
    clock.now += HOLD
    assert leases.lease_of(A) is None
    assert leases.candidate(B, IP("10.0.0.10")) == IP("10.0.0.10")  # lapsed holds nothing
    assert [(lease.client, lease.state) for lease in leases.expire()] == [(A, OFFERED)]
    assert leases.records()[0]["state"] == FREE


def test_a_discover_from_a_bound_client_keeps_its_lease(clock) -> None:
    leases = table(clock)
    address = bind(leases, A, lease_time=600)
    assert leases.offer(A, address).state == BOUND
    clock.now += 599
    assert leases.expire() == [] and leases.lease_of(A).state == BOUND


def test_renewal_moves_the_deadline(clock) -> None:
    leases = table(clock)
    address = bind(leases, A)
    clock.now += 200
    leases.commit(A, address, 300)
    clock.now += 150  # past the first deadline, before the second
    assert leases.expire() == []
    clock.now += 150
    assert [lease.state for lease in leases.expire()] == [BOUND]
    assert leases.lease_of(A) is None and leases.candidate(A) == address


def test_withdraw_frees_only_a_held_offer(clock) -> None:
    leases = table(clock)
    leases.offer(A, IP("10.0.0.10"))
    assert leases.withdraw(A).state == FREE
    bind(leases, B)
    assert leases.withdraw(B) is None and leases.lease_of(B).state == BOUND


def test_release_needs_the_holder_and_its_address(clock) -> None:
    leases = table(clock)
    address = bind(leases, A)
    assert leases.release(B, address) is None
    assert leases.release(A, IP("10.0.0.11")) is None
    assert leases.lease_of(A).state == BOUND


def test_a_declined_address_is_quarantined_then_reused(clock) -> None:
    leases = table(clock, last="10.0.0.11")
    leases.offer(A, IP("10.0.0.10"))
    assert leases.decline(B, IP("10.0.0.10")) is None  # not B's to decline
    declined = leases.decline(A, IP("10.0.0.10"))
    assert (declined.state, declined.client, declined.expires) == (DECLINED, "", 1000 + QUARANTINE)
    assert leases.candidate(A) == IP("10.0.0.11")  # the decliner does not get it back
    assert leases.candidate(B, IP("10.0.0.10")) == IP("10.0.0.11")
    bind(leases, A, lease_time=2 * QUARANTINE)
    assert leases.candidate(B) is None  # quarantine: the pool is exhausted
    clock.now += QUARANTINE
    assert [lease.state for lease in leases.expire()] == [DECLINED]
    assert leases.candidate(B) == IP("10.0.0.10")


def test_records_round_trip(clock) -> None:
    leases = table(clock, last="10.0.0.20")
    bind(leases, A)
    leases.offer(B, IP("10.0.0.15"))
    bind(leases, C)
    leases.release(C, IP("10.0.0.11"))
    leases.offer("52:54:00:00:00:0d", IP("10.0.0.12"))
    leases.decline("52:54:00:00:00:0d", IP("10.0.0.12"))
    records = leases.records()
    assert records[0] == {"address": "10.0.0.10", "client": A, "state": BOUND, "expires": 1300.0}
    again = LeaseTable.from_records(IP("10.0.0.10"), IP("10.0.0.20"), records, clock=clock)
    assert again.records() == records
    for client in (A, B, C, "52:54:00:00:00:0e"):
        assert again.candidate(client) == leases.candidate(client)
    assert again.candidate("52:54:00:00:00:0e") == IP("10.0.0.13")
    assert again.lease_of(B).state == OFFERED


def test_records_outside_a_changed_pool_are_left_out(clock) -> None:
    leases = table(clock)
    for client in (A, B, C):
        bind(leases, client)
    smaller = LeaseTable.from_records(
        IP("10.0.0.11"), IP("10.0.0.20"), leases.records(), clock=clock
    )
    assert [r["client"] for r in smaller.records()] == [B, C]
    assert smaller.candidate(A) == IP("10.0.0.13")


@pytest.mark.parametrize(
    "record",
    [
        {"address": "10.0.0.10", "client": A, "state": "lost", "expires": 1.0},
        {"address": "nowhere", "client": A, "state": BOUND, "expires": 1.0},
        {"address": "10.0.0.10", "client": A, "state": BOUND},
    ],
)
def test_malformed_records_are_refused_by_name(clock, record) -> None:
    with pytest.raises(ValueError, match="bad lease record"):
        LeaseTable.from_records(IP("10.0.0.10"), IP("10.0.0.12"), [record], clock=clock)


def test_a_journal_naming_a_client_or_an_address_twice(clock) -> None:
    """Found by tests/fuzz: records that no table writes (a journal edited by hand) left
    two records naming one client, or a client's index on an address another holds, so
    lease_of() missed a live lease or answered with another client's. A client keeps the
    lease that runs longest; an address, its last record."""
    records = [
        {"address": "10.0.0.10", "client": A, "state": BOUND, "expires": 2000.0},
        {"address": "10.0.0.11", "client": A, "state": OFFERED, "expires": 1010.0},
        {"address": "10.0.0.12", "client": B, "state": BOUND, "expires": 2000.0},
        {"address": "10.0.0.12", "client": C, "state": BOUND, "expires": 2000.0},
    ]
    leases = LeaseTable.from_records(IP("10.0.0.10"), IP("10.0.0.12"), records, clock=clock)
    assert [(r["address"], r["client"]) for r in leases.records()] == [
        ("10.0.0.10", A), ("10.0.0.11", ""), ("10.0.0.12", C)
    ]  # fmt: skip
    assert leases.lease_of(A).address == IP("10.0.0.10")
    assert leases.lease_of(B) is None and leases.lease_of(C).address == IP("10.0.0.12")


def test_a_client_without_a_mac_declines(clock) -> None:
    """Found by tests/fuzz: a DHCP client with hlen 0 is client "" (never indexed), and
    its DECLINE raised KeyError out of decline(): a traceback per datagram."""
    leases = table(clock)
    assert leases.offer("", IP("10.0.0.10")) is not None
    declined = leases.decline("", IP("10.0.0.10"))
    assert declined is not None and declined.state == DECLINED
    assert leases.candidate(A) == IP("10.0.0.11")


def test_a_huge_pool_costs_nothing_until_used(clock) -> None:
    """A /8 pool: a table that listed its free addresses would hold 16 million of them."""
    leases = table(clock, first="10.0.0.0", last="10.255.255.255")
    assert [bind(leases, c) for c in (A, B)] == [IP("10.0.0.0"), IP("10.0.0.1")]
    assert len(leases.records()) == 2


def test_an_empty_range_is_refused(clock) -> None:
    with pytest.raises(ValueError, match="empty pool"):
        table(clock, first="10.0.0.12", last="10.0.0.10")


def test_a_decline_after_the_offer_lapsed_still_quarantines(clock) -> None:
    """The address is in use on the wire whether or not the hold ran out meanwhile."""
    leases = table(clock)
    leases.offer(A, IP("10.0.0.10"))
    clock.now += HOLD
    assert leases.decline(A, IP("10.0.0.10")).state == DECLINED
    assert leases.candidate(B, IP("10.0.0.10")) == IP("10.0.0.11")


def test_leased_names_the_addresses_in_use_now(clock) -> None:
    """What the connection budgets ask of a peer's address: offered or bound, not run out."""
    leases = table(clock)
    address = bind(leases, A, lease_time=300)
    assert leases.leased(str(address)) and not leases.leased("10.0.0.11")
    assert not leases.leased("fe80::1") and not leases.leased("")
    clock.now += 301
    assert not leases.leased(str(address))
