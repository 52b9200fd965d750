"""System images: pulled from a registry, an OCI layout or a docker archive, verified by
digest, flattened into one root filesystem tar (and squashfs), cached by manifest digest."""

from layerpy.images.source import ImageError, ImageSource, parse_source
from layerpy.images.store import Image, ImageStore

__all__ = ["Image", "ImageError", "ImageSource", "ImageStore", "parse_source"]
