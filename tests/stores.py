"""A single server's node store and boot policy wired as ``layerpy serve`` wires them (the
state directory's journals as their backend), for tests that need them without a server."""

from __future__ import annotations

from typing import Any

from layerpy.boot import BootPolicy
from layerpy.config import Config
from layerpy.nodes import NodeStore
from layerpy.server import local_backend


def local_store(config: Config, **options: Any) -> NodeStore:
    """``options``: NodeStore's ``clock`` and ``feed``."""
    return NodeStore(config, local_backend(config), **options)


def local_policy(config: Config, **options: Any) -> BootPolicy:
    """A boot policy on a store of its own (``options`` as for ``local_store``)."""
    store = local_store(config, **options)
    return BootPolicy(store, store.backend)
