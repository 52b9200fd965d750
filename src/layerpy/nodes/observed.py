"""A node's observed state as one record (``backend.OBSERVED``), and back: what instances of
a cluster tell each other of the nodes they hear.

``record`` is written by the store when a non-quiet field changes (never for a heartbeat's
own fields); ``follow`` turns another instance's record into effects for this store. A
record read from etcd is validated field by field: a field that does not parse is left
out, not guessed at.

Liveness stays local: the instance a node's agent reports to (``heard_by``) is the only one
whose missed reports make the node lost. While this instance hears a node, another
instance's word on what the agent says (run state, busy, image, files) is older than its
own and is not taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from ipaddress import IPv4Address
from typing import Any

from layerpy.model import Boot, Busy, ImageState, Node, Phase, PowerState, RunState
from layerpy.nodes.effects import Effect, Observe

Record = dict[str, Any]


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(value)


def _table(value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    raise ValueError(value)


def _flag(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(value)


def _address(value: Any) -> IPv4Address | None:
    return None if value is None else IPv4Address(value)


# field -> how a record's value becomes the node's (raises ValueError, TypeError)
FIELDS: dict[str, Callable[[Any], Any]] = {
    "power": PowerState,
    "power_error": _text,
    "run_state": RunState,
    "busy": Busy,
    "image_state": ImageState,
    "image_digest": _text,
    "image_error": _text,
    "files_revision": _text,
    "files_error": _text,
    "mac": _text,
    "ip": _address,
    "hostname": _text,
    "location": _table,
    "conflict": _text,
    "binding": _table,
    "rebind_pending": _table,
    "problem": _text,
    "console_problem": _text,
    "secure_boot": _flag,
    "heard_by": _text,
}
# what an agent says of its node: the hearing instance's own word wins
AGENT_FIELDS = frozenset({"run_state", "busy", "image_state", "image_digest", "image_error",
                          "files_revision", "files_error", "secure_boot"})  # fmt: skip


def record(node: Node) -> Record:
    """What other instances are told of a node (JSON-able; no secret, no heartbeat)."""
    kept: Record = {}
    for field in FIELDS:
        value = getattr(node, field)
        kept[field] = str(value) if isinstance(value, IPv4Address) else value
    boot = node.boot
    if boot is not None:
        kept["boot"] = {
            "started": boot.started,
            "firmware": boot.firmware,
            "phases": {str(phase): when for phase, when in boot.phases.items()},
        }
    kept["boots"] = node.boots
    return kept


def follow(node: Node, kept: Mapping[str, Any], instance: str | None) -> list[Effect]:
    """Another instance's record of ``node`` as effects on this store (none when nothing in
    it is news). ``instance``: this one's name."""
    fields: dict[str, Any] = {}
    for field, parse in FIELDS.items():
        if field in kept:
            try:
                fields[field] = parse(kept[field])
            except (ValueError, TypeError):
                continue
    if node.heard_by == instance and fields.get("heard_by", instance) == instance:
        for field in AGENT_FIELDS:  # it reports here: our own word is the fresher
            fields.pop(field, None)
    boot = _boot(node.boot, kept.get("boot"))
    if boot is not None:
        fields["boot"] = boot
    if isinstance(kept.get("boots"), int) and kept["boots"] >= node.boots:
        fields["boots"] = kept["boots"]
    return [Observe(node.name, fields, f"seen by {kept.get('heard_by') or 'another instance'}")]


def _boot(mine: Boot | None, theirs: Any) -> Boot | None:
    """Their boot of the node when it is newer than ours, or ours with their phases added;
    None when it tells nothing new. The token stays ours (``TOKENS`` carries it)."""
    try:
        started = float(theirs["started"])
        firmware = _text(theirs.get("firmware"))
        phases = {Phase(p): float(t) for p, t in theirs.get("phases", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if mine is not None and started < mine.started and not (mine.resumed and not mine.phases):
        return None  # (a boot read back at start knows nothing but its token: theirs is news)
    if mine is not None and started == mine.started:
        if phases.keys() <= mine.phases.keys():
            return None
        phases = {**phases, **mine.phases}
    digest, boot_id = (mine.token_digest, mine.boot_id) if mine is not None else (None, None)
    xids = mine.xids if mine is not None and started == mine.started else frozenset()
    return Boot(started, phases, token_digest=digest, boot_id=boot_id, firmware=firmware,
                xids=xids)  # fmt: skip
