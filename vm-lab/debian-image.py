#!/usr/bin/env python3
"""A minimal Debian bookworm system image with systemd, as an OCI layout.

    .venv/bin/python vm-lab/debian-image.py OUT_DIR [--measure] [--force]

mmdebstrap (through apt's configured Debian mirror, the only network use) builds the root:
the Essential:yes packages plus systemd, systemd-sysv, dbus and busybox, without man pages,
docs, locales or apt's lists. A customize hook adds /etc/image-release (naming the recipe),
``layerpy-marker.service`` (enabled: prints ``SYSTEMD-IMAGE-MARKER`` with what runs as PID 1
on /dev/console when started and when stopped), masks the console gettys (the minOS owns
the console) and systemd-firstboot, and leaves machine-id and hostname to boot time.

The root becomes a one-layer OCI image (tests/oci.py's Layout, gzip) tagged ``bookworm``,
with Cmd /sbin/init and StopSignal SIGRTMIN+3; run it with ``systemd = true``:

    [images.debian]
    source = "oci-layout:OUT_DIR:bookworm"
    systemd = true

Both the mmdebstrap tar and the layout are cached in /var/cache/layerpy/debian-image/<key>,
the key being a hash of the recipe (suite, variant, packages, options, hook), so a rerun
copies the layout in well under a second; ``--force`` builds again (new package versions).
``--measure`` pulls the layout through layerpy's ImageStore (flatten + squashfs), as
``layerpy serve`` does, and prints the time and sizes. Needs root and mmdebstrap.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from oci import Layout  # noqa: E402

CACHE = Path(os.environ.get("LAYERPY_CACHE", "/var/cache/layerpy")) / "debian-image"
NAME = "layerpy-debian-systemd"
TAG = "bookworm"
MARKER = "SYSTEMD-IMAGE-MARKER"
SUITE = "bookworm"
VARIANT = "essential"  # Essential:yes only (no apt): the includes bring the rest
PACKAGES = ("systemd", "systemd-sysv", "dbus", "busybox")
# merged /usr as debootstrap does it: without it init-system-helpers pulls usrmerge and
# with it perl (~50 MB)
HOOK_DIRS = ("/usr/share/mmdebstrap/hooks/merged-usr",)
EXCLUDES = ("/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*", "/usr/share/info/*",
            "/usr/share/lintian/*")  # fmt: skip
EPOCH = 1704067200  # SOURCE_DATE_EPOCH: same packages, same bytes

MARKER_SCRIPT = f"""#!/bin/sh
# layerpy-marker.service: shows on the console that systemd runs this image
. /etc/image-release
echo "{MARKER} $1 pid1=$(cat /proc/1/comm) image=$NAME recipe=$RECIPE" >/dev/console
"""

MARKER_UNIT = """[Unit]
Description=layerpy marker (this image runs under systemd)
After=basic.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/layerpy-marker started
ExecStop=/usr/local/sbin/layerpy-marker stopping

[Install]
WantedBy=multi-user.target
"""

# Runs on the build host with the new root in $1 (mmdebstrap's root mode); the recipe key
# comes in as $LAYERPY_RECIPE from the environment.
HOOK = r"""set -eu
r=$1
printf 'NAME=%s\nSUITE=%s\nRECIPE=%s\n' "$LAYERPY_NAME" "$LAYERPY_SUITE" "$LAYERPY_RECIPE" \
    >"$r/etc/image-release"
mkdir -p "$r/usr/local/sbin" "$r/etc/systemd/system/multi-user.target.wants"
printf '%s' "$LAYERPY_MARKER_SCRIPT" >"$r/usr/local/sbin/layerpy-marker"
chmod 0755 "$r/usr/local/sbin/layerpy-marker"
printf '%s' "$LAYERPY_MARKER_UNIT" >"$r/etc/systemd/system/layerpy-marker.service"
ln -sf ../layerpy-marker.service "$r/etc/systemd/system/multi-user.target.wants/"
# The minOS keeps its shell on the console; a node image logs in over the network.
for unit in console-getty.service getty@.service serial-getty@.service \
        systemd-firstboot.service; do
    ln -sf /dev/null "$r/etc/systemd/system/$unit"
