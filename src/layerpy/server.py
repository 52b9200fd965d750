"""``layerpy serve``: wires config, node store, lifecycle and the boot services in one loop.

Config flows down from here: the node store records what is observed, the catalog keeps
images pulled, the lifecycle drives the engine; the services only move bytes between the
network and those. They meet again only on the store's change feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from ipaddress import IPv4Address
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from layerpy import budget, census, heap, host, logs
from layerpy.auth import Tokens
from layerpy.boot import BootPolicy
from layerpy.catalog import Catalog
from layerpy.cluster.instance import Applied, ClusterInstance
from layerpy.config import Config, ConfigError, ReloadRefused, load, parse, parse_shared
from layerpy.consoles import Consoles
from layerpy.heap import CollectorTimer, Settler, collector_paused
from layerpy.host import StartRefused
from layerpy.images import ImageStore
from layerpy.lifecycle import Lifecycle
from layerpy.nodes import NodeStore
from layerpy.nodes.backend import Backend, LocalJournal
from layerpy.nodes.effects import Observe
from layerpy.nodes.store import FileChange, compare
from layerpy.notify import notify, reloading
from layerpy.power.base import PowerSpec
from layerpy.services import listeners
from layerpy.services.api import build_api
from layerpy.services.beats import BEAT_TAKEN, BeatListener, Beats
from layerpy.services.dhcp import Neighbours, start_dhcp
from layerpy.services.http import build_app
from layerpy.services.shortcut import Shortcut
from layerpy.services.tftp import TftpBudget, accounting, start_tftp
from layerpy.stats import Stats

log = logging.getLogger("layerpy.server")

LAG_PROBE = 0.05  # seconds between looks at the event loop's lag


class Server:
    """One ``layerpy serve``; with ``cluster`` (joined: its file in force is ``config``)
    one instance of a cluster, whose store lives in etcd and whose lifecycle acts on the
    nodes it owns only."""

    def __init__(
        self, config: Config, backend: Backend, *, state_dir: Path | None = None,
        cluster: ClusterInstance | None = None,
    ) -> None:  # fmt: skip
        """``backend``: where the store keeps what outlives a restart (``local_backend``,
        or the cluster's)."""
        self.state_dir = state_dir
        self.backend = backend
        self.cluster = cluster
        config = self._with_overrides(config)
        self.stats = Stats()
        self.nodes = NodeStore(config, backend)  # what it writes, it writes 0700 (journal)
        _private_directory(config.server.state_dir)  # before the image store makes it, 0755
        images = ImageStore(config.server.state_dir / "images")
        self.catalog = Catalog(images, self.nodes.feed, self.stats)
        fence = cluster.fence if cluster else None
        self.lifecycle = Lifecycle(self.nodes, backend, self.catalog, config.server.power_poll,
                                   self.stats, fence)  # fmt: skip
        self.policy = BootPolicy(self.nodes, backend,
                                 pool_gate=cluster.holds_pool if cluster else None)  # fmt: skip
        self.beats = Beats(
            config.server.beat_port,
            self.nodes.nodes,
            lambda name: (*self.lifecycle.answer_basis(name), self.policy.servers_of(name)),
            self.nodes.beat,
            lambda outcome: self.stats.count("beat", outcome, ok=outcome in BEAT_TAKEN),
        )
        if cluster is not None:
            self._attach(cluster)
        self.stats.watch_nodes(functools.partial(census.count, self.lifecycle))
        self.plan = budget.plan(budget.raise_limit())  # what each subsystem may hold
        self.consoles = Consoles(config.server.state_dir / "consoles", self.nodes.saw_console,
                                 most=self.plan.consoles)  # fmt: skip
        self.consoles.elsewhere = self._console_elsewhere
        self._console_specs: dict[str, PowerSpec] = {}  # the file's, captured here or not
        self._console_sync_planned = False
        self._closers: list[object] = []
        self._runners: list[web.AppRunner] = []
        self._neighbours: Neighbours | None = None  # other DHCP servers on the segment
        self._reloading = asyncio.Lock()

    def _attach(self, cluster: ClusterInstance) -> None:
        """Tell the cluster where this instance hears it: the shared file's check and
        apply, the fence, the peers and the owners."""
        cluster.attach(check=self._check_shared, apply=self._apply_shared,
                       fence_changed=self._fence_changed,
                       on_peers=self._set_peers, on_owners=self._show_owners)  # fmt: skip
        self.policy.owner_url = cluster.owner_url
        self.stats.registry.register(cluster.metrics())
        self._show_owners(dict.fromkeys(self.nodes.nodes), quiet=True)  # none yet: not news

    @property
    def config(self) -> Config:
        return self.nodes.config

    def _with_overrides(self, config: Config) -> Config:
        if self.state_dir is None:
            return config
        return replace(config, server=replace(config.server, state_dir=self.state_dir))

    async def reload(self) -> Applied:
        """Re-read the node file and apply it whole, or refuse it whole (the service
        manager hears RELOADING, then READY either way). In a cluster: checked here, then
        proposed to every instance, applied by all or none."""
        reloading()
        try:
            if self.cluster is None:
                return await self._reload()
            return await self._propose()
        finally:
            self.ready()

    async def _propose(self) -> Applied:
        """The cluster's reload: the file read and checked as a local reload would be, then
        proposed (not under the lock: the commit's apply takes it)."""
        assert self.cluster is not None
        path = self.config.path
        try:
            text = await asyncio.to_thread(path.read_text, encoding="utf-8")
            await asyncio.to_thread(self._compared, lambda: parse(text, path))  # own tables too
            return await self.cluster.propose(text)
        except ReloadRefused as refused:
            log.error("reload refused, the running configuration stays: %s", refused)
            raise
        except OSError as error:
            log.error("reload refused, cannot read %s: %s", self.config.path, error.strerror)
            raise ReloadRefused([f"{self.config.path}: cannot read it: {error.strerror}"]) from None

    async def _check_shared(self, text: str) -> FileChange:
        """Could this instance run the cluster's file ``text``? (ReloadRefused if not.)"""
        assert self.cluster is not None
        own, path = self.cluster.shared.own_text, self.config.path
        return await asyncio.to_thread(self._compared, lambda: parse_shared(text, own, path))

    async def _apply_shared(self, text: str) -> Applied:
        """A committed revision of the cluster's file, applied whole (the service manager
        hears RELOADING, then READY)."""
        reloading()
        try:
            async with self._reloading:
                change = await self._check_shared(text)
                applied = await self._apply(change)
            assert self.cluster is not None
            self.cluster.set_nodes(_addresses(self.config))
            owners = self.cluster.owners.owners
            self._show_owners({name: owners.get(name) for name in self.nodes.nodes})
            return applied
        finally:
            self.ready()

    def _show_owners(self, owners: Mapping[str, str | None], quiet: bool = False) -> None:
        """Each node's owner as the store shows it (``owner``, "" for none yet): every
        instance shows every node's."""
        nodes = self.nodes.nodes
        self.nodes.apply(Observe(name, {"owner": owner or ""}, quiet=quiet)
                         for name, owner in owners.items() if name in nodes)  # fmt: skip
        self._adopt(name for name in owners if name in nodes)

    def _sync_consoles(self, config: Config | None = None) -> None:
        """Capture the consoles of the file (``config``: a new one) that are this instance's:
        in a cluster, only of the nodes its fence lets it act on. A BMC serves one SOL
        session, so two instances capturing one console would take it from each other: the
        owner captures, a take-over moves the capture, a closed fence stops it."""
        self._console_sync_planned = False
        if config is not None:
            self._console_specs = _console_specs(config)
        specs = self._console_specs
        if self.cluster is not None:
            fence = self.cluster.fence
            specs = {name: spec for name, spec in specs.items() if fence.allows(name)}
        self.consoles.sync(specs)

    def _fence_changed(self) -> None:
        """The fence may allow other nodes now: the lifecycle looks at what it held, and the
        consoles follow (once for a burst of changes: claims come in many watch events)."""
        self.lifecycle.fence_changed()
        if not self._console_sync_planned:
            self._console_sync_planned = True
            asyncio.get_running_loop().call_soon(self._sync_consoles)

    def _console_elsewhere(self, node: str) -> str | None:
        """Why this instance does not capture ``node``'s console although the file gives
        it one, and where to ask (None: the file gives it none)."""
        cluster = self.cluster
        if cluster is None or node not in self._console_specs:
            return None
        why = cluster.fence.why_not(node)
        if why is None:
            return f"the console of {node} is being opened here: try again in a moment"
        owner = cluster.owners.owners.get(node)
        instance = cluster.members.live.get(owner) if owner else None
        said = f"the console of {node} is captured by its owner only: {why}"
        if instance is not None and owner != cluster.name:
            host = urlsplit(instance.url).hostname
            said += f"; run `layerpy console {node}` on instance {owner}'s host ({host})"
        return said

    def _set_peers(self, peers: tuple[str, ...]) -> None:
        if peers != self.policy.peers:
            log.info("instances serving this segment besides this one: %s", ", ".join(peers) or "-")
        self.policy.peers = peers
        if self.cluster is not None:  # an instance left: the nodes it heard may be ours
            self._adopt(self.nodes.heard_by_others(self.cluster.members.live))

    def _adopt(self, names: Iterable[str]) -> None:
        """Of ``names``, the nodes this instance owns whose hearing instance is gone become
        this one's to judge (their liveness), as a killed or cut-off instance cannot."""
        cluster = self.cluster
        if cluster is None:
            return
        owners, live, nodes = cluster.owners.owners, cluster.members.live, self.nodes.nodes
        orphans = [name for name in names if owners.get(name) == cluster.name
                   and (heard := nodes[name].heard_by) and heard not in live
                   and heard != cluster.name]  # fmt: skip
        self.nodes.adopt(orphans)

    def ready(self) -> None:
        """Tell the service manager the server serves (and how many nodes)."""
        notify("READY=1", f"STATUS=serving {len(self.config.nodes)} nodes")

    async def _reload(self) -> dict[str, list[str]]:
        async with self._reloading:  # one at a time: each is compared with the one before
            try:
                change = await asyncio.to_thread(self._read_again)
            except ReloadRefused as refused:
                log.error("reload refused, the running configuration stays: %s", refused)
                raise
            return await self._apply(change)

    async def _apply(self, change: FileChange) -> Applied:
        """Apply a checked node file (the caller holds the reload lock)."""
        config, added, removed, changed = change.config, *change.names()
        retired = [self.config]  # its last reference, dropped in a worker thread: the
        # configs of 25 000 changed nodes took 35 ms to free, on the loop in one step
        self.nodes.apply_change(change)
        self.catalog.sync(config)
        if added or removed or changed:  # a console is a node's: else none changed
            self._sync_consoles(config)
        await self.lifecycle.applied(config, added, removed, changed)
        await asyncio.to_thread(retired.clear)
        if added or changed:  # else the file made nothing that lives on (compare)
            heap.settle()
        log.info(
            "reloaded %s: %d nodes, added %s, removed %s, changed %s", config.path,
            len(config.nodes), _names(added), _names(removed), _names(changed),
        )  # fmt: skip
        return {"added": sorted(added), "removed": sorted(removed), "changed": sorted(changed)}

    def _read_again(self) -> FileChange:
        """The node file read, checked and compared with the running one: most of a
        reload's work (0.3 s for 25 000 nodes), done in a worker thread while the event
        loop serves on. Pure: what it refuses changes nothing."""
        return self._compared(lambda: load(self.config.path))

    def _compared(self, read: Callable[[], Config]) -> FileChange:
        """A node file ``read`` and compared with the running one; ReloadRefused when it
        is wrong or changes what only a restart applies."""
        try:
            with collector_paused():
                config = self._with_overrides(read())
        except ConfigError as error:
            raise ReloadRefused(error.render().splitlines()) from None
        for section in ("server", "api", "cluster"):
            if getattr(config, section) != getattr(self.config, section):
                problem = f"[{section}] changed; restart layerpy serve to apply it"
                raise ReloadRefused([f"{config.path}: {problem}"])
        return compare(self.config, config)

    async def start(self) -> None:
        server = self.config.server
        if server.interface is not None:
            problem = host.interface_problem(server.interface, server.address)
            if problem is not None:
                raise StartRefused(problem)
        plan = self.plan
        log.info("%s", plan.summary())
        if (crowded := host.neighbour_warning(self.config)) is not None:
            log.warning("%s", crowded)
        bad = listeners.BadRequests(lambda: self.stats.count("http", "malformed", ok=False))
        logging.getLogger("aiohttp.server").addFilter(bad)
        self._closers.append(_Detach(logging.getLogger("aiohttp.server"), bad))
        await self._boot_http(plan)
        await self._operator_api(plan)
        self._closers.append(
            await start_tftp(
                self.config.ipxe.directory,
                str(server.address),
                server.tftp_port,
                interface=server.interface,
                on_event=accounting(self.stats, self.policy),
                budget=TftpBudget(
                    plan.tftp, plan.tftp_per_address, plan.tftp_known, self.policy.known
                ),
                lookup=self.policy.loader_file,
            )
        )
        self.catalog.sync(self.config)  # images pull in the background
        self._sync_consoles(self.config)
        if server.dhcp != "off":
            assert server.interface is not None
            if server.dhcp_probe:
                cluster = self.cluster  # its instances answer on the segment too
                self._neighbours = Neighbours(
                    server,
                    peers=cluster.peer_addresses if cluster else None,
                    settle=cluster.lease_ttl if cluster else 0.0,
                )
                await self._neighbours.look(starting=True)
            self._closers += await start_dhcp(
                self.policy,
                server.interface,
                server.address,
                self.stats,
                proxy=server.dhcp == "proxy",
                log_requests=server.log_requests,
            )
        if self.cluster is not None:  # last: owning nodes is for an instance that serves
            await self.cluster.start(_addresses(self.config))

    async def _serve_app(self, app: web.Application) -> web.AppRunner:
        runner = await listeners.runner(app)
        self._runners.append(runner)
        return runner

    def _admission(self, name: str, plan: budget.Plan, *, boot: bool) -> listeners.Admission:
        """A listener's connection budget from the plan: the boot network's keeps a part
        for known nodes; refusals and sheds are counted."""
        return listeners.Admission(
            name,
            total=plan.boot_http if boot else plan.operator_api,
            per_address=plan.boot_http_per_address if boot else plan.operator_api_per_address,
            known_share=plan.boot_http_known if boot else 0,
            known=self.policy.known if boot else lambda address: False,
            on_refused=lambda: self.stats.count("http", "refused", ok=False),
            on_shed=lambda: self.stats.count("http", "shed", ok=False),
        )

    async def _boot_http(self, plan: budget.Plan) -> None:
        server = self.config.server
        admission = self._admission("boot HTTP", plan, boot=True)
        beats = self.beats if server.beat_port else None
        app = build_app(self.policy, self.stats, self.lifecycle, self.catalog, beats=beats,
                        log_requests=server.log_requests)  # fmt: skip
        runner = await self._serve_app(app)
        await listeners.AdmittedSite(
            runner, str(server.address), server.http_port, admission, service="HTTP",
            shortcut=Shortcut(app),
        ).start()  # fmt: skip
        log.info("http for the boot network on %s", server.url)
        if beats is not None:
            self._closers.append(BeatListener(beats, str(server.address)))

    async def _operator_api(self, plan: budget.Plan) -> None:
        """The Unix socket and the TCP listeners for operators (a budget of their own,
        never the boot network's); the first operator token at the very first start."""
        server, api = self.config.server, self.config.api
        admission = self._admission("operator API", plan, boot=False)
        tokens = Tokens(server.state_dir)
        made = tokens.first_start()
        if made is not None:
            log.info("made the first operator token, admin; its secret is in %s (0600)", made)
        app = build_api(self.policy, self.nodes, self.stats, self.reload, self.lifecycle,
                        self.catalog, tokens, self.consoles, origins=api.origins,
                        log_requests=server.log_requests,
                        cluster=self.cluster.owners.overview if self.cluster else None)  # fmt: skip
        runner = await self._serve_app(app)
        socket_path = api.socket_path(server.state_dir)
        await listeners.unix_site(runner, socket_path, api.socket_group)
        names = [str(socket_path)]
        tls = None
        if api.tls_cert is not None and api.tls_key is not None:
            tls = listeners.tls_context(api.tls_cert, api.tls_key)
        for address, port in api.listen:
            site = listeners.AdmittedSite(runner, str(address), port, admission, tls, "the API")
            await site.start()
            names.append(site.name)
        log.info("operator API on %s", ", ".join(names))

    async def watch(self) -> None:
        """Continuous work: the lifecycle, and nodes that stop reporting."""
        with CollectorTimer(self.stats).timing():
            await self._work()

    async def _work(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.lifecycle.run())
            tasks.create_task(self._check_lost())
            tasks.create_task(self._measure_loop_lag())
            tasks.create_task(_sum_up_held_back_logs())
            if self._neighbours is not None:
                tasks.create_task(self._neighbours.watch())
            if self.cluster is not None:
                tasks.create_task(self.cluster.run())

    async def _measure_loop_lag(self) -> None:
        """How late the event loop wakes a timer, i.e. how long something else held it:
        every DHCP answer waits that long too. Shown as ``loop``/``lag`` in the stats."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(LAG_PROBE)
            self.stats.observe("loop", "lag", max(0.0, loop.time() - asked - LAG_PROBE))

    async def _check_lost(self) -> None:
        interval = max(0.5, self.config.server.heartbeat / 2)
        while True:
            await asyncio.sleep(interval)
            self.nodes.check_lost()

    async def close(self) -> None:
        """Everything stops in reverse order; a step slower than a second is logged with
        its time (a stop must be prompt: systemd and the operator wait on it)."""
        with _timed("the services"):
            for closer in reversed(self._closers):
                result = closer.close()  # type: ignore[attr-defined]
                if asyncio.iscoroutine(result):
                    await result
        with _timed("the consoles"):
            await self.consoles.close()  # first: its end closes the operators' console sessions
        with _timed("the HTTP listeners"):
            for runner in reversed(self._runners):
                await runner.cleanup()
        with _timed("the lifecycle"):
            await self.lifecycle.close()
        if self.cluster is not None:  # after the lifecycle: it acts on nothing any more
            with _timed("leaving the cluster"):
                await self.cluster.close()
        await self.backend.close()  # last: the local journals (a cluster's is closed by now)


@contextlib.contextmanager
def _timed(step: str) -> Iterator[None]:
    began = time.monotonic()
    yield
    if (took := time.monotonic() - began) > 1.0:
        log.info("stopping: %s took %.1f s", step, took)


class _Detach:
    """Closing takes a log filter off its logger again."""

    def __init__(self, logger: logging.Logger, log_filter: logging.Filter) -> None:
        self.logger, self.filter = logger, log_filter

    def close(self) -> None:
        self.logger.removeFilter(self.filter)


def local_backend(config: Config, state_dir: Path | None = None) -> LocalJournal:
    """A single server's store keeps its records in the state directory's journals
    (``state_dir`` overrides the file's)."""
    return LocalJournal(state_dir or config.server.state_dir)


def _private_directory(path: Path) -> None:
    """The state directory holds tokens: its owner's alone (0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("%s was mode %o; made it 0700 (it holds tokens)", path, mode)
        path.chmod(0o700)


def _console_specs(config: Config) -> dict[str, PowerSpec]:
    """The nodes whose consoles the file says where to read."""
    return {
        name: node.bmc
        for name, node in config.nodes.items()
        if node.bmc is not None and node.bmc.console is not None
    }


def _addresses(config: Config) -> dict[str, IPv4Address | None]:
    """Each node's address: which instances of the cluster may own it (their segments)."""
    return {name: node.ip for name, node in config.nodes.items()}


def _names(names: set[str]) -> str:
    return ",".join(sorted(names)) or "-"


async def _sum_up_held_back_logs() -> None:
    """The "… N more like this" line of a flood that stopped, not only at its next line."""
    while True:
        await asyncio.sleep(logs.SUMMARY_EVERY)
        logs.flush_all()


async def serve(config: Config, *, state_dir: Path | None = None) -> None:
    """Run until SIGINT or SIGTERM; SIGHUP reloads the node file."""
    cluster = None
    if config.cluster is not None:
        cluster = await ClusterInstance.join(config)  # the store's state is read from etcd
        config = cluster.config
    try:
        with collector_paused():
            backend = cluster.backend if cluster else local_backend(config, state_dir)
            server = Server(config, backend, state_dir=state_dir, cluster=cluster)
    except BaseException:
        if cluster is not None:
            await cluster.close()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    async def reload_on_signal() -> None:
        with contextlib.suppress(ReloadRefused):  # already logged, the old file stays
            await server.reload()

    reloads: set[asyncio.Task[None]] = set()

    def on_hangup() -> None:
        task = loop.create_task(reload_on_signal())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    starting = asyncio.create_task(server.start())
    stopped = asyncio.create_task(stop.wait())
    try:  # a stop during the start (its look for other DHCP servers takes seconds) is obeyed
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            log.info("stopped while starting")
        await starting
    except BaseException:
        stopped.cancel()
        await server.close()  # what did start (listeners, sockets) goes again
        if starting.cancelled():
            return
        raise
    heap.settle()
    log.info("serving %d nodes from %s", len(config.nodes), config.path)
    server.ready()
    watchers = [asyncio.create_task(server.watch()), asyncio.create_task(Settler().run())]
    try:
        await stopped
    finally:
        notify("STOPPING=1")
        log.info("stopping")
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await server.close()
