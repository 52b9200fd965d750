"""Another DHCP server on the segment that is an instance of the cluster not yet registered:
known as one as soon as it registers (services/dhcp.py ``Neighbours.not_peers``)."""

from __future__ import annotations

import asyncio
import time
from ipaddress import IPv4Address

from layerpy.services.dhcp import Neighbours

PEER, STRANGER = IPv4Address("10.99.0.2"), IPv4Address("10.99.0.9")


def test_a_peer_is_known_once_it_registers_and_a_stranger_after_the_settle(make_config) -> None:
    server = make_config().server
    registered_at = time.monotonic() + 0.5

    async def peers() -> set[IPv4Address]:  # the instances etcd knows: the peer from 0.5 s on
        return {PEER} if time.monotonic() >= registered_at else set()

    async def scenario() -> tuple[set[IPv4Address], float, set[IPv4Address], float]:
        neighbours = Neighbours(server, peers=peers, settle=5.0)
        start = time.monotonic()
        only_peer = await neighbours.not_peers({PEER})
        peer_took = time.monotonic() - start
        start = time.monotonic()
        both = await neighbours.not_peers({PEER, STRANGER})
        return only_peer, peer_took, both, time.monotonic() - start

    only_peer, peer_took, both, stranger_took = asyncio.run(scenario())
    assert only_peer == set() and peer_took < 2.0, (only_peer, peer_took)  # not one settle
    assert both == {STRANGER} and stranger_took >= 5.0, (both, stranger_took)
