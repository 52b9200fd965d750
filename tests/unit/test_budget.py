"""The descriptor plan and the connection budgets it sizes, without sockets; and the one
fact the shedding takes from aiohttp (is a connection inside a request?), on loopback."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import pytest
from aiohttp import web

from layerpy.budget import DHCP_SOCKETS, SHARES, plan
from layerpy.services import listeners
from layerpy.services.listeners import Admission, in_request


@pytest.mark.parametrize("limit", [256, 1024, 4096, 65536, 1 << 20])
def test_the_shares_and_the_reserve_make_the_limit(limit: int) -> None:
    shares = plan(limit)
    held = {
        "boot_http": shares.boot_http,
        "operator_api": shares.operator_api,
        "tftp": shares.tftp,
        "consoles": shares.consoles,
        "files": shares.files,
    }
    used = sum(held[name] * share.each for name, share in SHARES.items()) + DHCP_SOCKETS
    assert used + shares.reserve == limit
    assert shares.reserve >= limit // 10  # room nobody admits into
    assert 0 < shares.boot_http_known < shares.boot_http
    assert 0 < shares.tftp_known < shares.tftp
    assert 2 <= shares.boot_http_per_address <= 64 and 1 <= shares.tftp_per_address <= 32


def test_systemds_default_limit() -> None:
    """1 024, what the namespace tests run with: the numbers docs/scale.md shows."""
    shares = plan(1024)
    assert (shares.boot_http, shares.boot_http_known, shares.boot_http_per_address) == (179, 44, 44)
    assert (shares.operator_api, shares.tftp, shares.tftp_known) == (40, 61, 15)
    assert (shares.tftp_per_address, shares.consoles, shares.files) == (7, 102, 102)
    assert shares.reserve == 150
    assert shares.summary().startswith("descriptor plan for a limit of 1024: boot HTTP 179")


@dataclass(eq=False)
class Connection:
    address: str
    busy: bool = False

    def idle(self) -> bool:
        return not self.busy


KNOWN = {"10.0.0.11", "10.0.0.12"}


def admission(total: int = 8, per_address: int = 3, known_share: int = 2) -> Admission:
    counts = {"refused": 0, "shed": 0}

    def count(kind: str):
        return lambda: counts.__setitem__(kind, counts[kind] + 1)

    budget = Admission("boot HTTP", total, per_address, known_share, KNOWN.__contains__,
                       count("refused"), count("shed"))  # fmt: skip
    budget.counts = counts  # type: ignore[attr-defined]
    return budget


def fill(budget: Admission, addresses: list[str], busy: bool = False) -> list[Connection]:
    held = [Connection(address, busy) for address in addresses]
    for connection in held:
        assert budget.admit(connection) == (True, None)
    return held


def test_a_full_budget_sheds_the_oldest_idle_stranger() -> None:
    budget = admission()
    strangers = fill(budget, [f"10.9.0.{n}" for n in range(6)])  # all but the known share
    newcomer = Connection("10.9.1.1")
    assert budget.admit(newcomer) == (True, strangers[0])
    strangers[1].busy = True  # inside a request: never shed
    assert budget.admit(Connection("10.9.1.2")) == (True, strangers[2])
    assert len(budget.held) == 6 and budget.counts == {"refused": 0, "shed": 2}
    budget.release(strangers[2])  # the shed one's connection_lost comes later: no double count
    assert len(budget.held) == 6


def test_strangers_never_take_the_known_share_nor_shed_a_node() -> None:
    budget = admission()
    fill(budget, [f"10.9.0.{n}" for n in range(6)], busy=True)
    assert budget.admit(Connection("10.9.1.1")) == (False, None)  # all busy, rest is kept
    node = fill(budget, ["10.0.0.11", "10.0.0.12"])  # the nodes' share, all 8 taken
    assert budget.admit(Connection("10.9.1.2")) == (False, None)  # a node's idle one stays
    other = Connection("10.0.0.12")
    assert budget.admit(other) == (True, node[0])  # a node may shed anyone idle
    assert budget.counts == {"refused": 2, "shed": 1}


def test_a_node_sheds_an_idle_stranger_when_all_is_taken() -> None:
    budget = admission(known_share=0)
    strangers = fill(budget, [f"10.9.0.{n}" for n in range(8)])
    assert budget.admit(Connection("10.0.0.11")) == (True, strangers[0])


def test_busy_connections_go_to_the_back_of_the_line() -> None:
    """Busy ones walked past once are not walked again at the next newcomer."""
    budget = admission(known_share=0)
    held = fill(budget, [f"10.9.0.{n}" for n in range(4)], busy=True)
    held += fill(budget, [f"10.9.0.{n}" for n in range(4, 8)])
    first, second = Connection("10.9.1.1"), Connection("10.9.1.2")
    assert budget.admit(first) == (True, held[4])
    assert list(budget.held) == [*held[5:], *held[:4], first]
    assert budget.admit(second) == (True, held[5])


def test_per_address_cap_stays_and_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    budget = admission(total=100)
    held = fill(budget, ["10.9.0.1"] * 3)
    for _ in range(5):
        assert budget.admit(Connection("10.9.0.1")) == (False, None)
    assert budget.counts["refused"] == 5
    said = [r.getMessage() for r in caplog.records if "refusing" in r.getMessage()]
    assert said == [
        "refusing boot HTTP connections from 10.9.0.1: 3 open from there (limit 3 per address)"
    ]
    for connection in held:
        budget.release(connection)
    assert budget.open == {} and budget.strangers == 0 and budget.crowded == set()


def test_full_is_said_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    budget = admission(known_share=0)
    held = fill(budget, [f"10.9.0.{n}" for n in range(8)])
    for n in range(20):
        held.append(budget.admit(Connection(f"10.9.2.{n}"))[1])  # type: ignore[arg-type]
    full = [r.getMessage() for r in caplog.records if "8 of 8 in use" in r.getMessage()]
    assert full == [
        "boot HTTP connections: 8 of 8 in use, 8 from unknown addresses (who may hold 8); "
        "shedding idle connections for new ones, the oldest first"
    ]


# -- what aiohttp says: a connection waiting for its (next) request, or inside one ----------


async def _handler_states() -> list[bool]:
    """in_request() of the server's one connection: connected, half a request sent,
    inside a request, after its answer (keep-alive)."""
    inside, release = asyncio.Event(), asyncio.Event()
    handlers: list[asyncio.Protocol] = []

    async def slow(request: web.Request) -> web.Response:
        inside.set()
        await release.wait()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", slow)
    runner = await listeners.runner(app)
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()

    def factory() -> asyncio.Protocol:
        handlers.append(server())
        return handlers[-1]

    listening = await loop.create_server(factory, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    seen: list[bool] = []
    client = socket.create_connection(("127.0.0.1", port))
    client.setblocking(False)
    try:
        while not handlers:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        seen.append(in_request(handlers[0]))
        await loop.sock_sendall(client, b"GET / HTTP/1.1\r\nHost: x\r\n")
        await asyncio.sleep(0.05)
        seen.append(in_request(handlers[0]))
        await loop.sock_sendall(client, b"\r\n")
        await asyncio.wait_for(inside.wait(), 10)
        seen.append(in_request(handlers[0]))
        release.set()
        answer = await asyncio.wait_for(loop.sock_recv(client, 4096), 10)
        assert answer.startswith(b"HTTP/1.1 200")
        await asyncio.sleep(0.05)
        seen.append(in_request(handlers[0]))
    finally:
        client.close()
        listening.close()
        await runner.cleanup()
    return seen


def test_in_request_follows_aiohttp() -> None:
    assert asyncio.run(_handler_states()) == [False, False, True, False]
