import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from etcd import EtcdCluster
from netns import Link, need_root
from nodefile import BOOT_SECTIONS, write_boot_files


@pytest.fixture
def link():
    """A server namespace and a client namespace joined by a veth pair."""
    need_root()
    pair = Link(client_addr=None)
    yield pair
    pair.close()


LAB_LIKE = """\
[server]
interface = "{interface}"
address = "{server}"
state_dir = "state"
heartbeat = 2
http_port = {http_port}

[network]
subnet = "{subnet}"
gateway = "{server}"
pool = "{pool}"

{boot_sections}
[groups.compute]
nodes = "cn[001-002]"
ip = "{prefix}.[11-12]"
mac = ["52:54:00:99:00:11", "{client_mac}"]
"""


@pytest.fixture
def make_config(tmp_path: Path):
    """Writes a small node file (with stand-in kernel, initrd and iPXE files) and loads it."""
    from layerpy.config import load

    def make(
        client_mac: str = "52:54:00:99:00:12",
        interface: str = "br0",
        server: str = "10.99.0.1",
        http_port: int = 8080,
        **extra: str,
    ):
        write_boot_files(tmp_path)
        prefix = server.rsplit(".", 1)[0]
        text = LAB_LIKE.format(
            interface=interface,
            server=server,
            subnet=f"{prefix}.0/24",
            prefix=prefix,
            pool=f"{prefix}.200-{prefix}.250",
            client_mac=client_mac,
            http_port=http_port,
            boot_sections=BOOT_SECTIONS,
        ) + "".join(extra.values())
        path = tmp_path / "nodes.toml"
        path.write_text(text)
        return load(path)

    return make


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A 3-member etcd cluster in namespaces of its own, one per test module (tests/etcd.py)."""
    need_root()
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd", numbered=True))
    yield cluster
    cluster.close()
