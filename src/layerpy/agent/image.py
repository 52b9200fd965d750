"""A system image from the server into a root a container can run in, and back out.

The image is downloaded into RAM and checked against its size and sha256, then made a
root: a squashfs under an overlay whose upper layer is tmpfs, or a tar unpacked onto
tmpfs. Every root lives in a directory of its own under the images directory, so one
being prepared never touches the one running, and a restarted agent can tell its roots
(and the mounts in them) from leftovers.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator

from layerpy.agent.files import FilesError, directory
from layerpy.proto.agent import ImageSpec, decode, encode

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HTTP_TIMEOUT = 30.0
CHUNK = 1 << 20
DISK_WAIT = 15.0  # seconds a node's disk for persistent paths may take to appear


class PullError(Exception):
    """Download, verification or preparation failed; the message is the reason reported."""


def label(spec: ImageSpec | None) -> str:
    """How logs name an image: its name and the start of its digest."""
    if spec is None:
        return "none"
    digest = spec.digest
    return f"{spec.name} {digest[:19] + '…' if len(digest) > 19 else digest}"


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def mount_points() -> list[str]:
    """Mount points in mount order (mountinfo escapes spaces and the like as octal)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    unescape = re.compile(r"\\([0-7]{3})")
    return [unescape.sub(lambda m: chr(int(m[1], 8)), ln.split()[4]) for ln in lines]


