"""What a stopped server leaves: no file of its state directory open."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from layerpy.server import Server, local_backend


def open_files_under(directory: Path) -> list[str]:
    """This process's open files under `directory`."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{directory.resolve()}/"):
            found.append(target)
    return found


def test_a_closed_server_leaves_its_journals_closed(make_config) -> None:
    config = make_config()
    state = config.server.state_dir

    async def scenario() -> None:
        server = Server(config, local_backend(config))
        assert await server.policy.script("cn001", "10.99.0.11")  # a token: its journal
        assert any(f.endswith(".jsonl") for f in open_files_under(state)), "no journal open"
        await server.close()
        assert open_files_under(state) == []

    asyncio.run(scenario())
