"""The image store: pulls an image from its source, verifies every byte against its digest,
flattens the layers into one tar (and a squashfs), and keeps the result by manifest digest.

Under the store's root:

    blobs/sha256/<hex>                 verified blobs (image configs, layers), shared by images
    sha256/<hex>/image.json            one flattened image, named by its manifest digest:
    sha256/<hex>/rootfs.tar              its metadata, root filesystem tar,
    sha256/<hex>/rootfs.squashfs         and the same tree as squashfs (if tar2sqfs is installed)
    names.json                         image name (and platform) -> digest of its last pull
    tmp/                               work in progress, renamed into place when complete
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from layerpy.images.flatten import flatten
from layerpy.images.local import LocalFetcher
from layerpy.images.registry import RegistryFetcher
from layerpy.images.source import (
    INDEX_TYPES,
    Fetcher,
    ImageError,
    ImageSource,
    is_digest,
    load_json,
    sha256_digest,
)
from layerpy.proto import platform as platforms

Progress = Callable[[int, int | None], None]
CONFIG_KEYS = ("Entrypoint", "Cmd", "Env", "WorkingDir", "User")
MAX_CONFIG = 4 << 20
DOWNLOADS = 3  # blobs fetched at once
ROOTFS, SQUASHFS, META = "rootfs.tar", "rootfs.squashfs", "image.json"


@dataclass(frozen=True)
class Image:
    digest: str  # the manifest's: the image's identity
    source: str
    config: dict  # Entrypoint, Cmd, Env, WorkingDir, User, as the image has them
    architecture: str
    rootfs: Path
    rootfs_sha256: str
    rootfs_size: int
    squashfs: Path | None
    squashfs_sha256: str | None
    squashfs_size: int | None
    layers: int
    pulled_at: float
    seconds: float  # time to pull and flatten


class ImageStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        for path in (root / "blobs" / "sha256", root / "sha256", self.tmp):
            path.mkdir(parents=True, exist_ok=True)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # an image's folder is complete before it is renamed into place, and never changes
        # after: read once, not once per agent report (that cost 9 % of a heartbeat)
        self._read: dict[str, Image] = {}

    async def pull(
        self,
        name: str,
        source: ImageSource,
        progress: Progress | None = None,
        platform: str = platforms.DEFAULT,
    ) -> Image:
        """The image `source` names now for nodes of `platform` (``linux/arm64/v8``: the
        manifest an index lists for it), fetched and flattened unless the store has it. A
        pinned digest the store has needs no network at all."""
        started = time.monotonic()
        try:
            image = self.get(source.reference)
            if image is not None and image.architecture != platforms.architecture(platform):
                raise ImageError(f"{source}: image is for {image.architecture}, not {platform}")
            if image is None:
                fetcher: Fetcher = (
                    RegistryFetcher(source) if source.kind == "registry" else LocalFetcher(source)
                )
                try:
                    image = await self._pull(fetcher, source, progress, started, platform)
                finally:
                    await fetcher.close()
        except ImageError as error:
            raise ImageError(f"{name}: {error}") from None
        self._name(_key(name, platform), image.digest)
        return image

    def get(self, digest: str) -> Image | None:
        image = self._read.get(digest)
        if image is not None or not is_digest(digest):
            return image
        folder = self.root / "sha256" / digest.removeprefix("sha256:")
        try:
            meta = json.loads((folder / META).read_text())
        except FileNotFoundError:
            return None
        squashfs = folder / SQUASHFS if meta["squashfs"] else None
        image = Image(**{**meta, "rootfs": folder / ROOTFS, "squashfs": squashfs})
        self._read[digest] = image
        return image

    def list(self) -> list[Image]:
        found = (self.get("sha256:" + folder.name) for folder in (self.root / "sha256").iterdir())
        return sorted((image for image in found if image), key=lambda image: image.pulled_at)

    def named(self, name: str, platform: str = platforms.DEFAULT) -> Image | None:
        """The image last pulled as `name` for `platform`: lets a restart go on when its
        source is away."""
        return self.get(self._names().get(_key(name, platform), ""))

    async def _pull(
        self,
        fetcher: Fetcher,
        source: ImageSource,
        progress: Progress | None,
        started: float,
        platform: str,
    ) -> Image:
        digest, manifest = await self._resolve(fetcher, source.reference, platform)
        want = platforms.architecture(platform)
        async with self._locks[digest]:
            image = self.get(digest)
            if image is None:
                descriptors = self._descriptors(manifest, fetcher.where)
                await self._fetch(fetcher, descriptors, progress)
                config_path, *layers = (self._blob(d["digest"]) for d in descriptors)
                if config_path.stat().st_size > MAX_CONFIG:
                    raise ImageError(f"{fetcher.where}: image config is too large")
                config = load_json(config_path.read_bytes(), fetcher.where, "image config")
                arch = config.get("architecture", want)
                if arch != want:
                    raise ImageError(f"{fetcher.where}: image is for {arch}, not {want}")
                settings = config.get("config")
                settings = settings if isinstance(settings, dict) else {}
                image = await asyncio.to_thread(
                    self._build,
                    digest,
                    str(source),
                    {key: settings[key] for key in CONFIG_KEYS if key in settings},
                    layers,
                    started,
                    arch,
                )
        return image

    async def _resolve(self, fetcher: Fetcher, reference: str, platform: str) -> tuple[str, dict]:
        """The digest and contents of the image manifest `reference` names, choosing
        `platform` from an index (which may itself list indexes)."""
        for _ in range(4):
            data = await fetcher.manifest(reference)
            if is_digest(reference) and sha256_digest(data) != reference:
                raise ImageError(f"{fetcher.where}: manifest {reference} does not match its digest")
            document = load_json(data, fetcher.where, "manifest")
            if document.get("mediaType") not in INDEX_TYPES and "manifests" not in document:
                return sha256_digest(data), document
            chosen, offered = platforms.choose(document, platform)
            if chosen is None:
                offers = ", ".join(offered) or "none"
                raise ImageError(f"{fetcher.where}: no {platform} image (offers: {offers})")
            reference = chosen
        raise ImageError(f"{fetcher.where}: image indexes nested too deep")

    def _descriptors(self, manifest: dict, where: str) -> list[dict]:
        """The config and layer descriptors, checked: blob names become file names."""
        if manifest.get("schemaVersion") != 2 or not isinstance(manifest.get("layers"), list):
            raise ImageError(f"{where}: not an image manifest (schema 2, OCI or Docker)")
        found = [manifest.get("config"), *manifest["layers"]]
        for item in found:
            if not (
                isinstance(item, dict)
                and is_digest(str(item.get("digest")))
                and isinstance(item.get("size"), int)
                and item["size"] >= 0
            ):
                raise ImageError(f"{where}: the manifest has a bad blob descriptor")
        return found

    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")

    async def _fetch(self, fetcher: Fetcher, wanted: list[dict], progress: Progress | None) -> None:
        """Downloads the blobs the store lacks, a few at a time."""
        missing = list(
            {d["digest"]: d for d in wanted if not self._blob(d["digest"]).exists()}.values()
        )
        total, done = sum(d["size"] for d in missing), 0

        def advance(count: int) -> None:
            nonlocal done
            done += count
            if progress:
                progress(done, total)

        advance(0)
        gate = asyncio.Semaphore(DOWNLOADS)

        async def one(descriptor: dict) -> None:
            async with gate:
                await self._download(fetcher, descriptor, advance)

        tasks = [asyncio.create_task(one(descriptor)) for descriptor in missing]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failed (or the pull was cancelled): stop the others, let them clean up
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _download(
        self, fetcher: Fetcher, descriptor: dict, advance: Callable[[int], None]
    ) -> None:
        """One blob into the cache, checked against its size and digest as it streams."""
        digest, size = descriptor["digest"], descriptor["size"]
        hasher, got = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=self.tmp, prefix="blob-")
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in fetcher.blob(digest, size):
                    got += len(chunk)
                    if got > size:
                        raise ImageError(
                            f"{fetcher.where}: blob {digest} is larger than {size} bytes"
                        )
                    hasher.update(chunk)
                    out.write(chunk)
                    advance(len(chunk))
            if got != size:
                raise ImageError(f"{fetcher.where}: blob {digest} has {got} bytes, not {size}")
            if "sha256:" + hasher.hexdigest() != digest:
                raise ImageError(
                    f"{fetcher.where}: blob {digest} does not match its digest "
                    f"(got sha256:{hasher.hexdigest()})"
                )
            os.replace(tmp, self._blob(digest))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _build(
        self,
        digest: str,
        source: str,
        config: dict,
        layers: list[Path],
        started: float,
        architecture: str,
    ) -> Image:
        """Flattens and records the image in a scratch folder, then renames it into place."""
        stage = Path(tempfile.mkdtemp(dir=self.tmp, prefix="image-"))
        final = self.root / "sha256" / digest.removeprefix("sha256:")
        try:
            flatten(layers, stage / ROOTFS, stage)
            squashfs = _squashfs(stage / ROOTFS, stage / SQUASHFS)
            rootfs_sha256, rootfs_size = _digest(stage / ROOTFS)
            squashfs_sha256, squashfs_size = _digest(stage / SQUASHFS) if squashfs else (None, None)
            image = Image(
                digest=digest,
                source=source,
                config=config,
                architecture=architecture,
                rootfs=final / ROOTFS,
                rootfs_sha256=rootfs_sha256,
                rootfs_size=rootfs_size,
                squashfs=final / SQUASHFS if squashfs else None,
                squashfs_sha256=squashfs_sha256,
                squashfs_size=squashfs_size,
                layers=len(layers),
                pulled_at=time.time(),
                seconds=round(time.monotonic() - started, 3),
            )
            meta = {**asdict(image), "rootfs": ROOTFS, "squashfs": SQUASHFS if squashfs else None}
            (stage / META).write_text(json.dumps(meta, indent=1))
            try:
                stage.rename(final)
            except OSError:
                if not (final / META).exists():  # else another process made the same image
                    raise
            return image
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _names(self) -> dict[str, str]:
        try:
            return json.loads((self.root / "names.json").read_text())
        except FileNotFoundError:
            return {}

    def _name(self, name: str, digest: str) -> None:
        names = self._names()
        if names.get(name) != digest:
            _write_atomic(self.root / "names.json", json.dumps({**names, name: digest}, indent=1))


def _key(name: str, platform: str) -> str:
    """An image name's key in names.json: the name alone for the default platform (as
    before there were others), else ``name@platform``."""
    return name if platform == platforms.DEFAULT else f"{name}@{platform}"


def _squashfs(tar: Path, dest: Path) -> bool:
    """The tar as squashfs with tar2sqfs (squashfs-tools-ng), when that is installed."""
    tool = shutil.which("tar2sqfs")
    if tool is None:
        return False
    with tar.open("rb") as stdin:
        done = subprocess.run(
            [tool, "--quiet", "--no-skip", "--compressor", "gzip", str(dest)],
            stdin=stdin,
            capture_output=True,
        )
    if done.returncode:
        raise ImageError(f"tar2sqfs failed: {done.stderr.decode(errors='replace').strip()}")
    return True


def _digest(path: Path) -> tuple[str, int]:
    hasher = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            hasher.update(chunk)
    return hasher.hexdigest(), path.stat().st_size


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
