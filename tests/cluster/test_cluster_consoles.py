"""Consoles in a cluster (docs/ha.md, "Consoles"): only a node's owner captures its console
(a BMC serves one SOL session), the capture moves with a take-over, and an instance asked
for a console it does not capture names the owner. Real ``layerpy serve`` instances on the
3-member etcd (test_serve.py's heads); each node's console is a Unix socket served here that
notes which process connected (its peer credentials)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_serve import NODES, REST, TAKEOVER, Head, all_owned, heads, started, until

from etcd import EtcdCluster
from nodefile import InstanceFile

pytestmark = pytest.mark.netns


class SerialLines:
    """A serial socket per node: ``open[node]`` the pids connected now, ``ever[node]`` every
    pid that ever connected."""

    def __init__(self, directory: Path) -> None:
        self.open: dict[str, set[int]] = {node: set() for node in NODES}
        self.ever: dict[str, set[int]] = {node: set() for node in NODES}
        self._lock = threading.Lock()
        self._sockets = []
        for node in NODES:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(directory / f"{node}.console"))
            listener.listen(8)
            self._sockets.append(listener)
            threading.Thread(target=self._accept, args=(node, listener), daemon=True).start()

    def _accept(self, node: str, listener: socket.socket) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = struct.unpack("3i", creds)[0]
            threading.Thread(target=self._serve, args=(node, connection, pid), daemon=True).start()

    def _serve(self, node: str, connection: socket.socket, pid: int) -> None:
        with self._lock:
            self.open[node].add(pid)
            self.ever[node].add(pid)
        try:
            connection.sendall(f"{node} login: \n".encode())
            while connection.recv(4096):
                pass
        except OSError:
            pass
        finally:
            connection.close()
            with self._lock:
                self.open[node].discard(pid)

    def close(self) -> None:
        for listener in self._sockets:
            listener.close()


@pytest.fixture
def lines(tmp_path: Path) -> Iterator[SerialLines]:
    served = SerialLines(tmp_path)
    yield served
    served.close()


def captured_by_owners(heads_: list[Head], lines: SerialLines, via: Head) -> bool:
    """Each node's console open by its owner's process alone."""
    pids = {head.name: head.proc.pid for head in heads_ if head.proc is not None}
    owners = via.owners()
    return set(owners) == set(NODES) and all(
        lines.open[node] == {pids[owner]} for node, owner in owners.items()
    )


def test_only_the_owner_captures_a_console_and_the_capture_follows_a_take_over(
    cluster: EtcdCluster, instance_files: Callable[..., InstanceFile], tmp_path: Path,
    lines: SerialLines,
) -> None:  # fmt: skip
    console = f'console = "{tmp_path}/{{node}}.console"'
    rest = REST.replace('bmc = { driver = "none" }', f'bmc = {{ driver = "none", {console} }}')
    with heads(cluster, instance_files, 2, rest=rest) as pair:
        started(*pair)
        two = pair[1]
        until(lambda: all_owned(two, {head.name for head in pair}), "every node owned",
              logs=pair)  # fmt: skip
        until(lambda: captured_by_owners(pair, lines, two),
              "each console captured by its owner alone", logs=pair)  # fmt: skip
        owners = two.owners()
        for node in owners:  # never by the other, not even for a moment
            assert len(lines.ever[node]) == 1, f"{node}'s console was opened by {lines.ever}"
        # (on a busy machine the first may own all: sticky ownership keeps it so)
        node, owner_name = next(iter(sorted(owners.items())))
        owner = next(head for head in pair if head.name == owner_name)
        other = next(head for head in pair if head is not owner)
        code, text = other.call(f"/api/v1/nodes/{node}/console")
        assert code == 409 and owner.name in text and "layerpy console" in text, (code, text)
        shown = other.cli("console", node)  # the operator's command says where to go
        assert shown.returncode != 0 and f"instance {owner.name}" in shown.stderr, shown
        code, text = owner.call(f"/api/v1/nodes/{node}/console")
        assert code == 200 and f"{node} login:" in text, (code, text)
        owner.stop()  # a clean stop: its nodes and their consoles go to the other at once
        until(lambda: all_owned(other, {other.name}), f"{other.name} owning every node",
              timeout=TAKEOVER, logs=(other,))  # fmt: skip
        until(lambda: captured_by_owners([other], lines, other),
              f"{other.name} capturing every console", timeout=TAKEOVER, logs=(other,))  # fmt: skip
