"""The image store on local sources: the flattener against `umoci unpack` as the oracle,
hostile layers, determinism, source syntax, docker archives, the cache, digest checks."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections import defaultdict
from pathlib import Path

import pytest
from yarl import URL

import layerpy.images.store as store_module
from layerpy.images import ImageError, ImageSource, ImageStore, parse_source
from layerpy.images.registry import credentials_withheld

from oci import (
    BUSYBOX,
    Layout,
    build_image,
    build_multiarch,
    busybox_layer,
    debian_busybox,
    device,
    directory,
    fifo,
    file,
    hardlink,
    opaque,
    symlink,
    whiteout,
    write_docker_archive,
)

ROOT = os.geteuid() == 0  # umoci keeps owners and device nodes only as root

# Lower layers, then an upper one that deletes, hides, replaces and links across them.
LOWER = [
    *busybox_layer(),
    directory("etc/app", 0o750, 10, 20),
    file("etc/app/a.conf", "a v1\n", 0o640, 10, 20),
    hardlink("etc/app/a.hard", "etc/app/a.conf"),
    directory("etc/app/sub"),
    file("etc/app/sub/b", "b\n"),
    directory("data"),
    file("data/keep", "keep\n"),
    file("data/gone", "gone but linked\n", 0o600),
    hardlink("data/survivor", "data/gone"),
    directory("data/dir"),
    file("data/dir/x", "x\n"),
    directory("opq"),
    file("opq/old", "old\n"),
    directory("opq/olddir"),
    file("opq/olddir/y", "y\n"),
    file("usr-sbin-tool", "#!/bin/sh\n", 0o4755, 0, 0),
    symlink("abs-link", "/etc/passwd"),
    symlink("rel-link", "../etc/app/sub"),
    symlink("will-be-file", "bin/busybox"),
    device("dev-null", 1, 3),
    fifo("pipe"),
]
MIDDLE = [
    file("opq/new", "new, written before the opaque marker\n"),
    opaque("opq"),
    whiteout("data/gone"),
    whiteout("data/dir"),
    whiteout("bin/cat"),
    file("etc/app/a.conf", "a v2\n", 0o644, 10, 20),
    hardlink("etc/pw-link", "etc/passwd"),
    file("etc/app/sub", "a file where a directory was\n"),
    directory("data/keep", 0o711),
    file("data/keep/inside", "in\n"),
    file("will-be-file", "now a file\n"),
]
UPPER = [
    file("data/dir", "a file where a deleted directory was\n"),
    directory("etc/app", 0o700, 10, 20),  # only its metadata changes; the contents stay
    whiteout("etc/passwd"),  # etc/pw-link keeps the contents
    file("etc/passwd", "root:x:0:0::/:/bin/sh\n"),
    hardlink("bin/bb", "bin/busybox"),  # a link across layers that stays linked
]


def pull(
    store: ImageStore,
    source: str | ImageSource,
    name: str = "img",
    progress=None,
    platform: str = "linux/amd64",
):
    source = parse_source(source) if isinstance(source, str) else source
    return asyncio.run(store.pull(name, source, progress, platform))


def layered(path: Path, *layers: list, compress: str | None = "gzip") -> Path:
    layout = Layout(path)
    layout.tag("latest", layout.image(list(layers), {"Cmd": ["/bin/sh"]}, compress=compress))
    return path


def from_disk(root: Path) -> tuple[dict, set]:
    """Each path's (type, mode, uid, gid, mtime, contents) and the hard-link groups."""
    entries, inodes = {}, defaultdict(set)
    for path in [root, *sorted(root.rglob("*"))]:
        name = path.relative_to(root).as_posix()
        st = path.lstat()
        kind = stat.S_IFMT(st.st_mode)
        if stat.S_ISREG(kind):
            payload = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(kind):
            payload = os.readlink(path)
        elif stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
            payload = (os.major(st.st_rdev), os.minor(st.st_rdev))
        else:
            payload = None
        entries[name] = (
            kind,
            stat.S_IMODE(st.st_mode),
            st.st_uid,
            st.st_gid,
            int(st.st_mtime),
            payload,
        )
        if not stat.S_ISDIR(kind) and st.st_nlink > 1:
            inodes[st.st_ino].add(name)
    return entries, {frozenset(group) for group in inodes.values()}


