"""Image pull + flatten: layerpy's image store, and its flattener against `umoci raw
unpack` (the reference: decompress and apply the same layers, to a directory), on the same
images in one run.

Images: the e2e busybox image (2 layers); a 3-layer image of ~6000 small files with
whiteouts, an opaque directory and hard links; with --debian also a Debian bookworm
minbase root (mmdebstrap, cached in ~/.cache/layerpy-bench) as a one-layer image. Each is
pulled into a fresh store from its OCI layout and, when docker-registry and skopeo are
installed, from a registry on 127.0.0.1 (never anything else). "pull" is the whole of
ImageStore.pull (copy + verify blobs, flatten, tar2sqfs); "flatten" is the flattener alone.
Run as root, so umoci keeps owners too: `.venv/bin/python bench/images.py [--debian] [RUNS]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from layerpy.images import ImageStore, parse_source  # noqa: E402
from layerpy.images.flatten import flatten  # noqa: E402

from oci import (  # noqa: E402
    Layout,
    Registry,
    build_image,
    directory,
    file,
    hardlink,
    opaque,
    push,
    whiteout,
)

CACHE = Path.home() / ".cache" / "layerpy-bench"


def many_files(path: Path) -> Path:
    """3 layers: 4000 files, then deletions, an opaque directory, rewrites and hard links,
    then 2000 more files."""
    lower = [directory(f"d{d:02}") for d in range(40)] + [
        file(f"d{i % 40:02}/f{i:05}", f"file {i}\n" * (i % 50 + 1)) for i in range(4000)
    ]
    middle = [whiteout(f"d{i % 40:02}/f{i:05}") for i in range(0, 4000, 4)]
    middle += [opaque("d07"), *(file(f"d{i % 40:02}/f{i:05}", "new\n") for i in range(1, 4000, 8))]
    middle += [
        hardlink(f"d{i % 40:02}/h{i:05}", f"d{i % 40:02}/f{i:05}") for i in range(2, 4000, 8)
    ]
    upper = [directory("more")] + [file(f"more/g{i:05}", f"more {i}\n") for i in range(2000)]
    layout = Layout(path)
    layout.tag("latest", layout.image([lower, middle, upper], {"Cmd": ["/bin/sh"]}))
    return path


def debian(path: Path) -> Path:
    """Debian bookworm minbase from mmdebstrap (through apt's Debian mirror), one layer."""
    CACHE.mkdir(parents=True, exist_ok=True)
    tar = CACHE / "debian-bookworm-minbase.tar"
    if not tar.exists():
        if not shutil.which("mmdebstrap"):
            sys.exit("--debian needs mmdebstrap (apt-get install mmdebstrap)")
        part = tar.with_suffix(".part")
        subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=minbase", "--format=tar", "bookworm", str(part)],
            check=True,
        )
        part.rename(tar)
    cached = CACHE / "debian-layout"
    if not cached.exists():
        layout = Layout(cached.with_suffix(".part"))
        layout.tag("latest", layout.image([tar.read_bytes()], {"Cmd": ["/bin/bash"]}))
        layout.path.rename(cached)
    shutil.copytree(cached, path)
    return path


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def median(runs: int, action: Callable[[Path], object], scratch: Path) -> float:
    """The median wall time of `action(fresh directory)` over `runs` runs."""
    times = []
    for _ in range(runs):
        work = Path(tempfile.mkdtemp(dir=scratch))
        times.append(timed(lambda work=work: action(work)))
        shutil.rmtree(work)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="?", type=int, default=3)
    parser.add_argument("--debian", action="store_true", help="add a Debian minbase image")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        images = {
            "busybox (e2e A)": build_image(scratch / "a", "a", "IMAGE-A-MARKER"),
            "6k files, 3 layers": many_files(scratch / "many"),
        }
        if args.debian:
            images["debian minbase"] = debian(scratch / "debian")
        registry = None
        if shutil.which("docker-registry") and shutil.which("skopeo"):
            registry = Registry(scratch / "registry")
        try:
            rows = [
                measure(name, layout, registry, args.runs, scratch)
                for name, layout in images.items()
            ]
        finally:
            if registry:
                registry.close()
    header = ("image", "layers", "blobs MB", "tar MB", "sqfs MB", "pull layout s",
              "pull registry s", "flatten s", "umoci s", "umoci/flatten")  # fmt: skip
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"\nmedian of {args.runs} runs; umoci = `umoci raw unpack` of the same OCI layout")


def measure(name: str, layout: Path, registry: Registry | None, runs: int, scratch: Path) -> tuple:
    store = ImageStore(scratch / "store")
    image = asyncio.run(store.pull(name, parse_source(f"oci-layout:{layout}")))
    manifest = json.loads((layout / "blobs" / "sha256" / image.digest[7:]).read_bytes())
    layers = [store.root / "blobs" / "sha256" / d["digest"][7:] for d in manifest["layers"]]
    blob_mb = sum(d["size"] for d in [manifest["config"], *manifest["layers"]]) / 1e6

    def pull_layout(work: Path) -> None:
        asyncio.run(ImageStore(work).pull(name, parse_source(f"oci-layout:{layout}")))

    pull_registry = "-"
    if registry:
        repo = "bench/" + layout.name
        push(layout, registry.address, repo, "1")
        source = parse_source(f"registry://{registry.address}/{repo}:1", insecure=True)
        seconds = median(
            runs, lambda work: asyncio.run(ImageStore(work).pull(name, source)), scratch
        )
        pull_registry = f"{seconds:.2f}"
    ours = median(runs, lambda work: flatten(layers, work / "rootfs.tar", work), scratch)
    umoci = median(
        runs,
        lambda work: subprocess.run(
            ["umoci", "raw", "unpack", "--image", f"{layout}:latest", str(work / "rootfs")],
            check=True,
            capture_output=True,
        ),
        scratch,
    )
    return (
        name,
        str(image.layers),
        f"{blob_mb:.1f}",
        f"{image.rootfs_size / 1e6:.1f}",
        f"{image.squashfs_size / 1e6:.1f}" if image.squashfs_size else "-",
        f"{median(runs, pull_layout, scratch):.2f}",
        pull_registry,
        f"{ours:.2f}",
        f"{umoci:.2f}",
        f"{umoci / ours:.1f}x",
    )


if __name__ == "__main__":
    main()
