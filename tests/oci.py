"""Builds small layered OCI images in plain Python (tarfile + json), for the image tests,
the e2e lab and the benchmark, and pushes them to a registry with skopeo.

Everything is reproducible (fixed mtimes, gzip without timestamps), so the same call gives
the same digests, and two images built on the same base share its layer blob.

    layout = build_image(tmp / "a", "a", "IMAGE-A-MARKER", {"srv/data.txt": "hello"})
    push(layout, "127.0.0.1:5000", "lab/a", "1")
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static: runs with no libraries
APPLETS = ("sh", "cat", "echo", "sleep", "httpd")
MTIME = 1_700_000_000
REF = "org.opencontainers.image.ref.name"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass
class Entry:
    """One tar member of a layer, with its contents."""

    info: tarfile.TarInfo
    data: bytes = b""


Layer = list[Entry]


def _entry(name: str, kind: bytes, mode: int, uid: int = 0, gid: int = 0, **fields) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid, info.mtime = kind, mode, uid, gid, MTIME
    for key, value in fields.items():
        setattr(info, key, value)
    return Entry(info)


def file(name: str, data: bytes | str, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Entry:
    data = data.encode() if isinstance(data, str) else data
    entry = _entry(name, tarfile.REGTYPE, mode, uid, gid, size=len(data))
    entry.data = data
    return entry


def directory(name: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    return _entry(name, tarfile.DIRTYPE, mode, uid, gid)


def symlink(name: str, target: str) -> Entry:
    return _entry(name, tarfile.SYMTYPE, 0o777, linkname=target)


def hardlink(name: str, target: str) -> Entry:
    return _entry(name, tarfile.LNKTYPE, 0o644, linkname=target)


def device(name: str, major: int, minor: int, mode: int = 0o666) -> Entry:
    return _entry(name, tarfile.CHRTYPE, mode, devmajor=major, devminor=minor)


def fifo(name: str, mode: int = 0o600) -> Entry:
    return _entry(name, tarfile.FIFOTYPE, mode)


def whiteout(path: str) -> Entry:
    """Deletes `path` (a file or a whole directory) from the layers below."""
    parent, _, base = path.rpartition("/")
    return file(f"{parent}/.wh.{base}" if parent else f".wh.{base}", b"")


def opaque(path: str) -> Entry:
    """Hides everything the layers below put in directory `path`."""
    return file(f"{path}/.wh..wh..opq", b"")


def tar_bytes(entries: Layer) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            tar.addfile(entry.info, io.BytesIO(entry.data) if entry.data else None)
    return out.getvalue()


def busybox_layer(busybox: Path = BUSYBOX, applets: tuple[str, ...] = APPLETS) -> Layer:
    """A root filesystem of busybox-static (this machine's, or another architecture's
    binary) and a few applet symlinks."""
    return [
        directory("bin"),
        file("bin/busybox", busybox.read_bytes(), 0o755),
        *(symlink(f"bin/{applet}", "busybox") for applet in applets),
        directory("etc"),
        file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"),
        directory("root", 0o700),
        directory("srv"),
        directory("tmp", 0o1777),
    ]


def descriptor(media_type: str, data: bytes, **extra) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return {"mediaType": media_type, "digest": digest, "size": len(data), **extra}


def image_config(layers: list[bytes], config: dict | None = None, arch: str = "amd64") -> bytes:
    """The image config: `config` is its "config" object (Cmd, Env, ...); `layers` are the
    uncompressed layer tars, whose digests are the diff_ids."""
    diff_ids = ["sha256:" + hashlib.sha256(layer).hexdigest() for layer in layers]
    document = {
        "architecture": arch,
        "os": "linux",
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    return json.dumps(document, sort_keys=True).encode()


class Layout:
    """An OCI image layout directory (index.json + blobs/sha256/...) being written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        (path / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.manifests: list[dict] = []
        self._write_index()

    def blob(self, media_type: str, data: bytes, **extra) -> dict:
        found = descriptor(media_type, data, **extra)
        (self.path / "blobs" / "sha256" / found["digest"][7:]).write_bytes(data)
        return found

    def image(
        self,
        layers: list[Layer | bytes],
        config: dict | None = None,
        arch: str = "amd64",
        compress: str | None = "gzip",
        variant: str | None = None,
    ) -> dict:
        """Writes an image's blobs and returns its manifest's descriptor, with its platform
        (`variant`, e.g. "v8", only if given). A layer is a list of entries or a ready tar;
        `compress` is "gzip", "zstd" or None."""
        tars = [layer if isinstance(layer, bytes) else tar_bytes(layer) for layer in layers]
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": self.blob(CONFIG, image_config(tars, config, arch)),
            "layers": [self._layer(tar, compress) for tar in tars],
        }
        data = json.dumps(manifest, sort_keys=True).encode()
        platform = {"architecture": arch, "os": "linux"} | ({"variant": variant} if variant else {})
        return self.blob(MANIFEST, data, platform=platform)

    def _layer(self, tar: bytes, compress: str | None) -> dict:
        if compress == "gzip":
            return self.blob(LAYER + "+gzip", gzip.compress(tar, compresslevel=6, mtime=0))
        if compress == "zstd":
            done = subprocess.run(["zstd", "-q", "-c"], input=tar, capture_output=True, check=True)
            return self.blob(LAYER + "+zstd", done.stdout)
        return self.blob(LAYER, tar)

    def index(self, manifests: list[dict]) -> dict:
        """Writes an image index (a multi-platform image) and returns its descriptor."""
        document = {"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}
        return self.blob(INDEX, json.dumps(document, sort_keys=True).encode())

    def tag(self, ref: str, found: dict, annotations: dict[str, str] | None = None) -> dict:
        """Lists `found` in index.json under the ref name `ref`."""
        self.manifests.append({**found, "annotations": {REF: ref, **(annotations or {})}})
        self._write_index()
        return found

    def _write_index(self) -> None:
        document = {"schemaVersion": 2, "mediaType": INDEX, "manifests": self.manifests}
        (self.path / "index.json").write_text(json.dumps(document, indent=1))


def build_image(
    path: Path,
    name: str,
    marker: str,
    extra_files: dict[str, bytes | str] | None = None,
    ref: str = "latest",
) -> Path:
    """A two-layer busybox image as an OCI layout at `path` (tagged `ref`): it prints
    `marker` and serves /srv (which holds index.html = marker and `extra_files`) with
    busybox httpd on port 80. /etc/image-release names it."""
    top = [
        file("etc/image-release", f"{name}\n"),
        file("srv/index.html", f"{marker}\n"),
        *(file(path, data) for path, data in (extra_files or {}).items()),
    ]
    config = {
        "Cmd": ["/bin/sh", "-c", f"echo {marker}; exec httpd -f -p 80 -h /srv"],
        "Env": ["PATH=/bin"],
        "WorkingDir": "/",
    }
    layout = Layout(path)
    layout.tag(ref, layout.image([busybox_layer(), top], config))
    return path


def debian_busybox(arch: str, cache: Path = Path("/var/cache/layerpy")) -> bytes | None:
    """Debian's busybox-static binary for `arch` (arm64: from the .deb that
    `minos/build.sh --arch arm64` keeps in the cache), or None when it is not there."""
    debs = sorted((cache / "debs").glob(f"busybox-static_*_{arch}.deb"))
    if not debs:
        return None
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(debs[-1])], check=True,
                         capture_output=True).stdout  # fmt: skip
    return subprocess.run(["tar", "-xO", "./bin/busybox"], input=tar, check=True,
                          capture_output=True).stdout  # fmt: skip


