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
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

OFFERED, BOUND, DECLINED, FREE = "offered", "bound", "declined", "free"
STATES = (OFFERED, BOUND, DECLINED, FREE)
HOLD = 60.0
"""Seconds an offered address waits for the client's REQUEST (PXE firmware can be slow)."""
QUARANTINE = 600.0
"""Seconds a declined address stays out of use: another host answered ARP for it."""

_Held = tuple[str, str, float]
"""What the table keeps per address: (client, state, expires). A tuple of strings and a
float, because the garbage collector stops tracking such a tuple the first time it sees
it: a busy pool of 100 000 leases then adds nothing to the collector's pauses, where an
object per lease made each young collection under load take up to 1 ms (measured)."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One address of the pool as the table holds it, a snapshot; a free one remembers
    its last client, who gets it back (client "" when nobody may claim it: declined, or
    its client moved on)."""

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
        self._held: dict[int, _Held] = {}  # every address ever used
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
        return len(self._held)

    def __contains__(self, address: object) -> bool:
        return isinstance(address, IPv4Address) and int(address) in self._span

    # -- questions (no writes) ---------------------------------------------------------

    def lease_of(self, client: str) -> Lease | None:
        """The client's offered or bound lease, if it has not run out."""
        number = self._by_client.get(client)
        held = self._held.get(number) if number is not None else None
        if held is None or held[1] not in (OFFERED, BOUND) or held[2] <= self.clock():
            return None
        return Lease(IPv4Address(number), *held)

    def leased(self, address: str) -> bool:
        """Whether `address` (text, as a socket names a peer) is offered or bound now."""
        return self.holder(address) is not None

    def holder(self, address: str) -> str | None:
        """The client `address` (text, as a socket names a peer) is offered or bound to now."""
        try:
            held = self._held.get(int(IPv4Address(address)))
        except ValueError:
            return None
        if held is None or held[1] not in (OFFERED, BOUND) or held[2] <= self.clock():
            return None
        return held[0]

    def candidate(self, client: str, requested: IPv4Address | None = None) -> IPv4Address | None:
        """The address an allocation for this client would take, without taking it: its
        own (or last) address, else the one it asks for if free, else a never-used one,
        else the one free the longest; None when the pool is exhausted."""
        own = self._by_client.get(client)
        if own is not None and self._free_for(own, client):
            return IPv4Address(own)
        if requested is not None and requested in self and self._free_for(int(requested), client):
            return requested
        if self._cursor in self._span:
            return IPv4Address(self._cursor)
        oldest = next(iter(self._recycled), None)
        return None if oldest is None else IPv4Address(oldest)

    def records(self) -> list[dict[str, Any]]:
        """Every lease as a plain dict (address, client, state, expires), in address order."""
        return [self._lease(number).record() for number in sorted(self._held)]

    def changes(self, states: Container[str] = STATES) -> list[Lease]:
        """The leases written since the last call that are now in one of `states` (for a
        journal), and forget them all."""
        held = self._held
        changed = [self._lease(number) for number in self._changed if held[number][1] in states]
        self._changed.clear()
        return changed

    # -- explicit steps (writes) -------------------------------------------------------

    def offer(self, client: str, address: IPv4Address) -> Lease | None:
        """Hold an address offered to a client until its REQUEST; a bound lease of the same
        client on that address stays bound. None when the address is not the client's to get."""
        number = int(address)
        held = self._held.get(number)
        if (
            held is not None
            and held[1] == BOUND
            and held[2] > self.clock()
            and self._by_client.get(client) == number
        ):  # lease_of(client) is that bound lease, asked without making it
            return self._lease(number)
        return self._take(client, address, OFFERED, self.hold)

    def commit(self, client: str, address: IPv4Address, lease_time: float) -> Lease | None:
        """The client took the address (ACK): bound for lease_time seconds from now."""
        return self._take(client, address, BOUND, lease_time)

    def withdraw(self, client: str) -> Lease | None:
        """The client chose another server's offer: the address it was offered is free again."""
        lease = self.lease_of(client)
        if lease is None or lease.state != OFFERED:
            return None
        return self._free(int(lease.address))

    def release(self, client: str, address: IPv4Address) -> Lease | None:
        """The client gave the address back (it keeps it as its preferred one)."""
        lease = self.lease_of(client)
        if lease is None or lease.address != address:
            return None
        return self._free(int(address))

    def decline(self, client: str, address: IPv4Address) -> Lease | None:
        """The client found the address in use by another host: nobody gets it for a while,
        and the client forgets it (its next allocation is another address). None when the
        address is someone else's to decline."""
        if self._take(client, address, DECLINED, self.quarantine) is None:
            return None
        self._by_client.pop(client, None)  # client "" (no MAC) has no entry
        return self._disown(int(address))

    def expire(self) -> list[Lease]:
        """Free every lease whose time has passed; returns them as they were (for the log)."""
        now = self.clock()
        lapsed = []
        while self._deadlines and self._deadlines[0][0] <= now:
            expires, number = heapq.heappop(self._deadlines)
            _, state, held_until = self._held[number]
            if state != FREE and held_until == expires:  # else a stale entry
                lapsed.append(self._lease(number))
                self._free(number)
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
            table._restore_record(record)
        table._changed.clear()  # as restored: nothing new to write
        return table

    def adopt(self, record: dict[str, Any]) -> None:
        """Another server's record of an address (a cluster's shared pool), taken as a
        restore: not among changes() (raises ValueError when malformed)."""
        before = set(self._changed)
        self._restore_record(record)
        for number in [n for n in self._changed if n not in before]:
            del self._changed[number]

    def _restore_record(self, record: dict[str, Any]) -> None:
        try:
            address = IPv4Address(record["address"])
            held = (str(record["client"]), record["state"], float(record["expires"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"bad lease record {record!r}: {error}") from None
        if held[1] not in STATES:
            raise ValueError(f"bad lease record {record!r}: state {held[1]!r}")
        if address in self:
            self._restore(int(address), held)

    def _restore(self, number: int, held: _Held) -> None:
        """Put a record back, keeping what the table itself never writes out of it (a
        journal edited by hand can hold anything): an address's last record wins, and a
        client named twice keeps the lease that runs longest."""
        before = self._held.get(number)
        if before is not None and self._by_client.get(before[0]) == number:
            del self._by_client[before[0]]
        other = self._by_client.get(held[0]) if held[0] else None
        if other is not None and other != number:
            if self._held[other][2] >= held[2]:
                held = ("", held[1], held[2])
            else:
                self._disown(other)
        self._put(number, held)

    # -- internals ---------------------------------------------------------------------

    def _lease(self, number: int) -> Lease:
        return Lease(IPv4Address(number), *self._held[number])

    def _free_for(self, number: int, client: str) -> bool:
        """Nobody else holds the address (a lapsed lease holds nothing, even before expire())."""
        held = self._held.get(number)
        if held is None or held[1] == FREE or held[2] <= self.clock():
            return True
        return held[1] != DECLINED and held[0] == client

    def _take(self, client: str, address: IPv4Address, state: str, seconds: float) -> Lease | None:
        number = int(address)
        if number not in self._span or not self._free_for(number, client):
            return None
        mine = self._by_client.get(client)
        if mine is not None and mine != number:  # a client holds one address of the pool
            if self._held[mine][1] in (OFFERED, BOUND):
                self._free(mine)
            self._disown(mine)
        held = self._held.get(number)
        if held is not None and self._by_client.get(held[0]) == number:
            del self._by_client[held[0]]  # its last client loses the claim
        self._put(number, (client, state, self.clock() + seconds))
        return self._lease(number)

    def _put(self, number: int, held: _Held) -> None:
        """Put a lease in place and keep the indexes true (cursor, free set, client map)."""
        self._held[number] = held
        self._changed[number] = None
        client, state, expires = held
        if client:  # each client name is in one record at most
            self._by_client[client] = number
        if state == FREE:
            self._recycled[number] = None
        else:
            self._recycled.pop(number, None)
            heapq.heappush(self._deadlines, (expires, number))
        while self._cursor in self._span and self._cursor in self._held:
            self._cursor += 1  # each address is passed once: O(1) amortised

    def _free(self, number: int) -> Lease:
        client, _, expires = self._held[number]
        self._held[number] = (client, FREE, expires)
        self._recycled[number] = None
        self._changed[number] = None
        return self._lease(number)

    def _disown(self, number: int) -> Lease:
        """Nobody may claim the address back: it keeps its state, not its client."""
        _, state, expires = self._held[number]
        self._held[number] = ("", state, expires)
        self._changed[number] = None
        return self._lease(number)
