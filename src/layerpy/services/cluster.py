"""``GET /api/v1/cluster``: the instances of the cluster, their health and their nodes
(``cluster.owners.Owners.overview``), or, without ``[cluster]``, that this server is a
single instance."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

Overview = Callable[[], Awaitable[dict[str, Any]]]
OVERVIEW: web.AppKey[Overview | None] = web.AppKey("cluster_overview")
SINGLE = "this server is a single instance (its node file has no [cluster] table)"


def add_cluster_route(app: web.Application, overview: Overview | None) -> None:
    app[OVERVIEW] = overview
    app.router.add_get("/api/v1/cluster", show_cluster)


async def show_cluster(request: web.Request) -> web.Response:
    overview = request.app[OVERVIEW]
    if overview is None:
        return web.json_response({"cluster": False, "message": SINGLE})
    return web.json_response({"cluster": True, **await overview()})
