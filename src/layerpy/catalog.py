"""The node file's system images, kept pulled: what each image name means right now.

A name resolves to the digest of its last successful pull. When a new pull fails (a
missing tag, a corrupt blob, a registry that is away), the name keeps its previous digest
and carries the reason, so nodes stay on the image they run. A new digest is published on
the change feed (kind ``image``), for whoever decides which node runs what.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from layerpy.config import Config, ImageConfig
from layerpy.images import Image, ImageError, ImageStore
from layerpy.nodes.feed import ChangeFeed
from layerpy.proto.agent import ImageSpec

if TYPE_CHECKING:
    from layerpy.stats import Stats

log = logging.getLogger("layerpy.images")


@dataclass
class Entry:
    config: ImageConfig
    image: Image | None = None
    state: str = "pulling"  # pulling | ready | error
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        image = self.image
        return {
            "name": self.config.name,
            "source": str(self.config.source),
            "state": self.state,
            "error": self.error,
            "digest": image.digest if image else None,
            "rootfs_size": image.rootfs_size if image else None,
            "squashfs_size": image.squashfs_size if image else None,
            "layers": image.layers if image else None,
            "pull_seconds": round(image.seconds, 2) if image else None,
            "systemd": self.config.systemd,
        }


class Catalog:
    def __init__(self, store: ImageStore, feed: ChangeFeed, stats: Stats | None = None) -> None:
        self.store = store
        self.feed = feed
        self.stats = stats  # hears each pull: its time, outcome and bytes downloaded
        self.entries: dict[str, Entry] = {}
        self._pulls: set[asyncio.Task[None]] = set()

    def sync(self, config: Config) -> None:
        """Pull every image of the node file in the background (again after a reload,
        so a moved tag is noticed)."""
        previous = self.entries
        self.entries = {}
        for name, image_config in config.images.items():
            old = previous.get(name)
            image = old.image if old else self.store.named(name)
            self.entries[name] = Entry(image_config, image)
            task = asyncio.create_task(self._pull(name))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)

    async def _pull(self, name: str) -> None:
        entry = self.entries[name]
        source = entry.config.source
        log.info("%s: pulling %s", name, source)
        started, downloaded = time.perf_counter(), 0

        def progress(done: int, total: int | None) -> None:
            nonlocal downloaded
            downloaded = done

        try:
            image = await self.store.pull(name, source, progress)
        except Exception as error:  # whatever failed, the image keeps its last good digest
            self._observe(source.kind, started, False, downloaded)
            if not isinstance(error, ImageError):
                log.exception("%s: pull failed", name)
                error = ImageError(f"{name}: pull failed: {type(error).__name__}: {error}")
            entry.state, entry.error = "error", str(error)
            kept = f"; nodes keep {entry.image.digest[:19]}" if entry.image else ""
            log.error("%s%s", error, kept)
            return
        self._observe(source.kind, started, True, downloaded)
        if self.entries.get(name) is not entry:
            return  # a reload replaced this entry meanwhile
        changed = entry.image is None or entry.image.digest != image.digest
        entry.image, entry.state, entry.error = image, "ready", None
        log.info("%s: %s ready (%d layers, %.1f s)", name, image.digest[:19], image.layers,
                 image.seconds)  # fmt: skip
        if changed:
            self.feed.publish("", "image", {"image": name, "digest": image.digest})

    def _observe(self, source: str, started: float, ok: bool, downloaded: int) -> None:
        if self.stats is not None:
            self.stats.observe("image", source, time.perf_counter() - started, ok, downloaded)

    def current(self, name: str) -> Image:
        """The image a node wanting `name` should run; ImageError says why there is none."""
        entry = self.entries.get(name)
        if entry is None:
            raise ImageError(f"{name}: not in the node file")
        if entry.image is None:
            raise ImageError(entry.error or f"{name}: still pulling")
        return entry.image

    def digest(self, name: str | None) -> str | None:
        entry = self.entries.get(name or "")
        return entry.image.digest if entry and entry.image else None

    def spec(self, name: str, digest: str, base_url: str) -> ImageSpec | None:
        """What the agent is told to run."""
        image = self.store.get(digest)
        entry = self.entries.get(name)
        if image is None or entry is None:
            return None
        squashfs = image.squashfs is not None
        fmt = "squashfs" if squashfs else "tar"
        return ImageSpec(
            name=name,
            digest=digest,
            url=f"{base_url}/images/{digest}/rootfs.{fmt}",
            format=fmt,
            sha256=image.squashfs_sha256 if squashfs else image.rootfs_sha256,
            size=image.squashfs_size if squashfs else image.rootfs_size,
            config=image.config,
            systemd=entry.config.systemd,
            command=entry.config.command,
            persist=entry.config.persist,
        )
