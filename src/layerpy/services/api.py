"""The operator API: nodes, plans, events, metrics, power, images and reload.

Served only on operator listeners (the Unix socket and the ``[api] listen`` addresses),
never on the boot network, and only to an authenticated operator: over the socket the
kernel names the user (file permissions decided that they may connect); over TCP a bearer
token names the operator and its scope. Reading needs ``read``, changing needs ``admin``.
Every change is logged and published as an ``operator`` event, with who, from where and
what.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from layerpy import hostlist
from layerpy.auth import GUESS_EVERY, GUESSES, Guesses, Operator, Scope, Tokens, bearer, socket_peer
from layerpy.boot import Booter
from layerpy.catalog import Catalog
from layerpy.config import ReloadRefused, values
from layerpy.consoles import Consoles
from layerpy.logs import Throttle
from layerpy.model import Busy
from layerpy.nodes import NodeStore
from layerpy.services.cluster import Overview, add_cluster_route
from layerpy.services.http import (
    CATALOG,
    OPERATOR,
    POWER,
    STATS,
    Handler,
    PowerControl,
    image_file,
    profile,
    read_json,
    share,
)
from layerpy.services.listeners import peer_of
from layerpy.services.live import NODES, PUBLIC_PATHS, add_live_routes, audit
from layerpy.services.pieces import json_answer
from layerpy.stats import Stats
from layerpy.text import printable
from layerpy.turns import expand_in_turns, in_turns

log = logging.getLogger("layerpy.api")
quiet = Throttle(log)  # refusals a caller can cause: a few a minute each

POWER_ACTIONS = ("on", "off", "cycle", "clear", "status")
MISSING_SHOWN = 20  # a 404 names this many missing nodes, then counts the rest
CYCLES_AT_ONCE = 256  # power cycles one operator's call has in flight (BMC commands)
BODY_LIMIT = 128 * 1024  # bytes of a request body (413 beyond): the longest hostlist, twice

Reload = Callable[[], Awaitable[dict[str, list[str]]]]
RELOAD: web.AppKey[Reload] = web.AppKey("reload")
TOKENS: web.AppKey[Tokens] = web.AppKey("tokens", Tokens)
WRONG_TOKENS: web.AppKey[Guesses] = web.AppKey("wrong_tokens", Guesses)


def build_api(
    booter: Booter,
    nodes: NodeStore,
    stats: Stats,
    reload: Reload,
    power: PowerControl,
    catalog: Catalog,
    tokens: Tokens,
    consoles: Consoles,
    *,
    origins: tuple[str, ...] = (),
    log_requests: bool = False,
    cluster: Overview | None = None,
) -> web.Application:
    app = web.Application(middlewares=[profile, authenticate], client_max_size=BODY_LIMIT)
    share(app, booter, stats, power, catalog, log_requests)
    app[RELOAD] = reload
    app[TOKENS] = tokens
    app[WRONG_TOKENS] = Guesses()
    app.add_routes(
        [
            web.get("/api/v1/nodes", list_nodes),
            web.get("/api/v1/nodes/{name}", show_node),
            web.get("/api/v1/nodes/{name}/explain", explain),
            web.get("/api/v1/unknown", list_unknown),
            web.get("/api/v1/events", list_events),
            web.get("/api/v1/stats", show_stats),
            web.get("/api/v1/plan", plan),
            web.get("/api/v1/images", list_images),
            web.get("/images/{digest}/{file}", image_file),
            web.get("/metrics", metrics),
            web.post("/api/v1/power", power_action),
            web.post("/api/v1/image", image_action),
            web.post("/api/v1/reload", reload_config),
            web.post("/api/v1/bind", bind_node),
        ]
    )
    add_live_routes(app, nodes, consoles, origins)
    add_cluster_route(app, cluster)
    return app


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who is asking (401 if nobody we know), and whether they may (403). The dashboard's
    own files hold no data and are served to anyone who can connect."""
    if request.method == "GET" and request.path in PUBLIC_PATHS:
        return await handler(request)
    operator = _operator(request)
    if operator is None:
        raise web.HTTPUnauthorized(
            text="an operator token is needed: Authorization: Bearer <token> "
            "(layerpy token add NAME makes one)\n",
            headers={"WWW-Authenticate": 'Bearer realm="layerpy"'},
        )
    if not operator.may(request.method):
        what = f"{request.method} {printable(request.path)}"
        quiet.log("read-only scope", logging.WARNING, "%s from %s may only read: refused %s",
                  operator.name, operator.address, what)  # fmt: skip
        raise web.HTTPForbidden(text=f"{operator.name} may only read (scope read)\n")
    request[OPERATOR] = operator
    return await handler(request)


