"""Membership: this instance's etcd lease, its record ``<prefix>/instances/<name>`` attached to
that lease, and the live instances (docs/ha.md, "Ownership and fencing").

The lease is granted for ``ttl`` seconds and kept alive every ttl/3 (client-go's retry period);
each answered keepalive, confirmed by a linearizable read (etcd's leader answers keepalives
without quorum), moves the local deadline (``fence.LeaseClock``). When etcd says the
lease is gone, a new one is granted and the record put again: the instance's owner keys went
with the old lease, and ownership claims afresh only what is still unowned.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from ipaddress import IPv4Address

from layerpy import __version__
from layerpy.cluster.assign import Segments, parse_segment
from layerpy.cluster.etcd import Compare, Etcd, EtcdError, EtcdUnavailable, Op
from layerpy.cluster.fence import LeaseClock
from layerpy.cluster.mirror import Mirror

log = logging.getLogger("layerpy.cluster")

GONE_KEPT = 256  # instances remembered after they left, for the operator's "last seen"


@dataclass(frozen=True)
class Instance:
    """An instance's record, as every instance reads it (the agents' server lists too)."""

    name: str
    url: str  # its boot HTTP, e.g. http://10.99.0.1:8080
    segment: str  # "" or an IPv4 subnet (assign.serves)
    started: float  # wall clock, seconds since the epoch
    version: str  # layerpy's

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Instance:
        """Raises ValueError naming what is wrong: a record is read, never trusted."""
        record = json.loads(data)
        if not isinstance(record, dict):
            raise ValueError("an instance record is not a JSON object")
        fields = {"name": str, "url": str, "segment": str, "started": (int, float), "version": str}
        for field, kind in fields.items():
            if not isinstance(record.get(field), kind):
                raise ValueError(f"an instance record's {field!r} is missing or mistyped")
        parse_segment(record["segment"])
        return cls(**{field: record[field] for field in fields})


def serving(instances: Iterable[Instance], address: IPv4Address | None) -> list[Instance]:
    """The instances that serve a node at ``address``, by name: an agent's server list."""
    by_name = {instance.name: instance for instance in instances}
    names = Segments({name: i.segment for name, i in by_name.items()}).candidates(address)
    return [by_name[name] for name in sorted(names)]


def check_name(name: str) -> str:
    """An instance's name is a key segment: no '/', printable, short."""
    if not (0 < len(name) <= 63) or "/" in name or not name.isprintable() or name != name.strip():
        raise ValueError(f"instance name {name!r}: 1 to 63 printable characters, no '/'")
    return name


