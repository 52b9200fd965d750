"""sd_notify: what the service manager receives, at a path or an abstract address."""

from __future__ import annotations

import os
import socket

import pytest

from layerpy.notify import notify, reloading


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_fields_reach_the_manager_as_one_datagram(tmp_path, monkeypatch, abstract) -> None:
    name = f"@layerpy-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as manager:
        manager.bind("\0" + name[1:] if abstract else name)
        manager.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", name)
        assert notify("READY=1", "STATUS=serving 4 nodes")
        assert manager.recv(4096) == b"READY=1\nSTATUS=serving 4 nodes"
        assert reloading()
        first, stamp = manager.recv(4096).decode().split("\n")
        assert first == "RELOADING=1" and stamp.startswith("MONOTONIC_USEC=")


def test_without_a_manager_nothing_is_sent(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not notify("READY=1")  # unreachable: the server goes on
