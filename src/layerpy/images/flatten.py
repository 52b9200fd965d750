"""Flattens image layers into one deterministic tar, in memory, without unpacking anything.

The layers are applied to a tree of names (whiteouts, opaque directories, hard links),
and the tree is written out sorted, so the same layers always give the same bytes. Since
no directory is ever written, a hostile layer cannot reach outside the image: names and
hard-link targets with ".." are refused, and a path through a symlink is resolved inside
the tree (absolute targets and ".." stop at its root), as runc/umoci's securejoin does. The
result therefore never holds an entry below a symlink, and extracting it is safe.

File contents are copied from the layer tars when the result is written: compressed
layers are first decompressed to scratch files, so that they can be read in any order.
"""

from __future__ import annotations

import contextlib
import gzip
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from layerpy.images.source import ImageError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
XATTR = "SCHILY.xattr."
# POSIX ACLs are dropped: tar2sqfs cannot store them, and the minOS runs containers as root
POSIX_ACL = XATTR + "system.posix_acl_"
MAX_SYMLINKS = 40  # as Linux's path resolution
GZIP, ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"


class _Refused(Exception):
    """A layer entry that cannot be applied; the message says why."""


class _Inode:
    """A file's metadata and where its contents are; hard links share one."""

    __slots__ = ("info", "tar")

    def __init__(self, info: tarfile.TarInfo | None, tar: tarfile.TarFile | None = None) -> None:
        self.info, self.tar = info, tar  # info None: a directory no layer declared


class _Node:
    __slots__ = ("children", "inode")

    def __init__(self, inode: _Inode, children: dict[str, _Node] | None = None) -> None:
        self.inode, self.children = inode, children  # children is None for non-directories


def flatten(layers: Sequence[Path], dest: Path, scratch: Path) -> None:
    """Writes the root filesystem that `layers` (tar blobs, bottom first; gzip, zstd or
    plain) make as one tar at `dest`. Scratch files go to a directory under `scratch`."""
    root = _Node(_Inode(None), {})
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=scratch)))
        for number, path in enumerate(layers, 1):
            what = f"layer {number} (sha256:{path.name})"
            try:
                tar = stack.enter_context(tarfile.open(_plain(path, tmp, what), "r:"))
                _apply(root, tar)
            except tarfile.TarError as error:
                raise ImageError(f"{what}: not a valid tar ({error})") from None
            except _Refused as error:
                raise ImageError(f"{what}: {error}") from None
        with tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as out:
            _write(out, root)


def _plain(path: Path, tmp: Path, what: str) -> Path:
    """The layer as an uncompressed (seekable) tar."""
    with path.open("rb") as blob:
        magic = blob.read(4)
    if not magic.startswith(GZIP) and magic != ZSTD:
        return path
    plain = tmp / path.name
    if magic == ZSTD:
        if not shutil.which("zstd"):
            raise ImageError(f"{what}: zstd-compressed, and the zstd program is not installed")
        done = subprocess.run(["zstd", "-dqf", str(path), "-o", str(plain)], capture_output=True)
        if done.returncode:
            raise ImageError(f"{what}: zstd failed: {done.stderr.decode(errors='replace')}")
        return plain
    try:
        with gzip.open(path) as source, plain.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
    except (OSError, EOFError) as error:
        raise ImageError(f"{what}: bad gzip data ({error})") from None
    return plain


def _parts(name: str) -> list[str]:
    """A member name as path components below the root; "" and "." vanish, ".." is refused."""
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _Refused(f"'..' in {name!r}")
    return parts


def _apply(root: _Node, tar: tarfile.TarFile) -> None:
    """Applies one layer: its whiteouts first (they hide only what lower layers made,
    wherever they stand in the tar), then its entries in tar order."""
    info = None
    try:
        entries, whiteouts = [], []
        for info in tar:
            parts = _parts(info.name)
            if parts and parts[-1].startswith(WHITEOUT):
                whiteouts.append((info, parts))
            else:
                entries.append((info, parts))
        for info, (*where, name) in whiteouts:  # noqa: B007 (the error names it)
            _whiteout(root, where, name)
        for info, parts in entries:
            _add(root, parts, info, tar)
    except _Refused as error:
        assert info is not None
        raise _Refused(f"{info.name!r}: {error}") from None


