"""Work on many nodes in turns, so that no request or reload holds the event loop.

An operator may name 100 000 nodes in one call, and a reload may change as many; every
DHCP answer, TFTP block and other request waits for whatever holds the loop. Such work
walks its list with `in_turns`, which lets the loop run whenever TURN seconds of the
caller's work have passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

from layerpy import hostlist

TURN = 0.005  # seconds of work between two turns of the event loop
T = TypeVar("T")


async def in_turns(items: Iterable[T]) -> AsyncIterator[T]:
    """`items`, letting the event loop run whenever the work on them (the caller's, between
    two items) has taken TURN seconds."""
    loop = asyncio.get_running_loop()
    until = loop.time() + TURN
    for item in items:
        yield item
        if loop.time() >= until:
            await asyncio.sleep(0)
            until = loop.time() + TURN


async def expand_in_turns(expression: str) -> list[str]:
    """A hostlist's names, made in turns (HostlistError, with the limit it broke, before
    any is made)."""
    return [name async for name in in_turns(hostlist.names(expression))]
