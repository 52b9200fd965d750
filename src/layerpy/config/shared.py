"""An instance's own settings and the cluster's: what of a node file may differ between
the instances of one cluster (docs/ha.md).

An instance's own settings are the tables that say where it listens and how it reaches
etcd: [server] (interface, address, ports, state directory), [api] (its listeners and
their certificate) and [cluster] (its name and segment, and its own client certificate or
credentials for etcd). Everything else, what the nodes are and boot, is the cluster's and
the same on every instance. Pure: parsed TOML in, a difference or a combined file out.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from layerpy.text import printable

OWN = ("server", "api", "cluster")  # top-level tables
_BARE = re.compile(r"[A-Za-z0-9_-]+")  # a TOML key that needs no quotes
SHOWN = 80  # characters of a value quoted in a difference


class _Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT: Any = _Absent()


def is_own(path: tuple[str, ...]) -> bool:
    """Whether a key path is one of the instance's own settings (or inside one)."""
    return bool(path) and path[0] in OWN


@dataclass(frozen=True)
class Difference:
    """The first key of the cluster's part that differs: its value here and there
    (:data:`ABSENT` where it is missing)."""

    path: tuple[str, ...]
    here: Any
    there: Any

    @property
    def key(self) -> str:
        """The key path as the file would write it: files."/etc/hosts".mode."""
        key = ".".join(part if _BARE.fullmatch(part) else f'"{part}"' for part in self.path)
        return printable(key, SHOWN)

    def render(self, revision: int) -> str:
        theirs = f"the cluster's file (revision {revision})"
        if self.here is ABSENT:
            return f"{self.key} is in {theirs}, not here"
        if self.there is ABSENT:
            return f"{self.key} is here, not in {theirs}"
        return f"{self.key} differs: {_shown(self.here)} here, {_shown(self.there)} in {theirs}"


def first_difference(here: Mapping[str, Any], there: Mapping[str, Any]) -> Difference | None:
    """The first key path, in this file's order (then the other's), whose value differs
    outside the instance's own settings; None when the cluster's parts are equal."""
    return _walk(here, there, ())


def rest_differs(own_text: str, cluster_text: str, revision: int) -> str | None:
    """Why this instance's file cannot join a cluster running ``cluster_text``: the
    first key that differs (or a file that is not TOML); None when it may."""
    try:  # a TOMLDecodeError is a ValueError, as is int()'s limit on digits
        here = tomllib.loads(own_text)
    except ValueError as error:
        return f"this node file is not TOML: {error}"
    try:
        there = tomllib.loads(cluster_text)
    except ValueError as error:
        return f"the cluster's file (revision {revision}) is not TOML: {error}"
    difference = first_difference(here, there)
    return difference.render(revision) if difference else None


def combined(own: Mapping[str, Any], cluster: Mapping[str, Any]) -> dict[str, Any]:
    """The cluster's file as this instance runs it: its own tables from ``own`` (one
    ``own`` leaves out is left out, to take its defaults here)."""
    data = {key: value for key, value in cluster.items() if key not in OWN}
    data.update((key, own[key]) for key in OWN if key in own)
    return data


def _walk(
    here: Mapping[str, Any], there: Mapping[str, Any], path: tuple[str, ...]
) -> Difference | None:
    for key in [*here, *(key for key in there if key not in here)]:
        at = (*path, key)
        if is_own(at):
            continue
        mine, theirs = here.get(key, ABSENT), there.get(key, ABSENT)
        if isinstance(mine, dict) and isinstance(theirs, dict):
            if found := _walk(mine, theirs, at):
                return found
        elif not _same(mine, theirs):
            return Difference(at, mine, theirs)
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal as TOML values: 1, 1.0 and true are three different settings."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return bool(a == b)


def _shown(value: Any) -> str:
    return "a table" if isinstance(value, dict) else printable(repr(value), SHOWN)
