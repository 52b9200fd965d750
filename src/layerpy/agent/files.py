"""The node's own files: fetched from the server by digest, checked, kept in RAM, and
written into an image's root.

The server names each file by the sha256 of its bytes (``FilesSpec``); the bytes come over
HTTP with the node's credential and are kept only if they match, in a directory only root
may read (secrets are among them). Writing into a root never follows a symlink the image
holds: each directory is opened below the last without following links, and a file is
replaced by renaming a new one over it, owned and moded before it gets its name, so a
secret is never readable by others, not even for a moment. Owners are names of the image
(its /etc/passwd and /etc/group), not of the minOS.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import urllib.error
import urllib.request
from collections.abc import Callable

from layerpy.proto.agent import FILES_PATH, MAX_FILE, FileSpec, FilesSpec

HTTP_TIMEOUT = 30.0


class FilesError(Exception):
    """A file could not be fetched, checked or placed; the message says which and why."""


class NodeFiles:
    """The store of fetched files (``<dir>/<sha256>``) and the record of what was placed
    into the running root, so a file the server no longer gives is removed from it."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.placed_path = os.path.join(directory, "placed.json")

    def fetch(
        self, spec: FilesSpec, server: str, authorization: str | None, check: Callable[[], None]
    ) -> None:
        """Every file of `spec` not in the store yet, checked against its digest and size."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        for file in spec.files:
            path = self._stored(file)
            if os.path.exists(path):
                continue
            check()
            data = _download(server + FILES_PATH + file.digest, file, authorization)
            tmp = path + ".part"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)

    def place(self, root: str, spec: FilesSpec) -> list[FileSpec]:
        """Write `spec`'s files into `root` and remove the ones placed before that it no
        longer names; returns the files whose bytes, mode or owner changed."""
        owners = Owners(root)
        changed = []
        for file in spec.files:
            with open(self._stored(file), "rb") as f:
                data = f.read()
            uid, gid = owners.ids(file)
            if write(root, file.path, data, file.mode, uid, gid):
                changed.append(file)
        wanted = {file.path for file in spec.files}
        for path in self.placed(root) - wanted:
            with contextlib.suppress(FileNotFoundError):
                remove(root, path)
        self._record(root, wanted)
        self._sweep(spec)
        return changed

    def placed(self, root: str) -> set[str]:
        """The paths placed into `root` (none if the record is of another root)."""
        try:
            with open(self.placed_path, encoding="utf-8") as f:
                record = json.load(f)
            paths = record["paths"] if record["root"] == root else []
            return {path for path in paths if isinstance(path, str)}
        except (OSError, ValueError, KeyError, TypeError):
            return set()

    def _record(self, root: str, paths: set[str]) -> None:
        tmp = self.placed_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"root": root, "paths": sorted(paths)}, f)
        os.replace(tmp, self.placed_path)

    def _sweep(self, spec: FilesSpec) -> None:
        """Drop stored files no longer named: the store holds what is wanted, no more."""
        keep = {os.path.basename(self._stored(file)) for file in spec.files} | {"placed.json"}
        for name in os.listdir(self.dir):
            if name not in keep:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))

    def _stored(self, file: FileSpec) -> str:
        return os.path.join(self.dir, file.digest.removeprefix("sha256:"))


def _download(url: str, file: FileSpec, authorization: str | None) -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the boot network
    request = urllib.request.Request(url)
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with opener.open(request, timeout=HTTP_TIMEOUT) as response:
            data = response.read(file.size + 1)
    except urllib.error.HTTPError as e:
        e.close()
        raise FilesError(f"{file.path}: the server refused it: HTTP {e.code} {e.reason}") from None
    except (OSError, ValueError) as e:
        raise FilesError(f"{file.path}: cannot fetch it: {getattr(e, 'reason', e)}") from None
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if len(data) != file.size or got != file.digest:
        named = f"{file.size} of {file.digest[:19]}…"
        raise FilesError(f"{file.path}: got {len(data)} bytes of {got[:19]}…, not the {named}")
    return data


class Owners:
    """User and group names of an image, read from its own /etc/passwd and /etc/group."""

    def __init__(self, root: str) -> None:
        self.users = _ids(root, "/etc/passwd")
        self.groups = _ids(root, "/etc/group")

    def ids(self, file: FileSpec) -> tuple[int, int]:
        user, group = file.owner.split(":")
        return self._id(user, self.users, "user", file), self._id(group, self.groups, "group", file)

    @staticmethod
    def _id(name: str, known: dict[str, int], what: str, file: FileSpec) -> int:
        if name.isdigit():  # the contract's pattern: at most 9 ASCII digits
            return int(name)
        if name not in known:
            raise FilesError(f"{file.path}: the image has no {what} {name!r}")
        return known[name]


def _ids(root: str, path: str) -> dict[str, int]:
    """Names to ids from the image's passwd or group file (whatever it holds: ids in
    range only)."""
    try:
        data = read(root, path)
    except (OSError, FilesError):
        return {}
    ids: dict[str, int] = {}
    for line in (data or b"").decode("utf-8", errors="replace").splitlines():
        fields = line.split(":")
        if len(fields) > 2 and re.fullmatch(r"[0-9]{1,9}", fields[2]):
            ids.setdefault(fields[0], int(fields[2]))
    return ids


# -- paths inside a root, never through its symlinks ----------------------------------------


def directory(root: str, path: str, create: bool) -> tuple[int, str]:
    """An open descriptor of `path`'s directory inside `root` (made if `create`), and the
    last name; FilesError when a component is a symlink or no directory."""
    *parents, name = path.strip("/").split("/")
    if any(part in ("", ".", "..") for part in (*parents, name)):
        raise FilesError(f"{path}: not a normalised path")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parents:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                why = f"{part} in the image is not a directory ({e.strerror})"
                raise FilesError(f"{path}: {why}; a symlink is not followed") from None
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def read(root: str, path: str, limit: int = MAX_FILE) -> bytes | None:
    """A regular file's first `limit` + 1 bytes; None for anything else (a FIFO, a device,
    a symlink: an image may hold any of them where a file is expected)."""
    fd, name = directory(root, path, create=False)
    try:
        found = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with open(found, "rb") as f:
        return f.read(limit + 1) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None


def write(root: str, path: str, data: bytes, mode: int, uid: int, gid: int) -> bool:
    """Put `data` at `path` in `root` unless it is there already, as it is; True if written."""
    fd, name = directory(root, path, create=True)
    try:
        with contextlib.suppress(OSError):
            old = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            with open(old, "rb") as f:
                info = os.fstat(f.fileno())
                kept = (stat.S_ISREG(info.st_mode), stat.S_IMODE(info.st_mode), info.st_uid,
                        info.st_gid, info.st_size)  # fmt: skip
                if kept == (True, mode, uid, gid, len(data)) and f.read(len(data)) == data:
                    return False
        tmp = f".{name}.layerpy-new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        new = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        with open(new, "wb") as f:
            f.write(data)
            os.fchown(f.fileno(), uid, gid)
            os.fchmod(f.fileno(), mode)  # after chown, which clears set-id bits
        try:
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except IsADirectoryError:
            os.unlink(tmp, dir_fd=fd)
            raise FilesError(f"{path}: the image has a directory there") from None
        return True
    finally:
        os.close(fd)


def remove(root: str, path: str) -> None:
    fd, name = directory(root, path, create=False)
    try:
        os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
