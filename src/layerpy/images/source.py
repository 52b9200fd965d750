"""Where a system image comes from: the source syntax of the node file, and the interface
every source (registry, OCI layout, docker archive) offers the store."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST, *INDEX_TYPES)

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(  # a name or an address, with an optional port
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*|\[[0-9a-fA-F:.]+\])"
    r"(?::[0-9]{1,5})?"
)
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPO = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG = re.compile(r"\w[\w.-]{0,127}")
_SYNTAX = (
    "registry://HOST[:PORT]/REPO[:TAG|@sha256:…], oci-layout:DIR[:REF]"
    " or docker-archive:FILE[:REPO:TAG]"
)


class ImageError(Exception):
    """A pull that failed; the message is for the user and names the image and the cause."""


@dataclass(frozen=True)
class ImageSource:
    kind: str  # "registry" | "oci-layout" | "docker-archive"
    location: str  # "host[:port]/repo/name", a layout directory or an archive file
    reference: str  # tag, ref name, "repo:tag" in an archive, or "sha256:…"; "" = the only/first
    insecure: bool = False  # plain HTTP, for a local registry
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    credentials_to: tuple[str, ...] = ()  # other hosts the credentials may go to (token services)

    def __str__(self) -> str:
        """The source as the node file spells it (without credentials)."""
        if self.kind == "registry":
            mark = "@" if is_digest(self.reference) else ":"
            return f"registry://{self.location}{mark}{self.reference}"
        return f"{self.kind}:{self.location}" + (f":{self.reference}" if self.reference else "")


def is_digest(text: str) -> bool:
    return DIGEST.fullmatch(text) is not None


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def load_json(data: bytes, where: str, what: str, shape: type = dict) -> Any:
    """Parses metadata that must be a JSON object (or array): anything else is an ImageError."""
    try:
        value = json.loads(data)
    except ValueError as error:
        raise ImageError(f"{where}: {what} is not JSON ({error})") from None
    if not isinstance(value, shape):
        raise ImageError(f"{where}: {what} is not a JSON {'object' if shape is dict else 'array'}")
    return value


def objects(value: object) -> list[dict]:
    """The objects in a JSON array (nothing if it is not one)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def parse_source(text: str, *, insecure: bool = False) -> ImageSource:
    """Parses a node file's image source. Local paths end at their first colon, as in
    skopeo's `oci:` and `docker-archive:` transports."""
    kind, sep, rest = text.partition(":")
    if kind == "registry" and rest.startswith("//"):
        return _parse_registry(text, rest[2:], insecure)
    if kind in ("oci-layout", "docker-archive") and sep:
        path, _, reference = rest.partition(":")
        good = _TAG.fullmatch(reference) or is_digest(reference) or not reference
        if kind == "docker-archive" and reference:
            name, _, tag = reference.rpartition(":")
            good = bool(name and _TAG.fullmatch(tag))
        if path and good:
            return ImageSource(kind, path, reference)
    raise ValueError(f"image source {text!r}: expected {_SYNTAX}")


def _parse_registry(text: str, rest: str, insecure: bool) -> ImageSource:
    host, _, path = rest.partition("/")
    if "@" in path:
        repo, _, reference = path.partition("@")
        good = is_digest(reference)
    else:
        repo, colon, reference = path.partition(":")
        reference = reference if colon else "latest"
        good = _TAG.fullmatch(reference) is not None
    if not _HOST.fullmatch(host):
        raise ValueError(f"image source {text!r}: bad registry host {host!r}")
    if not _REPO.fullmatch(repo):
        raise ValueError(
            f"image source {text!r}: bad repository name {repo!r} (lowercase a-z0-9._-/)"
        )
    if not good:
        raise ValueError(f"image source {text!r}: bad tag or digest {reference!r}")
    return ImageSource("registry", f"{host}/{repo}", reference, insecure=insecure)


class Fetcher(Protocol):
    """What the store needs from a source: manifests by tag or digest, blobs by digest.
    The store verifies everything it gets."""

    where: str  # "registry 127.0.0.1:5000", "oci-layout /srv/img": starts error messages

    async def manifest(self, reference: str) -> bytes: ...

    def blob(self, digest: str, size: int) -> AsyncIterator[bytes]: ...

    async def close(self) -> None: ...
