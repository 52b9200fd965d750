"""Ownership's I/O shell: mirrors ``<prefix>/owners/``, asks ``assign.Assignment`` what to
claim and release, and applies that with etcd transactions (docs/ha.md, "Ownership and
fencing").

A claim is one transaction: if the owner key does not exist (version 0), put this instance's
name on it with this instance's lease — never read-then-write, so of two instances claiming
at once one wins. A release deletes the key only if it still names this instance. The owner
key goes with the owner's lease: a dead instance's nodes become unowned when its TTL runs
out, and the others claim them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from ipaddress import IPv4Address
from typing import Any

from layerpy.cluster.assign import Assignment
from layerpy.cluster.etcd import Compare, Etcd, EtcdError, EtcdUnavailable, Op
from layerpy.cluster.fence import Fence
from layerpy.cluster.members import Instance, Membership
from layerpy.cluster.mirror import Mirror
from layerpy.hostlist import fold

log = logging.getLogger("layerpy.cluster")

POOL = "pool:"  # owned like a node: a segment's discovery pool ("pool:10.99.0.0-24")
PER_REQUEST = 64  # claims/releases sent in one request (etcd's --max-txn-ops is 128)
IN_FLIGHT = 4  # such requests at once
RETRY = 0.5  # seconds before deciding again after etcd failed a transaction


class Owners:
    """Claims and releases this instance's nodes; ``fence`` is the lifecycle's gate.

    ``on_fence_change`` (no arguments) is called when the fence may have changed for some
    node: wire it to ``Lifecycle.fence_changed``. ``on_owners`` gets the owner keys that
    changed (node → owning instance, None when none), for the operator's view."""

    def __init__(
        self,
        etcd: Etcd,
        members: Membership,
        *,
        prefix: str,
        grace: float = 1.0,
        settle: float | None = None,
        on_fence_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.etcd = etcd
        self.members = members
        self.key_prefix = f"{prefix}/owners/"
        self.assignment = Assignment(members.name, grace, settle)
        self._mirror = Mirror(etcd, self.key_prefix, self._owners_changed)
        self.owners: dict[str, str] = {}  # node → owning instance, as last mirrored
        self.fence = Fence(members.clock, members.now, on_fence_change, self.owners.get)
        self.nodes: dict[str, IPv4Address | None] = {}
        self.on_owners: Callable[[dict[str, str | None]], None] = lambda changes: None
        self._dirty = asyncio.Event()
        self._lease = 0  # the lease the last decision was made with
        self._tasks: list[asyncio.Task[None]] = []
        members.on_lease = self._lease_changed
        members.on_members = self._dirty.set

    def set_nodes(self, nodes: Mapping[str, IPv4Address | None]) -> None:
        """The nodes of the file in force, with their addresses (None: not known)."""
        self.nodes = dict(nodes)
        self._dirty.set()

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._mirror.run(), name="cluster-owners"),
            asyncio.create_task(self._decide_loop(), name="cluster-assign"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def _lease_changed(self) -> None:
        """Decide again when the lease turned fresh or stale, or is a new one; not on each
        keepalive (a decision over many nodes costs CPU)."""
        if self.fence.check() or self.members.clock.lease != self._lease:
            self._lease = self.members.clock.lease
            self._dirty.set()

    def _owners_changed(self, keys: set[str]) -> None:
        me = self.members.name
        changes: dict[str, int | None] = {}
        owners: dict[str, str | None] = {}
        for node in keys:
            kv = self._mirror.kvs.get(node)
            if kv is None:
                self.owners.pop(node, None)
                changes[node] = owners[node] = None
                continue
            self.owners[node] = owners[node] = owner = kv.value.decode(errors="replace")
            changes[node] = kv.lease if owner == me else None
        self.fence.set_owned(changes)
        self.on_owners(owners)
        self._dirty.set()

    async def _decide_loop(self) -> None:
        wake_at: float | None = None
        while True:
            timeout = None if wake_at is None else max(0.0, wake_at - self.members.now())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), timeout)
            self._dirty.clear()
            if not self._mirror.revision or not self.members.clock.fresh(self.members.now()):
                wake_at = None  # not read yet, or no fresh lease: nothing to claim with
                continue
            segments = {name: inst.segment for name, inst in self.members.live.items()}
            # in a thread, on copies: at 100 000 nodes a decision takes ~0.1 s of CPU, which
            # must not hold the event loop (the GIL is handed back every 5 ms)
            decision = await asyncio.to_thread(
                self.assignment.decide,
                self.members.now(),
                segments,
                dict(self.nodes),
                dict(self.owners),
            )
            wake_at = decision.wake_at
            if (decision.claim or decision.release) and not await self._apply(
                decision.claim, decision.release
            ):
                wake_at = self.members.now() + RETRY

    async def _apply(self, claim: tuple[str, ...], release: tuple[str, ...]) -> bool:
        """Run the transactions; False if etcd failed any (the caller decides again)."""
        me, lease = self.members.name.encode(), self.members.clock.lease
        slots = asyncio.Semaphore(IN_FLIGHT)

        async def batch(nodes: tuple[str, ...], claiming: bool) -> list[tuple[bool, bool]]:
            """Per node (whether etcd answered, whether its transaction took): each node's
            claim or release is a transaction of its own, PER_REQUEST of them sent together
            (one round trip and one raft proposal; a start claims 100 000 nodes)."""
            parts = []
            for node in nodes:
                key = self.key_prefix + node
                if claiming:
                    parts.append(([Compare.version(key, "==", 0)], [Op.put(key, me, lease)]))
                else:
                    parts.append(([Compare.value(key, "==", me)], [Op.delete(key)]))
            async with slots:
                try:
                    _, took = await self.etcd.each_txn(parts)
                except (EtcdUnavailable, EtcdError) as error:  # e.g. the lease just expired
                    verb = "claim" if claiming else "release"
                    log.debug("%s %s: %s", verb, _brief(list(nodes)), error)
                    return [(False, False)] * len(nodes)
            return [(True, won) for won in took]

        async def each(nodes: tuple[str, ...], claiming: bool) -> list[tuple[bool, bool]]:
            chunks = [nodes[i : i + PER_REQUEST] for i in range(0, len(nodes), PER_REQUEST)]
            results = await asyncio.gather(*(batch(chunk, claiming) for chunk in chunks))
            return [result for chunk in results for result in chunk]

        # stop acting on a node before its key goes: another may claim it the moment it does
        self.fence.set_owned(dict.fromkeys(release))
        claimed = await each(claim, True)
        released = await each(release, False)
        for verb, nodes, results in (("claimed", claim, claimed), ("released", release, released)):
            took = [node for node, (_, won) in zip(nodes, results, strict=True) if won]
            if took:  # one line a decision, not one a node (a start claims thousands)
                log.info("%s %d: %s", verb, len(took), _brief(took))
        kept = {node for node, (done, _) in zip(release, released, strict=True) if not done}
        if kept:  # releases etcd did not take: the fence as the keys say
            self._owners_changed(kept)
        return all(done for done, _ in claimed) and not kept

    async def overview(self) -> dict[str, Any]:
        """Every instance with its health and the nodes it owns, for ``layerpy cluster`` and
        ``GET /api/v1/cluster``. Read fresh from etcd; from the local copies (and said so)
        when etcd does not answer."""
        try:
            kvs, _ = await self.etcd.range(self.members.key_prefix)
            owner_kvs, _ = await self.etcd.range(self.key_prefix)
            live: dict[str, Instance] = {}
            for kv in kvs:
                try:
                    record = Instance.from_json(kv.value)
                except ValueError:
                    continue
                live[record.name] = record
            owners = {
                kv.key[len(self.key_prefix) :]: kv.value.decode(errors="replace")
                for kv in owner_kvs
            }
            source = "etcd"
        except (EtcdUnavailable, EtcdError) as error:
            live, owners = dict(self.members.live), dict(self.owners)
            source = f"local copy: etcd did not answer ({error})"
        owned: dict[str, list[str]] = {}
        for node, owner in owners.items():
            owned.setdefault(owner, []).append(node)
        pools = {name: [n for n in held if n.startswith(POOL)] for name, held in owned.items()}
        clock, now = self.members.clock, self.members.now()
        instances = []
        for name in sorted(set(live) | set(self.members.gone) | set(owned)):
            record = live.get(name)
            entry: dict[str, Any] = {
                "name": name,
                "alive": record is not None,
                "url": record.url if record else None,
                "segment": record.segment if record else None,
                "started": record.started if record else None,
                "version": record.version if record else None,
                "last_seen": time.time() if record else self.members.gone.get(name),
                "self": name == self.members.name,
                "nodes": sorted(n for n in owned.get(name, []) if not n.startswith(POOL)),
                "pools": sorted(pools.get(name, [])),  # the discovery pools it answers
            }
            if name == self.members.name:
                entry["lease_fresh_for"] = round(max(0.0, clock.deadline - now), 1)
            instances.append(entry)
        unowned = sorted(n for n in self.nodes if n not in owners and not n.startswith(POOL))
        return {"source": source, "instances": instances, "unowned": unowned}


def _brief(names: list[str], most: int = 300) -> str:
    """Node names as a hostlist, cut to ``most`` characters for a log line."""
    text = fold(names)
    return text if len(text) <= most else text[: most - 1] + "…"
