"""The node store's state files: small JSON records kept across restarts of the server.

Written atomically (a crash leaves the old file or the new one, never half of one) and
readable by the server's user only: they hold boot tokens.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("layerpy.nodes")
# Some files are rewritten at every boot: a storm of a thousand rewrites one of a thousand
# records a thousand times, and indent made the encoding 4x slower (pure Python, not C).
_compact = json.JSONEncoder(separators=(",", ":")).encode


class StateFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def read(self, name: str) -> dict[str, Any]:
        path = self.directory / name
        try:
            records = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            log.error("ignoring unreadable %s: %s", path, error)
            return {}
        return records if isinstance(records, dict) else {}

    def write(self, name: str, records: dict[str, Any]) -> bool:
        """Replace the file; False (and logged) when it cannot be written."""
        path = self.directory / name
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "w", encoding="utf-8") as f:
                f.write(_compact(records))
            os.chmod(tmp, 0o600)  # an older file of another mode may have been reused
            _owned_like_directory(tmp)
            os.replace(tmp, path)
        except OSError as error:
            log.error("cannot save %s: %s", path, error.strerror)
            return False
        return True


def _owned_like_directory(path: Path) -> None:
    """root running `layerpy token` for a server of its own user: the file stays the
    server's, or the server could no longer read it."""
    owner = path.parent.stat()
    if os.geteuid() == 0 and (owner.st_uid, owner.st_gid) != (0, 0):
        os.chown(path, owner.st_uid, owner.st_gid)
