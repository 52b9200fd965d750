"""The operator's view of the cluster: ``GET /api/v1/cluster`` with and without [cluster],
and the rows ``layerpy cluster`` prints from it."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from layerpy.cli import cluster_rows
from layerpy.services.cluster import SINGLE, add_cluster_route

OVERVIEW: dict[str, Any] = {
    "source": "etcd",
    "unowned": ["cn009"],
    "instances": [
        {"name": "a", "alive": True, "url": "http://10.99.0.1:8080", "segment": "",
         "started": 1.0, "version": "0.1.0", "last_seen": 100.0, "self": True,
         "nodes": ["cn001", "cn002", "cn003"], "lease_fresh_for": 3.2},
        {"name": "b", "alive": True, "url": "http://10.99.0.2:8080", "segment": "10.99.0.0/24",
         "started": 1.0, "version": "0.1.0", "last_seen": 100.0, "self": False,
         "nodes": ["cn004"]},
        {"name": "c", "alive": False, "url": None, "segment": None, "started": None,
         "version": None, "last_seen": 88.0, "self": False, "nodes": []},
    ],
}  # fmt: skip


async def get_cluster(overview: Any) -> dict[str, Any]:
    app = web.Application()
    add_cluster_route(app, overview)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        response = await client.get("/api/v1/cluster")
        assert response.status == 200
        return await response.json()


def test_a_server_without_cluster_says_it_is_a_single_instance() -> None:
    assert asyncio.run(get_cluster(None)) == {"cluster": False, "message": SINGLE}


def test_a_cluster_member_answers_its_overview() -> None:
    async def overview() -> dict[str, Any]:
        return OVERVIEW

    assert asyncio.run(get_cluster(overview)) == {"cluster": True, **OVERVIEW}


def test_layerpy_cluster_rows() -> None:
    assert cluster_rows(OVERVIEW, now=100.0) == [
        ("a *", "alive, lease fresh 3.2 s", "all", "http://10.99.0.1:8080", "0.1.0",
         "3 cn[001-003]"),
        ("b", "alive", "10.99.0.0/24", "http://10.99.0.2:8080", "0.1.0", "1 cn004"),
        ("c", "gone 12 s ago", "-", "-", "-", "0"),
    ]  # fmt: skip
    stale = {**OVERVIEW, "instances": [{**OVERVIEW["instances"][0], "lease_fresh_for": 0.0}]}
    assert cluster_rows(stale, now=100.0)[0][1] == "lost etcd: not acting"
