"""Boot tokens: a fresh secret per boot, handed to the node in its kernel command line.

Only digests are kept (``layerpy.digests``), through the store's backend, with the boot id
the agent reported: a restarted server still recognises the agents of the nodes it booted,
and takes their next heartbeat for what it is, a node ready since before the restart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from layerpy import digests
from layerpy.model import Node, Phase
from layerpy.nodes.effects import Effect, Mark, NewBoot, Resume, Token


def issue(node: Node) -> tuple[str, list[Effect]]:
    """A token for the node's boot (a new boot when its script was handed out already)."""
    fresh = node.boot is None or Phase.SCRIPT in node.boot.phases
    token = digests.new()
    boot_id = None if fresh or node.boot is None else node.boot.boot_id
    firmware = node.boot.firmware if node.boot is not None else None  # the same machine's
    effects: list[Effect] = [NewBoot(node.name, firmware)] if fresh else []
    return token, [
        *effects,
        Token(node.name, digests.digest(token), boot_id),
        Mark(node.name, Phase.SCRIPT),
    ]


def hand_over(node: Node) -> tuple[str, list[Effect]]:
    """A new boot of ``node`` with its own token, for an agent that turned out to be it."""
    token = digests.new()
    return token, [
        NewBoot(node.name, "identity by location"),
        Token(node.name, digests.digest(token), None),
    ]


def holds(node: Node, token: str) -> bool:
    """Whether ``token`` is the node's current boot token."""
    return node.boot is not None and digests.matches(node.boot.token_digest, token)


def record(node: Node) -> dict[str, Any]:
    """What the backend keeps of a node's boot (``backend.TOKENS``)."""
    boot = node.boot
    assert boot is not None
    return {"sha256": boot.token_digest, "boot_id": boot.boot_id, "boots": node.boots}


def resume(records: Mapping[str, Mapping[str, Any]], nodes: Mapping[str, Node]) -> list[Effect]:
    """The boots of before a restart, of the nodes still in the file."""
    effects: list[Effect] = []
    for name, kept in records.items():
        if name not in nodes:
            continue
        digest, boot_id, boots = kept.get("sha256"), kept.get("boot_id"), kept.get("boots")
        effects.append(
            Resume(
                name,
                digest if isinstance(digest, str) else None,
                boot_id if isinstance(boot_id, str) else None,
                boots if isinstance(boots, int) else 0,
            )
        )
    return effects


def follow(node: Node, kept: Mapping[str, Any]) -> list[Effect]:
    """Another instance's token of ``node``: an agent that moves here keeps its token."""
    digest, boot_id, boots = kept.get("sha256"), kept.get("boot_id"), kept.get("boots")
    if not isinstance(digest, str) or not (boot_id is None or isinstance(boot_id, str)):
        return []
    boots = boots if isinstance(boots, int) else node.boots
    if node.boot is None:
        return [Resume(node.name, digest, boot_id, boots)]
    if (node.boot.token_digest, node.boot.boot_id) == (digest, boot_id):
        return []
    return [Token(node.name, digest, boot_id)]
