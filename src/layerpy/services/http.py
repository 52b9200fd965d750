"""HTTP: iPXE scripts, the minOS kernel and initrd, the agent endpoint and the REST API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from layerpy import hostlist
from layerpy.boot import BootPolicy
from layerpy.catalog import Catalog
from layerpy.config import ReloadRefused
from layerpy.model import Phase
from layerpy.nodes import DISCOVERY, NodeStore, ReportRejected
from layerpy.proto.agent import REPORT_PATH, Answer, ImageSpec, encode
from layerpy.stats import Stats

log = logging.getLogger("layerpy.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
POWER_ACTIONS = ("on", "off", "cycle", "clear", "status")


class PowerControl(Protocol):
    """What the API needs of the lifecycle (kept abstract: services never import power)."""

    def override(self, name: str, power: str | None) -> None: ...
    def override_image(self, name: str, image: str) -> None: ...
    async def cycle(self, name: str) -> None: ...
    def status(self, name: str) -> dict[str, Any]: ...
    def plan(self, name: str) -> dict[str, Any]: ...
    def explain(self, name: str) -> dict[str, Any]: ...
    def image_spec(self, name: str) -> ImageSpec | None: ...


POLICY: web.AppKey[BootPolicy] = web.AppKey("policy", BootPolicy)
NODES: web.AppKey[NodeStore] = web.AppKey("nodes", NodeStore)
STATS: web.AppKey[Stats] = web.AppKey("stats", Stats)
LOG_REQUESTS: web.AppKey[bool] = web.AppKey("log_requests", bool)
RELOAD: web.AppKey[Callable[[], Awaitable[dict[str, list[str]]]]] = web.AppKey("reload")
POWER: web.AppKey[PowerControl] = web.AppKey("power")
CATALOG: web.AppKey[Catalog] = web.AppKey("catalog", Catalog)
IMAGE_FILES = ("rootfs.tar", "rootfs.squashfs", "config.json")


def build_app(
    policy: BootPolicy,
    stats: Stats,
    reload: Callable[[], Awaitable[dict[str, list[str]]]],
    power: PowerControl,
    catalog: Catalog,
    *,
    log_requests: bool = False,
) -> web.Application:
    app = web.Application(middlewares=[_profile], client_max_size=1024 * 1024)
    app[CATALOG] = catalog
    app[RELOAD] = reload
    app[POWER] = power
    app[POLICY] = policy
    app[NODES] = policy.nodes
    app[STATS] = stats
    app[LOG_REQUESTS] = log_requests
    app.add_routes(
        [
            web.get("/boot/{name}.ipxe", boot_script),
            web.get("/boot/discover/{mac}.ipxe", discovery_script),
            web.get("/minos/kernel", minos_file),
            web.get("/minos/initrd", minos_file),
            web.post(REPORT_PATH, agent_report),
            web.get("/api/v1/nodes", list_nodes),
            web.get("/api/v1/nodes/{name}", show_node),
            web.get("/api/v1/unknown", list_unknown),
            web.get("/api/v1/events", list_events),
            web.get("/api/v1/stats", show_stats),
            web.get("/metrics", metrics),
            web.post("/api/v1/reload", reload_config),
            web.get("/images/{digest}/{file}", image_file),
            web.get("/api/v1/images", list_images),
            web.post("/api/v1/power", power_action),
            web.post("/api/v1/image", image_action),
            web.get("/api/v1/plan", plan),
            web.get("/api/v1/nodes/{name}/explain", explain),
        ]
    )
    return app


@web.middleware
async def _profile(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Service time per route, and per-request debug lines when asked for."""
    started = time.perf_counter()
    route = request.match_info.route.resource
    kind = route.canonical if route is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    finally:
        elapsed = time.perf_counter() - started
        request.app[STATS].observe("http", f"{request.method} {kind}", elapsed, ok=status < 400)
        if request.app[LOG_REQUESTS]:
            log.debug(
                "%s %s %s -> %d in %.1f ms",
                request.remote,
                request.method,
                request.path,
                status,
                elapsed * 1000,
            )


async def boot_script(request: web.Request) -> web.Response:
    policy = request.app[POLICY]
    name = request.match_info["name"]
    node = policy.nodes.nodes.get(name)
    if node is None:
        raise web.HTTPNotFound(text=f"no node named {name!r}\n")
    if request.remote != str(node.config.ip):
        log.warning("%s: refused its boot script to %s", name, request.remote)
        raise web.HTTPForbidden(text=f"the boot script of {name} is only for {node.config.ip}\n")
    return web.Response(text=policy.script(node), content_type="text/plain")


async def discovery_script(request: web.Request) -> web.Response:
    """The minOS for a machine no node claims yet, for the address it got from the pool."""
    policy = request.app[POLICY]
    mac = request.match_info["mac"].lower()
    address = policy.discovery_address(mac)
    if address is None or mac not in policy.nodes.unknown:
        raise web.HTTPNotFound(text=f"no discovery boot for {mac}\n")
    if request.remote != str(address):
        raise web.HTTPForbidden(text=f"the discovery boot of {mac} is only for {address}\n")
    script = policy.discovery_script(mac)
    assert script is not None  # the machine is known, checked above
    return web.Response(text=script, content_type="text/plain")


