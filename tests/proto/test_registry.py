"""The registry client against a real Debian `docker-registry` (distribution 2.8) on
127.0.0.1, with images pushed by skopeo: tags, digests, multi-platform indexes, errors,
a corrupted blob, and the three ways in: anonymous, basic (htpasswd) and bearer tokens from
a token service (written here: a few lines that sign ES256 JWTs the registry checks).

Covered: what a lab or site registry needs. Not covered: HTTPS with a real certificate
(the TLS path is only seen failing against plain HTTP) and redirects to blob storage."""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
import shutil
import tarfile
import threading
import time
import urllib.parse
import warnings
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from layerpy.images import ImageError, ImageSource, ImageStore, parse_source
from layerpy.proto.platform import DEFAULT, architecture, of_machine

from oci import Layout, Registry, build_image, busybox_layer, file, free_port, push

pytestmark = pytest.mark.skipif(
    not (shutil.which("docker-registry") and shutil.which("skopeo")),
    reason="needs docker-registry and skopeo (vm-lab/setup.sh installs them)",
)


def manifest_digest(layout: Path) -> str:
    """The digest of the image a build_image() layout holds."""
    return json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]


def source(registry: Registry, path: str, **credentials: str) -> ImageSource:
    """A plain-HTTP source in `registry`."""
    return replace(
        parse_source(f"registry://{registry.address}/{path}", insecure=True), **credentials
    )


def pull(
    store: ImageStore,
    src: ImageSource,
    name: str = "base",
    progress=None,
    platform: str = "linux/amd64",
):
    return asyncio.run(store.pull(name, src, progress, platform))


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    """An anonymous registry holding lab/a:1, lab/b:1, a two-platform lab/multi:1, and
    lab/arm:1 as `docker buildx` makes one: arm64/v8, arm/v7 and amd64 images and an
    attestation manifest (unknown/unknown)."""
    tmp = tmp_path_factory.mktemp("registry")
    registry = Registry(tmp / "registry")
    try:
        layouts = {
            "a": build_image(tmp / "a", "a", "IMAGE-A-MARKER"),
            "b": build_image(tmp / "b", "b", "IMAGE-B-MARKER", {"srv/b.txt": "b"}),
        }
        multi = Layout(tmp / "multi")
        platforms = {
            arch: multi.image([busybox_layer(), [file("arch", arch)]], arch=arch)
            for arch in ("arm64", "amd64")
        }
        multi.tag("latest", multi.index(list(platforms.values())))
        arm = Layout(tmp / "arm")
        builds = {
            "/".join(filter(None, ("linux", arch, variant))): arm.image(
                [busybox_layer(), [file("arch", f"{arch}/{variant}")]], arch=arch, variant=variant
            )
            for arch, variant in (("arm", "v7"), ("arm64", "v8"), ("amd64", None))
        }
        attestation = arm.image([[file("provenance.json", "{}")]], arch="unknown")
        attestation["platform"] = {"architecture": "unknown", "os": "unknown"}
        arm.tag("latest", arm.index([attestation, *builds.values()]))
        for name, layout in {**layouts, "multi": multi.path, "arm": arm.path}.items():
            push(layout, registry.address, f"lab/{name}", "1")
        yield registry, layouts, {**platforms, **builds}
    finally:
        registry.close()


def test_pull_by_tag_and_digest(lab, tmp_path: Path) -> None:
    registry, layouts, _ = lab
    store = ImageStore(tmp_path / "store")
    seen: list[tuple[int, int | None]] = []
    image = pull(store, source(registry, "lab/a:1"), progress=lambda *p: seen.append(p))
    assert image.digest == manifest_digest(layouts["a"]) and image.layers == 2
    assert image.source == f"registry://{registry.address}/lab/a:1"
    assert seen[-1][0] == seen[-1][1] > 1_000_000
    local = pull(ImageStore(tmp_path / "local"), parse_source(f"oci-layout:{layouts['a']}"))
    assert local.rootfs_sha256 == image.rootfs_sha256 and local.config == image.config
    by_digest = source(registry, f"lab/a@{image.digest}")
    fresh = pull(ImageStore(tmp_path / "fresh"), by_digest)
    assert fresh.digest == image.digest and fresh.rootfs_sha256 == image.rootfs_sha256
    # B shares A's base layer: the second pull fetches only B's own blobs
    seen.clear()
    pull(store, source(registry, "lab/b:1"), "other", lambda *p: seen.append(p))
    assert seen[-1][1] < 10_000