done
: >"$r/etc/machine-id"  # empty: systemd makes a new one each boot, no first-boot units
rm -f "$r/etc/hostname"  # keep the name the runner gives the container
rm -rf "$r/var/lib/apt/lists"/* "$r/var/cache/apt"/*.bin "$r/var/log"/*.log
# A stateless node keeps its journal in /run; this directory also carries POSIX ACLs,
# which squashfs cannot store (tar2sqfs refuses system.posix_acl_* xattrs).
rm -rf "$r/var/log/journal"
"""


def recipe() -> dict:
    return {"suite": SUITE, "variant": VARIANT, "packages": PACKAGES, "hook_dirs": HOOK_DIRS,
            "excludes": EXCLUDES, "epoch": EPOCH, "hook": HOOK, "script": MARKER_SCRIPT,
            "unit": MARKER_UNIT, "name": NAME, "tag": TAG}  # fmt: skip


def recipe_key() -> str:
    return hashlib.sha256(json.dumps(recipe(), sort_keys=True).encode()).hexdigest()[:16]


def log(msg: str) -> None:
    print(f"debian-image: {msg}", file=sys.stderr, flush=True)


def mmdebstrap(tar: Path, key: str) -> None:
    """The root as a tar, from Debian packages through apt's configured mirror."""
    if not shutil.which("mmdebstrap"):
        sys.exit("debian-image: needs mmdebstrap (apt-get install mmdebstrap)")
    cmd = ["mmdebstrap", "--quiet", "--mode=root", f"--variant={VARIANT}"]
    cmd += [f"--hook-dir={d}" for d in HOOK_DIRS]
    cmd += [f"--include={','.join(PACKAGES)}"]
    cmd += [f"--dpkgopt=path-exclude={pattern}" for pattern in EXCLUDES]
    cmd += [f"--customize-hook={HOOK}", "--format=tar", SUITE, str(tar)]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH), "LAYERPY_NAME": NAME,
           "LAYERPY_SUITE": SUITE, "LAYERPY_RECIPE": key,
           "LAYERPY_MARKER_SCRIPT": MARKER_SCRIPT, "LAYERPY_MARKER_UNIT": MARKER_UNIT}  # fmt: skip
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"debian-image: mmdebstrap failed:\n{done.stdout.decode(errors='replace')}")


def layout(tar: Path, dest: Path, key: str) -> None:
    config = {
        "Cmd": ["/sbin/init"],
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "StopSignal": "SIGRTMIN+3",
        "Labels": {"org.opencontainers.image.title": NAME, "org.layerpy.recipe": key},
    }
    out = Layout(dest)
    out.tag(TAG, out.image([tar.read_bytes()], config))


def build(out_dir: Path, force: bool = False) -> dict:
    """The cached (or new) layout, copied to `out_dir`; returns what it did and took."""
    key = recipe_key()
    cache = CACHE / key
    tar, cached = cache / "rootfs.tar", cache / "layout"
    facts: dict = {"key": key, "cache": str(cache)}
    if force:
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not tar.exists():
        log(f"mmdebstrap {SUITE} {VARIANT} + {','.join(PACKAGES)} (recipe {key})")
        started = time.monotonic()
        part = tar.with_suffix(".part")
        mmdebstrap(part, key)
        part.rename(tar)
        facts["mmdebstrap_s"] = round(time.monotonic() - started, 1)
    if not cached.exists():
        started = time.monotonic()
        part = cache / "layout.part"
        shutil.rmtree(part, ignore_errors=True)
        layout(tar, part, key)
        part.rename(cached)
        facts["layout_s"] = round(time.monotonic() - started, 1)
    shutil.rmtree(out_dir, ignore_errors=True)
    try:  # hard links when on the same filesystem: blobs are content-addressed, never edited
        shutil.copytree(cached, out_dir, copy_function=os.link)
    except OSError:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.copytree(cached, out_dir)
    blobs = list((out_dir / "blobs" / "sha256").iterdir())
    facts.update(
        layout=str(out_dir),
        source=f"oci-layout:{out_dir}:{TAG}",
        rootfs_tar_mb=round(tar.stat().st_size / 1e6, 1),
        layout_mb=round(sum(b.stat().st_size for b in blobs) / 1e6, 1),
    )
    return facts


def measure(out_dir: Path) -> dict:
    """Pull + flatten + squashfs through layerpy's ImageStore, from a fresh store."""
    from layerpy.images import ImageStore, parse_source

    with tempfile.TemporaryDirectory() as tmp:
        store = ImageStore(Path(tmp))
        started = time.monotonic()
        image = asyncio.run(store.pull("debian", parse_source(f"oci-layout:{out_dir}:{TAG}")))
        took = time.monotonic() - started
    return {
        "digest": image.digest,
        "pull_s": round(took, 1),
        "flat_tar_mb": round(image.rootfs_size / 1e6, 1),
        "squashfs_mb": round(image.squashfs_size / 1e6, 1) if image.squashfs_size else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where the OCI layout goes (replaced)")
    parser.add_argument("--force", action="store_true", help="ignore the cache")
    parser.add_argument("--measure", action="store_true", help="pull it through layerpy")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("debian-image: run as root (mmdebstrap --mode=root)")
    started = time.monotonic()
    facts = build(args.out_dir.resolve(), args.force)
    facts["build_s"] = round(time.monotonic() - started, 1)
    if args.measure:
        facts.update(measure(args.out_dir.resolve()))
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