class Membership:
    """Keeps this instance registered and mirrors the live instances.

    ``on_lease`` is called after every change of the lease's freshness (keepalive answered,
    deadline passed, lease lost, new lease); ``on_members`` after the live set changed."""

    def __init__(
        self,
        etcd: Etcd,
        *,
        prefix: str,
        name: str,
        url: str,
        segment: str = "",
        ttl: int = 5,
        margin: float = 1.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        parse_segment(segment)
        if ttl < 2 or not 0 <= margin < ttl / 2:
            raise ValueError(f"lease_ttl {ttl} s is too short for a {margin} s margin")
        self.etcd = etcd
        self.key_prefix = f"{prefix}/instances/"
        self.me = Instance(check_name(name), url, segment, time.time(), __version__)
        self.ttl = ttl
        self.clock = LeaseClock(margin)
        self.now = now
        self.live: dict[str, Instance] = {}
        self.gone: dict[str, float] = {}  # name → wall time it was seen leaving
        self.on_lease: Callable[[], None] = lambda: None
        self.on_members: Callable[[], None] = lambda: None
        self._mirror = Mirror(etcd, self.key_prefix, self._members_changed)
        self._tasks: list[asyncio.Task[None]] = []
        self._renewed = asyncio.Event()

    @property
    def name(self) -> str:
        return self.me.name

    async def start(self) -> None:
        """Register (waiting up to a TTL for a previous run of this name to expire), then keep
        the lease alive and follow the instances. Raises RuntimeError if the name is taken."""
        await self._register(wait_for_name=self.ttl + 1.0)
        self._tasks = [
            asyncio.create_task(self._keepalive(), name="cluster-keepalive"),
            asyncio.create_task(self._watchdog(), name="cluster-deadline"),
            asyncio.create_task(self._mirror.run(), name="cluster-instances"),
        ]
        for task in self._tasks:
            task.add_done_callback(_ended)

    async def stop(self) -> None:
        """Leave: revoke the lease, so this instance's record and owner keys go at once and
        the others take its nodes over without waiting for the TTL."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        lease, self.clock.lease = self.clock.lease, 0
        self.clock.lost()
        if lease:
            try:
                await self.etcd.revoke(lease)
            except (EtcdUnavailable, EtcdError) as error:
                log.warning(
                    "leaving: could not revoke the lease (it expires in %d s): %s", self.ttl, error
                )

    async def _register(self, wait_for_name: float = 0.0) -> None:
        """Grant a lease and put the record on it, unless another lease holds this name."""
        key = self.key_prefix + self.name
        give_up = self.now() + wait_for_name
        while True:
            sent = self.now()
            lease = await self.etcd.grant(self.ttl)
            result = await self.etcd.txn(
                [Compare.version(key, "==", 0)], [Op.put(key, self.me.to_json(), lease=lease)]
            )
            if result.succeeded:
                self.clock.granted(lease, sent, self.ttl)
                log.info(
                    "instance %s registered in etcd with lease %x (%d s)",
                    self.name,
                    lease,
                    self.ttl,
                )
                self._renewed.set()
                self._tell_lease()
                return
            await self.etcd.revoke(lease)
            if self.now() >= give_up:
                raise RuntimeError(f"another instance named {self.name!r} is alive in etcd")
            await asyncio.sleep(0.5)

    async def _keepalive(self) -> None:
        while True:
            lease, sent = self.clock.lease, self.now()
            try:
                left = await self.etcd.keepalive(lease)
                if left <= 0:
                    log.warning("etcd lease %x is gone: registering %s again", lease, self.name)
                    self.clock.lost()
                    self._tell_lease()
                    await self._register(wait_for_name=self.ttl + 1.0)
                    continue
                # etcd 3.4's leader renews a lease by itself, without quorum, until it steps
                # down (up to two election timeouts): only a linearizable read (confirmed by
                # a quorum) after the keepalive makes its answer count
                await self.etcd.get(self.key_prefix + self.name)
            except (EtcdUnavailable, EtcdError, RuntimeError) as error:
                log.debug("keepalive: %s", error)
                await asyncio.sleep(min(0.5, self.ttl / 10))
                continue
            self.clock.renewed(lease, sent, left)
            self._renewed.set()
            self._tell_lease()
            await asyncio.sleep(self.ttl / 3)

    async def _watchdog(self) -> None:
        """Say the lease is stale at its deadline, without waiting for etcd to say anything."""
        while True:
            self._renewed.clear()
            delay = self.clock.deadline - self.now()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._renewed.wait(), delay + 0.001)
                    continue
                except TimeoutError:
                    pass
            self._tell_lease()
            await self._renewed.wait()

    def _tell_lease(self) -> None:
        """``on_lease``, whose failure is logged and goes no further: it must stop neither
        the keepalives nor the deadline (a listener that raised once in the keepalive
        task ended it silently: no more renewals, the fence closed for good)."""
        try:
            self.on_lease()
        except Exception:
            log.exception("telling of a change of the etcd lease failed")

    def _members_changed(self, keys: set[str]) -> None:
        for name in keys:
            kv = self._mirror.kvs.get(name)
            if kv is None:
                if self.live.pop(name, None) is not None:
                    self.gone[name] = time.time()
                continue
            try:
                self.live[name] = Instance.from_json(kv.value)
            except ValueError as error:
                log.warning("instance record %s ignored: %s", kv.key, error)
                self.live.pop(name, None)
                continue
            self.gone.pop(name, None)
        while len(self.gone) > GONE_KEPT:
            del self.gone[min(self.gone, key=self.gone.__getitem__)]
        self.on_members()


def _ended(task: asyncio.Task[None]) -> None:
    """Each of membership's tasks runs until stopped: one that ends otherwise is a bug that
    would leave the lease unrenewed or the fence unwatched, said at once, not at the stop."""
    if not task.cancelled():
        log.error("%s ended: %r (the lease is no longer kept alive: restart this instance)",
                  task.get_name(), task.exception())  # fmt: skip
