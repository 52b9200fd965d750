"""The node file's system images, kept pulled: what each image name means right now.

A name resolves, for each node platform (``linux/amd64``, ``linux/arm64/v8``: what the
agents report), to the digest of its last successful pull for that platform: a
multi-architecture image gives each its own manifest. Images are pulled for amd64 from the
start and for another platform once a node of it is seen (``want``). When a new pull fails
(a missing tag, a corrupt blob, a registry that is away, no image for the platform), the
name keeps its previous digest and carries the reason, so nodes stay on the image they run.
A new digest is published on the change feed (kind ``image``), for whoever decides which
node runs what.
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
from layerpy.proto.platform import DEFAULT

if TYPE_CHECKING:
    from layerpy.stats import Stats

log = logging.getLogger("layerpy.images")


@dataclass
class Entry:
    config: ImageConfig
    image: Image | None = None
    state: str = "pulling"  # pulling | ready | error
    error: str | None = None
    platform: str = DEFAULT

    def as_json(self) -> dict[str, Any]:
        image = self.image
        return {
            "name": self.config.name,
            "platform": self.platform,
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
        self.platforms: dict[str, dict[str, Entry]] = {DEFAULT: {}}  # platform -> name -> entry
        self._images: dict[str, ImageConfig] = {}
        self._pulls: set[asyncio.Task[None]] = set()
        # (name, digest, base URL) -> the entry it was made from and the spec: one object
        # per image, however many reports ask (an agent's answer compares it, `Beats`)
        self._specs: dict[tuple[str, str, str], tuple[Entry, ImageSpec]] = {}

    @property
    def entries(self) -> dict[str, Entry]:
        """The node file's images, as pulled for amd64 nodes (every name is here)."""
        return self.platforms[DEFAULT]

    def sync(self, config: Config) -> None:
        """Pull every image of the node file in the background, for every platform nodes
        were seen with (again after a reload, so a moved tag is noticed)."""
        self._images = dict(config.images)
        for platform in self.platforms:
            self._sync(platform)

    def want(self, platform: str) -> None:
        """A node of `platform` is here: pull every image for it too (once; later reloads
        pull again for it, as for amd64)."""
        if platform not in self.platforms:
            log.info("nodes of %s: pulling the images for them", platform)
            self._sync(platform)

    def _sync(self, platform: str) -> None:
        previous = self.platforms.get(platform, {})
        entries = self.platforms[platform] = {}
        for name, image_config in self._images.items():
            old = previous.get(name)
            image = old.image if old else self.store.named(name, platform)
            entries[name] = Entry(image_config, image, platform=platform)
            task = asyncio.create_task(self._pull(name, platform))
            self._pulls.add(task)
            task.add_done_callback(self._pulls.discard)

    async def _pull(self, name: str, platform: str) -> None:
        entry = self.platforms[platform][name]
        source = entry.config.source
        log.info("%s: pulling %s%s", name, source, _for(platform))
        started, downloaded = time.perf_counter(), 0

        def progress(done: int, total: int | None) -> None:
            nonlocal downloaded
            downloaded = done

        try:
            image = await self.store.pull(name, source, progress, platform)
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
        if self.platforms[platform].get(name) is not entry:
            return  # a reload replaced this entry meanwhile
        changed = entry.image is None or entry.image.digest != image.digest
        entry.image, entry.state, entry.error = image, "ready", None
        log.info("%s: %s ready%s (%d layers, %.1f s)", name, image.digest[:19], _for(platform),
                 image.layers, image.seconds)  # fmt: skip
        if changed:
            news = {"image": name, "digest": image.digest, "platform": platform}
            self.feed.publish("", "image", news)

    def _observe(self, source: str, started: float, ok: bool, downloaded: int) -> None:
        if self.stats is not None:
            self.stats.observe("image", source, time.perf_counter() - started, ok, downloaded)

    def entry(self, name: str | None, platform: str = DEFAULT) -> Entry | None:
        return self.platforms.get(platform, {}).get(name or "")

    def current(self, name: str, platform: str = DEFAULT) -> Image:
        """The image a node of `platform` wanting `name` should run; ImageError says why
        there is none (a platform not yet wanted is pulled from now on)."""
        if name not in self._images:
            raise ImageError(f"{name}: not in the node file")
        self.want(platform)
        entry = self.platforms[platform][name]
        if entry.image is None:
            raise ImageError(entry.error or f"{name}: still pulling{_for(platform)}")
        return entry.image

    def digest(self, name: str | None, platform: str = DEFAULT) -> str | None:
        entry = self.entry(name, platform)
        return entry.image.digest if entry and entry.image else None

    def all_entries(self) -> list[Entry]:
        """Every image for every platform, amd64 first."""
        return [entry for entries in self.platforms.values() for entry in entries.values()]

    def spec(self, name: str, digest: str, base_url: str) -> ImageSpec | None:
        """What the agent is told to run."""
        entry = self.entries.get(name)
        made = self._specs.get((name, digest, base_url))
        if made is not None and made[0] is entry:
            return made[1]
        image = self.store.get(digest)
        if image is None or entry is None:
            return None
        squashfs = image.squashfs is not None
        fmt = "squashfs" if squashfs else "tar"
        spec = ImageSpec(
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
        self._specs[(name, digest, base_url)] = (entry, spec)
        return spec


def _for(platform: str) -> str:
    """' for linux/arm64/v8' in a log line; nothing for the default platform."""
    return "" if platform == DEFAULT else f" for {platform}"
