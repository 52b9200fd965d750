"""tests/etcd.py itself: an instance cut off from etcd keeps its boot link; members restart."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from layerpy.cluster.etcd import Etcd, EtcdUnavailable

from etcd import EtcdCluster
from netns import Netns

pytestmark = pytest.mark.netns


def test_an_instance_cut_from_etcd_keeps_its_boot_link(etcd_cluster: EtcdCluster) -> None:
    boot = Netns("lpbs")
    try:
        boot.run("ip", "link", "add", "br0", "type", "bridge")
        boot.run("ip", "addr", "add", "10.80.0.1/24", "dev", "br0")
        boot.run("ip", "link", "set", "br0", "up")
        instance = etcd_cluster.add_instance()
        instance.connect(boot.name, "br0", "boot0", "10.80.0.2/24")
        boot.popen([sys.executable, "-m", "http.server", "--bind", "10.80.0.1", "8000"],
                   cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

        def boot_link_answers() -> bool:
            result = instance.netns.run("curl", "-sf", "-m", "2", "-o", "/dev/null",
                                        "http://10.80.0.1:8000/", check=False)  # fmt: skip
            return result.returncode == 0

        deadline = time.monotonic() + 20
        while not boot_link_answers():
            assert time.monotonic() < deadline, "the boot segment's server never answered"
            time.sleep(0.1)

        async def put() -> int:
            etcd = Etcd(etcd_cluster.endpoints, timeout=0.5)
            await etcd.open()
            try:
                return await etcd.put("/fixture", b"x")
            finally:
                await etcd.close()

        instance.cut()
        try:
            with pytest.raises(EtcdUnavailable):
                instance.run(put)
            assert boot_link_answers(), "cutting etcd off cut the boot link too"
        finally:
            instance.restore()
        assert instance.run(put) > 0
    finally:
        boot.close()


def test_a_member_stopped_and_restarted_rejoins(etcd_cluster: EtcdCluster) -> None:
    member = etcd_cluster.members[2]
    member.stop()
    assert not member.running
    etcd_cluster.wait_healthy()  # the two others
    member.restart()
    etcd_cluster.wait_healthy()
    assert etcd_cluster.status(member).get("Leader") not in (None, "0")
