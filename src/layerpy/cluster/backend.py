"""The store's records in etcd (BACKEND.md): a mirror answered at once, etcd written behind it.

At open every record under the prefix is read at one revision into a mirror, and a watch
follows from that revision, so `load` is synchronous and other instances' changes arrive
through `on_change`. `put`/`delete` change the mirror at once and queue the write; a writer
task sends the queue to etcd in order, up to BATCH writes per transaction (one that would not
be full first waits LINGER for more, unless a caller awaits the queue). While etcd is away
the queue waits (the instance keeps serving from its mirror) and is sent when etcd returns; a
key written again while queued keeps its place with the newer record, so the queue holds at
most one write per key. `create`/`replace` are compare-and-swap transactions the caller awaits.

Values are JSON envelopes {"by": instance, "record": {...}}: the writer's name tells the echo
of this instance's own writes from other instances' changes (a delete carries no value: it is
told by revision, see `_on_event`). Per key the mirror keeps the revision its view is current
at and only moves forward, so a change seen twice (by the watch and by a failed transaction's
read) is applied and reported once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from layerpy.logs import Outage
from layerpy.nodes.backend import Unreachable

from .etcd import Compacted, Compare, Etcd, EtcdError, EtcdUnavailable, KeyValue, Op

log = logging.getLogger("layerpy.cluster.backend")

# nodes/backend.py's kinds
KINDS = ("tokens", "bindings", "leases", "overrides", "observed", "assigned", "clients")
BATCH = 64  # writes per transaction (etcd's --max-txn-ops defaults to 128)
LINGER = 0.1  # seconds a transaction that is not full waits for more writes (see _write)
# distinct keys waiting for etcd (one write per key: see the docstring) past which the
# instance holds (stops acting: `on_backlog`) until half are written; nothing is refused or
# dropped, since the queue never holds more keys than the mirror does
MAX_QUEUED = 1 << 20

Record = dict[str, Any]
Callback = Callable[[str, str, Record | None], None]
Write = tuple[str, str, Record, Record | None]  # kind, key, record, the record it replaces
Queued = tuple[tuple[str, str], bytes | None]  # (kind, key), the value (None: delete)
_GONE = object()


class EtcdBackend:
    def __init__(
        self,
        etcd: Etcd,
        instance: str,
        prefix: str = "/layerpy/v1",
        kinds: Iterable[str] = KINDS,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self._etcd, self.instance = etcd, instance
        self.max_queued = max_queued
        self.backed_up = False  # more than max_queued wait, and not yet half drained
        # told True when the queue passes max_queued, False when half of that drained
        self.on_backlog: Callable[[bool], None] = lambda backed_up: None
        self._prefix = prefix.rstrip("/") + "/"
        self._mirror: dict[str, dict[str, Record]] = {kind: {} for kind in kinds}
        self._seen: dict[tuple[str, str], tuple[int, int]] = {}  # (current at, mod_revision)
        self._queue: OrderedDict[tuple[str, str], bytes | None] = OrderedDict()  # None: delete
        self._bases: dict[tuple[str, str], int] = {}  # a queued amend: the mod_revision it needs
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._hurry = asyncio.Event()  # stopping: the writer skips its back-off
        self._now = asyncio.Event()  # someone awaits the queue: no lingering
        self._sent = asyncio.Event()  # set when a transaction of the queue is answered
        self._callbacks: list[Callback] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        """Read every record (raises EtcdUnavailable), then watch and write behind."""
        revision = await self._read_all()
        self._tasks = [
            asyncio.create_task(self._watch(revision), name="etcd-backend-watch"),
            asyncio.create_task(self._write(), name="etcd-backend-writer"),
        ]

    async def drain(self, within: float) -> None:
        """Stop: up to `within` seconds for etcd to take the queued writes, then close,
        saying how many went and how many are dropped (a stop must not wait on etcd)."""
        queued, loop = len(self._queue), asyncio.get_running_loop()
        began = loop.time()
        self._hurry.set()  # no back-off pause: try now
        self._now.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self.flush()
        await self.close()
        if self._queue:
            kinds = Counter(kind for kind, _ in self._queue)
            log.warning(
                "etcd backend: stopping: %d writes not sent to etcd within %g s (%s); etcd "
                "keeps the state before them",
                len(self._queue), within, ", ".join(f"{n} {k}" for k, n in kinds.items()),
            )  # fmt: skip
        elif queued:
            log.info("etcd backend: stopping: %d queued writes flushed to etcd in %.1f s",
                     queued, loop.time() - began)  # fmt: skip

    async def close(self) -> None:
        """Stop watching and writing (what is still queued is lost: `drain` says it)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # --- BACKEND.md -----------------------------------------------------------------

    def load(self, kind: str) -> dict[str, Record]:
        return dict(self._mirror[kind])

    def get(self, kind: str, key: str) -> Record | None:
        return self._mirror[kind].get(key)

    def put(self, kind: str, key: str, record: Record) -> None:
        self._bases.pop((kind, key), None)
        self._enqueue(kind, key, self._encode(record))  # encoded now: the caller may change it
        self._mirror[kind][key] = record

    def delete(self, kind: str, key: str) -> None:
        self._bases.pop((kind, key), None)
        self._enqueue(kind, key, None)
        self._mirror[kind].pop(key, None)

    def amend(self, kind: str, key: str, record: Record) -> None:
        where = (kind, key)
        if where in self._queue and where not in self._bases:
            self.put(kind, key, record)  # a put of ours still to go: it wins anyway
            return
        self._bases[where] = self._seen.get(where, (0, 0))[1]  # 0: absent
        self._enqueue(kind, key, self._encode(record))
        self._mirror[kind][key] = record

    async def create(self, kind: str, key: str, record: Record) -> bool:
        compare = Compare.version(self._key(kind, key), "==", 0)
        return await self._swap([(kind, key, record)], [compare])

    async def replace(self, kind: str, key: str, record: Record, expected: Record | None) -> bool:
        return await self.replace_all([(kind, key, record, expected)])

    async def replace_all(self, writes: Sequence[Write]) -> bool:
        if any((kind, key) in self._queue for kind, key, _, _ in writes):
            await self.flush()  # their revisions are known once written
        compares = []
        for kind, key, _, expected in writes:
            if self._mirror[kind].get(key) != expected:
                return False
            name = self._key(kind, key)
            if expected is None:
                compares.append(Compare.version(name, "==", 0))
            else:
                # unknown (a write etcd refused): 0 fails, and the failure's read teaches us
                revision = self._seen.get((kind, key), (0, 0))[1]
                compares.append(Compare.mod_revision(name, "==", revision))
        return await self._swap([(kind, key, record) for kind, key, record, _ in writes], compares)

    async def flush(self) -> None:
        self._now.set()
        await self._drained.wait()

    async def written(self, kind: str, key: str) -> None:
        while (kind, key) in self._queue:  # waits while etcd is away: the caller bounds it
            self._now.set()
            await self._sent.wait()

    async def fresh(self, kind: str, key: str) -> None:
        """A linearizable read of one key (raises Unreachable), applied as the watch
        would apply it: a change another instance made that the watch has not yet brought."""
        try:
            result = await self._etcd.txn([], [Op.get(self._key(kind, key))])
        except (EtcdUnavailable, EtcdError) as error:
            raise Unreachable(str(error)) from None
        kvs = result.responses[0]
        self._learn(kind, key, kvs[0] if kvs else None, result.revision)

    def on_change(self, callback: Callback) -> None:
        self._callbacks.append(callback)

    # --- transactions ---------------------------------------------------------------

    async def _swap(
        self, writes: Sequence[tuple[str, str, Record]], compares: Sequence[Compare]
    ) -> bool:
        """One transaction: every record written if every compare holds."""
        names = [self._key(kind, key) for kind, key, _ in writes]
        values = [self._encode(record) for _, _, record in writes]
        puts = [Op.put(name, value) for name, value in zip(names, values, strict=True)]
        result = await self._etcd.txn(compares, puts, [Op.get(name) for name in names])
        if result.succeeded:
            for kind, key, record in writes:
                self._settle(kind, key, record, result.revision, result.revision)
            return True
        currents = [kvs[0] if kvs else None for kvs in result.responses]
        if all(kv is not None and kv.value == v for kv, v in zip(currents, values, strict=True)):
            # our own write: applied once already, its answer lost and the retry refused
            for (kind, key, record), kv in zip(writes, currents, strict=True):
                assert kv is not None
                self._settle(kind, key, record, result.revision, kv.mod_revision)
            return True
        for (kind, key, _), kv in zip(writes, currents, strict=True):
            self._learn(kind, key, kv, result.revision)
        return False

    def _settle(self, kind: str, key: str, record: Record, at: int, mod: int) -> None:
        """Our own write is in etcd at revision `at`."""
        if at > self._seen.get((kind, key), (0, 0))[0]:
            self._seen[kind, key] = (at, mod)
            if (kind, key) not in self._queue:
                self._mirror[kind][key] = record

    def _learn(self, kind: str, key: str, kv: KeyValue | None, at: int) -> None:
        """etcd's state of a key at revision `at` (kv None: absent), told to the callbacks if
        it is news and no write of ours is queued to replace it."""
        if at <= self._seen.get((kind, key), (0, 0))[0]:
            return
        self._seen[kind, key] = (at, kv.mod_revision if kv else 0)
        if (kind, key) in self._queue:
            return
        by, record = self._decode(kv) if kv else ("", None)
        if kv is not None and record is None:
            return  # not a record envelope (logged)
        if self._mirror[kind].get(key) == record:
            return
        if record is None:
            del self._mirror[kind][key]
        else:
            self._mirror[kind][key] = record
        if by == self.instance:
            return  # the echo of our own create/replace, seen before its answer
        for callback in self._callbacks:
            try:
                callback(kind, key, record)
            except Exception:
                log.exception("etcd backend: a change callback failed on %s/%s", kind, key)

    # --- reading and watching -------------------------------------------------------

    async def _read_all(self) -> int:
        kvs, revision = await self._etcd.range(self._prefix)
        present = set()
        for kv in kvs:
            if (where := self._where(kv.key)) is not None:
                present.add(where)
                self._learn(*where, kv, revision)
        for kind, records in self._mirror.items():
            for key in [key for key in records if (kind, key) not in present]:
                self._learn(kind, key, None, revision)
        return revision

    async def _watch(self, revision: int) -> None:
        while True:
            try:
                async for events in self._etcd.watch(self._prefix, revision + 1):
                    for event in events:
                        if (where := self._where(event.kv.key)) is not None:
                            kv = event.kv if event.kind == "put" else None
                            self._learn(*where, kv, event.kv.mod_revision)
                    revision = events[-1].kv.mod_revision
            except EtcdError as error:
                if not isinstance(error, Compacted):
                    log.error("etcd backend: the watch failed: %s", error)
                    await asyncio.sleep(1)
                    continue
                log.warning("etcd backend: %s; reading every record again", error)
                outage = Outage(log, "etcd backend: reading every record again")
                while True:
                    try:
                        revision = await self._read_all()
                        break
                    except EtcdUnavailable as error:
                        outage.failed(str(error))
                outage.ok()

    # --- writing behind -------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Writes waiting for etcd (one per key)."""
        return len(self._queue)

    def _enqueue(self, kind: str, key: str, value: bytes | None) -> None:
        self._queue[kind, key] = value
        self._drained.clear()
        self._wake.set()
        if not self.backed_up and len(self._queue) > self.max_queued:
            self.backed_up = True
            self.on_backlog(True)

    async def _write(self) -> None:
        pause, away = 0.1, False
        size = BATCH
        while True:
            if not self._queue:
                self._drained.set()
                self._wake.clear()
                self._now.clear()
                await self._wake.wait()
                # a boot writes its token and several observed records within moments: a
                # key written again while it waits goes once, and a fuller transaction is
                # one raft proposal for more writes (fewer for the other instances to apply)
                if len(self._queue) < size and not self._now.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._now.wait(), LINGER)
                continue
            batch = list(itertools.islice(self._queue.items(), size))  # not the whole queue
            try:
                revision, took = await self._send(batch)
            except EtcdUnavailable as error:
                if not away:
                    log.warning("etcd backend: %s; %d writes wait", error, len(self._queue))
                away = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), pause)
                pause = min(pause * 2, 2.0)
                continue
            except EtcdError as error:
                if size > 1:
                    size = 1  # find the write etcd refuses
                    continue
                log.error("etcd backend: etcd refused the write of %s/%s: %s", *batch[0][0], error)
                revision, took = None, [False]
            if away:
                log.warning("etcd backend: etcd is back; %d writes wait", len(self._queue))
            pause, away, size = 0.1, False, BATCH
            outdated = []
            for (where, value), landed in zip(batch, took, strict=True):
                if self._queue.get(where, _GONE) is value:  # not written again meanwhile
                    del self._queue[where]
                    amended = self._bases.pop(where, None) is not None
                    if revision is not None and landed:
                        self._settle_write(where, revision, 0 if value is None else revision)
                    elif revision is not None and amended:
                        outdated.append(where)
            for kind, key in outdated:
                await self._read_back(kind, key)
            sent, self._sent = self._sent, asyncio.Event()
            sent.set()
            if self.backed_up and len(self._queue) <= self.max_queued // 2:
                self.backed_up = False
                self.on_backlog(False)

    async def _send(self, batch: list[Queued]) -> tuple[int, list[bool]]:
        """One transaction of queued writes: etcd's revision, and per write whether it
        landed (a put or delete always does; an amend only if its key is unchanged)."""
        ops = [
            Op.delete(self._key(*where)) if value is None else Op.put(self._key(*where), value)
            for where, value in batch
        ]
        bases = [self._bases.get(where) for where, _ in batch]
        if all(base is None for base in bases):
            return (await self._etcd.txn([], ops)).revision, [True] * len(batch)
        return await self._etcd.each_txn([
            ([] if base is None else [Compare.mod_revision(op.key, "==", base)], [op])
            for op, base in zip(ops, bases, strict=True)
        ])  # fmt: skip

    async def _read_back(self, kind: str, key: str) -> None:
        """An amend that found its key changed: the newer record, read back (the watch may
        have brought it while the amend was queued, and kept the amend in the mirror)."""
        self._seen.pop((kind, key), None)
        try:
            await self.fresh(kind, key)
        except Unreachable as error:  # the watch's next event of the key applies
            log.warning("etcd backend: %s/%s not read back: %s", kind, key, error)

    def _settle_write(self, where: tuple[str, str], at: int, mod: int) -> None:
        if at > self._seen.get(where, (0, 0))[0]:
            self._seen[where] = (at, mod)

    # --- keys and values ------------------------------------------------------------

    def _key(self, kind: str, key: str) -> str:
        return f"{self._prefix}{kind}/{key}"

    def _where(self, name: str) -> tuple[str, str] | None:
        """(kind, key) of an etcd key, None when not a record of ours (the node file...)."""
        kind, _, key = name[len(self._prefix) :].partition("/")
        return (kind, key) if kind in self._mirror and key else None

    def _encode(self, record: Record) -> bytes:
        envelope = {"by": self.instance, "record": record}
        return json.dumps(envelope, separators=(",", ":")).encode()

    def _decode(self, kv: KeyValue) -> tuple[str, Record | None]:
        try:
            envelope = json.loads(kv.value)
            by, record = envelope["by"], envelope["record"]
            if isinstance(by, str) and isinstance(record, dict):
                return by, record
        except (ValueError, TypeError, KeyError):
            pass
        log.warning("etcd backend: %s is not a record envelope: ignored", kv.key)
        return "", None