async def minos_file(request: web.Request) -> web.FileResponse:
    policy = request.app[POLICY]
    which = request.path.rsplit("/", 1)[1]
    node = policy.node_for_fetch(request.remote or "")
    if node is not None:
        policy.nodes.mark(node, Phase(which))
    minos = policy.config.minos
    return web.FileResponse(minos.kernel if which == "kernel" else minos.initrd)


async def agent_report(request: web.Request) -> web.Response:
    try:
        payload = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="report must be JSON\n") from None
    try:
        ack = request.app[NODES].report(payload)
    except ReportRejected as rejected:
        log.warning("rejected an agent report from %s: %s", request.remote, rejected.reason)
        return web.json_response({"error": rejected.reason}, status=rejected.status)
    nodes = request.app[NODES]
    image = None if ack.node == DISCOVERY else request.app[POWER].image_spec(ack.node)
    heartbeat = nodes.config.server.heartbeat
    return web.json_response(encode(Answer(ack.node, heartbeat, image, ack.identity)))


async def reload_config(request: web.Request) -> web.Response:
    try:
        return web.json_response(await request.app[RELOAD]())
    except ReloadRefused as refused:
        return web.json_response({"problems": refused.problems}, status=400)


async def power_action(request: web.Request) -> web.Response:
    """``{"nodes": "cn[001-004]", "action": "on|off|cycle|clear|status"}``; on and off
    override the desired power until cleared or the node file changes."""
    body = await _json_object(request)
    action, expression = body.get("action"), body.get("nodes")
    if action not in POWER_ACTIONS or not isinstance(expression, str):
        raise web.HTTPBadRequest(
            text=f"need nodes (a hostlist) and action (one of {', '.join(POWER_ACTIONS)})\n"
        )
    names = _expand_nodes(request, expression)
    power = request.app[POWER]
    if action in ("on", "off", "clear"):
        for name in names:
            power.override(name, None if action == "clear" else action)
    elif action == "cycle":
        await asyncio.gather(*(power.cycle(name) for name in names))
    return web.json_response({name: power.status(name) for name in names})


async def image_action(request: web.Request) -> web.Response:
    """``{"nodes": "cn[001-004]", "image": "b"}`` runs image b on them until the override is
    cleared (``layerpy power clear``) or the node file changes."""
    body = await _json_object(request)
    expression, image = body.get("nodes"), body.get("image")
    if not isinstance(expression, str) or not isinstance(image, str):
        raise web.HTTPBadRequest(text="need nodes (a hostlist) and image (a name)\n")
    names = _expand_nodes(request, expression)
    power = request.app[POWER]
    try:
        for name in names:
            power.override_image(name, image)
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{error}\n") from None
    return web.json_response({name: power.status(name) for name in names})


async def plan(request: web.Request) -> web.Response:
    power = request.app[POWER]
    return web.json_response([power.plan(name) for name in request.app[NODES].nodes])


async def explain(request: web.Request) -> web.Response:
    """One node's explain (an object), or a hostlist's (a list, in hostlist order)."""
    expression = request.match_info["name"]
    names = _expand_nodes(request, expression)
    power = request.app[POWER]
    if "[" in expression or "," in expression:
        return web.json_response([power.explain(name) for name in names])
    return web.json_response(power.explain(names[0]))


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise web.HTTPBadRequest(text="the body must be JSON\n") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object\n")
    return body


MISSING_SHOWN = 20  # a 404 names this many missing nodes, then counts the rest


def _expand_nodes(request: web.Request, expression: str) -> list[str]:
    """Node names from a hostlist (sized before it is expanded: 400 when too large or
    malformed); 404 naming the ones that are not in the file."""
    try:
        names = hostlist.expand(expression)
    except hostlist.HostlistError as error:
        raise web.HTTPBadRequest(text=f"{error}\n") from None
    missing = [name for name in names if name not in request.app[NODES].nodes]
    if missing:
        shown = ", ".join(missing[:MISSING_SHOWN])
        more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
        raise web.HTTPNotFound(text=f"not in the node file: {shown}{more}\n")
    return names


async def image_file(request: web.Request) -> web.StreamResponse:
    """A flattened image (tar or squashfs, with Range) or its config, by manifest digest."""
    digest, name = request.match_info["digest"], request.match_info["file"]
    image = request.app[CATALOG].store.get(digest)
    if image is None or name not in IMAGE_FILES:
        raise web.HTTPNotFound(text=f"no {name} for image {digest}\n")
    if name == "config.json":
        return web.json_response(image.config)
    path = image.rootfs if name == "rootfs.tar" else image.squashfs
    if path is None:
        raise web.HTTPNotFound(text=f"image {digest} has no squashfs (tar2sqfs missing)\n")
    return web.FileResponse(path)


async def list_images(request: web.Request) -> web.Response:
    entries = request.app[CATALOG].entries.values()
    return web.json_response([entry.as_json() for entry in entries])


async def list_nodes(request: web.Request) -> web.Response:
    nodes = request.app[NODES].nodes.values()
    return web.json_response([node.as_json() for node in nodes])


async def show_node(request: web.Request) -> web.Response:
    node = request.app[NODES].nodes.get(request.match_info["name"])
    if node is None:
        raise web.HTTPNotFound(text=f"no node named {request.match_info['name']!r}\n")
    return web.json_response(node.as_json())


async def list_unknown(request: web.Request) -> web.Response:
    machines = request.app[NODES].unknown.values()
    return web.json_response([machine.as_json() for machine in machines])


async def list_events(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODES].feed.events())


async def show_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS].as_json())


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[STATS].prometheus(), content_type="text/plain")
