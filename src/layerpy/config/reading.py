"""The machinery every section reader uses: typed getters that turn a wrong value into a
problem (instead of an exception), and problems that know their line in the file, so that
one run reports everything that is wrong."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from layerpy.config.records import Problem

Getter = Callable[..., Any]  # get(key, kind, convert=None, *, default=None, required=False)


class Reader:
    """Reads values out of the parsed TOML, collecting problems with their lines."""

    def __init__(self, path: Path, text: str) -> None:
        self.file = path
        self.base = path.parent
        self.lines = _key_lines(text)
        self.problems: list[Problem] = []

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message, self._line(key)))

    def _line(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    def is_table(self, value: Any, key: str) -> bool:
        """Whether ``value`` is a table; if not, that is a problem."""
        if isinstance(value, dict):
            return True
        self.problem(key, f"must be a table, not {_kind(value)}")
        return False

    def table(self, data: dict[str, Any], key: str, allowed: set[str] | None) -> dict[str, Any]:
        """A top-level table; with ``allowed``, any other key in it is a problem."""
        value = data.get(key, {})
        if not self.is_table(value, key):
            return {}
        if allowed is not None:
            self.unknown_keys(value, key, allowed)
        return value

    def named_tables(
        self, data: dict[str, Any], section: str, known: set[str]
    ) -> Iterator[tuple[str, str, Getter]]:
        """``[section.NAME]`` tables: each name, its key prefix and a getter for its keys."""
        for name, table in self.table(data, section, None).items():
            prefix = f"{section}.{name}"
            if not self.is_table(table, prefix):
                continue
            self.unknown_keys(table, prefix, known)
            yield name, prefix, self.getter(table, prefix)

    def unknown_keys(self, table: dict[str, Any], prefix: str, known: set[str]) -> None:
        for unknown in sorted(set(table) - known):
            self.problem(
                f"{prefix}.{unknown}", f"unknown key (known keys: {', '.join(sorted(known))})"
            )

    def get(
        self,
        table: dict[str, Any],
        key: str,
        kind: type | tuple[type, ...],
        convert: Callable[[Any], Any] | None = None,
        *,
        default: Any = None,
        required: bool = False,
        prefix: str,
    ) -> Any:
        """``table[key]`` checked against ``kind`` and converted; ``default`` (and a problem
        if it was wrong or required) otherwise."""
        full = f"{prefix}.{key}"
        if key not in table:
            if required:
                self.problem(full, "is required")
            return default
        value = table[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
            expected = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            self.problem(full, f"must be {_article(expected)}, not {_kind(value)}")
            return default
        if convert is None:
            return value
        try:
            return convert(value)
        except ValueError as error:
            self.problem(full, str(error))
            return default

    def getter(self, table: dict[str, Any], prefix: str) -> Getter:
        """:meth:`get` bound to one table and its key prefix."""

        def get(key: str, kind: Any, convert: Any = None, **options: Any) -> Any:
            return self.get(table, key, kind, convert, prefix=prefix, **options)

        return get

    def path(self, value: str) -> Path:
        """Paths in the file are relative to the file."""
        return Path(os.path.normpath(self.base / Path(value).expanduser()))

    def password(self, get: Getter, prefix: str, *, private: bool = False) -> str | None:
        """A secret from ``password_file`` or ``password_env``, never from the file itself;
        ``private``: a password file every user of this host may read is refused."""
        path = get("password_file", str, self.path)
        variable = get("password_env", str)
        if path and variable:
            self.problem(prefix, "give password_file or password_env, not both")
        if path is not None:
            try:
                if private and (why := open_to_all(path, path.stat().st_mode)):
                    self.problem(f"{prefix}.password_file", why)
                    return None
                return path.read_text().strip()
            except OSError as error:
                self.problem(f"{prefix}.password_file", f"cannot read {path}: {error.strerror}")
            except UnicodeDecodeError:
                self.problem(f"{prefix}.password_file", f"{path} is not UTF-8 text")
        if variable is not None:
            if variable not in os.environ:
                self.problem(
                    f"{prefix}.password_env", f"environment variable {variable} is not set"
                )
            return os.environ.get(variable)
        return None


def missing(path: Path) -> str | None:
    """Why ``path`` is no file to read: it does not exist, or its name cannot even be
    looked up (too long, ...: ``is_file`` raises for those); None for a regular file."""
    try:
        return None if path.is_file() else "does not exist"
    except OSError as error:
        return f"cannot be looked up ({error.strerror})"


def open_to_all(path: Path, mode: int) -> str | None:
    """Why a secret's file is refused: every user of this host may read it."""
    if mode & stat.S_IROTH:
        return f"{path} is readable by every user of this host: chmod o-r it"
    return None


def line_of_syntax_error(message: str) -> int | None:
    match = re.search(r"at line (\d+)", message)
    return int(match.group(1)) if match else None


def _kind(value: Any) -> str:
    """What a TOML value is, in words."""
    names = {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "a table",
    }
    return names.get(type(value), type(value).__name__)


def _article(name: str) -> str:
    words = {
        "str": "a string",
        "int": "an integer",
        "float": "a number",
        "bool": "a boolean",
        "list": "a list",
        "dict": "a table",
    }
    return " or ".join(words.get(part, part) for part in name.split(" or "))


def _key_lines(text: str) -> dict[str, int]:
    """Map dotted key paths to the line that defines them (best effort, for messages)."""
    lines: dict[str, int] = {}
    table = ""
    header = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    assignment = re.compile(r"^\s*([A-Za-z0-9_.\"' -]+?)\s*=")
    for number, line in enumerate(text.splitlines(), start=1):
        if match := header.match(line):
            table = _normalise_key(match.group(1))
            lines.setdefault(table, number)
        elif match := assignment.match(line):
            key = _normalise_key(match.group(1))
            lines.setdefault(f"{table}.{key}" if table else key, number)
    return lines


def _normalise_key(key: str) -> str:
    return ".".join(part.strip().strip("\"'") for part in key.split("."))
