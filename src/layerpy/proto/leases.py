"""Lease table for a DHCP address pool: who holds which address, in what state, until when.

Pure and clock-injected, so it can be asked while a DHCP answer is being decided
(:meth:`LeaseTable.candidate` and :meth:`LeaseTable.lease_of` change nothing) and written
only afterwards, by the explicit steps hold, commit, withdraw, release, decline and expire.

Allocation never scans the pool: never-used addresses come from a cursor over the range,
freed ones from an insertion-ordered set (longest free first), and expiry pops a heap of
deadlines. Records are plain dicts, so a caller can persist the table and rebuild it.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from ipaddress import IPv4Address
from typing import Any

OFFERED, BOUND, DECLINED, FREE = "offered", "bound", "declined", "free"
STATES = (OFFERED, BOUND, DECLINED, FREE)
HOLD = 60.0
"""Seconds an offered address waits for the client's REQUEST (PXE firmware can be slow)."""
QUARANTINE = 600.0
"""Seconds a declined address stays out of use: another host answered ARP for it."""


@dataclass(slots=True)
class Lease:
    """One address of the pool; a free one remembers its last client, who gets it back
    (client "" when nobody may claim it: declined, or its client moved on)."""

    address: IPv4Address
    client: str
    state: str
    expires: float

    def record(self) -> dict[str, Any]:
        return {
            "address": str(self.address),
            "client": self.client,
            "state": self.state,
            "expires": self.expires,
        }


