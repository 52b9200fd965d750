#!/usr/bin/env python3
"""Minimal Debian bookworm system images with systemd, as OCI layouts.

    .venv/bin/python vm-lab/debian-image.py OUT_DIR [--flavour systemd|slurm] [--measure] [--force]

mmdebstrap (through apt's configured Debian mirror, the only network use) builds the root:
the Essential:yes packages plus systemd, systemd-sysv, dbus and busybox (and, for a flavour,
its own packages; never their Recommends), without man pages, docs, locales or apt's lists.
A customize hook adds /etc/image-release (naming the recipe), ``layerpy-marker.service``
(enabled: prints ``SYSTEMD-IMAGE-MARKER`` with what runs as PID 1 on /dev/console when
started and when stopped), masks the console gettys (the minOS owns the console) and
systemd-firstboot, and leaves machine-id and hostname to boot time.

Flavour ``systemd`` (the default) is that root as a one-layer OCI image (tests/oci.py's
Layout, gzip) tagged ``bookworm``, with Cmd /sbin/init and StopSignal SIGRTMIN+3; run it
with ``systemd = true``:

    [images.debian]
    source = "oci-layout:OUT_DIR:bookworm"
    systemd = true

Flavour ``slurm`` (image ``layerpy-slurm``) adds slurmd and munge, both enabled, but no
/etc/slurm/slurm.conf and no /etc/munge/munge.key: layerpy delivers them (vm-lab/slurm/)
before the container starts, and each unit waits for its file (ConditionPathExists); a
drop-in hands the key to the munge user first, so it may arrive owned by root.
``/usr/local/sbin/layerpy-busy on|off`` (slurm.conf's Prolog and Epilog, which pass no
argument: then it goes by $SLURM_SCRIPT_CONTEXT) creates and removes /run/layerpy/busy,
the file the agent reports the node busy by. One layout holds two tags: ``v1``, and ``v2``
= v1's layer plus a small one setting VERSION=v2 in /etc/image-release: two digests
sharing the big layer, for a rolling update.

Both the mmdebstrap tar and the layout are cached in /var/cache/layerpy/debian-image/<key>,
the key being a hash of the flavour's recipe (suite, variant, packages, options, hooks), so
a rerun copies the layout in well under a second; ``--force`` builds again (new package
versions). ``--measure`` pulls each tag through layerpy's ImageStore (flatten + squashfs),
as ``layerpy serve`` does, and prints the time and sizes. Needs root and mmdebstrap.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from oci import CONFIG, LAYER, MANIFEST, Layout, file, image_config, tar_bytes  # noqa: E402

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

# --- the slurm flavour ---------------------------------------------------------------------

SLURM_NAME = "layerpy-slurm"
SLURM_TAGS = ("v1", "v2")
LAYERS_VERSION = 1  # of slurm_layout(): bump to rebuild cached layouts
SLURM_PACKAGES = ("slurmd", "munge")  # slurmd brings slurm-wlm-basic-plugins; no slurmctld

BUSY_SCRIPT = """#!/bin/sh
# layerpy-busy on|off: the node is busy while /run/layerpy/busy exists (the layerpy agent
# reports it, and a rolling update waits for it to go). /run/layerpy is bind-mounted from
# the minOS. slurm.conf runs it as Prolog (PrologFlags=Alloc: on every node of a job, at
# allocation) and Epilog, which pass no argument: then $SLURM_SCRIPT_CONTEXT tells.
# It never fails: a failing prolog would drain the node.
case "${1:-${SLURM_SCRIPT_CONTEXT:-}}" in
on | prolog_slurmd)
    mkdir -p /run/layerpy && echo "${SLURM_JOB_ID:-manual}" >/run/layerpy/busy ;;
off | epilog_slurmd)
    rm -f /run/layerpy/busy ;;
*)
    echo "usage: layerpy-busy on|off" >&2 ;;
esac
exit 0
"""

# layerpy may deliver the key owned by root: munged wants it its own, and not readable by
# anyone else ("+": as root, whatever User= says; "-": a read-only key is munged's to judge)
MUNGE_DROPIN = """[Unit]
ConditionPathExists=/etc/munge/munge.key