def from_tar(path: Path) -> tuple[dict, set]:
    """The same view of a flattened tar, without extracting it."""
    kinds = {
        tarfile.REGTYPE: stat.S_IFREG,
        tarfile.DIRTYPE: stat.S_IFDIR,
        tarfile.SYMTYPE: stat.S_IFLNK,
        tarfile.CHRTYPE: stat.S_IFCHR,
        tarfile.BLKTYPE: stat.S_IFBLK,
        tarfile.FIFOTYPE: stat.S_IFIFO,
    }
    entries, groups = {}, defaultdict(set)
    with tarfile.open(path) as tar:
        for info in tar:
            name = info.name.removeprefix("./") or "."
            if info.islnk():
                entries[name] = entries[info.linkname]
                groups[info.linkname] |= {info.linkname, name}
                continue
            if info.isreg():
                payload = hashlib.sha256(tar.extractfile(info).read()).hexdigest()
            elif info.issym():
                payload = info.linkname
            elif info.ischr() or info.isblk():
                payload = (info.devmajor, info.devminor)
            else:
                payload = None
            entries[name] = (
                kinds[info.type],
                info.mode,
                info.uid,
                info.gid,
                int(info.mtime),
                payload,
            )
    return entries, {frozenset(group) for group in groups.values()}


def umoci(layout: Path, bundle: Path) -> tuple[dict, set]:
    rootless = [] if ROOT else ["--rootless"]
    subprocess.run(
        ["umoci", "unpack", *rootless, "--image", f"{layout}:latest", str(bundle)],
        check=True,
        capture_output=True,
    )
    return from_disk(bundle / "rootfs")


def without_owners_and_devices(ours: tuple[dict, set], theirs: tuple[dict, set]) -> tuple:
    """Without root, umoci keeps neither owners nor device nodes (it makes empty files in
    their place): compare the rest."""
    devices = {
        name for name, entry in ours[0].items() if stat.S_ISCHR(entry[0]) or stat.S_ISBLK(entry[0])
    }
    return tuple(
        (
            {
                name: (e[0], e[1], None, None, *e[4:])
                for name, e in entries.items()
                if name not in devices
            },
            groups,
        )
        for entries, groups in (ours, theirs)
    )


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


# --- the flattener, with umoci as the oracle ------------------------------------------------


@pytest.mark.parametrize(
    "layers",
    [
        pytest.param([LOWER], id="one-layer"),
        pytest.param([LOWER, MIDDLE], id="whiteouts-opaque-hardlinks"),
        pytest.param([LOWER, MIDDLE, UPPER], id="three-layers"),
    ],
)
def test_flattened_tree_matches_umoci(store: ImageStore, tmp_path: Path, layers: list) -> None:
    layout = layered(tmp_path / "layout", *layers)
    image = pull(store, f"oci-layout:{layout}:latest")
    ours, theirs = from_tar(image.rootfs), umoci(layout, tmp_path / "bundle")
    if not ROOT:
        ours, theirs = without_owners_and_devices(ours, theirs)
    assert ours == theirs


def test_flattened_details(store: ImageStore, tmp_path: Path) -> None:
    """The cases the oracle comparison covers, spelled out."""
    image = pull(store, f"oci-layout:{layered(tmp_path / 'l', LOWER, MIDDLE, UPPER)}")
    entries, groups = from_tar(image.rootfs)
    assert "opq/new" in entries and "opq/old" not in entries and "opq/olddir" not in entries
    assert "data/gone" not in entries and "bin/cat" not in entries
    assert entries["data/survivor"][5] == hashlib.sha256(b"gone but linked\n").hexdigest()
    assert entries["etc/app/a.hard"][5] == hashlib.sha256(b"a v1\n").hexdigest()
    assert entries["etc/app"][:4] == (stat.S_IFDIR, 0o700, 10, 20)
    assert "etc/app/a.conf" in entries  # a directory's new metadata keeps its contents
    assert entries["usr-sbin-tool"][1] == 0o4755
    assert entries["dev-null"][5] == (1, 3)
    assert entries["abs-link"][5] == "/etc/passwd"
    assert stat.S_ISREG(entries["data/dir"][0]) and stat.S_ISREG(entries["will-be-file"][0])
    assert (
        entries["etc/pw-link"][5] == hashlib.sha256(b"root:x:0:0:root:/root:/bin/sh\n").hexdigest()
    )
    assert entries["etc/passwd"][5] == hashlib.sha256(b"root:x:0:0::/:/bin/sh\n").hexdigest()
    assert not [group for group in groups if "etc/pw-link" in group]
    assert frozenset({"bin/busybox", "bin/bb"}) in groups
    with tarfile.open(image.rootfs) as tar:
        names = tar.getnames()
        assert all(not info.uname and not info.gname for info in tar)  # numeric owners
    assert names == sorted(names, key=lambda n: n.split("/")) and names[0] == "."


