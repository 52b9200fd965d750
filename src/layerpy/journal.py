"""An append-only file of JSON records that survives ``kill -9`` at any moment.

Each batch of records is one ``write()`` on an ``O_APPEND`` descriptor, made before the
answer that depends on it is sent: once the kernel has it, a killed process loses nothing
(only a power cut can tear the last line, and replay skips a torn line). The file is
rewritten from the live records (atomically: a new file, then rename) once it holds many
times more lines than records, so it never grows without bound.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("layerpy.journal")

SLACK = 1024  # lines allowed beyond compact_factor x live records before rewriting
_line = json.JSONEncoder(separators=(",", ":")).encode  # one encoder (dumps makes one a call)


class Journal:
    def __init__(self, path: Path, key: str, compact_factor: int = 4) -> None:
        """Records are told apart by their ``key`` field; the last one of a key wins."""
        self.path, self.key, self.factor = path, key, compact_factor
        self.lines = 0
        self._fd: int | None = None

    def replay(self) -> list[dict[str, Any]]:
        """The live records, last per key, in the order they were first written."""
        latest: dict[Any, dict[str, Any]] = {}
        self.lines = 0
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as error:
            log.error("ignoring unreadable %s: %s", self.path, error)
            return []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                record = json.loads(line)
                latest[record[self.key]] = record
            except (ValueError, TypeError, KeyError):
                log.warning("%s:%d: skipped a torn or unreadable record", self.path, number)
                continue
            self.lines += 1
        return list(latest.values())

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        """One write of every record; raises OSError when it cannot (the caller must not
        then answer as if it were kept)."""
        data = "".join(_line(record) + "\n" for record in records)
        if not data:
            return
        if self._fd is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o600)
        os.write(self._fd, data.encode())
        self.lines += data.count("\n")

    def crowded(self, live: int) -> bool:
        """Whether the file holds enough dead lines to be worth rewriting."""
        return self.lines > self.factor * live + SLACK

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file by exactly ``records`` (atomically)."""
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="utf-8") as out:
            out.writelines(_line(r) + "\n" for r in records)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)
        self.close()
        self.lines = len(records)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
