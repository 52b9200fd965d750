"""Image sources on the local disk: an OCI image layout directory, and a `docker save`
archive (the classic manifest.json format, or Docker 25+'s OCI layout inside the tar).

An archive is indexed once (member name -> offset, size); each blob is then read with a
file handle of its own, so blobs copy concurrently without re-reading the tar."""

from __future__ import annotations

import asyncio
import json
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from layerpy.images.source import (
    OCI_CONFIG,
    OCI_LAYER,
    OCI_MANIFEST,
    ImageError,
    ImageSource,
    is_digest,
    load_json,
    objects,
    sha256_digest,
)

CHUNK = 1 << 20
MAX_JSON = 4 << 20
REF_NAME = "org.opencontainers.image.ref.name"
IMAGE_NAME = "io.containerd.image.name"  # how Docker 25+ `docker save` names its images


class _Files:
    """Regular files by name, from a directory or from inside a tar archive."""

    def __init__(self, path: Path, where: str) -> None:
        self.path, self.where = path, where
        self.members: dict[str, tuple[int, int]] | None = None
        if path.is_dir():
            return
        try:
            with tarfile.open(path, "r:") as tar:
                self.members = {
                    info.name.removeprefix("./"): (info.offset_data, info.size)
                    for info in tar
                    if info.isreg() and not info.sparse
                }
        except (OSError, tarfile.TarError) as error:
            raise ImageError(f"{where}: cannot read it ({error})") from None

    def span(self, name: str) -> tuple[Path, int, int] | None:
        """Where the file's bytes are: (file, offset, size), or None if there is no such file."""
        if self.members is None:
            path = self.path / name
            return (path, 0, path.stat().st_size) if path.is_file() else None
        found = self.members.get(name)
        return (self.path, *found) if found else None

    def read(self, name: str) -> bytes:
        span = self.span(name)
        if span is None:
            raise ImageError(f"{self.where}: no {name}")
        if span[2] > MAX_JSON:
            raise ImageError(f"{self.where}: {name} is too large for image metadata")
        return b"".join(self.chunks(name))

    def chunks(self, name: str) -> Iterator[bytes]:
        span = self.span(name)
        if span is None:
            raise ImageError(f"{self.where}: no {name}")
        path, start, size = span
        with open(path, "rb") as file:
            file.seek(start)
            while size > 0:
                chunk = file.read(min(CHUNK, size))
                if not chunk:
                    raise ImageError(f"{self.where}: {name} is truncated")
                size -= len(chunk)
                yield chunk


class LocalFetcher:
    """Reads an OCI layout (a directory, or inside a docker archive) or a classic archive."""

    def __init__(self, source: ImageSource) -> None:
        self.where = f"{source.kind} {source.location}"
        path = Path(source.location)
        layout = source.kind == "oci-layout"
        if not (path.is_dir() if layout else path.is_file()):
            raise ImageError(f"{self.where}: no such {'directory' if layout else 'file'}")
        self.files = _Files(path, self.where)
        self.oci = self.files.span("index.json") is not None
        if not self.oci and (layout or self.files.span("manifest.json") is None):
            kind = "an OCI layout" if layout else "a docker archive"
            raise ImageError(f"{self.where}: not {kind} (no index.json or manifest.json)")
        self.blobs: dict[str, str] = {}  # classic archives: digest -> member name

    async def manifest(self, reference: str) -> bytes:
        return await asyncio.to_thread(self._manifest, reference)

    async def blob(self, digest: str, size: int) -> AsyncIterator[bytes]:
        name = self.blobs.get(digest) or f"blobs/sha256/{digest.removeprefix('sha256:')}"
        if not is_digest(digest) or self.files.span(name) is None:
            raise ImageError(f"{self.where}: blob {digest} is missing")
        chunks = self.files.chunks(name)
        while chunk := await asyncio.to_thread(next, chunks, b""):
            yield chunk

    async def close(self) -> None:
        pass

    def _manifest(self, reference: str) -> bytes:
        if not self.oci:
            return self._classic(reference)
        if is_digest(reference):
            return self.files.read(f"blobs/sha256/{reference.removeprefix('sha256:')}")
        index = self.files.read("index.json")
        if not reference:
            return index  # an index: the store picks this machine's platform from it
        manifests = objects(load_json(index, self.where, "index.json").get("manifests"))
        for found in manifests:
            notes = found.get("annotations") or {}
            name = notes.get(IMAGE_NAME, "")
            if reference in (notes.get(REF_NAME), name) or name.endswith("/" + reference):
                return self._manifest(str(found.get("digest")))
        names = sorted({str((m.get("annotations") or {}).get(REF_NAME)) for m in manifests})
        raise ImageError(f"{self.where}: no image {reference!r} (has: {', '.join(names)})")

    def _classic(self, reference: str) -> bytes:
        """Classic `docker save` has no manifest: make the one a registry would hold (layers
        are stored uncompressed, so their digests are the config's diff_ids)."""
        data = self.files.read("manifest.json")
        images = objects(load_json(data, self.where, "manifest.json", list))
        chosen = next(
            (i for i in images if not reference or reference in (i.get("RepoTags") or [])), None
        )
        if chosen is None:
            tags = sorted(str(t) for i in images for t in i.get("RepoTags") or [])
            raise ImageError(f"{self.where}: no image {reference!r} (has: {', '.join(tags)})")
        config_name, layers = chosen.get("Config"), chosen.get("Layers")
        if not isinstance(config_name, str) or not isinstance(layers, list):
            raise ImageError(f"{self.where}: manifest.json lacks Config or Layers")
        config_data = self.files.read(config_name)
        config = load_json(config_data, self.where, config_name)
        rootfs = config.get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        spans = [self.files.span(str(name)) for name in layers]
        if not isinstance(diff_ids, list) or len(diff_ids) != len(layers) or None in spans:
            raise ImageError(
                f"{self.where}: manifest.json and the image config disagree on the layers"
            )
        config_digest = sha256_digest(config_data)
        self.blobs = {config_digest: config_name, **dict(zip(diff_ids, layers, strict=True))}
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_data)},
            "layers": [
                {"mediaType": OCI_LAYER, "digest": digest, "size": span[2]}
                for digest, span in zip(diff_ids, spans, strict=True)
            ],
        }
        return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
