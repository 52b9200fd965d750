"""Throw-away network namespaces for protocol tests.

Every test host lives in a namespace this module creates; nothing is ever sent from the
default namespace. Names carry the pid and a counter so parallel runs never collide, and
teardown kills only the processes started here before deleting the namespace.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_counter = itertools.count()


def need_root() -> None:
    """Fail, saying why, where namespaces cannot be made."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        raise AssertionError(
            "protocol tests need root and iproute2 (run them through tests/run.sh)"
        )


def unique_name(prefix: str) -> str:
    return f"{prefix}{os.getpid() % 100000}x{next(_counter)}"


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Netns:
    """One namespace, with the processes started in it."""

    def __init__(self, prefix: str = "lpt") -> None:
        self.name = unique_name(prefix)
        sh("ip", "netns", "add", self.name)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.run("ip", "link", "set", "lo", "up")

    def cmd(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.cmd(*cmd), check=check, capture_output=True, text=True, timeout=timeout
        )

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(self.cmd(*cmd), start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        sh("ip", "netns", "del", self.name, check=False)


class Link:
    """Two namespaces joined by a veth pair: a server side and a client side."""

    def __init__(self, server_addr: str = "10.77.0.1/24", client_addr: str | None = None) -> None:
        self.server = Netns("lps")
        self.client = Netns("lpc")
        self.server_if, self.client_if = "lpsrv0", "lpcli0"
        tmp_a, tmp_b = unique_name("va"), unique_name("vb")
        try:
            sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
            sh("ip", "link", "set", tmp_a, "netns", self.server.name)
            sh("ip", "link", "set", tmp_b, "netns", self.client.name)
            self.server.run("ip", "link", "set", tmp_a, "name", self.server_if)
            self.client.run("ip", "link", "set", tmp_b, "name", self.client_if)
            self.server.run("ip", "addr", "add", server_addr, "dev", self.server_if)
            if client_addr:
                self.client.run("ip", "addr", "add", client_addr, "dev", self.client_if)
            self.server.run("ip", "link", "set", self.server_if, "up")
            self.client.run("ip", "link", "set", self.client_if, "up")
        except BaseException:
            self.close()
            raise

    def client_mac(self) -> str:
        out = self.client.run("cat", f"/sys/class/net/{self.client_if}/address").stdout
        return out.strip()

    def close(self) -> None:
        self.client.close()
        self.server.close()


_CLONE_NEWNET = 0x40000000


def call_in(namespace: str, function: Callable[[], T]) -> T:
    """function() in a thread of its own that has entered the namespace: sockets it opens
    live there (pytest itself stays in the default namespace; os.setns is 3.12's)."""
    libc = ctypes.CDLL(None, use_errno=True)
    outcome: list[Any] = []

    def run() -> None:
        try:
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace}")
            finally:
                os.close(fd)
            outcome.append((True, function()))
        except BaseException as error:
            outcome.append((False, error))

    thread = threading.Thread(target=run, name=f"in-{namespace}")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