def _whiteout(root: _Node, where: list[str], name: str) -> None:
    parent = _walk(root, where, create=False)
    if parent is None:
        return
    assert parent.children is not None
    if name == OPAQUE:
        parent.children.clear()
    elif not name.startswith(WHITEOUT + WHITEOUT):  # other .wh..wh. names: aufs metadata
        parent.children.pop(name.removeprefix(WHITEOUT), None)


def _walk(root: _Node, parts: list[str], create: bool) -> _Node | None:
    """The directory that `parts` names, following symlinks inside the tree. Missing
    directories are made (as extraction would) if `create`, else give None."""
    stack = [root]
    pending = parts[::-1]
    followed = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if len(stack) > 1:
                stack.pop()
            continue
        children = stack[-1].children
        assert children is not None
        node = children.get(part)
        if node is None:
            if not create:
                return None
            node = children[part] = _Node(_Inode(None), {})
        elif node.children is None:
            info = node.inode.info
            assert info is not None
            if not info.issym():
                if create:
                    raise _Refused(f"{part} is not a directory")
                return None
            followed += 1
            if followed > MAX_SYMLINKS:
                raise _Refused("too many levels of symbolic links")
            if info.linkname.startswith("/"):
                del stack[1:]
            pending.extend(info.linkname.split("/")[::-1])
            continue
        stack.append(node)
    return stack[-1]


def _add(root: _Node, parts: list[str], info: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
    if not parts:
        if not info.isdir():
            raise _Refused("the root must be a directory")
        root.inode = _Inode(info)
        return
    parent = _walk(root, parts[:-1], create=True)
    assert parent is not None and parent.children is not None
    name, old = parts[-1], parent.children.get(parts[-1])
    if info.isdir():
        if old is not None and old.children is not None:
            old.inode = _Inode(info)  # directories merge: the upper one's metadata wins
        else:
            parent.children[name] = _Node(_Inode(info), {})
        return
    if info.islnk():
        inode = _link_target(root, info)
    elif info.isreg() or info.issym() or info.ischr() or info.isblk() or info.isfifo():
        inode = _Inode(info, tar)
    else:
        raise _Refused(f"unsupported entry type {info.type!r}")
    parent.children[name] = _Node(inode)


def _link_target(root: _Node, info: tarfile.TarInfo) -> _Inode:
    """The inode a hard link shares: it lives on even if its first name is later deleted."""
    *where, name = _parts(info.linkname) or [""]
    parent = _walk(root, where, create=False)
    target = parent.children.get(name) if parent and parent.children is not None else None
    if target is None or target.children is not None:
        raise _Refused(f"hard link to {info.linkname!r}, which is no file")
    return target.inode


def _write(out: tarfile.TarFile, root: _Node) -> None:
    """Writes the tree depth-first in name order. The first name of a hard-linked inode
    carries the data; its other names link to that one."""
    first: dict[int, str] = {}
    pending = [(".", root)]
    while pending:
        path, node = pending.pop()
        entry, data = _entry(path, node, first)
        out.addfile(entry, data)
        if node.children:
            prefix = "" if path == "." else path + "/"
            pending.extend(
                (prefix + name, node.children[name]) for name in sorted(node.children, reverse=True)
            )


def _entry(
    path: str, node: _Node, first: dict[int, str]
) -> tuple[tarfile.TarInfo, IO[bytes] | None]:
    """The output header for one node (numeric owners only), and its data if it has any."""
    entry = tarfile.TarInfo(path)
    source = node.inode.info
    if source is None:
        entry.type, entry.mode = tarfile.DIRTYPE, 0o755
        return entry, None
    entry.mode, entry.mtime = source.mode, source.mtime
    entry.uid, entry.gid = source.uid, source.gid
    entry.pax_headers = {k: v for k, v in source.pax_headers.items() if _kept_xattr(k)}
    if node.children is not None:
        entry.type = tarfile.DIRTYPE
    elif id(node.inode) in first:
        entry.type, entry.linkname = tarfile.LNKTYPE, first[id(node.inode)]
    else:
        first[id(node.inode)] = path
        if source.isreg():
            assert node.inode.tar is not None
            entry.size = source.size
            return entry, node.inode.tar.extractfile(source)
        entry.type, entry.linkname = source.type, source.linkname
        entry.devmajor, entry.devminor = source.devmajor, source.devminor
    return entry, None


def _kept_xattr(key: str) -> bool:
    return key.startswith(XATTR) and not key.startswith(POSIX_ACL)
