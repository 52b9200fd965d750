"""A ``layerpy serve`` instance stops promptly on SIGTERM with writes queued for etcd: what
etcd takes in time is flushed, what it does not is dropped and said (a 100 000-node instance
once had not stopped 60 s after SIGTERM)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import pytest
from test_serve import NODES, heads, started, until

from etcd import EtcdCluster
from nodefile import InstanceFile

pytestmark = pytest.mark.netns

STOP_WITHIN = 10.0  # seconds from SIGTERM to exit: the flush (5 s), the revoke (2 s), slack


def test_sigterm_with_writes_queued_for_an_unreachable_etcd_exits_saying_what_it_drops(
    cluster: EtcdCluster, instance_files: Callable[..., InstanceFile]
) -> None:
    with heads(cluster, instance_files, 1) as (one,):
        started(one)
        one.instance.cut()
        try:
            for node in range(1, len(NODES) + 1):  # a boot token and an observed record each
                one.boot(node)
            until(lambda: "writes wait" in one.log.read_text(), "head1 saying writes wait",
                  logs=(one,))  # fmt: skip
            assert one.proc is not None
            asked = time.monotonic()
            one.proc.send_signal(signal.SIGTERM)
            until(lambda: one.proc.poll() is not None, "head1 exited after SIGTERM",
                  timeout=STOP_WITHIN, logs=(one,))  # fmt: skip
            print(f"stopped {time.monotonic() - asked:.1f} s after SIGTERM, etcd away")
            said = one.log.read_text()
            assert "not sent to etcd" in said, said[-3000:]
        finally:
            one.instance.restore(check=False)


def test_sigterm_flushes_the_queued_writes_when_etcd_takes_them(
    cluster: EtcdCluster, instance_files: Callable[..., InstanceFile], prefix: str
) -> None:
    with heads(cluster, instance_files, 1) as (one,):
        started(one)
        one.instance.cut()
        try:
            for node in range(1, len(NODES) + 1):
                one.boot(node)
            until(lambda: "writes wait" in one.log.read_text(), "head1 saying writes wait",
                  logs=(one,))  # fmt: skip
        finally:
            one.instance.restore()
        assert one.proc is not None
        asked = time.monotonic()
        one.proc.send_signal(signal.SIGTERM)  # the writer may still be in its back-off
        until(lambda: one.proc.poll() is not None, "head1 exited after SIGTERM",
              timeout=STOP_WITHIN, logs=(one,))  # fmt: skip
        print(f"stopped {time.monotonic() - asked:.1f} s after SIGTERM, etcd back")
        assert "not sent to etcd" not in one.log.read_text()
        written = cluster.etcdctl(
            cluster.members[0], "get", "--prefix", "--keys-only", f"{prefix}/tokens/"
        )
        assert all(f"{prefix}/tokens/{node}" in written.stdout for node in NODES), written.stdout
