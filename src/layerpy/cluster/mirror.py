"""A live local copy of one etcd prefix: read it whole, then follow its watch; read it again
when the watch's history was compacted or etcd was away. Membership and ownership each keep
one (instances, owners) and decide from it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from layerpy.cluster.etcd import Compacted, Etcd, EtcdError, EtcdUnavailable, KeyValue
from layerpy.logs import Outage

log = logging.getLogger("layerpy.cluster")


class Mirror:
    """``kvs``: key below the prefix (the prefix cut off) → its KeyValue. ``on_change`` is
    called with the keys that changed (all keys after a fresh read)."""

    def __init__(
        self, etcd: Etcd, prefix: str, on_change: Callable[[set[str]], None], retry: float = 0.5
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0  # the revision the copy is at (0: not read yet)
        self._on_change = on_change
        self._retry = retry
        self._outage = Outage(log, f"reading {prefix}")

    async def run(self) -> None:
        """Follow the prefix until cancelled."""
        while True:
            try:
                await self._read()
                async for events in self.etcd.watch(self.prefix, self.revision + 1):
                    changed = set()
                    for event in events:
                        key = event.kv.key[len(self.prefix) :]
                        if event.kind == "put":
                            self.kvs[key] = event.kv
                        else:
                            self.kvs.pop(key, None)
                        changed.add(key)
                        self.revision = max(self.revision, event.kv.mod_revision)
                    self._on_change(changed)
            except Compacted:
                log.info("watch of %s compacted: reading it again", self.prefix)
            except (EtcdUnavailable, EtcdError) as error:
                self._outage.failed(str(error))
                await asyncio.sleep(self._retry)

    async def _read(self) -> None:
        kvs, revision = await self.etcd.range(self.prefix)
        fresh = {kv.key[len(self.prefix) :]: kv for kv in kvs}
        changed = set(fresh) | set(self.kvs)
        self.kvs, self.revision = fresh, revision
        self._outage.ok()
        self._on_change(changed)
