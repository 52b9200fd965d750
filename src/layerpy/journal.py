"""An append-only file of JSON records that survives ``kill -9`` at any moment.

Each batch of records is one ``write()`` on an ``O_APPEND`` descriptor, made before the
answer that depends on it is sent: once the kernel has it, a killed process loses nothing
(only a power cut can tear the last line, and replay skips a torn line). The file is
rewritten from the live records (atomically: a new file, then rename) once it holds many
times more lines than records, so it never grows without bound: with an event loop
running, in a worker thread (`compact`), since writing 50 000 records held the loop for
140 ms (docs/scale.md); the appends meanwhile go on to the old file, which keeps every
record until the new one is renamed over it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable, Sequence
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
        self._since: list[str] | None = None  # the lines appended while compacting

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
        if self._since is not None:
            self._since.append(data)

    def crowded(self, live: int) -> bool:
        """Whether the file holds enough dead lines to be worth rewriting."""
        return self.lines > self.factor * live + SLACK

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the file by exactly ``records`` (atomically)."""
        self._write_new((None, record) for record in records)
        self._rename(len(records))

    def compact(self, live: Sequence[tuple[Any, dict[str, Any]]]) -> None:
        """Replace the file by the `live` records (key, record without its key field), in a
        worker thread when an event loop runs: the lines appended meanwhile go to the old
        file and, once the new one is written, after them; then it is renamed over the old
        one. The records must not change in place (a put replaces them). One at a time: a
        call while one runs does nothing."""
        if self._since is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_new(live)
            self._rename(len(live))
            return
        since: list[str] = []
        self._since = since
        written = loop.run_in_executor(None, self._write_new, live)
        written.add_done_callback(lambda done: self._finish(done, since, len(live)))

    def _write_new(self, records: Iterable[tuple[Any, dict[str, Any]]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "w", encoding="utf-8") as out:
            for key, record in records:
                out.write(_line(record if key is None else {self.key: key, **record}) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def _finish(self, written: asyncio.Future[None], since: list[str], count: int) -> None:
        """On the loop again: the lines appended meanwhile added, the new file in place."""
        if self._since is not since:
            return  # closed meanwhile: the old file holds every record
        self._since = None
        if written.cancelled() or written.exception() is not None:
            log.error("cannot compact %s: %s", self.path, written.exception())
            return
        try:
            with open(self.path.with_suffix(".tmp"), "a", encoding="utf-8") as out:
                out.writelines(since)
                out.flush()
                os.fsync(out.fileno())
            self._rename(count + sum(data.count("\n") for data in since))
        except OSError as error:
            log.error("cannot compact %s: %s", self.path, error)

    def _rename(self, lines: int) -> None:
        os.replace(self.path.with_suffix(".tmp"), self.path)
        if self._fd is not None:
            os.close(self._fd)  # the next append opens the new file
            self._fd = None
        self.lines = lines

    def close(self) -> None:
        """A compaction still running is dropped: the file has every record."""
        self._since = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
