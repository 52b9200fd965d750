"""Operator input the API must survive (issue 26): every route, taken from the app's own
router, answers generated hostlists and JSON bodies with 2xx or 4xx, never 5xx; and the
largest inputs it accepts, on a node file of 25 000 nodes, never hold the event loop for
50 ms. The API runs in-process (aiohttp's test server on 127.0.0.1) on a real Server's
node store, lifecycle and catalog, with an admin token."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import pytest
from aiohttp import ClientResponseError, web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from layerpy import hostlist
from layerpy.auth import Scope, Tokens
from layerpy.config import load
from layerpy.nodes.feed import Change
from layerpy.server import Server, local_backend
from layerpy.services.api import BODY_LIMIT, POWER_ACTIONS, build_api
from layerpy.services.live import SHOWN_EXPANSION, _shown
from layerpy.services.pieces import PIECE, json_answer
from layerpy.turns import in_turns

from nodefile import big_groups, big_node_file
from test_hostlist import FUZZ, expressions, garbage

LARGE = 25_000  # nodes in the node file of the loop-lag test (one group: g0n[00001-25000])
ALL = f"g0n[00001-{LARGE}]"
HELD = 0.05  # seconds no request may hold the event loop for (issue 26)
PROBE = 0.005  # seconds between the probe's timers
T = TypeVar("T")
Run = Callable[[str, str, bytes | None], int]  # method, path, body: the status


@contextlib.asynccontextmanager
async def operator_api(path: Path) -> AsyncIterator[tuple[web.Application, TestClient]]:
    """The operator API of a server on this node file (its listeners not started: nothing
    on the network), with a client that sends an admin token."""
    config = load(path)
    server = Server(config, local_backend(config))
    gc.collect()  # the node file's objects out of the collector's way, as serve() puts them
    gc.freeze()
    secret = Tokens(server.config.server.state_dir).create("fuzz", Scope.ADMIN)
    tokens = Tokens(server.config.server.state_dir)
    app = build_api(server.policy, server.nodes, server.stats, server.reload, server.lifecycle,
                    server.catalog, tokens, server.consoles)  # fmt: skip
    headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
    try:
        async with TestClient(TestServer(app, host="127.0.0.1"), headers=headers) as client:
            yield app, client
    finally:
        await server.close()
        gc.unfreeze()


async def answer(client: TestClient, method: str, path: str, body: bytes | None) -> int:
    """The status, the body read as bytes (never parsed here); a stream is left unread."""
    try:
        async with client.request(method, path, data=body) as response:
            if response.content_type != "text/event-stream":
                await response.read()
            return response.status
    except ClientResponseError as error:
        if method != "HEAD" or len(path) < 8190:
            raise
        return error.status  # aiohttp's 400 to a request line too long has a body, HEAD too


# -- every route, generated input ---------------------------------------------------------

PLACEHOLDER = re.compile(r"\{(\w+)\}")


def routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path pattern) of every route the app has: a new route is fuzzed too."""
    found = {(route.method, route.resource.canonical) for route in app.router.routes()}
    assert found, "the app has no routes"
    return sorted(found)


def json_text(value: object) -> bytes:
    return json.dumps(value).encode()


hostlists = st.one_of(
    expressions, garbage, st.sampled_from(["cn[001-004]", "cn001", "cn[001-002],cn004"])
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=40)
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=20,
)
shaped = st.fixed_dictionaries(
    {},
    optional={
        "nodes": st.one_of(hostlists, anything),
        "node": st.one_of(st.sampled_from(["cn001", "cn009"]), anything),
        "action": st.one_of(st.sampled_from([*POWER_ACTIONS, "explode"]), anything),
        "force": st.one_of(st.booleans(), anything),
        "image": st.one_of(st.sampled_from(["missing"]), anything),
        "mac": st.one_of(st.sampled_from(["52:54:00:aa:00:07", "zz"]), anything),
    },
)
sizes = st.integers(1, 2 * BODY_LIMIT)
bodies = st.one_of(
    st.none(),
    shaped.map(json_text),
    anything.map(json_text),
    st.binary(max_size=200),
    sizes.map(lambda n: json_text({"nodes": "x" * n, "action": "status"})),  # long and huge
    sizes.map(lambda n: b"[" * n + b"]" * n),  # nested
    sizes.map(lambda n: json_text({"nodes": "cn[001-004]", "action": "on", "pad": [0] * n})),
)


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[web.Application, Run]]:
    """The API on a small node file, served by a loop in a thread of its own for the
    whole module: each example only sends requests (`run` waits for one there)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fuzzed API", daemon=True)
    thread.start()

    def run(work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, loop).result(timeout=120)

    served = operator_api(big_node_file(tmp_path_factory.mktemp("fuzz"), 4))
    app, client = run(served.__aenter__())
    try:
        yield app, lambda method, path, body: run(answer(client, method, path, body))
    finally:
        run(served.__aexit__(None, None, None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()


def url(pattern: str, values: dict[str, str]) -> str:
    """The pattern's placeholders filled with `values`, percent-encoded."""
    return PLACEHOLDER.sub(lambda found: quote(values[found[1]], safe=""), pattern)


