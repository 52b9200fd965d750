"""Fuzzing the node file reader: generated TOML documents (a valid node file with keys
given wrong types and odd values, huge ranges, unknown keys and tables) and raw bytes.
``config.load`` returns a Config or raises ConfigError whose message names the problems;
no other exception escapes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.client import socket_of
from layerpy.config import Config, ConfigError, load

from fuzzing import FUZZ, rarely, text_or_junk
from nodefile import write_boot_files

VALID: dict[str, Any] = {
    "server": {"interface": "br0", "address": "10.99.0.1", "state_dir": "state",
               "heartbeat": 2, "http_port": 8080},
    "network": {"subnet": "10.99.0.0/24", "gateway": "10.99.0.1", "dns": ["10.99.0.1"],
                "pool": "10.99.0.200-10.99.0.250", "discover": True, "lease_time": 3600},
    "minos": {"kernel": "vmlinuz", "initrd": "initrd", "cmdline": "console=ttyS0"},
    "ipxe": {"dir": "ipxe"},
    "api": {"listen": ["127.0.0.1:8081"]},
    "switches": {"sw1": {"relay": "10.99.0.254", "remote_id": "sw1"}},
    "images": {"rocky": {"source": "docker-archive:rocky.tar", "persist": ["/var/lib/x"]}},
    "groups": {"compute": {"nodes": "cn[001-002]", "ip": "10.99.0.[11-12]",
                           "mac": ["52:54:00:99:00:11", "52:54:00:99:00:12"], "image": "rocky",
                           "bmc": {"driver": "none"}, "vars": {"rack": "a"}}},
    "nodes": {"cn003": {"ip": "10.99.0.13", "location": "sw1:swp3", "power": "off",
                        "bmc": {"driver": "command", "address": "pdu1", "on": "p {address} '{node} x' on",
                                "off": "p off", "status": "p {x}", "status_exit": {"on": 0, "off": 1}},
                        "vars": {"x": 3}}},
    "files": {"/etc/motd": {"template": "motd", "mode": "0644", "nodes": "cn[001-003]"}},
}  # fmt: skip
"""A node file that loads (checked below), for the generator to spoil one key at a time."""


class Raw(str):
    """TOML written as it is: numbers of any size, which Hypothesis cannot print as ints."""


odd_strings = st.one_of(
    text_or_junk,
    st.sampled_from([
        "cn[0-99999999]", "cn[1-3][1-3][1-3][1-3][1-3][1-3][1-3][1-3][1-3][1-3][1-3]",
        "10.99.0.[0-9999]", "10.99.[0-255].[0-255]", "x" + "[0-1]" * 20, "cn[3-1]", "cn[",
        "52:54:00:99:00:11-52:54:00:99:ff:ff", "00:00:00:00:00:00-ff:ff:ff:ff:ff:ff",
        "sw1:swp[1-100000]", "10.99.0.0/0", "0.0.0.0/0", "10.99.0.250-10.99.0.200",
        "10.99.0.1:99999", "../../etc/passwd", "/dev/zero", "{node}", "{x}", "~root/x",
        "ipmi", "redfish", "sol", "proxy", "off", "mac", "LABEL=x", "/dev/sda1", "not-utf8",
        "x" * 300 + "/y", "~no-such-user-7/x", "command", "{0}", "{node!r}", "{", "a 'b", "",
    ]),
)  # fmt: skip
scalars = st.one_of(
    odd_strings,
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, -1, 2**31, 2**32, 2**63 - 1, -(2**63)]),
    st.sampled_from([Raw("1" + "0" * 400), Raw("-" + "9" * 5000), Raw("inf"), Raw("nan")]),
    st.floats(allow_nan=True, allow_infinity=True),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(["driver", "address", "x", ""]), inner, max_size=3),
    ),
    max_leaves=8,
)


def toml(value: Any) -> str:
    """A TOML value (inline tables for tables): enough of TOML for these documents."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)  # inf, -inf and 1e+300 are TOML
    if isinstance(value, str):
        return json.dumps(value)  # \uXXXX escapes; a lone surrogate makes a TOML error
    if isinstance(value, list):
        return "[" + ", ".join(map(toml, value)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml(v)}" for k, v in value.items()) + "}"


def document(data: dict[str, Any]) -> str:
    """Sections as [tables], their named tables as [section."name"], the rest inline."""
    lines = []
    for section, table in data.items():
        if not isinstance(table, dict):
            lines.append(f"{json.dumps(section)} = {toml(table)}")
            continue
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
        lines.append(f"[{json.dumps(section)}]")
        lines.extend(f"{json.dumps(k)} = {toml(v)}" for k, v in plain.items())
        for name, inner in table.items():
            if isinstance(inner, dict):
                lines.append(f"[{json.dumps(section)}.{json.dumps(name)}]")
                lines.extend(f"{json.dumps(k)} = {toml(v)}" for k, v in inner.items())
    return "\n".join(lines) + "\n"


def _paths(data: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for key, value in data.items():
        found.append((*prefix, key))
        if isinstance(value, dict):
            found.extend(_paths(value, (*prefix, key)))
    return found


PATHS = _paths(VALID)


@st.composite
def spoiled(draw: st.DrawFn) -> dict[str, Any]:
    """The valid node file with one to four keys given another value, removed, or joined
    by an unknown one."""
    data = json.loads(json.dumps(VALID))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(PATHS))
        *parents, key = path
        table = data
        for parent in parents:
            table = table.get(parent)
            if not isinstance(table, dict):
                break
        else:
            if draw(rarely):
                table.pop(key, None)
            elif draw(rarely):
                table[draw(st.text(max_size=8))] = draw(values)
            else:
                table[key] = draw(values)
    return data


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The directory of the node file, with the boot files, image and template it names."""
    directory = tmp_path_factory.mktemp("fuzz-config")
    write_boot_files(directory)
    (directory / "rocky.tar").write_bytes(bytes(1024))
    (directory / "motd").write_text("hello {{ node.name }}\n")
    (directory / "not-utf8").write_bytes(b"\xff\xfe\x00secret")
    return directory


def check_load(site: Path, content: bytes) -> Config | None:
    """load() gives a Config or a ConfigError; the CLI's lenient reading of the same file
    (for the API socket of 'layerpy reload') gives a path whatever the file holds."""
    path = site / "nodes.toml"
    path.write_bytes(content)
    assert isinstance(socket_of(path), Path)
    try:
        config = load(path)
    except ConfigError as error:
        message = error.render()
        assert error.problems and message, "a ConfigError must say what is wrong"
        assert all(line.startswith(str(path)) for line in message.splitlines() if line)
        return None
    return config


def test_the_valid_file_loads(site: Path) -> None:
    assert check_load(site, document(VALID).encode()) is not None


@FUZZ
@given(spoiled())
def test_spoiled_node_files(site: Path, data: dict[str, Any]) -> None:
    try:
        text = document(data)
    except UnicodeEncodeError:  # pragma: no cover - json.dumps escapes everything
        return
    loaded = check_load(site, text.encode("utf-8", "surrogatepass"))
    event("refused" if loaded is None else "loaded")


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda text, at, junk: text[:at] + junk + text[at:],
            st.just(document(VALID).encode()),
            st.integers(0, len(document(VALID).encode())),
            st.binary(min_size=1, max_size=8),
        ),
    )
)
def test_raw_bytes(site: Path, content: bytes) -> None:
    event("refused" if check_load(site, content) is None else "loaded")