[Service]
ExecStartPre=-+/bin/chown munge:munge /etc/munge/munge.key
ExecStartPre=-+/bin/chmod 0400 /etc/munge/munge.key
"""

SLURM_HOOK = r"""set -eu
r=$1
echo "VERSION=v1" >>"$r/etc/image-release"
printf '%s' "$LAYERPY_BUSY_SCRIPT" >"$r/usr/local/sbin/layerpy-busy"
chmod 0755 "$r/usr/local/sbin/layerpy-busy"
mkdir -p "$r/etc/systemd/system/munge.service.d"
printf '%s' "$LAYERPY_MUNGE_DROPIN" >"$r/etc/systemd/system/munge.service.d/layerpy.conf"
# layerpy delivers both before the container starts (munge's postinst made a key: no)
rm -f "$r/etc/munge/munge.key" "$r/etc/slurm/slurm.conf"
mkdir -p "$r/var/spool/slurmd"
systemctl --root="$r" --quiet enable munge.service slurmd.service
rm -rf "$r/var/log"/*.log "$r/var/cache/debconf"/*-old
# without libpmix (not installed), slurmd logs an error loading these at each start
rm -f "$r/usr/lib/x86_64-linux-gnu/slurm-wlm"/mpi_pmix*.so
"""


@dataclass(frozen=True)
class Flavour:
    """What one flavour adds to the base recipe."""

    name: str
    tags: tuple[str, ...]
    packages: tuple[str, ...] = PACKAGES
    hook: str = ""  # run after HOOK
    env: dict[str, str] = field(default_factory=dict)  # for the hook

    @property
    def hooks(self) -> list[str]:
        return [HOOK, self.hook] if self.hook else [HOOK]


FLAVOURS = {
    "systemd": Flavour(NAME, (TAG,)),
    "slurm": Flavour(
        SLURM_NAME,
        SLURM_TAGS,
        PACKAGES + SLURM_PACKAGES,
        SLURM_HOOK,
        {"LAYERPY_BUSY_SCRIPT": BUSY_SCRIPT, "LAYERPY_MUNGE_DROPIN": MUNGE_DROPIN},
    ),
}


def recipe(flavour: Flavour = FLAVOURS["systemd"]) -> dict:
    found = {"suite": SUITE, "variant": VARIANT, "packages": flavour.packages,
             "hook_dirs": HOOK_DIRS, "excludes": EXCLUDES, "epoch": EPOCH, "hook": HOOK,
             "script": MARKER_SCRIPT, "unit": MARKER_UNIT, "name": flavour.name,
             "tag": flavour.tags[0]}  # fmt: skip
    if flavour.hook:  # the systemd flavour's key (and cache) stay what they were
        found |= {"flavour_hook": flavour.hook, "flavour_env": flavour.env,
                  "tags": flavour.tags, "layers": LAYERS_VERSION}  # fmt: skip
    return found


def recipe_key(flavour: Flavour = FLAVOURS["systemd"]) -> str:
    return hashlib.sha256(json.dumps(recipe(flavour), sort_keys=True).encode()).hexdigest()[:16]


def log(msg: str) -> None:
    print(f"debian-image: {msg}", file=sys.stderr, flush=True)


def mmdebstrap(tar: Path, key: str, flavour: Flavour = FLAVOURS["systemd"]) -> None:
    """The root as a tar, from Debian packages through apt's configured mirror."""
    if not shutil.which("mmdebstrap"):
        sys.exit("debian-image: needs mmdebstrap (apt-get install mmdebstrap)")
    cmd = ["mmdebstrap", "--quiet", "--mode=root", f"--variant={VARIANT}"]
    cmd += [f"--hook-dir={d}" for d in HOOK_DIRS]
    cmd += [f"--include={','.join(flavour.packages)}"]
    cmd += [f"--dpkgopt=path-exclude={pattern}" for pattern in EXCLUDES]
    cmd += [f"--customize-hook={hook}" for hook in flavour.hooks]
    cmd += ["--format=tar", SUITE, str(tar)]
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(EPOCH), "LAYERPY_NAME": flavour.name,
           "LAYERPY_SUITE": SUITE, "LAYERPY_RECIPE": key,
           "LAYERPY_MARKER_SCRIPT": MARKER_SCRIPT, "LAYERPY_MARKER_UNIT": MARKER_UNIT,
           **flavour.env}  # fmt: skip
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"debian-image: mmdebstrap failed:\n{done.stdout.decode(errors='replace')}")


def image_config_object(flavour: Flavour, key: str, tag: str) -> dict:
    labels = {"org.opencontainers.image.title": flavour.name, "org.layerpy.recipe": key}
    if flavour.hook:
        labels["org.opencontainers.image.version"] = tag
    return {
        "Cmd": ["/sbin/init"],
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "StopSignal": "SIGRTMIN+3",
        "Labels": labels,
    }


def layout(tar: Path, dest: Path, key: str, flavour: Flavour = FLAVOURS["systemd"]) -> None:
    if flavour.hook:
        slurm_layout(tar, dest, key, flavour)
        return
    out = Layout(dest)
    out.tag(TAG, out.image([tar.read_bytes()], image_config_object(flavour, key, TAG)))


def release_of(tar: Path) -> str:
    """/etc/image-release as the mmdebstrap tar has it."""
    with tarfile.open(tar) as rootfs:
        member = rootfs.extractfile("./etc/image-release")
        assert member is not None
        return member.read().decode()


def slurm_layout(tar: Path, dest: Path, key: str, flavour: Flavour) -> None:
    """Tags v1 (the root, one layer) and v2 (the same layer blob plus a small one that sets
    VERSION=v2 in /etc/image-release) in one layout, the big layer gzipped once."""
    out = Layout(dest)
    root = tar.read_bytes()
    top = tar_bytes(
        [file("etc/image-release", release_of(tar).replace("VERSION=v1", "VERSION=v2"))]
    )
    root_blob = out.blob(LAYER + "+gzip", gzip.compress(root, compresslevel=6, mtime=0))
    top_blob = out.blob(LAYER + "+gzip", gzip.compress(top, compresslevel=9, mtime=0))
    for tag, layers, blobs in (
        ("v1", [root], [root_blob]),
        ("v2", [root, top], [root_blob, top_blob]),
    ):
        config = image_config(layers, image_config_object(flavour, key, tag))
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST,
                    "config": out.blob(CONFIG, config), "layers": blobs}  # fmt: skip
        data = json.dumps(manifest, sort_keys=True).encode()
        out.tag(tag, out.blob(MANIFEST, data, platform={"architecture": "amd64", "os": "linux"}))


def build(out_dir: Path, force: bool = False, flavour: str = "systemd") -> dict:
    """The cached (or new) layout, copied to `out_dir`; returns what it did and took."""
    chosen = FLAVOURS[flavour]
    key = recipe_key(chosen)
    cache = CACHE / key
    tar, cached = cache / "rootfs.tar", cache / "layout"
    facts: dict = {"flavour": flavour, "key": key, "cache": str(cache)}
    if force:
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not tar.exists():
        log(f"mmdebstrap {SUITE} {VARIANT} + {','.join(chosen.packages)} (recipe {key})")
        started = time.monotonic()
        part = tar.with_suffix(".part")
        mmdebstrap(part, key, chosen)
        part.rename(tar)
        facts["mmdebstrap_s"] = round(time.monotonic() - started, 1)
    if not cached.exists():
        started = time.monotonic()
        part = cache / "layout.part"
        shutil.rmtree(part, ignore_errors=True)
        layout(tar, part, key, chosen)
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
        source=f"oci-layout:{out_dir}:{chosen.tags[0]}",
        rootfs_tar_mb=round(tar.stat().st_size / 1e6, 1),
        layout_mb=round(sum(b.stat().st_size for b in blobs) / 1e6, 1),
    )
    if len(chosen.tags) > 1:
        index = json.loads((out_dir / "index.json").read_text())
        facts["tags"] = {
            m["annotations"]["org.opencontainers.image.ref.name"]: m["digest"]
            for m in index["manifests"]
        }
        facts["sources"] = [f"oci-layout:{out_dir}:{tag}" for tag in chosen.tags]
    return facts


def measure(out_dir: Path, tag: str = TAG) -> dict:
    """Pull + flatten + squashfs through layerpy's ImageStore, from a fresh store."""
    from layerpy.images import ImageStore, parse_source

    with tempfile.TemporaryDirectory() as tmp:
        store = ImageStore(Path(tmp))
        started = time.monotonic()
        image = asyncio.run(store.pull("debian", parse_source(f"oci-layout:{out_dir}:{tag}")))
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
    parser.add_argument("--flavour", choices=sorted(FLAVOURS), default="systemd")
    parser.add_argument("--force", action="store_true", help="ignore the cache")
    parser.add_argument("--measure", action="store_true", help="pull it through layerpy")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("debian-image: run as root (mmdebstrap --mode=root)")
    started = time.monotonic()
    facts = build(args.out_dir.resolve(), args.force, args.flavour)
    facts["build_s"] = round(time.monotonic() - started, 1)
    if args.measure:
        tags = FLAVOURS[args.flavour].tags
        if len(tags) == 1:
            facts.update(measure(args.out_dir.resolve(), tags[0]))
        else:
            facts["measure"] = {tag: measure(args.out_dir.resolve(), tag) for tag in tags}
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
