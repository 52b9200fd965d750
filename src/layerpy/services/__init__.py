"""The network services: DHCP, TFTP, HTTP and the API, on one event loop.

`run` is that loop: uvloop, libuv's event loop for asyncio. Lock-step TFTP is one pass of
the loop per block, and the standard loop's pass cost about as much again as the block's
own work; HTTP pays the loop's cost per connection (bench/tftp.py, bench/http_files.py; figures
in docs/scale.md). The services use only what both loops offer (not ``loop.sendfile`` or
``loop.sock_sendto``, which uvloop lacks), so tests that run them in process on the
standard loop exercise the same code.
"""

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a new uvloop event loop, as asyncio.run would."""
    return uvloop.run(main)