def build_multiarch(path: Path, busyboxes: dict[str, Path], command: list[str]) -> dict[str, str]:
    """A busybox image for each architecture (`busyboxes`: arch -> its busybox binary) in
    one OCI index at `path`, tagged latest, as `docker buildx --platform ...` pushes one
    (arm64 as arm64/v8); /arch names the architecture, `command` runs (sh, cat, echo,
    sleep, uname). Returns each architecture's manifest digest."""
    layout = Layout(path)
    applets = ("sh", "cat", "echo", "sleep", "uname")
    found = {
        arch: layout.image([busybox_layer(busybox, applets), [file("arch", arch)]],
                           {"Cmd": command}, arch=arch, variant="v8" if arch == "arm64" else None)
        for arch, busybox in busyboxes.items()
    }  # fmt: skip
    layout.tag("latest", layout.index(list(found.values())))
    return {arch: descriptor["digest"] for arch, descriptor in found.items()}


def write_docker_archive(
    path: Path,
    layers: list[Layer],
    config: dict | None = None,
    repo_tag: str = "lab/image:latest",
    oci: bool = False,
) -> Path:
    """A `docker save` tarball: the classic format (manifest.json, <id>.json,
    <id>/layer.tar), or with `oci` the Docker 25+ one (an OCI layout plus manifest.json)."""
    tars = [tar_bytes(layer) for layer in layers]
    config_data = image_config(tars, config)
    digests = [descriptor("", data)["digest"][7:] for data in (config_data, *tars)]
    members: dict[str, bytes] = {}
    if oci:
        with tempfile.TemporaryDirectory() as tmp:
            layout = Layout(Path(tmp))
            found = layout.image(layers, config, compress=None)
            name = "docker.io/" + repo_tag if "/" in repo_tag else "docker.io/library/" + repo_tag
            layout.tag("latest", found, {"io.containerd.image.name": name})
            for item in sorted(Path(tmp).rglob("*")):
                if item.is_file():
                    members[str(item.relative_to(tmp))] = item.read_bytes()
        config_name = f"blobs/sha256/{digests[0]}"
        layer_names = [f"blobs/sha256/{digest}" for digest in digests[1:]]
    else:
        config_name = f"{digests[0]}.json"
        layer_names = [f"{digest}/layer.tar" for digest in digests[1:]]
        members[config_name] = config_data
        members.update(zip(layer_names, tars, strict=True))
    manifest = [{"Config": config_name, "RepoTags": [repo_tag], "Layers": layer_names}]
    members["manifest.json"] = json.dumps(manifest).encode()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            tar.addfile(file(name, data).info, io.BytesIO(data))
    return path