def test_flatten_is_deterministic(tmp_path: Path) -> None:
    layout = layered(tmp_path / "layout", LOWER, MIDDLE, UPPER)
    first = pull(ImageStore(tmp_path / "one"), f"oci-layout:{layout}")
    second = pull(ImageStore(tmp_path / "two"), f"oci-layout:{layout}")
    assert first.rootfs.read_bytes() == second.rootfs.read_bytes()
    assert first.rootfs_sha256 == hashlib.sha256(first.rootfs.read_bytes()).hexdigest()
    if first.squashfs:
        assert first.squashfs.read_bytes() == second.squashfs.read_bytes()
    # Compression does not matter: the same entries make the same tree.
    plain = pull(
        ImageStore(tmp_path / "three"),
        f"oci-layout:{layered(tmp_path / 'p', LOWER, MIDDLE, UPPER, compress=None)}",
    )
    assert plain.digest != first.digest and plain.rootfs_sha256 == first.rootfs_sha256


@pytest.mark.skipif(not shutil.which("tar2sqfs"), reason="squashfs-tools-ng is not installed")
def test_squashfs_holds_the_same_tree(store: ImageStore, tmp_path: Path) -> None:
    image = pull(store, f"oci-layout:{layered(tmp_path / 'l', LOWER, MIDDLE, UPPER)}")
    assert image.squashfs and image.squashfs_size == image.squashfs.stat().st_size
    back = tmp_path / "back.tar"
    with back.open("wb") as out:
        subprocess.run(["sqfs2tar", str(image.squashfs)], stdout=out, check=True)
    ours, theirs = from_tar(image.rootfs), from_tar(back)
    # sqfs2tar names no root entry, and which name of a hard link holds the data is its choice
    assert {k: v for k, v in ours[0].items() if k != "."} == theirs[0]
    assert ours[1] == theirs[1]


@pytest.mark.skipif(not shutil.which("zstd"), reason="zstd is not installed")
def test_zstd_layers(store: ImageStore, tmp_path: Path) -> None:
    reference = pull(store, f"oci-layout:{layered(tmp_path / 'gzip', LOWER, MIDDLE)}")
    image = pull(store, f"oci-layout:{layered(tmp_path / 'zstd', LOWER, MIDDLE, compress='zstd')}")
    assert image.digest != reference.digest and image.rootfs_sha256 == reference.rootfs_sha256


# --- hostile layers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (
            [[file("../escape", "x")]],
            r"layer 1 \(sha256:[0-9a-f]{64}\): '\.\./escape': '\.\.' in '\.\./escape'$",
        ),
        ([[file("a/../../escape", "x")]], r"layer 1 .*: 'a/\.\./\.\./escape': '\.\.' in "),
        (
            [[file("f", "x"), hardlink("steal", "../../etc/shadow")]],
            r"layer 1 .*: 'steal': '\.\.' in '\.\./\.\./etc/shadow'",
        ),
        (
            [[hardlink("dangling", "nothing")]],
            "layer 1 .*: 'dangling': hard link to 'nothing', which is no file",
        ),
        (
            [[directory("d"), hardlink("dirlink", "d")]],
            "layer 1 .*: 'dirlink': hard link to 'd', which is no file",
        ),
        (
            [[symlink("loop", "loop")], [file("loop/x", "x")]],
            "layer 2 .*: 'loop/x': too many levels of symbolic links",
        ),
        (
            [[file("plain", "x")], [file("plain/x", "x")]],
            "layer 2 .*: 'plain/x': plain is not a directory",
        ),
    ],
)
def test_hostile_layers_are_refused(store: ImageStore, tmp_path: Path, layers, message) -> None:
    layout = layered(tmp_path / "evil", *layers)
    with pytest.raises(ImageError, match="^evil: " + message):
        pull(store, f"oci-layout:{layout}", name="evil")
    assert store.list() == [] and os.listdir(store.root / "tmp") == []


