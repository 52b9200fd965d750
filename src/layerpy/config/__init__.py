"""The node file: TOML in, a typed and validated :class:`Config` out.

This is the only package that reads the file. Every problem is collected (not just the
first) and reported with the file, the line where it can be found, the key path and what
is wrong, so ``layerpy check`` can say everything in one go.

records: what the file says, as typed records; reading: getters and problems with lines;
values: value converters; boot, images, nodes: the section readers; here: the whole file.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

from layerpy.config import boot, cluster, files, images, nodes, shared
from layerpy.config.reading import Reader, line_of_syntax_error
from layerpy.config.records import (
    DHCP_MODES,
    POWER_STATES,
    ApiConfig,
    ClusterConfig,
    Config,
    ConfigError,
    FileConfig,
    ImageConfig,
    IpxeConfig,
    MinosConfig,
    NetworkConfig,
    NodeConfig,
    Problem,
    ReloadRefused,
    RpiConfig,
    ServerConfig,
    SignedConfig,
    SwitchConfig,
)

__all__ = [
    "DHCP_MODES",
    "POWER_STATES",
    "ApiConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "FileConfig",
    "ImageConfig",
    "IpxeConfig",
    "MinosConfig",
    "NetworkConfig",
    "NodeConfig",
    "Problem",
    "ReloadRefused",
    "RpiConfig",
    "ServerConfig",
    "SignedConfig",
    "SwitchConfig",
    "load",
    "parse",
    "parse_shared",
]

SECTIONS = (
    "server", "network", "minos", "ipxe", "signed", "api", "images", "switches", "groups",
    "nodes", "files", "cluster", "rpi",
)  # fmt: skip


def load(path: str | Path) -> Config:
    """Read and validate a node file; raise :class:`ConfigError` listing every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(path, [Problem("", f"cannot read the file: {error.strerror}")]) from None
    except UnicodeDecodeError as error:
        line = path.read_bytes()[: error.start].count(b"\n") + 1
        problem = Problem("", f"not UTF-8 text (byte {error.object[error.start]:#x})", line)
        raise ConfigError(path, [problem]) from None
    return parse(text, path)


def parse(text: str, path: Path) -> Config:
    return _checked(Reader(path, text), _toml(text, path))


def parse_shared(text: str, own: str, path: Path) -> Config:
    """The cluster's node file ``text`` as this instance runs it: with its own settings
    (its [server], [api] and [cluster]: config/shared.py) from ``own``, the text of its
    own node file ``path``, whose directory relative paths start from."""
    reader = Reader(path, text)  # lines: the own settings' in own, the others' in text
    lines = {key: line for key, line in reader.lines.items() if not _own(key)}
    lines.update((key, line) for key, line in Reader(path, own).lines.items() if _own(key))
    reader.lines = lines
    return _checked(reader, shared.combined(_toml(own, path), _toml(text, path)))


def _own(key: str) -> bool:
    return shared.is_own(tuple(key.split(".")))


def _toml(text: str, path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        line = line_of_syntax_error(str(error))
        raise ConfigError(path, [Problem("", f"TOML syntax error: {error}", line)]) from None
    except ValueError:  # tomllib lets int()'s limit on digits through as it is
        limit = sys.get_int_max_str_digits()
        found = re.search(rf"\d{{{limit + 1},}}", text)
        line = text.count("\n", 0, found.start()) + 1 if found else None
        problem = Problem("", f"a number of more than {limit} digits (no setting takes one)", line)
        raise ConfigError(path, [problem]) from None


def _checked(reader: Reader, data: dict[str, Any]) -> Config:
    config = _read(reader, data)
    if reader.problems or config is None:
        raise ConfigError(reader.file, reader.problems)
    return config


def _read(r: Reader, data: dict[str, Any]) -> Config | None:
    """Every section, in the order their checks need each other."""
    for unknown in sorted(set(data) - set(SECTIONS)):
        r.problem(unknown, f"unknown section (known: {', '.join(SECTIONS)})")
    network = boot.network(r, data)
    server = boot.server(r, data, network)
    minos = boot.minos(r, data)
    ipxe = boot.ipxe(r, data, server)
    rpi = boot.rpi(r, data, minos)
    api = boot.api(r, data)
    known_images = images.read(r, data)
    switches = nodes.switches(r, data)
    all_nodes = nodes.read(r, data, network, server)
    nodes.check_references(r, all_nodes, known_images, switches)
    signed = boot.signed(r, data, server, all_nodes)
    node_files = files.read(r, data, known_images, all_nodes)
    shared = cluster.read(r, data, network)
    if server is None or network is None or minos is None or r.problems:
        return None
    config = Config(r.file, server, network, minos, ipxe, api, known_images, switches, all_nodes,
                    node_files, shared, rpi, signed)  # fmt: skip
    files.check_renders(r, config)
    return None if r.problems else config
