"""Keep the system image the server wants running as a container, with the node's own
files in it, and swap either without a reboot.

The server names an image (digest, URL, sha256, format); a worker thread prepares it
(``image``) and places the node's files into it (``files``) while the old container keeps
running, and only then swaps the container (``process``). A failed pull is retried with
backoff and leaves the old container running; containers do not depend on the agent or
the server, and a prepared image needs no network. New files for the running image are
written into its root in place, and each changed file's ``apply`` command run inside.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from layerpy.agent.files import FilesError, NodeFiles
from layerpy.agent.image import PullError, Roots, label
from layerpy.agent.process import Container, backoff
from layerpy.proto.agent import FilesSpec, FilesStatus, ImageSpec, ImageState, ImageStatus, encode

BUSYBOX = "/bin/busybox"
NODE_DIR = "node"  # below the state directory: the container's /run/layerpy (a job's "busy")


class Superseded(Exception):
    """The server wants something else now: drop this pull."""


def _uptime() -> float:
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def _stderr(msg: str) -> None:
    print(f"layerpy-agent: {msg}", file=sys.stderr, flush=True)


def _key(spec: ImageSpec | None) -> str | None:
    """What makes a new container: the image and how it is run (not the URL it comes from)."""
    if spec is None:
        return None
    return json.dumps(encode(dataclasses.replace(spec, name="", url="")), sort_keys=True)


class Runner:
    """Keeps the image the server wants running. want(), tick() and report() return quickly:
    pulls run in a worker thread, restarts are driven by tick()."""

    def __init__(
        self,
        state_dir: str = "/run/layerpy",
        log: Callable[[str], None] = _stderr,
        hostname: str = "",
        *,
        busybox: str = BUSYBOX,
        console: str = "/dev/console",
        stop_timeout: float = 10.0,
        backoff: tuple[float, float] = (1.0, 30.0),
        pull_backoff: tuple[float, float] = (5.0, 300.0),
        persist_disk: str = "",
    ) -> None:
        state_dir = os.path.realpath(state_dir)
        self.log = log
        self.hostname = hostname or socket.gethostname()
        self.authorization: str | None = None  # the node's credential for its image and files
        self.server = ""  # the server's URL, where the node's files come from
        self.pull_backoff = pull_backoff
        persist = os.path.join(state_dir, "persist")
        self._roots = Roots(os.path.join(state_dir, "images"), busybox, log, persist)
        self.persist = self._roots.keep_on(persist_disk)  # where persistent paths are kept
        node_dir = os.path.join(state_dir, NODE_DIR)
        os.makedirs(node_dir, mode=0o755, exist_ok=True)
        self._files = NodeFiles(os.path.join(state_dir, "files"))
        self._container = Container(
            self._roots,
            os.path.join(state_dir, "container.json"),
            log,
            node_dir=node_dir,
            busybox=busybox,
            console=console,
            stop_timeout=stop_timeout,
            backoff=backoff,
        )
        # (state, spec it is about, error, uptime since): one tuple, so report() reads it whole
        self._status = ImageStatus(ImageState.NONE, since=_uptime())
        self._want: ImageSpec | None = None
        self._want_key: str | None = None
        self._pull_error: tuple[str | None, ImageSpec | None, str] | None = None  # key, spec, why
        self._pull_fails = 0
        self._retry_at = 0.0
        self._files_want: FilesSpec | None = None
        self._files_status = FilesStatus()  # the revision in the running root, and trouble
        self._files_failing: tuple[str, int, float] | None = None  # revision, fails, retry at
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()  # the container and its image
        self._state_lock = threading.RLock()  # the wanted spec, the worker, the state reported
        self._adopt()

    # -- the API the agent loop calls --

    def want(self, spec: ImageSpec | None, files: FilesSpec | None = None) -> None:
        """The server's answer: the image to run (None for nothing) and the node's files
        (None: the server said nothing of them, keep what is there)."""
        key = _key(spec)
        with self._state_lock:
            if files is not None:
                self._files_want = files
            if key == self._want_key:
                self._want = spec  # same container; the URL may have moved
            else:
                self._want, self._want_key = spec, key
        self._kick()

    def use(self, server: str) -> None:
        """Fetch from this server from now on (the agent moved to it): the wanted image's
        URL moves too when it was the old server's, and a failed pull or files fetch is
        retried at once. The container runs on."""
        old, self.server = self.server, server
        with self._state_lock:
            spec = self._want
            if old and spec is not None and spec.url.startswith(old + "/"):
                self._want = dataclasses.replace(spec, url=server + spec.url[len(old) :])
            self._retry_at = 0.0
            if self._files_failing is not None:
                self._files_failing = (*self._files_failing[:2], 0.0)

    def tick(self) -> None:
        """Reap and restart a dead container, start pending pulls; skips while a swap runs."""
        if self._lock.acquire(blocking=False):
            try:
                if self._container.watch(self.hostname):
                    self._settle()
            finally:
                self._lock.release()
        self._kick()

    def report(self) -> ImageStatus:
        proc = self._container.proc
        pid = proc.init_pid() if proc else None
        return dataclasses.replace(self._status, container_pid=pid)

    def files(self) -> FilesStatus:
        return self._files_status

    # -- state --

    def _set(self, state: ImageState, spec: ImageSpec | None, error: str | None = None) -> None:
        """The state reported, in one record so report() reads it whole."""
        old = self._status
        digest = spec.digest if spec else None
        since = old.since
        if (old.state, old.digest, old.error) != (state, digest, error):
            since = _uptime()
        name = spec.name if spec else None
        self._status = ImageStatus(state, name, digest, error, None, since)

    def _settle(self) -> None:
        """The resting state, once no pull is under way."""
        with self._state_lock:
            image = self._container.image
            if self._worker is not None:
                return
            if self._pull_error is not None:
                self._set(ImageState.ERROR, self._pull_error[1], self._pull_error[2])
            elif image is not None and self._container.error:
                self._set(ImageState.ERROR, image.spec, self._container.error)
            elif image is not None:
                self._set(ImageState.ACTIVE, image.spec)
            else:
                self._set(ImageState.NONE, None)

    def _check(self, key: str | None) -> None:
        if self._want_key != key:
            raise Superseded

    def _adopt(self) -> None:
        """Carry on with what a previous agent left running or prepared; sweep the rest."""
        image = self._container.adopt()
        if image is not None:
            self._want, self._want_key = image.spec, _key(image.spec)
            self._settle()
        self._roots.sweep(keep=image)

    # -- pulls (worker thread) --

    def _kick(self) -> None:
        """Start a worker when the server wants another image than what runs, or other
        files in it."""
        with self._state_lock:
            if self._worker is not None:
                return
            spec, key = self._want, self._want_key
            image = self._container.image
            if key == (_key(image.spec) if image else None):
                if self._pull_error is not None:  # the server went back to what runs
                    self._pull_error = None
                    self._settle()
                files = self._files_want
                if image is not None and files is not None and self._files_due(files):
                    self._start(self._update_files, files)
                return
            if (
                self._pull_error
                and self._pull_error[0] == key
                and time.monotonic() < self._retry_at
            ):
                return
            if spec is not None:  # reported from now on, not when the thread gets going
                self._set(ImageState.UPDATING if image else ImageState.PULLING, spec)
            self._start(self._work, spec, key)

    def _start(self, work: Callable[..., None], *args: object) -> None:
        self._worker = threading.Thread(target=work, args=args, name="layerpy-image",
                                        daemon=True)  # fmt: skip
        self._worker.start()

    def _files_due(self, files: FilesSpec) -> bool:
        """Other files than the running root has, and no failure of them to wait out."""
        failing = self._files_failing
        if files.revision == self._files_status.revision:
            return False
        return failing is None or failing[0] != files.revision or time.monotonic() >= failing[2]

    def _work(self, spec: ImageSpec | None, key: str | None) -> None:
        try:
            if spec is None:
                with self._lock:
                    self._check(key)
                    if self._container.image is not None:
                        self.log(
                            f"image {self._container.image.label}: stopping, the server wants none"
                        )
                        self._container.replace(None, self.hostname)
                        self._files_placed(None, None)
            else:
                self._switch(spec, key)
            self._pull_error, self._pull_fails = None, 0
        except Superseded:
            self.log(f"image {label(spec)}: superseded, dropped")
        except Exception as e:  # whatever it was, the old container keeps running
            reason = str(e) if isinstance(e, PullError) else f"{type(e).__name__}: {e}"
            same = self._pull_error is not None and self._pull_error[0] == key
            self._pull_fails = self._pull_fails + 1 if same else 1
            delay = backoff(self.pull_backoff, self._pull_fails)
            self._retry_at = time.monotonic() + delay
            self._pull_error = (key, spec, reason)
            self.log(f"image {label(spec)}: {reason}; retrying in {delay:g} s")
        finally:
            with self._state_lock:
                self._worker = None
            self._settle()
            self._kick()

    def _switch(self, spec: ImageSpec, key: str | None) -> None:
        """Prepare the new image and its files while the old container runs, then swap the
        containers."""
        t0 = time.monotonic()
        verb = "updating" if self._container.image else "pulling"
        image = self._roots.prepare(
            spec, self.hostname, verb, lambda: self._check(key), self.authorization
        )
        try:
            files = self._files_want
            if files is not None:
                self._files.fetch(files, self.server, self.authorization, lambda: self._check(key))
                self._files.place(image.root, files)
            with self._lock:
                self._check(key)
                self._container.replace(image, self.hostname)
                self._files_placed(files, None)
        except FilesError as e:
            raise PullError(f"files: {e}") from None
        finally:
            if self._container.image is not image:
                self._roots.teardown(image)
        self.log(f"image {image.label} active in {time.monotonic() - t0:.1f} s")

    # -- files into the running image (worker thread) --

    def _update_files(self, files: FilesSpec) -> None:
        """Write the node's new files into the running root, and apply the changed ones."""
        try:
            self._files.fetch(files, self.server, self.authorization, lambda: None)
            with self._lock:
                image = self._container.image
                if image is None:
                    return
                changed = self._files.place(image.root, files)
                problems = []
                for command in dict.fromkeys(f.apply for f in changed if f.apply):
                    problem = self._container.run_inside(command)
                    if problem is not None:
                        problems.append(f"apply {command!r}: {problem}")
                self._files_placed(files, "; ".join(problems) or None)
            paths = ", ".join(f.path for f in changed) or "none changed"
            self.log(f"files revision {files.revision} in place ({paths})")
            for problem in problems:
                self.log(f"files: {problem}")
        except Exception as e:  # whatever it was, the running container is left as it is
            failing = self._files_failing
            fails = failing[1] + 1 if failing and failing[0] == files.revision else 1
            delay = backoff(self.pull_backoff, fails)
            self._files_failing = (files.revision, fails, time.monotonic() + delay)
            why = str(e) if isinstance(e, FilesError | OSError) else f"{type(e).__name__}: {e}"
            error = f"revision {files.revision}: {why}"
            self._files_status = FilesStatus(self._files_status.revision, error)
            self.log(f"files {error}; retrying in {delay:g} s")
        finally:
            with self._state_lock:
                self._worker = None
            self._kick()

    def _files_placed(self, files: FilesSpec | None, error: str | None) -> None:
        self._files_failing = None
        self._files_status = FilesStatus(files.revision if files else None, error)