def _operator(request: web.Request) -> Operator | None:
    sock = peer_of(request)
    if sock is not None:  # the Unix socket: whoever could open it is an operator
        return Operator(socket_peer(sock), Scope.ADMIN, "unix socket")
    secret = bearer(request.headers.get("Authorization"))
    if secret is None:
        return None
    remote = request.remote or "?"
    guesses = request.app[WRONG_TOKENS]
    if wait := guesses.wait(remote):
        request.app[STATS].count("http", "guessing", ok=False)
        raise web.HTTPTooManyRequests(
            text=f"too many wrong operator tokens from {remote}: try again in {wait} s\n",
            headers={"Retry-After": str(wait)},
        )
    record = request.app[TOKENS].check(secret)
    if record is None:
        quiet.log("unknown operator token", logging.WARNING,
                  "%s: refused an unknown operator token", remote)  # fmt: skip
        if guesses.wrong(remote):
            quiet.log("operator token guessing", logging.WARNING,
                      "%s: %d wrong operator tokens: its tokens are refused (429) until "
                      "it earns a guess back (one each %g s)", remote, GUESSES,
                      GUESS_EVERY)  # fmt: skip
        return None
    return Operator(f"token {record.name}", record.scope, remote)


# -- reading --------------------------------------------------------------------------------


async def list_nodes(request: web.Request) -> web.StreamResponse:
    """Every node; ``X-Layerpy-Seq`` is the last change before they were read, for a
    stream to go on from (``Last-Event-ID``) without missing one."""
    store = request.app[NODES]
    headers = {"X-Layerpy-Seq": str(store.feed.seq)}
    nodes = in_turns(list(store.nodes.values()))
    return await json_answer(request, nodes, lambda node: node.as_json(), headers=headers)


async def show_node(request: web.Request) -> web.Response:
    node = request.app[NODES].nodes.get(request.match_info["name"])
    if node is None:
        raise web.HTTPNotFound(text=f"no node named {printable(request.match_info['name'], 64)}\n")
    return web.json_response(node.as_json())


async def explain(request: web.Request) -> web.StreamResponse:
    """One node's explain (an object), or a hostlist's (a list, in hostlist order)."""
    expression = request.match_info["name"]
    names = await _expand_nodes(request, expression)
    power = request.app[POWER]
    if "[" in expression or "," in expression:
        return await json_answer(request, _each_node(request, names), power.explain)
    return web.json_response(power.explain(names[0]))


async def list_unknown(request: web.Request) -> web.StreamResponse:
    machines = in_turns(list(request.app[NODES].unknown.values()))
    return await json_answer(request, machines, lambda machine: machine.as_json())


async def list_events(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODES].feed.events())


async def show_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATS].as_json())


async def plan(request: web.Request) -> web.StreamResponse:
    names = list(request.app[NODES].nodes)
    return await json_answer(request, _each_node(request, names), request.app[POWER].plan)