def test_symlinks_cannot_carry_writes_out(store: ImageStore, tmp_path: Path) -> None:
    """Writes through symlinks land inside the tree, where the link points from its root;
    no entry of the result is below a symlink, so extracting it cannot escape either."""
    lower = [
        directory("etc"),
        file("etc/passwd", "original\n"),
        symlink("abs", "/etc"),
        symlink("up", "../../../../.."),
        symlink("dangling", "/nonexistent/dir"),
    ]
    upper = [
        file("abs/passwd", "through an absolute symlink\n"),
        file("up/escaped", "through ../\n"),
        file("/rooted", "absolute member name\n"),
        file("dangling/made", "into a directory the link names\n"),
    ]
    image = pull(store, f"oci-layout:{layered(tmp_path / 'l', lower, upper)}")
    with tarfile.open(image.rootfs) as tar:
        infos = {info.name.removeprefix("./") or ".": info for info in tar}
        assert tar.extractfile(infos["etc/passwd"]).read() == b"through an absolute symlink\n"
    assert {"escaped", "rooted", "nonexistent/dir/made"} <= infos.keys()
    assert infos["abs"].issym() and infos["up"].issym()
    links = {name for name, info in infos.items() if info.issym()}
    assert not [n for n in infos if any(n.startswith(link + "/") for link in links)]
    target = tmp_path / "extracted"
    with tarfile.open(image.rootfs) as tar:
        tar.extractall(target)  # fine: nothing is below a symlink
    assert (target / "escaped").read_text() == "through ../\n"