def push(
    layout: Path,
    registry: str,
    repo: str,
    tag: str,
    ref: str = "latest",
    creds: str | None = None,
) -> None:
    """Copies `ref` of an OCI layout to a plain-HTTP registry with skopeo, a real client
    (every platform of an index too)."""
    creds_args = ["--dest-creds", creds] if creds else []
    source, dest = f"oci:{layout}:{ref}", f"docker://{registry}/{repo}:{tag}"
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--all",
            "--dest-tls-verify=false",
            *creds_args,
            source,
            dest,
        ],
        check=True,
        capture_output=True,
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Registry:
    """A Debian docker-registry (distribution 2.8) on 127.0.0.1 at a free port, storing
    under `root`; `auth` is its config's auth section. close() kills only this process."""

    def __init__(self, root: Path, auth: dict | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        config = {
            "version": "0.1",
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(root / "data")}},
            "http": {"addr": self.address},
            **({"auth": auth} if auth else {}),
        }
        (root / "config.yml").write_text(json.dumps(config))  # YAML reads JSON
        with open(root / "registry.log", "wb") as log:
            self.process = subprocess.Popen(
                ["docker-registry", "serve", str(root / "config.yml")], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.close()
                    log_text = (root / "registry.log").read_text()
                    raise RuntimeError(f"docker-registry did not start: {log_text}") from None
                time.sleep(0.05)

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (to corrupt them in a test)."""
        hex_ = digest.removeprefix("sha256:")
        return self.root / "data/docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
