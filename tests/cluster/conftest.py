"""What the real-etcd tests share: the module's 3-member cluster (``etcd_cluster``, one per
module) made whole after each test, its first instance namespace, a key prefix per test,
and instances' node files on them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from etcd import EtcdCluster, Instance
from nodefile import InstanceFile, instance_file

_prefixes = itertools.count()


@pytest.fixture
def cluster(etcd_cluster: EtcdCluster) -> Iterator[EtcdCluster]:
    """The module's cluster, made whole again after each test."""
    yield etcd_cluster
    etcd_cluster.heal()


@pytest.fixture
def instance(cluster: EtcdCluster) -> Instance:
    return cluster.instances[0] if cluster.instances else cluster.add_instance()


@pytest.fixture
def prefix() -> str:
    """A prefix of the test's own: the module's tests share one cluster."""
    return f"/lpt{next(_prefixes)}"


@pytest.fixture
def instance_files(
    cluster: EtcdCluster, prefix: str, tmp_path: Path
) -> Callable[..., InstanceFile]:
    """``make(name, server, rest)``: an instance's folder under the test's and its node file
    on the module's cluster and the test's prefix (``server``: its [server] table's lines)."""

    def make(name: str, server: str, rest: str) -> InstanceFile:
        return instance_file(tmp_path / name, name, server, cluster.endpoints, prefix, rest)

    return make