def test_manifest_list_resolves_to_the_platform(lab, tmp_path: Path) -> None:
    registry, _, platforms = lab
    for arch in ("arm64", "amd64"):
        image = pull(ImageStore(tmp_path / arch), source(registry, "lab/multi:1"),
                     platform=f"linux/{arch}")  # fmt: skip
        assert image.digest == platforms[arch]["digest"] and image.architecture == arch
    with pytest.raises(
        ImageError, match=r"no linux/s390x image \(offers: linux/arm64, linux/amd64\)"
    ):
        pull(
            ImageStore(tmp_path / "s390x"), source(registry, "lab/multi:1"), platform="linux/s390x"
        )


def test_each_node_platform_gets_its_own_manifest_of_an_index(lab, tmp_path: Path) -> None:
    """One store pulls lab/arm:1 for an arm64 node (the platform its agent reports from
    uname's aarch64: linux/arm64/v8), a 32-bit arm/v7 one and an amd64 one (an agent older
    than protocol 1.3 reports none: linux/amd64); each gets its own manifest, and the
    store remembers each by name and platform. A node whose variant the index lacks, and an
    architecture it lacks, get no image, never another platform's."""
    registry, _, platforms = lab
    store = ImageStore(tmp_path / "store")
    src = source(registry, "lab/arm:1")
    for platform in (of_machine("aarch64"), of_machine("armv7l"), DEFAULT):
        image = pull(store, src, "base", platform=platform)
        assert image.digest == platforms[platform]["digest"], platform
        assert image.architecture == architecture(platform)
        assert store.named("base", platform) == image
    assert store.named("base", "linux/arm64/v8") != store.named("base")
    with tarfile.open(store.named("base", "linux/arm64/v8").rootfs) as flat:
        assert flat.extractfile("arch").read() == b"arm64/v8"
    with pytest.raises(ImageError, match=r"no linux/arm/v6 image \(offers: unknown/unknown, "
                       r"linux/arm/v7, linux/arm64/v8, linux/amd64\)"):  # fmt: skip
        pull(store, src, platform=of_machine("armv6l"))
    with pytest.raises(ImageError, match=r"no linux/riscv64 image"):
        pull(store, src, platform=of_machine("riscv64"))


def test_missing_tag_and_repository(lab, tmp_path: Path) -> None:
    registry, _, _ = lab
    store = ImageStore(tmp_path / "store")
    for path, what in (("lab/a:2", "lab/a:2"), ("lab/nothing:1", "lab/nothing:1")):
        with pytest.raises(ImageError) as caught:
            pull(store, source(registry, path))
        assert (
            str(caught.value)
            == f"base: registry {registry.address}: manifest {what} not found (404)"
        )