async def list_images(request: web.Request) -> web.Response:
    entries = request.app[CATALOG].all_entries()
    return web.json_response([entry.as_json() for entry in entries])


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format 0.0.4 (docs/metrics.md lists the metrics)."""
    body = await request.app[STATS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- changing -------------------------------------------------------------------------------


async def power_action(request: web.Request) -> web.StreamResponse:
    """``{"nodes": "cn[001-004]", "action": "on|off|cycle|clear|status"}``; on and off
    override the desired power until cleared or the node file changes. ``cycle`` skips
    busy nodes (as ``off`` waits for them) unless ``"force": true``."""
    body = await _json_object(request)
    action, expression, force = body.get("action"), body.get("nodes"), body.get("force", False)
    if action not in POWER_ACTIONS or not isinstance(expression, str):
        raise web.HTTPBadRequest(
            text=f"need nodes (a hostlist) and action (one of {', '.join(POWER_ACTIONS)})\n"
        )
    if not isinstance(force, bool):
        raise web.HTTPBadRequest(text="force must be true or false\n")
    names = await _expand_nodes(request, expression)
    power, store = request.app[POWER], request.app[NODES]
    skipped = {}
    if action != "status":
        audit(request, f"power {action}{' (force)' if force else ''} {expression}", expression)
    if action in ("on", "off", "clear"):
        async for name in _each_node(request, names):
            power.override(name, None if action == "clear" else action)
    elif action == "cycle":
        busy = [] if force else [name for name in names if store.nodes[name].busy == Busy.BUSY]
        skipped = {name: "busy: not cycled (force to cycle it anyway)" for name in busy}
        await _cycle(power, [name for name in names if name not in skipped])

    def answer(name: str) -> dict[str, Any]:
        return power.status(name) | {"skipped": skipped.get(name)}

    return await json_answer(request, _each_node(request, names), answer, keyed=True)


async def _cycle(power: PowerControl, names: list[str]) -> None:
    """Cycle `names`, CYCLES_AT_ONCE at a time: one task each, 10 000 of them, started and
    then ended in one turn of the event loop each time, held it for 70 ms."""
    waiting = iter(names)

    async def cycler() -> None:
        for name in waiting:  # shared: each name is taken by one cycler
            await power.cycle(name)
            await asyncio.sleep(0)  # a node without a BMC awaits nothing

    await asyncio.gather(*(cycler() for _ in range(min(CYCLES_AT_ONCE, len(names)))))


async def image_action(request: web.Request) -> web.StreamResponse:
    """``{"nodes": "cn[001-004]", "image": "b"}`` runs image b on them until the override is
    cleared (``layerpy power clear``) or the node file changes."""
    body = await _json_object(request)
    expression, image = body.get("nodes"), body.get("image")
    if not isinstance(expression, str) or not isinstance(image, str):
        raise web.HTTPBadRequest(text="need nodes (a hostlist) and image (a name)\n")
    names = await _expand_nodes(request, expression)
    power = request.app[POWER]
    try:
        async for name in _each_node(request, names):
            power.override_image(name, image)  # the first refuses an unknown image
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{printable(error)}\n") from None
    audit(request, f"image {image} on {expression}", expression)
    return await json_answer(request, _each_node(request, names), power.status, keyed=True)


async def bind_node(request: web.Request) -> web.Response:
    """``{"node": "cn003", "mac": "52:54:00:aa:00:07"}``: that machine is that node from
    now on (confirms an LLDP claim, or names new hardware)."""
    body = await _json_object(request)
    name, mac = body.get("node"), body.get("mac")
    if not isinstance(name, str) or not isinstance(mac, str):
        raise web.HTTPBadRequest(text="need node (a name) and mac\n")
    try:
        mac = values.mac(mac)
    except ValueError as error:
        raise web.HTTPBadRequest(text=f"{printable(error)}\n") from None
    nodes = request.app[NODES]
    if name not in nodes.nodes:
        raise web.HTTPNotFound(text=f"no node named {printable(name, 64)}\n")
    audit(request, f"bind {name} {mac}", name)
    nodes.bind(name, mac, request[OPERATOR].name)
    return web.json_response(request.app[POWER].status(name))


async def reload_config(request: web.Request) -> web.Response:
    audit(request, "reload")
    try:
        return web.json_response(await request.app[RELOAD]())
    except ReloadRefused as refused:
        return web.json_response({"problems": refused.problems}, status=400)


async def _json_object(request: web.Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="the body must be a JSON object\n")
    return body


async def _expand_nodes(request: web.Request, expression: str) -> list[str]:
    """Node names from a hostlist, made in turns (checked against the limits of
    docs/api.md before any is made: 400 saying which when one is broken); 404 naming the
    ones that are not in the file."""
    try:
        names = await expand_in_turns(expression)
    except hostlist.HostlistError as error:
        raise web.HTTPBadRequest(text=f"{printable(error)}\n") from None
    nodes = request.app[NODES].nodes
    missing = [name for name in names if name not in nodes]
    if missing:
        shown = ", ".join(printable(name, 64) for name in missing[:MISSING_SHOWN])
        more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
        raise web.HTTPNotFound(text=f"not in the node file: {shown}{more}\n")
    return names


async def _each_node(request: web.Request, names: list[str]) -> AsyncIterator[str]:
    """`names` in turns, less any node a reload removed meanwhile."""
    store = request.app[NODES]
    async for name in in_turns(names):
        if name in store.nodes:
            yield name