class LeaseTable:
    """The leases of the addresses first..last (inclusive); clients are named by MAC."""

    def __init__(
        self,
        first: IPv4Address,
        last: IPv4Address,
        *,
        clock: Callable[[], float] = time.time,
        hold: float = HOLD,
        quarantine: float = QUARANTINE,
    ) -> None:
        if first > last:
            raise ValueError(f"empty pool {first}-{last}")
        self.first, self.last = first, last
        self._span = range(int(first), int(last) + 1)  # int tests: IPv4Address compares in Python
        self.clock = clock
        self.hold = hold
        self.quarantine = quarantine
        # Addresses are kept as ints inside: an IPv4Address hashes through hex(), which
        # would cost more than the rest of a DISCOVER.
        self._leases: dict[int, Lease] = {}  # every address ever used
        self._by_client: dict[str, int] = {}  # a client's current or last address
        self._recycled: OrderedDict[int, None] = OrderedDict()  # the FREE records
        self._cursor = int(first)  # below it, every address has a record
        self._deadlines: list[tuple[float, int]] = []  # (expires, address); stale entries too
        self._changed: dict[int, None] = {}  # written since the last changes()

    @property
    def range(self) -> tuple[IPv4Address, IPv4Address]:
        return self.first, self.last

    def __len__(self) -> int:
        """Addresses with a record (ever used)."""
        return len(self._leases)

    def __contains__(self, address: object) -> bool:
        return isinstance(address, IPv4Address) and int(address) in self._span

    # -- questions (no writes) ---------------------------------------------------------

    def lease_of(self, client: str) -> Lease | None:
        """The client's offered or bound lease, if it has not run out."""
        address = self._by_client.get(client)
        lease = self._leases.get(address) if address is not None else None
        if lease is None or lease.state not in (OFFERED, BOUND) or self._expired(lease):
            return None
        return lease

    def candidate(self, client: str, requested: IPv4Address | None = None) -> IPv4Address | None:
        """The address an allocation for this client would take, without taking it: its
        own (or last) address, else the one it asks for if free, else a never-used one,
        else the one free the longest; None when the pool is exhausted."""
        own = self._by_client.get(client)
        if own is not None and self._free_for(own, client):
            return self._leases[own].address
        if requested is not None and requested in self and self._free_for(int(requested), client):
            return requested
        if self._cursor in self._span:
            return IPv4Address(self._cursor)
        oldest = next(iter(self._recycled), None)
        return None if oldest is None else self._leases[oldest].address

    def records(self) -> list[dict[str, Any]]:
        """Every lease as a plain dict (address, client, state, expires), in address order."""
        return [self._leases[a].record() for a in sorted(self._leases)]

    def changes(self) -> list[Lease]:
        """The leases written since the last call (for a journal), and forget them."""
        changed = [self._leases[a] for a in self._changed]
        self._changed.clear()
        return changed

    # -- explicit steps (writes) -------------------------------------------------------

    def offer(self, client: str, address: IPv4Address) -> Lease | None:
        """Hold an address offered to a client until its REQUEST; a bound lease of the same
        client on that address stays bound. None when the address is not the client's to get."""
        lease = self.lease_of(client)
        if lease is not None and lease.address == address and lease.state == BOUND:
            return lease
        return self._take(client, address, OFFERED, self.hold)

    def commit(self, client: str, address: IPv4Address, lease_time: float) -> Lease | None:
        """The client took the address (ACK): bound for lease_time seconds from now."""
        return self._take(client, address, BOUND, lease_time)

    def withdraw(self, client: str) -> Lease | None:
        """The client chose another server's offer: the address it was offered is free again."""
        lease = self.lease_of(client)
        if lease is None or lease.state != OFFERED:
            return None
        return self._free(lease)

    def release(self, client: str, address: IPv4Address) -> Lease | None:
        """The client gave the address back (it keeps it as its preferred one)."""
        lease = self.lease_of(client)
        if lease is None or lease.address != address:
            return None
        return self._free(lease)

    def decline(self, client: str, address: IPv4Address) -> Lease | None:
        """The client found the address in use by another host: nobody gets it for a while,
        and the client forgets it (its next allocation is another address). None when the
        address is someone else's to decline."""
        lease = self._take(client, address, DECLINED, self.quarantine)
        if lease is not None:
            del self._by_client[client]
            lease.client = ""
        return lease

    def expire(self) -> list[Lease]:
        """Free every lease whose time has passed; returns them as they were (for the log)."""
        now = self.clock()
        lapsed = []
        while self._deadlines and self._deadlines[0][0] <= now:
            expires, number = heapq.heappop(self._deadlines)
            lease = self._leases[number]
            if lease.state != FREE and lease.expires == expires:  # else a stale entry
                lapsed.append(replace(lease))
                self._free(lease)
        return lapsed

    @classmethod
    def from_records(
        cls,
        first: IPv4Address,
        last: IPv4Address,
        records: Iterable[dict[str, Any]],
        **options: Any,
    ) -> LeaseTable:
        """A table rebuilt from records(); records outside first..last are left out (the
        pool was changed), malformed ones raise ValueError naming the record."""
        table = cls(first, last, **options)
        for record in records:
            try:
                lease = Lease(
                    IPv4Address(record["address"]),
                    str(record["client"]),
                    record["state"],
                    float(record["expires"]),
                )
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"bad lease record {record!r}: {error}") from None
            if lease.state not in STATES:
                raise ValueError(f"bad lease record {record!r}: state {lease.state!r}")
            if lease.address in table:
                table._restore(lease)
        table._changed.clear()  # as restored: nothing new to write
        return table

    # -- internals ---------------------------------------------------------------------

    def _expired(self, lease: Lease) -> bool:
        return lease.expires <= self.clock()

    def _free_for(self, address: int, client: str) -> bool:
        """Nobody else holds the address (a lapsed lease holds nothing, even before expire())."""
        lease = self._leases.get(address)
        if lease is None or lease.state == FREE or self._expired(lease):
            return True
        return lease.state != DECLINED and lease.client == client

    def _take(self, client: str, address: IPv4Address, state: str, seconds: float) -> Lease | None:
        number = int(address)
        if address not in self or not self._free_for(number, client):
            return None
        mine = self._by_client.get(client)
        if mine is not None and mine != number:  # a client holds one address of the pool
            old = self._leases[mine]
            if old.state in (OFFERED, BOUND):
                self._free(old)
            old.client = ""
            self._changed[mine] = None
        lease = self._leases.get(number)
        if lease is not None and self._by_client.get(lease.client) == number:
            del self._by_client[lease.client]  # its last client loses the claim
        lease = Lease(address, client, state, self.clock() + seconds)
        self._restore(lease)
        return lease

    def _restore(self, lease: Lease) -> None:
        """Put a lease in place and keep the indexes true (cursor, free set, client map)."""
        number = int(lease.address)
        self._leases[number] = lease
        self._changed[number] = None
        if lease.client:  # each client name is in one record at most
            self._by_client[lease.client] = number
        if lease.state == FREE:
            self._recycled[number] = None
        else:
            self._recycled.pop(number, None)
            heapq.heappush(self._deadlines, (lease.expires, number))
        while self._cursor in self._span and self._cursor in self._leases:
            self._cursor += 1  # each address is passed once: O(1) amortised

    def _free(self, lease: Lease) -> Lease:
        lease.state = FREE
        number = int(lease.address)
        self._recycled[number] = None
        self._changed[number] = None
        return lease