def download(
    url: str,
    path: str,
    sha256: str,
    size: int | None,
    label: str,
    check: Callable[[], None] = lambda: None,
    authorization: str | None = None,
) -> None:
    """Stream ``url`` to ``path``, hashing as it comes, sending the node's `authorization`
    (image files are served only to the nodes that run them).

    ``check`` runs between chunks and raises to abandon the download. Failures raise
    PullError naming ``label`` (the digest the server knows the image by).
    """
    digest = hashlib.sha256()
    n = 0
    # No proxies: the server is on the node's own boot network, whatever the environment says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        request = urllib.request.Request(url)
        if authorization is not None:
            request.add_header("Authorization", authorization)
        with opener.open(request, timeout=HTTP_TIMEOUT) as resp, open(path, "wb") as f:
            while chunk := resp.read(CHUNK):
                check()
                n += len(chunk)
                if size is not None and n > size:
                    raise PullError(f"size mismatch for {label}: more than {size} bytes")
                digest.update(chunk)
                f.write(chunk)
    except urllib.error.HTTPError as e:
        e.close()
        raise PullError(f"download of {label} failed: HTTP {e.code} {e.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise PullError(f"download of {label} failed: {reason}") from None
    if size is not None and n != size:
        raise PullError(f"size mismatch for {label}: got {n} bytes, expected {size}")
    if digest.hexdigest() != sha256.lower():
        raise PullError(f"sha256 mismatch for {label}: got {digest.hexdigest()}")


def extract_tar(path: str, root: str, check: Callable[[], None] = lambda: None) -> None:
    """Unpack a rootfs tar into ``root`` with owners, modes (setuid too), links and devices.

    Refuses entries (and hard link targets) that would land outside ``root``, also through
    symlinks unpacked earlier; symlinks themselves may point anywhere: they are resolved
    inside the chroot.
    """
    root = os.path.realpath(root)
    # Our own checks replace the extraction filters of newer Pythons (which drop setuid bits).
    kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}

    def checked(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
        for m in tf:  # lazily: each check sees the links extracted before it
            check()
            m.name = m.name.lstrip("/")
            names = [m.name]
            if m.islnk():
                m.linkname = m.linkname.lstrip("/")
                names.append(m.linkname)
            for name in names:
                if not inside(os.path.realpath(os.path.join(root, name)), root):
                    raise PullError(f"tar entry {name!r} escapes the image root")
            yield m

    try:
        with tarfile.open(path, "r:") as tf:
            tf.extractall(root, members=checked(tf), numeric_owner=True, **kw)
    except (OSError, tarfile.TarError) as e:
        raise PullError(f"cannot unpack the tar: {e}") from None


class Image:
    """A prepared root: what runs in it, and the mounts and files to drop afterwards."""

    def __init__(
        self,
        spec: ImageSpec,
        dir: str,
        mounts: list[str],
        argv: list[str],
        binds: list[tuple[str, str]] | None = None,
    ) -> None:
        self.spec = spec
        self.dir = dir
        self.mounts = mounts  # mount points in mount order
        self.argv = argv  # what the shim runs: env -i ... nsenter --root ... command
        self.binds = binds or []  # (kept directory, path in the image): its persistent paths

    @property
    def root(self) -> str:
        return os.path.join(self.dir, "root")

    @property
    def label(self) -> str:
        return label(self.spec)

    def record(self) -> dict:
        """What container.json keeps of it, for an agent that restarts."""
        return {
            "spec": encode(self.spec),
            "dir": self.dir,
            "mounts": self.mounts,
            "argv": self.argv,
            "binds": self.binds,
        }

    @classmethod
    def from_record(cls, record: dict) -> Image:
        """Raises ContractError, KeyError or TypeError for a record that is not one."""
        spec = decode(ImageSpec, record["spec"], "container.json spec")
        binds = [(str(kept), str(path)) for kept, path in record.get("binds", [])]
        return cls(spec, str(record["dir"]), list(record["mounts"]), list(record["argv"]), binds)


class Roots:
    """The images directory: roots made from image specs, torn down, and swept of what a
    previous agent left there; and the persistent paths the roots share (``persist_dir``)."""

    def __init__(
        self, images_dir: str, busybox: str, log: Callable[[str], None], persist_dir: str
    ) -> None:
        self.dir = images_dir
        self.busybox = busybox
        self.log = log
        self.persist_dir = persist_dir

    def prepare(
        self,
        spec: ImageSpec,
        hostname: str,
        verb: str,
        check: Callable[[], None],
        authorization: str | None = None,
    ) -> Image:
        """Download and prepare an image (the contract checked the spec's fields);
        ``check`` raises to abandon it half way."""
        digest, fmt, sha, size, url = spec.digest, spec.format, spec.sha256, spec.size, spec.url
        mb = f"{size / 1e6:.1f} MB" if size is not None else "size unknown"
        self.log(f"image {label(spec)} {verb} ({mb})")
        os.makedirs(self.dir, exist_ok=True)
        image = Image(spec, tempfile.mkdtemp(prefix=sha[:12] + "-", dir=self.dir), [], [])
        try:
            path = os.path.join(image.dir, f"rootfs.{fmt}")
            download(url, path, sha, size, digest, check, authorization)
            if fmt == "squashfs":
                lower, rw = os.path.join(image.dir, "lower"), os.path.join(image.dir, "rw")
                self._mount(image, lower, "-t", "squashfs", "-o", "loop,ro", path)
                self._mount(image, rw, "-t", "tmpfs", "-o", "mode=0755", "tmpfs")
                for d in ("upper", "work"):
                    os.mkdir(os.path.join(rw, d))
                opts = f"lowerdir={lower},upperdir={rw}/upper,workdir={rw}/work"
                self._mount(image, image.root, "-t", "overlay", "-o", opts, "overlay")
            else:
                self._mount(image, image.root, "-t", "tmpfs", "-o", "mode=0755", "tmpfs")
                extract_tar(path, image.root, check)
                os.unlink(path)  # the tree is on tmpfs now: give the RAM back
            image.argv = self._command(image, hostname)
            self._persist(image)
            return image
        except BaseException:
            self.teardown(image)
            raise

    def teardown(self, image: Image) -> None:
        """Unmount and delete a root: its RAM goes back to the node."""
        if not self._umount(reversed(image.mounts)):
            self.log(f"image {image.label}: kept {image.dir}, it is still mounted")
            return
        shutil.rmtree(image.dir, ignore_errors=True)

    def sweep(self, keep: Image | None) -> None:
        """Unmount and delete every root but ``keep``: a previous agent's, or half made."""
        keep_dir = keep.dir if keep else None
        stale = [
            m
            for m in mount_points()
            if inside(m, self.dir) and not (keep_dir and inside(m, keep_dir))
        ]
        if not self._umount(stale[::-1]):
            return
        try:
            names = os.listdir(self.dir)
        except OSError:
            names = []
        for name in names:
            path = os.path.join(self.dir, name)
            if path != keep_dir:
                shutil.rmtree(path, ignore_errors=True)

    def _command(self, image: Image, hostname: str) -> list[str]:
        """env -i + nsenter --root/--wd + the command: what the shim runs, chrooted."""
        spec, root = image.spec, image.root
        cfg = spec.config
        if spec.systemd:
            cmd = ["/sbin/init"]
        elif spec.command:
            cmd = list(spec.command)
        else:
            cmd = list(cfg.get("Entrypoint") or []) + list(cfg.get("Cmd") or [])
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise PullError(f"{label(spec)} has no command (Entrypoint, Cmd or command)")
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": hostname}
        env.update(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        env["container"] = "layerpy"  # systemd's container interface; also a marker
        wd = os.path.realpath(os.path.join(root, (cfg.get("WorkingDir") or "/").lstrip("/")))
        if not inside(wd, os.path.realpath(root)):
            raise PullError(f"WorkingDir {cfg.get('WorkingDir')!r} leaves the image root")
        os.makedirs(wd, exist_ok=True)
        if cfg.get("User") not in (None, "", "root", "0", "0:0"):
            self.log(f"image {label(spec)} asks for User {cfg['User']!r}; runs as root")
        bb = self.busybox
        envs = [f"{k}={v}" for k, v in env.items()]
        return [bb, "env", "-i", *envs, bb, "nsenter", f"--root={root}", f"--wd={wd}", "--", *cmd]

    def keep_on(self, disk: str) -> str:
        """Mount `disk` on the persist directory, so that the persistent paths outlive a
        reboot too; returns where they are kept, for the node's report. A disk that does
        not come within DISK_WAIT or does not mount leaves them in RAM (and says so)."""
        if not disk:
            return "ram"
        if self.persist_dir in mount_points():
            return f"disk {disk}"  # mounted by this agent before a restart
        os.makedirs(self.persist_dir, mode=0o700, exist_ok=True)
        with contextlib.suppress(PullError):  # no udev: load the usual file system here
            self._bb("modprobe", "-q", "ext4")
        deadline = time.monotonic() + DISK_WAIT
        while True:
            try:
                self._bb("mount", "-o", "nosuid,nodev", disk, self.persist_dir)
            except PullError as e:
                if time.monotonic() < deadline:
                    time.sleep(1)
                    continue
                self.log(f"persistent paths in RAM: cannot mount {disk}: {e}")
                return f"ram (cannot mount {disk})"
            self.log(f"persistent paths on {disk}")
            return f"disk {disk}"

    def _persist(self, image: Image) -> None:
        """The image's persistent paths, bound from the persist directory where they outlive
        image changes; the first time a path is kept it starts as the image has it."""
        for path in image.spec.persist:
            kept = os.path.join(self.persist_dir, path.lstrip("/"))
            try:
                fd, name = directory(image.root, path, create=True)
            except FilesError as e:
                raise PullError(f"persistent path {e}") from None
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                os.close(os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd))
            except OSError as e:
                raise PullError(f"persistent path {path} is no directory in the image: "
                                f"{e.strerror}") from None  # fmt: skip
            finally:
                os.close(fd)
            if not os.path.isdir(kept):
                part = kept + ".part"
                shutil.rmtree(part, ignore_errors=True)
                os.makedirs(os.path.dirname(kept), mode=0o700, exist_ok=True)
                self._bb("cp", "-a", image.root + path, part)
                os.rename(part, kept)
                os.sync()  # on a disk: there after a power loss
                self.log(f"image {image.label}: keeping {path} from now on")
            image.binds.append((kept, path))

    def _mount(self, image: Image, target: str, *args: str) -> None:
        os.makedirs(target, exist_ok=True)
        self._bb("mount", *args, target)
        image.mounts.append(target)

    def _umount(self, targets: Iterable[str]) -> bool:
        ok = True
        for target in targets:
            try:
                self._bb("umount", target)
            except PullError:
                try:  # busy (a process elsewhere holds it): detach, freed when released
                    self._bb("umount", "-l", target)
                except PullError as e:
                    ok = False
                    self.log(f"cannot unmount {target}: {e}")
        return ok

    def _bb(self, *args: str) -> None:
        try:
            p = subprocess.run(
                [self.busybox, *args], capture_output=True, text=True, timeout=120, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise PullError(f"{args[0]} failed: {e}") from None
        if p.returncode != 0:
            detail = p.stderr.strip() or f"status {p.returncode}"
            raise PullError(f"{' '.join(args[:1] + args[-1:])} failed: {detail}")
