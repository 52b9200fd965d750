"""What the real-etcd tests share: the module's 3-member cluster (``etcd_cluster``, one per
module) made whole after each test, its first instance namespace, and a key prefix per test."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from etcd import EtcdCluster, Instance

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