# --- sources ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("registry://127.0.0.1:5000/lab/base:1", ("registry", "127.0.0.1:5000/lab/base", "1")),
        (
            "registry://registry.example.org/library/debian",
            ("registry", "registry.example.org/library/debian", "latest"),
        ),
        (
            "registry://[::1]:5000/a/b@sha256:" + "0" * 64,
            ("registry", "[::1]:5000/a/b", "sha256:" + "0" * 64),
        ),
        ("oci-layout:/srv/images/base", ("oci-layout", "/srv/images/base", "")),
        ("oci-layout:/srv/images/base:v2", ("oci-layout", "/srv/images/base", "v2")),
        ("oci-layout:rel/dir:sha256:" + "a" * 64, ("oci-layout", "rel/dir", "sha256:" + "a" * 64)),
        ("docker-archive:/tmp/base.tar", ("docker-archive", "/tmp/base.tar", "")),
        (
            "docker-archive:/tmp/base.tar:localhost:5000/lab/base:1",
            ("docker-archive", "/tmp/base.tar", "localhost:5000/lab/base:1"),
        ),
    ],
)
def test_parse_source(text: str, expected: tuple) -> None:
    source = parse_source(text)
    assert (source.kind, source.location, source.reference) == expected
    assert parse_source(str(source)) == source


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("docker://busybox", "expected registry://HOST"),
        ("registry:/127.0.0.1/x", "expected registry://HOST"),
        ("registry://127.0.0.1:5000/Lab/Base:1", "bad repository name 'Lab/Base'"),
        ("registry://127.0.0.1:5000", "bad repository name ''"),
        ("registry://user@host/x", "bad registry host 'user@host'"),
        ("registry://host/x:bad tag", "bad tag or digest 'bad tag'"),
        ("registry://host/x@sha256:123", "bad tag or digest 'sha256:123'"),
        ("oci-layout:", "expected registry://HOST"),
        ("docker-archive:/f.tar:notag", "expected registry://HOST"),
        ("", "expected registry://HOST"),
    ],
)
def test_parse_source_rejects_junk(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        parse_source(text)


@pytest.mark.parametrize(
    ("realm", "allowed", "withheld"),
    [
        ("https://registry.example/token", (), None),
        ("https://auth.example/token", ("auth.example",), None),
        ("https://evil.example/token", (), "credentials not sent to evil.example, not the "
         "registry's host: list it in the image's credentials_to if it is the registry's "
         "token service"),
        ("http://registry.example/token", (), "credentials not sent to registry.example: "
         "only over TLS (https)"),
        ("http://127.0.0.1:5001/token", ("127.0.0.1",), None),  # loopback: never on a wire
    ],
)  # fmt: skip
def test_credentials_go_only_to_the_registrys_own_token_service(realm, allowed, withheld) -> None:
    source = ImageSource("registry", "registry.example/r", "1", user="u", password="hunter2",
                         credentials_to=allowed)  # fmt: skip
    assert credentials_withheld(realm, URL("https://registry.example"), source) == withheld


def test_credentials_stay_out_of_text() -> None:
    source = ImageSource("registry", "h/r", "1", user="u", password="hunter2")
    assert "hunter2" not in repr(source) and "hunter2" not in str(source)


@pytest.mark.parametrize("oci", [False, True], ids=["classic", "docker25-oci"])
def test_docker_archive(store: ImageStore, tmp_path: Path, oci: bool) -> None:
    config = {"Entrypoint": ["/bin/sh"], "Cmd": ["-c", "true"], "User": "0", "Labels": {"x": "y"}}
    archive = write_docker_archive(
        tmp_path / "img.tar", [LOWER, MIDDLE], config, "lab/arch:7", oci=oci
    )
    reference = pull(store, f"oci-layout:{layered(tmp_path / 'l', LOWER, MIDDLE)}")
    for text in (f"docker-archive:{archive}", f"docker-archive:{archive}:lab/arch:7"):
        image = pull(store, text)
        assert image.rootfs_sha256 == reference.rootfs_sha256 and image.layers == 2
        assert image.config == {"Entrypoint": ["/bin/sh"], "Cmd": ["-c", "true"], "User": "0"}
    with pytest.raises(
        ImageError, match=r"img: docker-archive .*img.tar: no image 'lab/other:1' \(has: "
    ):
        pull(store, f"docker-archive:{archive}:lab/other:1")


def test_multi_platform_layout(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "multi")
    amd = layout.image([busybox_layer(), [file("arch", "amd64")]], arch="amd64")
    arm = layout.image([busybox_layer(), [file("arch", "arm64")]], arch="arm64")
    layout.tag("latest", layout.index([arm, amd]))
    image = pull(ImageStore(tmp_path / "s"), f"oci-layout:{layout.path}:latest")
    assert image.digest == amd["digest"] and image.architecture == "amd64"
    source = f"oci-layout:{layout.path}"
    arm_image = pull(ImageStore(tmp_path / "arm"), source, platform="linux/arm64/v8")
    assert arm_image.digest == arm["digest"] and arm_image.architecture == "arm64"
    with pytest.raises(
        ImageError, match=r"no linux/riscv64 image \(offers: linux/arm64, linux/amd64\)"
    ):
        pull(ImageStore(tmp_path / "rv"), source, platform="linux/riscv64")
    # an amd64 manifest pinned by digest is refused to arm64 nodes, fetched or kept
    pinned = f"oci-layout:{layout.path}:{amd['digest']}"
    for store in (ImageStore(tmp_path / "fresh"), ImageStore(tmp_path / "s")):
        with pytest.raises(ImageError, match=r"image is for amd64, not (linux/)?arm64"):
            pull(store, pinned, platform="linux/arm64/v8")


def test_missing_sources(store: ImageStore, tmp_path: Path) -> None:
    build_image(tmp_path / "a", "a", "IMAGE-A-MARKER")
    cases = {
        f"oci-layout:{tmp_path}/nowhere": "no such directory",
        f"oci-layout:{tmp_path}/a:v9": r"no image 'v9' \(has: latest\)",
        f"docker-archive:{tmp_path}/a": "no such file",
        f"oci-layout:{tmp_path}": "not an OCI layout",
    }
    for text, message in cases.items():
        with pytest.raises(ImageError, match=f"^base: .*{message}"):
            pull(store, text, name="base")


# --- the store: cache, verification, atomicity ------------------------------------------------


def test_cache_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flattened = []
    real = store_module.flatten
    monkeypatch.setattr(store_module, "flatten", lambda *a: flattened.append(a) or real(*a))
    a = build_image(tmp_path / "a", "a", "IMAGE-A-MARKER")
    b = build_image(tmp_path / "b", "b", "IMAGE-B-MARKER", {"srv/b.txt": "b"})
    store = ImageStore(tmp_path / "store")
    totals: list[tuple[int, int | None]] = []
    first = pull(store, f"oci-layout:{a}", "a", lambda done, total: totals.append((done, total)))
    assert totals[0] == (0, totals[-1][1]) and totals[-1][0] == totals[-1][1] > 1_000_000
    assert [done for done, _ in totals] == sorted(done for done, _ in totals)
    again = pull(store, f"oci-layout:{a}", "a")
    restarted = ImageStore(tmp_path / "store")
    assert pull(restarted, f"oci-layout:{a}", "a") == again == first
    assert len(flattened) == 1
    # B shares A's busybox layer: only its own small layer and config are copied
    totals.clear()
    second = pull(store, f"oci-layout:{b}", "b", lambda done, total: totals.append((done, total)))
    assert len(flattened) == 2 and totals[-1][1] < 10_000
    assert store.list() == [first, second] and store.get(second.digest) == second
    assert store.named("a") == first and store.named("b") == second and store.named("c") is None
    # a pinned digest the store has is served with the source gone
    shutil.rmtree(a)
    assert pull(restarted, f"oci-layout:{a}:{first.digest}", "a") == first


def test_tampered_blob_is_refused_and_nothing_cached(store: ImageStore, tmp_path: Path) -> None:
    layout = layered(tmp_path / "l", LOWER, MIDDLE)
    blobs = sorted((layout / "blobs" / "sha256").iterdir(), key=lambda p: p.stat().st_size)
    big = blobs[-1]  # the busybox layer
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0xFF
    big.write_bytes(bytes(data))
    with pytest.raises(
        ImageError, match=f"img: oci-layout .*: blob sha256:{big.name} does not match its digest"
    ):
        pull(store, f"oci-layout:{layout}")
    assert store.list() == [] and not (store.root / "blobs" / "sha256" / big.name).exists()
    assert os.listdir(store.root / "tmp") == [] and os.listdir(store.root / "sha256") == []
    big.write_bytes(gzip.compress(b"short", mtime=0))
    with pytest.raises(ImageError, match=f"blob sha256:{big.name} has 25 bytes, not "):
        pull(store, f"oci-layout:{layout}")


def test_failed_flatten_leaves_nothing(store: ImageStore, tmp_path: Path) -> None:
    layout = layered(tmp_path / "l", LOWER, [file("../x", "x")])
    with pytest.raises(ImageError):
        pull(store, f"oci-layout:{layout}")
    assert os.listdir(store.root / "sha256") == [] and os.listdir(store.root / "tmp") == []
    assert not (store.root / "names.json").exists()


def test_concurrent_pulls_flatten_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flattened = []
    real = store_module.flatten
    monkeypatch.setattr(store_module, "flatten", lambda *a: flattened.append(a) or real(*a))
    layout = build_image(tmp_path / "a", "a", "IMAGE-A-MARKER")
    store = ImageStore(tmp_path / "store")

    async def both():
        source = parse_source(f"oci-layout:{layout}")
        return await asyncio.gather(store.pull("one", source), store.pull("two", source))

    one, two = asyncio.run(both())
    assert one == two and len(flattened) == 1


def test_hostile_manifests(store: ImageStore, tmp_path: Path) -> None:
    layout = Layout(tmp_path / "l")
    config = layout.blob("application/vnd.oci.image.config.v1+json", b"{}")
    escape = {**config, "digest": "sha256:../../../../etc/passwd"}
    manifest = {"schemaVersion": 2, "config": config, "layers": [escape]}
    layout.tag(
        "bad",
        layout.blob("application/vnd.oci.image.manifest.v1+json", json.dumps(manifest).encode()),
    )
    with pytest.raises(
        ImageError, match=r"^img: oci-layout .*: the manifest has a bad blob descriptor$"
    ):
        pull(store, f"oci-layout:{layout.path}:bad")
    good = layout.tag("good", layout.image([LOWER]))
    pinned = good["digest"]
    manifest_file = layout.path / "blobs" / "sha256" / pinned[7:]
    manifest_file.write_bytes(manifest_file.read_bytes() + b" ")
    with pytest.raises(ImageError, match=f"manifest {pinned} does not match its digest"):
        pull(store, f"oci-layout:{layout.path}:{pinned}")
    assert store.list() == []


def test_the_lab_multiarch_image_gives_arm64_nodes_an_arm64_busybox(tmp_path: Path) -> None:
    """The busybox index the arm64 lab test runs: an arm64 node's flattened image holds
    Debian's aarch64 busybox (ELF machine 183), an amd64 node's this machine's."""
    arm64 = debian_busybox("arm64")
    if arm64 is None:
        pytest.skip("no arm64 busybox-static .deb cached: run minos/build.sh --arch arm64")
    (tmp_path / "busybox-arm64").write_bytes(arm64)
    busyboxes = {"amd64": BUSYBOX, "arm64": tmp_path / "busybox-arm64"}
    digests = build_multiarch(tmp_path / "multi", busyboxes, ["/bin/sh"])
    store = ImageStore(tmp_path / "store")
    for platform, arch, machine in (("linux/arm64/v8", "arm64", 183), ("linux/amd64", "amd64", 62)):
        image = pull(store, f"oci-layout:{tmp_path / 'multi'}:latest", platform=platform)
        assert image.digest == digests[arch]
        with tarfile.open(image.rootfs) as flat:
            elf = flat.extractfile("bin/busybox").read(20)
        assert int.from_bytes(elf[18:20], "little") == machine, platform
