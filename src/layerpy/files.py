"""What files each node gets, rendered on the server: Jinja2 templates with the node's facts
and the whole cluster's, and secrets read whole from the server's files.

Templates run in Jinja2's sandbox with undefined names as errors (a typo in a variable is a
refused render, not an empty line in slurm.conf), and each file is bounded in size. A
node's files have one revision, a digest of every path, mode, owner and content, which the
agent reports back once it has placed them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import StrictUndefined, TemplateError
from jinja2.sandbox import SandboxedEnvironment

from layerpy import hostlist
from layerpy.config import Config, FileConfig, NodeConfig

MAX_FILE = 1 << 20  # bytes a template or secret may be, and a rendered file


class RenderError(ValueError):
    """A file that cannot be made for a node; the message names the file, node and line."""


@dataclass(frozen=True)
class NodeFile:
    """One file as a node gets it."""

    path: str
    mode: int
    owner: str
    content: bytes
    secret: bool
    apply: str | None
    source: Path

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(self.content).hexdigest()


def environment() -> SandboxedEnvironment:
    env = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True,
                               autoescape=False)  # fmt: skip
    env.filters["hostlist"] = hostlist.fold
    return env


def compile_template(text: str) -> None:
    """Raise TemplateError when `text` is no template (checked when the node file loads)."""
    environment().parse(text)


def files_for(config: Config, name: str) -> list[NodeFile]:
    """Node `name`'s files in path order; RenderError when one cannot be made."""
    node = config.nodes[name]
    made = []
    for file in sorted(config.files.values(), key=lambda f: f.path):
        if file.wanted_by(node):
            made.append(_make(config, file, node))
    return made


def revision(files: list[NodeFile]) -> str:
    """One digest of what a node gets: it changes when any path, mode, owner or byte does."""
    summary = "\n".join(f"{f.path} {f.mode:o} {f.owner} {f.digest}" for f in files)
    return hashlib.sha256(summary.encode()).hexdigest()[:16]


def _make(config: Config, file: FileConfig, node: NodeConfig) -> NodeFile:
    try:
        raw = _read(file.source)
    except OSError as error:
        raise RenderError(f"{file.path}: cannot read {file.source}: {error.strerror}") from None
    if file.secret:
        content = raw
    else:
        try:
            text = _template(raw.decode("utf-8")).render(context(config, node))
        except (TemplateError, UnicodeDecodeError) as error:
            line = getattr(error, "lineno", None)
            where = f"{file.source}{f' line {line}' if line else ''}"
            raise RenderError(f"{file.path} for {node.name}: {error} ({where})") from None
        content = text.encode()
        if len(content) > MAX_FILE:
            raise RenderError(f"{file.path} for {node.name}: over {MAX_FILE} bytes rendered")
    return NodeFile(file.path, file.mode, file.owner, content, file.secret, file.apply, file.source)


def _read(path: Path) -> bytes:
    with path.open("rb") as source:
        data = source.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise OSError(0, f"over {MAX_FILE} bytes")
    return data


@lru_cache(maxsize=256)
def _template(text: str) -> Any:
    return environment().from_string(text)


def context(config: Config, node: NodeConfig) -> dict[str, Any]:
    """What a template sees: the node's variables by name, ``node`` (its facts),
    ``nodes`` (every node's, in file order), ``groups`` (each group's ``hosts`` as a
    hostlist and its ``names``) and ``server``; and the ``hostlist`` filter."""
    cluster = _cluster(config)
    return {**node.vars, "node": cluster.facts[node.name], **cluster.shared}


@dataclass(frozen=True)
class _Cluster:
    facts: dict[str, dict[str, Any]]
    shared: dict[str, Any]


_last: tuple[Config, _Cluster] | None = None  # one node file is in force at a time


def _cluster(config: Config) -> _Cluster:
    """Every node's facts, worked out once per node file (not once per render)."""
    global _last
    if _last is not None and _last[0] is config:
        return _last[1]
    facts = {name: _facts(node) for name, node in config.nodes.items()}
    members: dict[str, list[str]] = {}
    for node in config.nodes.values():
        if node.group is not None:
            members.setdefault(node.group, []).append(node.name)
    groups = {g: {"hosts": hostlist.fold(names), "names": names} for g, names in members.items()}
    server = {"address": str(config.server.address), "url": config.server.url}
    made = _Cluster(facts, {"nodes": list(facts.values()), "groups": groups, "server": server})
    _last = (config, made)
    return made


def _facts(node: NodeConfig) -> dict[str, Any]:
    switch, port = node.location or (None, None)
    return {
        "name": node.name, "ip": str(node.ip) if node.ip else None, "mac": node.mac,
        "group": node.group, "image": node.image, "switch": switch, "port": port,
        "vars": node.vars,
    }  # fmt: skip
