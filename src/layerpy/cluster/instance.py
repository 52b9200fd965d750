"""This ``layerpy serve`` as one instance of a cluster: the cluster's pieces assembled in the
order they depend on each other (docs/ha.md, "Running instances").

Joining (before the server is built, since the node store loads from the backend): etcd
opened, the shared node file started (published, or joined if this file's rest is the
cluster's), the store's backend read. Starting (once the server serves): membership on a
lease, then ownership. Closing undoes it in reverse: ownership, membership (its lease
revoked, so the others take the nodes over at once), the backend, etcd.

What the server gives back is wired with ``attach``: how a proposed file is checked and a
committed one applied, where the fence's changes go, where the agents' server lists go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from ipaddress import IPv4Address, ip_network
from urllib.parse import urlsplit

from layerpy.cluster.backend import EtcdBackend
from layerpy.cluster.etcd import Etcd, EtcdError, EtcdUnavailable
from layerpy.cluster.file import Committed, FileRefused, SharedFile
from layerpy.cluster.members import Instance, Membership, serving
from layerpy.cluster.metrics import ClusterMetrics
from layerpy.cluster.owners import POOL, Owners
from layerpy.config import Config, ConfigError, parse_shared
from layerpy.host import StartRefused

log = logging.getLogger("layerpy.cluster")

REACH_WITHIN = 20.0  # seconds a starting instance tries etcd before it gives up (booted together)
FLUSH_WITHIN = 5.0  # seconds a clean stop waits for the store's queued writes to reach etcd
REVOKE_WITHIN = 2.0  # seconds a clean stop waits for etcd to revoke its lease (else: its TTL)

Applied = dict[str, list[str]]  # what a reload changed, as `layerpy reload` shows it


class ClusterInstance:
    """The etcd client, the shared file, the store's backend, membership and ownership of
    one instance. ``config`` is the file in force (the cluster's, with this instance's own
    settings), once joined."""

    def __init__(self, config: Config, own_text: str) -> None:
        cluster = config.cluster
        if cluster is None:
            raise ValueError("not a cluster's node file: it has no [cluster]")
        self.config = config
        self.name = cluster.name
        self.lease_ttl = float(cluster.lease_ttl)  # seconds an instance may go unnoticed
        self.address = config.server.address
        self.etcd = Etcd.from_config(cluster)
        self.shared: SharedFile[Applied] = SharedFile(
            self.etcd, cluster.name, cluster.prefix, own_text,
            check=lambda text: self.check(text), apply=self._apply,
        )  # fmt: skip
        self.backend = EtcdBackend(self.etcd, cluster.name, cluster.prefix)
        self.members = Membership(self.etcd, prefix=cluster.prefix, name=cluster.name,
                                  url=config.server.url, segment=cluster.segment,
                                  ttl=cluster.lease_ttl)  # fmt: skip
        self.owners = Owners(self.etcd, self.members, prefix=cluster.prefix,
                             settle=cluster.lease_ttl,
                             on_fence_change=lambda: self.fence_changed())  # fmt: skip
        self.fence = self.owners.fence
        self.backend.on_backlog = self._backlog
        segment = ip_network(cluster.segment) if cluster.segment else config.network.subnet
        # the segment's discovery pool is owned like a node (by an instance of the segment),
        # so one instance answers the machines no node claims, behind its fence
        self.pool = f"{POOL}{segment.network_address}-{segment.prefixlen}"
        self._pool_address = segment.network_address
        self._ownership_members = self.members.on_members  # ownership's: decide again
        self.members.on_members = self._members_changed
        # wired by the server (attach)
        self.check: Callable[[str], Awaitable[object]] = _unattached
        self.apply: Callable[[str], Awaitable[Applied]] = _unattached
        self.fence_changed: Callable[[], None] = lambda: None
        self.on_peers: Callable[[tuple[str, ...]], None] = lambda peers: None
        self.owners.on_owners = lambda changes: self.on_owners(changes)
        self.on_owners: Callable[[Mapping[str, str | None]], None] = lambda changes: None

    @classmethod
    async def join(cls, config: Config) -> ClusterInstance:
        """Open etcd, take the cluster's node file (or publish this one) and read the
        store's records. Raises StartRefused saying what to do."""
        own_text = await asyncio.to_thread(config.path.read_text, encoding="utf-8")
        instance = cls(config, own_text)
        try:
            await instance._join(own_text)
        except BaseException:
            await instance.etcd.close()
            raise
        return instance

    async def _join(self, own_text: str) -> None:
        members = ", ".join(self.etcd.endpoints)
        try:
            await self._reach()
            committed = await self.shared.start()
            if committed.text != own_text:
                self.config = await asyncio.to_thread(
                    parse_shared, committed.text, own_text, self.config.path
                )
            await self.backend.open()
        except EtcdUnavailable as error:
            raise StartRefused(
                f"no etcd member answered ({error}). Tried {members} ([cluster] etcd): start "
                "etcd's members, or correct the list, then start again"
            ) from None
        except EtcdError as error:
            raise StartRefused(
                f"etcd at {members} refused: {error}. Check [cluster] user, password_file, "
                "ca, cert and key"
            ) from None
        except FileRefused as refused:
            raise StartRefused(str(refused)) from None
        except ConfigError as error:
            raise StartRefused(
                f"the cluster's node file (revision {self.shared.revision}) cannot run here:\n"
                + error.render()
            ) from None

    async def _reach(self) -> None:
        """First contact, tried again for REACH_WITHIN seconds: etcd and layerpy may start
        together (a host's boot), and a member may be electing a leader."""
        give_up = asyncio.get_running_loop().time() + REACH_WITHIN
        while True:
            try:
                return await self.etcd.open()
            except EtcdUnavailable as error:
                if asyncio.get_running_loop().time() >= give_up:
                    raise
                log.warning("etcd: %s; trying again until %g s have passed", error, REACH_WITHIN)
            await asyncio.sleep(1.0)

    def attach(
        self,
        *,
        check: Callable[[str], Awaitable[object]],
        apply: Callable[[str], Awaitable[Applied]],
        fence_changed: Callable[[], None],
        on_peers: Callable[[tuple[str, ...]], None],
        on_owners: Callable[[Mapping[str, str | None]], None],
    ) -> None:
        """The server's side: ``check`` a proposed file (ReloadRefused if this instance could
        not run it), ``apply`` a committed one, ``fence_changed`` the lifecycle's,
        ``on_peers`` the other live instances' URLs serving this one's segment, and
        ``on_owners`` the nodes whose owner changed (None: none owns it now)."""
        self.check, self.apply = check, apply
        self.fence_changed, self.on_peers, self.on_owners = fence_changed, on_peers, on_owners

    async def start(self, nodes: Mapping[str, IPv4Address | None]) -> None:
        """Register (lease), then claim nodes. Raises StartRefused if the name is taken."""
        try:
            await self.members.start()
        except RuntimeError as error:
            raise StartRefused(f"{error}: give each instance its own [cluster] name") from None
        except (EtcdUnavailable, EtcdError) as error:
            raise StartRefused(f"registering in etcd: {error}") from None
        self.set_nodes(nodes)
        await self.owners.start()

    def set_nodes(self, nodes: Mapping[str, IPv4Address | None]) -> None:
        """The nodes of the file in force, and this segment's pool, to be owned."""
        self.owners.set_nodes({**nodes, self.pool: self._pool_address})

    def holds_pool(self) -> bool:
        """Whether this instance answers unknown machines from the discovery pool now."""
        return self.fence.allows(self.pool)

    async def run(self) -> None:
        """Follow the shared node file: verdicts on others' reloads, their commits applied."""
        await self.shared.run()

    async def propose(self, text: str) -> Applied:
        """``layerpy reload`` here: checked by every live instance, then applied by all."""
        return await self.shared.propose(text)

    async def _apply(self, committed: Committed) -> Applied:
        return await self.apply(committed.text)

    async def peer_addresses(self) -> set[IPv4Address]:
        """The boot addresses of the instances registered now: their DHCP answers on the
        segment are the cluster's, not another server's (none known while etcd is away)."""
        try:
            kvs, _ = await self.etcd.range(self.members.key_prefix)
        except (EtcdUnavailable, EtcdError):
            return set()
        found = set()
        for kv in kvs:
            with contextlib.suppress(ValueError, TypeError):
                found.add(IPv4Address(urlsplit(Instance.from_json(kv.value).url).hostname))
        return found

    def owner_url(self, node: str) -> str | None:
        """The boot HTTP URL of the instance that owns ``node`` (None: none live owns it).
        Cut off from etcd (its lease not known fresh), this instance names another of its
        segment instead: its agents move there, whose instances judge them while this one
        cannot act (a silent node is then found lost by its new owner, see server.py)."""
        members = self.members
        if not members.clock.fresh(members.now()):
            others = serving(members.live.values(), self.address)
            return next((i.url for i in others if i.name != self.name), None)
        owner = self.owners.owners.get(node)
        instance = self.members.live.get(owner) if owner is not None else None
        return instance.url if instance is not None else None

    def metrics(self) -> ClusterMetrics:
        """The cluster's gauges, for the server's registry."""
        members, fence, backend = self.members, self.fence, self.backend
        return ClusterMetrics(
            self._node_owners, lambda: members.live,
            lambda: members.clock.fresh(members.now()) and fence.held is None,
            queued=lambda: backend.queued, holds=lambda: fence.holds,
        )  # fmt: skip

    def _backlog(self, backed_up: bool) -> None:
        """The store's writes wait for etcd past the backend's limit (etcd away or slow for
        long, or a flood of changes): hold, so nothing is decided that could not be kept,
        until half are written. Boots and reports go on from the mirror; nothing is lost."""
        limit = self.backend.max_queued
        self.fence.hold(
            f"more than {limit} writes wait for etcd, until {limit // 2} are left"
            if backed_up
            else None
        )

    def _node_owners(self) -> dict[str, str]:
        """Each node's owner (the pool's is not a node's)."""
        return {node: owner for node, owner in self.owners.owners.items() if node != self.pool}

    def _members_changed(self) -> None:
        self._ownership_members()
        others = serving(self.members.live.values(), self.address)
        self.on_peers(tuple(i.url for i in others if i.name != self.name))

    async def close(self) -> None:
        """Leave, bounded (FLUSH_WITHIN + REVOKE_WITHIN): ownership stops, the store's
        queued writes go out (before the others take the nodes over, so that they read
        them), the lease is revoked (they take over without waiting for its TTL), etcd
        closes."""
        await self.owners.stop()
        await self.backend.drain(FLUSH_WITHIN)
        try:
            async with asyncio.timeout(REVOKE_WITHIN):
                await self.members.stop()
        except TimeoutError:
            log.warning("leaving: etcd did not revoke the lease within %g s (it expires in "
                        "%d s)", REVOKE_WITHIN, self.members.ttl)  # fmt: skip
        await self.etcd.close()


async def _unattached(text: str) -> Applied:
    raise RuntimeError("the cluster instance is not attached to a server")