@settings(FUZZ, max_examples=max(1, FUZZ.max_examples // 10))  # each example: every route
@given(data=st.data())
def test_every_route_answers_generated_input_without_a_server_error(
    fuzzed: tuple[web.Application, Run], data: st.DataObject
) -> None:
    """Hostlists (valid, at the limits, garbage) in each path placeholder and JSON bodies
    (the routes' shapes with values of any type, any JSON, bytes, huge, nested deep) to
    every route and method: 2xx or 4xx."""
    app, send = fuzzed
    problems = []
    for method, pattern in data.draw(st.permutations(routes(app))):
        target = url(pattern, {name: data.draw(hostlists) for name in PLACEHOLDER.findall(pattern)})
        body = data.draw(bodies)
        status = send(method, target, body)
        if not 200 <= status < 500:
            problems.append(f"{method} {target:.200} {body!r:.200}: {status}")
    assert not problems, "\n".join(problems)


# -- the event loop, the largest accepted input --------------------------------------------


@dataclass
class LoopProbe:
    """A timer every PROBE seconds in the server's loop: how long each wake came late
    (wall time: includes this machine's other load) and how much CPU the loop's thread
    used meanwhile (an upper bound of what any handler held it for, on a busy machine too)."""

    held: list[float] = field(default_factory=list)
    late: list[float] = field(default_factory=list)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked, cpu = loop.time(), time.thread_time()
            await asyncio.sleep(PROBE)
            self.late.append(loop.time() - asked - PROBE)
            self.held.append(time.thread_time() - cpu)

    def worst(self, since: int) -> tuple[float, float]:
        return max(self.held[since:], default=0.0), max(self.late[since:], default=0.0)


def largest_inputs() -> list[tuple[str, str, bytes | None, int]]:
    """(method, path, body, expected status): the most work a request may ask for."""

    def power(nodes: str, action: str = "on") -> bytes:
        return json_text({"nodes": nodes, "action": action})

    most_terms = "x[" + ",".join(f"{n:05d}" for n in range(hostlist.MAX_TERMS - 1)) + "]"
    longest = ",".join([ALL] * (hostlist.MAX_LENGTH // (len(ALL) + 1)))
    return [
        ("POST", "/api/v1/power", power(ALL, "on"), 200),
        ("POST", "/api/v1/power", power(ALL, "status"), 200),
        ("POST", "/api/v1/power", power(ALL, "cycle"), 200),
        ("POST", "/api/v1/power", power(ALL, "clear"), 200),
        ("POST", "/api/v1/power", power(f"x[1-{hostlist.MAX_EXPANSION}]"), 404),
        ("POST", "/api/v1/power", power(most_terms), 404),
        ("POST", "/api/v1/power", power(longest), 400),  # 2 000 x 25 000 names: too large
        ("POST", "/api/v1/power", power("x" + "[0-1]" * 13_000), 400),
        ("POST", "/api/v1/image", json_text({"nodes": ALL, "image": "missing"}), 400),
        ("GET", f"/api/v1/nodes/{ALL}/explain", None, 200),
        ("GET", "/api/v1/nodes", None, 200),
        ("GET", "/api/v1/plan", None, 200),
        ("GET", "/api/v1/unknown", None, 200),
        ("GET", "/api/v1/events", None, 200),
        ("GET", "/metrics", None, 200),
        ("POST", "/api/v1/power", b"[" * (BODY_LIMIT - 1), 400),
        ("POST", "/api/v1/power", json_text({"nodes": [0] * (BODY_LIMIT // 4)}), 400),
        ("POST", "/api/v1/power", json_text({"nodes": "\u00e9" * (BODY_LIMIT // 13)}), 400),
        ("POST", "/api/v1/power", b" " * BODY_LIMIT + b"{}", 413),
        ("POST", "/api/v1/reload", None, 200),  # the file unchanged: 25 000 nodes compared
    ]


def test_no_request_holds_the_event_loop(tmp_path: Path) -> None:
    path = big_node_file(tmp_path, LARGE)

    async def scenario() -> list[str]:
        probe, problems, worst = LoopProbe(), [], 0.0
        async with operator_api(path) as (_, client):
            await answer(client, "GET", "/api/v1/stats", None)  # first-call costs
            probing = asyncio.create_task(probe.run())
            for method, target, body, expected in largest_inputs():
                since = len(probe.held)
                status = await answer(client, method, target, body)
                await asyncio.sleep(2 * PROBE)  # the probe's look after the answer
                held, late = probe.worst(since)
                worst = max(worst, held)
                what = f"{method} {target[:60]} {(body or b'')[:60]!r} ({len(body or b'')} bytes)"
                if status != expected:
                    problems.append(f"{what}: {status}, expected {expected}")
                if held > HELD:
                    problems.append(f"{what}: held the loop {held * 1000:.0f} ms "
                                    f"(a timer came {late * 1000:.0f} ms late)")  # fmt: skip
            probing.cancel()
        print(f"\nthe loop held at most {worst * 1000:.0f} ms by one request (bound "
              f"{HELD * 1000:.0f} ms) on {LARGE} nodes")  # fmt: skip
        return problems

    problems = asyncio.run(scenario())
    assert not problems, "\n".join(problems)


def test_reloads_at_once_are_applied_one_after_the_other(tmp_path: Path) -> None:
    """The file is read in a worker thread; two operators' reloads of a file with a new
    node (called together) each compare with the file the other applied: one adds it."""
    path = big_node_file(tmp_path, 4)

    async def scenario() -> list[dict[str, list[str]]]:
        async with operator_api(path) as (_, client):
            path.write_text(path.read_text().replace(big_groups(4), big_groups(5)))
            calls = [client.post("/api/v1/reload") for _ in range(2)]
            answers = await asyncio.gather(*calls)
            assert [a.status for a in answers] == [200, 200], [await a.text() for a in answers]
            return [await a.json() for a in answers]

    added = sorted(answer["added"] for answer in asyncio.run(scenario()))
    assert added == [[], ["g0n00005"]]


def test_answers_in_turns_are_the_json_of_the_whole() -> None:
    """json_answer's pieces join to what json.dumps gives of the whole list or object:
    empty, within one piece, across many; a HEAD answer has no body."""
    values = {f"n{i}": {"i": i, "text": "é" * (i % 7)} for i in range(3 * PIECE // 20)}

    async def listed(request: web.Request) -> web.StreamResponse:
        count = int(request.query["count"])
        keyed = "keyed" in request.query
        names = in_turns(list(values)[:count])
        return await json_answer(request, names, values.__getitem__, keyed=keyed)

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/", listed)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            for count in (0, 1, 50, len(values)):
                chosen = dict(list(values.items())[:count])
                for keyed, whole in ((False, list(chosen.values())), (True, chosen)):
                    query = {"count": str(count)} | ({"keyed": ""} if keyed else {})
                    async with client.get("/", params=query) as response:
                        assert response.content_type == "application/json"
                        assert await response.text() == json.dumps(whole), (count, keyed)
            async with client.head("/", params={"count": "50"}) as response:
                assert (response.status, await response.read()) == (200, b"")

    asyncio.run(scenario())


def test_a_filtered_stream_expands_an_operators_call_only_when_small() -> None:
    """An operator's call is matched against a stream's nodes by its hostlist up to
    SHOWN_EXPANSION names; a larger one is shown without being expanded per stream."""

    def call(nodes: str) -> Change:
        return Change(1, 0.0, nodes, "event", {"event": "operator"}, "power on")

    wanted = {"cn002"}
    assert _shown(call("cn[001-004]"), wanted)
    assert not _shown(call("cn[005-008]"), wanted)
    assert not _shown(call(f"cn[3-{SHOWN_EXPANSION + 2}]"), wanted)
    assert _shown(call(f"cn[3-{SHOWN_EXPANSION + 3}]"), wanted)
