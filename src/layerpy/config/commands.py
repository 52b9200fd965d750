"""Power commands in the node file (``bmc = { driver = "command", on = "…", … }``): each
template is split into arguments like a shell line (shlex) once, at load time, and each
argument is filled in on its own, so that no value (a variable with spaces, quotes or a
``;``) can add, split or join arguments; nothing runs through a shell.

Placeholders are ``{node}``, ``{address}``, ``{port}``, ``{user}`` and the node's
variables (its group's ``vars``, then its own); ``{{`` and ``}}`` are literal braces. A
group's templates are read and checked once (``read``); each node's arguments are made
when every node's variables are known (``fill``), after the [nodes.NAME] tables.
"""

from __future__ import annotations

import functools
import re
import shlex
import string
from dataclasses import replace
from typing import Any

from layerpy.config import values
from layerpy.config.reading import Getter, Reader
from layerpy.config.records import NodeConfig
from layerpy.power.base import MAX_COMMAND_TIMEOUT, CommandSpec, PowerSpec

OPERATIONS = ("on", "off", "cycle", "status", "boot_network")
REQUIRED = ("on", "off", "status")
KEYS = {*OPERATIONS, "status_on", "status_off", "status_exit", "timeout"}
BUILT_IN = ("node", "address", "port", "user")  # they win over variables of these names


def read(r: Reader, get: Getter, prefix: str) -> CommandSpec | None:
    """A bmc table's commands, as templates (split and checked, placeholders not filled)."""
    known = len(r.problems)
    argvs = {op: _template(r, get, prefix, op, required=op in REQUIRED) for op in OPERATIONS}
    status_on = get("status_on", str, _pattern)
    status_off = get("status_off", str, _pattern)
    status_exit = get("status_exit", dict, _exit_codes, default=())
    timeout = get("timeout", (int, float), _timeout, default=CommandSpec.timeout)
    if status_exit and (status_on is not None or status_off is not None):
        r.problem(f"{prefix}.status_exit", "give status_exit or status_on/status_off, not both")
    if any(argvs[op] is None for op in REQUIRED) or len(r.problems) > known:
        return None
    patterns = {"status_on": status_on, "status_off": status_off}
    return CommandSpec(
        **{op: argv or () for op, argv in argvs.items()},
        **{key: pattern for key, pattern in patterns.items() if pattern is not None},
        status_exit=status_exit,
        timeout=float(timeout),
    )


def fill(r: Reader, nodes: dict[str, NodeConfig], own: set[str]) -> None:
    """Each node's commands with its placeholders filled in (in place); a placeholder a
    node has no value for is a problem of the table that gave the commands (`own`: the
    nodes whose bmc is their [nodes.NAME]'s, not their group's), said once per table."""
    said: set[tuple[str, str]] = set()
    for name, node in nodes.items():
        spec = node.bmc
        if spec is None or spec.command is None:
            continue
        where = (
            f"nodes.{name}.bmc" if name in own or node.group is None else f"groups.{node.group}.bmc"
        )
        filled = {}
        for op in OPERATIONS:
            try:
                filled[op] = tuple(_fill(arg, node, spec) for arg in getattr(spec.command, op))
            except ValueError as error:
                if (f"{where}.{op}", str(error)) not in said:
                    said.add((f"{where}.{op}", str(error)))
                    r.problem(f"{where}.{op}", f"{name}: {error}")
        if len(filled) == len(OPERATIONS):
            nodes[name] = replace(node, bmc=replace(spec, command=replace(spec.command, **filled)))


def _template(
    r: Reader, get: Getter, prefix: str, op: str, *, required: bool
) -> tuple[str, ...] | None:
    """One command's arguments, still with placeholders; None when absent or wrong."""
    text = get(op, str, required=required)
    if text is None:
        return None
    key = f"{prefix}.{op}"
    try:
        argv = tuple(shlex.split(text))
    except ValueError as error:  # no closing quotation, no escaped character
        r.problem(key, f"{text!r}: {error} (it is split into arguments like a shell line)")
        return None
    if not argv:
        r.problem(key, "is empty: give the program and its arguments")
        return None
    for arg in argv:
        try:
            _fields(arg)
        except ValueError as error:
            r.problem(key, f"{text!r}: {error}")
            return None
    return argv


@functools.lru_cache(maxsize=1024)
def _fields(arg: str) -> tuple[tuple[str, str | None], ...]:
    """One argument as (literal, placeholder) pieces; ValueError for what is no
    placeholder (``{0}``, ``{x.y}``, ``{x!r}``, ``{x:5}``, a lone brace)."""
    try:
        parts = list(string.Formatter().parse(arg))
    except ValueError as error:
        raise ValueError(f"{error}; write {{{{ or }}}} for a brace") from None
    pieces = []
    for literal, field, spec, conversion in parts:
        if field is not None and (not field.isidentifier() or spec or conversion):
            shown = field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(
                f"{{{shown}}} is no placeholder: write {{name}} (node, address, port, user or "
                "a variable), or {{ and }} for braces"
            )
        pieces.append((literal, field))
    return tuple(pieces)


def _fill(arg: str, node: NodeConfig, spec: PowerSpec) -> str:
    """One argument with its placeholders replaced by `node`'s values, as one argument."""
    built_in = {"node": node.name, "address": spec.address, "port": spec.port, "user": spec.user}
    out = []
    for literal, field in _fields(arg):
        out.append(literal)
        if field is None:
            continue
        if field in built_in:
            value = built_in[field]
            if value is None:
                raise ValueError(f"{{{field}}} is used, but the bmc table sets no {field}")
        elif field in node.vars:
            value = _scalar(field, node.vars[field])
        else:
            known = ", ".join(sorted(k for k in node.vars if k not in BUILT_IN)) or "none"
            raise ValueError(
                f"{{{field}}} is no placeholder: not node, address, port or user, nor one of "
                f"its vars ({known}); add it to vars, or write {{{{ and }}}} for braces"
            )
        out.append(str(value))
    text = "".join(out)
    if "\0" in text:
        raise ValueError("an argument would hold a NUL character, which no program can get")
    return text


def _scalar(name: str, value: Any) -> str:
    """A variable as argument text: strings and numbers as written, booleans as TOML's."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise ValueError(f"{{{name}}}: vars.{name} is no string, number or boolean")


def _pattern(value: str) -> str:
    if not value:
        raise ValueError("is empty: it would match any output")
    try:
        re.compile(value)
    except re.error as error:
        raise ValueError(f"{value!r} is no regular expression: {error}") from None
    return value


def _exit_codes(table: dict[str, Any]) -> tuple[tuple[int, str], ...]:
    """``{ on = 0, off = 1 }``: which exit code of the status command means which state."""
    if set(table) != {"on", "off"}:
        raise ValueError("must name the exit codes of both states, like { on = 0, off = 1 }")
    codes = [(table[state], state) for state in ("on", "off")]
    if any(not isinstance(c, int) or isinstance(c, bool) or not 0 <= c <= 255 for c, _ in codes):
        raise ValueError("exit codes are integers from 0 to 255")
    if table["on"] == table["off"]:
        raise ValueError("on and off need different exit codes")
    return tuple(codes)


def _timeout(value: float) -> float:
    values.positive(value)
    if value > MAX_COMMAND_TIMEOUT:
        raise ValueError(
            f"at most {MAX_COMMAND_TIMEOUT:g} s (a power action runs up to three commands, "
            "boot_network, off and on, in the 30 s the engine gives it)"
        )
    return value