def test_unreachable_registry_fails_fast(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    started = time.monotonic()
    with pytest.raises(ImageError, match=rf"^base: registry {address}: unreachable \(.*refused"):
        pull(
            ImageStore(tmp_path / "store"),
            parse_source(f"registry://{address}/lab/a:1", insecure=True),
        )
    assert time.monotonic() - started < 5


def test_plain_http_registry_needs_insecure(lab, tmp_path: Path) -> None:
    registry, _, _ = lab
    plain = parse_source(f"registry://{registry.address}/lab/a:1")  # HTTPS by default
    with pytest.raises(
        ImageError, match=r"TLS failed .*is it plain HTTP \(then mark it insecure\)"
    ):
        pull(ImageStore(tmp_path / "store"), plain)


def test_corrupted_blob_in_the_registry(lab, tmp_path: Path) -> None:
    """Bytes changed inside the registry's storage: refused, named, and nothing cached."""
    registry, _, _ = lab
    layout = build_image(tmp_path / "c", "c", "IMAGE-C-MARKER")  # a top layer of its own
    push(layout, registry.address, "lab/c", "1")
    manifest = json.loads((layout / "blobs/sha256" / manifest_digest(layout)[7:]).read_text())
    top = manifest["layers"][-1]["digest"]
    data = bytearray(registry.blob_file(top).read_bytes())
    data[-10] ^= 0xFF  # the same size: the registry serves it as it is
    registry.blob_file(top).write_bytes(bytes(data))
    store = ImageStore(tmp_path / "store")
    with pytest.raises(
        ImageError,
        match=f"^base: registry {registry.address}: blob {top} does not match its digest",
    ):
        pull(store, source(registry, "lab/c:1"))
    assert store.list() == [] and os.listdir(store.root / "tmp") == []
    assert not (store.root / "blobs/sha256" / top[7:]).exists()


def test_basic_auth(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # bcrypt by libxcrypt, as htpasswd -B makes

        hashed = crypt.crypt("s3cret", crypt.mksalt(crypt.METHOD_BLOWFISH))
    (tmp_path / "htpasswd").write_text(f"lab:{hashed}\n")
    auth = {"htpasswd": {"realm": "lab", "path": str(tmp_path / "htpasswd")}}
    registry = Registry(tmp_path / "registry", auth)
    try:
        layout = build_image(tmp_path / "a", "a", "IMAGE-A-MARKER")
        push(layout, registry.address, "lab/a", "1", creds="lab:s3cret")
        store = ImageStore(tmp_path / "store")
        prefix = f"base: registry {registry.address}: manifest lab/a:1: unauthorized"
        with pytest.raises(ImageError, match=rf"^{prefix} \(401, needs a user and password\)"):
            pull(store, source(registry, "lab/a:1"))
        with pytest.raises(ImageError, match=rf"^{prefix} \(401, credentials refused\)"):
            pull(store, source(registry, "lab/a:1", user="lab", password="wrong"))
        image = pull(store, source(registry, "lab/a:1", user="lab", password="s3cret"))
        assert image.digest == manifest_digest(layout)
    finally:
        registry.close()


class TokenService:
    """A token service as a registry's `auth.token` expects one: checks basic credentials
    and grants what the scope asks, as an ES256 JWT whose x5c names a self-signed cert."""

    def __init__(self, root: Path, user: str, password: str, host: str = "127.0.0.1") -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lab token service")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.bundle = root / "token-ca.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.requests: list[dict] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                service.requests.append({**query, "auth": self.headers.get("Authorization")})
                if self.headers.get("Authorization") != service.expected:
                    self.send_response(401)
                    self.end_headers()
                    return
                body = json.dumps({"token": service.token(query)}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.realm = f"http://{host}:{self.server.server_port}/token"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def token(self, query: dict[str, str]) -> str:
        access = []
        for scope in query.get("scope", "").split():
            kind, _, rest = scope.partition(":")
            repo, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": repo, "actions": actions.split(",")})
        now = int(time.time())
        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "ES256", "x5c": [base64.b64encode(der).decode()]}
        claims = {
            "iss": "lab-issuer",
            "sub": "lab",
            "aud": query.get("service"),
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": str(now),
            "access": access,
        }
        signing_input = b".".join(_b64(json.dumps(part).encode()) for part in (header, claims))
        r, s = decode_dss_signature(self.key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        return (signing_input + b"." + _b64(r.to_bytes(32, "big") + s.to_bytes(32, "big"))).decode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


@pytest.fixture
def tokens(tmp_path: Path):
    service = TokenService(tmp_path, "lab", "s3cret")
    yield service
    service.close()


def registry_behind(tokens: TokenService, tmp_path: Path) -> tuple[Registry, Path]:
    """A registry that wants tokens from `tokens`, holding lab/a:1 (pushed as lab)."""
    issuer = {"realm": tokens.realm, "service": "lab-registry", "issuer": "lab-issuer"}
    registry = Registry(
        tmp_path / "registry", {"token": {**issuer, "rootcertbundle": str(tokens.bundle)}}
    )
    try:
        layout = build_image(tmp_path / "a", "a", "IMAGE-A-MARKER")
        push(layout, registry.address, "lab/a", "1", creds="lab:s3cret")
    except BaseException:
        registry.close()
        raise
    return registry, layout


def test_credentials_never_go_to_a_token_service_on_another_host(tmp_path: Path) -> None:
    """A registry names its token service; a hostile one names its own. The credentials go
    only to the registry's host (127.0.0.1), not to 127.0.0.2, unless the image lists it."""
    elsewhere = TokenService(tmp_path, "lab", "s3cret", host="127.0.0.2")
    registry, layout = registry_behind(elsewhere, tmp_path)
    try:
        store = ImageStore(tmp_path / "store")
        credentials = {"user": "lab", "password": "s3cret"}
        elsewhere.requests.clear()  # (the push's)
        with pytest.raises(ImageError, match=r"credentials not sent to 127\.0\.0\.2, not the"):
            pull(store, source(registry, "lab/a:1", **credentials))
        assert [request["auth"] for request in elsewhere.requests] == [None]
        listed = replace(source(registry, "lab/a:1", **credentials), credentials_to=("127.0.0.2",))
        assert pull(store, listed).digest == manifest_digest(layout)
        assert elsewhere.requests[-1]["auth"] == elsewhere.expected
    finally:
        registry.close()
        elsewhere.close()


def test_token_auth(tmp_path: Path, tokens: TokenService) -> None:
    registry, layout = registry_behind(tokens, tmp_path)
    try:
        store = ImageStore(tmp_path / "store")
        with pytest.raises(
            ImageError,
            match=rf"^base: registry {registry.address}: token service {tokens.realm} refused \(401\)",
        ):
            pull(store, source(registry, "lab/a:1"))
        tokens.requests.clear()
        image = pull(store, source(registry, "lab/a:1", user="lab", password="s3cret"))
        assert image.digest == manifest_digest(layout)
        assert tokens.requests == [
            {"service": "lab-registry", "scope": "repository:lab/a:pull", "auth": tokens.expected}
        ]
    finally:
        registry.close()
