"""The [images.NAME] tables: the system images nodes may run, where each comes from and
how it is started."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from yarl import URL

from layerpy.config import values
from layerpy.config.reading import Reader
from layerpy.config.records import ImageConfig
from layerpy.images.registry import is_loopback
from layerpy.images.source import parse_source
from layerpy.proto.agent import MAX_FILES

IMAGE_KEYS = {
    "source",
    "insecure",
    "systemd",
    "command",
    "user",
    "password_file",
    "password_env",
    "credentials_to",
    "persist",
}


def read(r: Reader, data: dict[str, Any]) -> dict[str, ImageConfig]:
    """Each image by name; a path source is relative to the node file, like all paths."""
    images = {}
    for name, prefix, get in r.named_tables(data, "images", IMAGE_KEYS):
        insecure = get("insecure", bool, default=False)
        source = get("source", str, partial(parse_source, insecure=insecure), required=True)
        command = get("command", list, values.string_list)
        persist = get("persist", list, _persistent_paths, default=())
        password = r.password(get, prefix)
        if source is None:
            continue
        if source.kind != "registry" and insecure:
            r.problem(f"{prefix}.insecure", "applies to registry sources only")
        user = get("user", str)
        registry_host = URL(f"http://{source.location.partition('/')[0]}").host
        if (user or password) and insecure and not is_loopback(registry_host):
            r.problem(
                f"{prefix}.insecure",
                "credentials go only over TLS (or loopback): drop insecure, or the user and "
                "password",
            )
        if user or password:
            credentials_to = get("credentials_to", list, values.string_list, default=())
            source = replace(source, user=user, password=password, credentials_to=credentials_to)
        if source.kind != "registry":
            source = replace(source, location=str(r.path(source.location)))
        systemd = get("systemd", bool, default=False)
        images[name] = ImageConfig(name, source, systemd, command, persist or ())
    kept = [(name, path) for name, image in images.items() for path in image.persist]
    for outer_image, outer in kept:
        for image, inner in kept:
            if inner.startswith(outer + "/"):
                r.problem(f"images.{image}.persist", f"{inner} is inside {outer}, which image "
                          f"{outer_image} keeps: a node keeps one store for all its images; "
                          "name the outer one only")  # fmt: skip
    return images


def _persistent_paths(value: list[Any]) -> tuple[str, ...]:
    """Directories the node keeps across image changes (none inside another: checked
    across all images, whose nodes share one store)."""
    paths = tuple(values.image_path(path) for path in values.string_list(value))
    if len(paths) > MAX_FILES:
        raise ValueError(f"names more than {MAX_FILES} paths")
    if len(set(paths)) != len(paths):
        raise ValueError("names a path twice")
    return paths
