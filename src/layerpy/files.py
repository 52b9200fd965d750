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
from layerpy.config.records import Config, FileConfig, NodeConfig
from layerpy.proto.agent import MAX_FILE, MAX_FILES, FileSpec, FilesSpec


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
    """Node `name`'s files with the image the node file gives it, in path order;
    RenderError when one cannot be made."""
    node = config.nodes[name]
    return _files(config, node, node.image)


def _files(config: Config, node: NodeConfig, image: str | None) -> list[NodeFile]:
    return [_make(config, file, node) for file in _chosen(config, node, image)]


def _chosen(config: Config, node: NodeConfig, image: str | None) -> list[FileConfig]:
    """The files `node` gets when it runs `image`, in path order."""
    wanted = [f for f in config.files.values() if f.for_node(node) and f.for_image(image)]
    return sorted(wanted, key=lambda f: f.path)


def render_problems(config: Config) -> dict[str, str]:
    """The first failure of each file, made for every node the file gives it to."""
    problems: dict[str, str] = {}
    if not config.files:  # no node gets any: no pass over (maybe 100 000) nodes at start
        return problems
    for node in config.nodes.values():
        chosen = _chosen(config, node, node.image)
        if len(chosen) > MAX_FILES:
            problems[chosen[MAX_FILES].path] = f"{node.name} gets over {MAX_FILES} files"
        for file in chosen:
            if file.path not in problems:
                try:
                    _make(config, file, node)
                except RenderError as error:
                    problems[file.path] = str(error)
    return problems


def revision(files: list[NodeFile]) -> str:
    """One digest of what a node gets: it changes when any path, mode, owner or byte does."""
    summary = "\n".join(f"{f.path} {f.mode:o} {f.owner} {f.digest}" for f in files)
    return hashlib.sha256(summary.encode()).hexdigest()[:16]


NO_FILES = FilesSpec(revision([]), ())  # most nodes': one for all of them


class Deliveries:
    """What the agents are told of their files and may fetch: each node's files made once
    per node file and image (not once per report), their bytes kept once per digest (a
    cluster's nodes mostly share them)."""

    def __init__(self) -> None:
        self._config: Config | None = None
        self._specs: dict[tuple[str, str | None], FilesSpec] = {}
        self._contents: dict[str, bytes] = {}

    def spec(self, config: Config, name: str, image: str | None) -> FilesSpec:
        """Node `name`'s files when it runs `image`; RenderError when they cannot be made
        (a secret gone from the server since the file was loaded)."""
        if config is not self._config:
            self._config, self._specs, self._contents = config, {}, {}
        key = (name, image)
        made = self._specs.get(key)
        if made is None:
            files = _files(config, config.nodes[name], image)
            for file in files:
                self._contents.setdefault(file.digest, file.content)
            made = FilesSpec(revision(files), tuple(map(_spec, files))) if files else NO_FILES
            self._specs[key] = made
        return made

    def content(self, spec: FilesSpec, digest: str) -> bytes | None:
        """The bytes of one of `spec`'s files (None when it names no such file)."""
        if all(file.digest != digest for file in spec.files):
            return None
        return self._contents.get(digest)


def _spec(file: NodeFile) -> FileSpec:
    return FileSpec(file.path, file.digest, len(file.content), file.mode, file.owner, file.apply)


def _make(config: Config, file: FileConfig, node: NodeConfig) -> NodeFile:
    try:
        raw = _read(file.source)
    except OSError as error:
        why = f"cannot read {file.source}: {error.strerror}"
        raise RenderError(f"{file.path}: {why}") from None
    if file.secret:
        content = raw
    else:
        try:
            text = _template(raw.decode("utf-8")).render(context(config, node))
        except (TemplateError, UnicodeDecodeError) as error:
            line = getattr(error, "lineno", None)
            where = f"{file.source}{f' line {line}' if line else ''}"
            why = f"{error} ({where})"
            raise RenderError(f"{file.path} for {node.name}: {why}") from None
        content = text.encode()
        if len(content) > MAX_FILE:
            why = f"over {MAX_FILE} bytes rendered"
            raise RenderError(f"{file.path} for {node.name}: {why}")
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
