"""`layerpy init`'s node file: its discovery pool, and that it loads as written."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface

from layerpy import bundle
from layerpy.config import parse
from layerpy.config.starter import discovery_pool, starter

from nodefile import write_boot_files


def test_the_pool_sits_at_the_top_of_the_subnet_away_from_the_server() -> None:
    assert discovery_pool(IPv4Interface("10.0.0.1/24")) == (
        IPv4Address("10.0.0.188"),
        IPv4Address("10.0.0.250"),
    )
    assert discovery_pool(IPv4Interface("10.0.0.200/24")) == (
        IPv4Address("10.0.0.10"),
        IPv4Address("10.0.0.72"),
    )
    wide = discovery_pool(IPv4Interface("10.1.0.1/16"))
    assert wide is not None and int(wide[1]) - int(wide[0]) == 99  # POOL_SIZE at most
    assert discovery_pool(IPv4Interface("10.0.0.1/30")) is None


def test_the_starter_file_loads_as_written(tmp_path, monkeypatch) -> None:
    write_boot_files(tmp_path)
    monkeypatch.setattr(
        bundle, "minos", lambda arch="amd64": (tmp_path / "vmlinuz", tmp_path / "initrd")
    )
    monkeypatch.setattr(bundle, "ipxe_dir", lambda: tmp_path / "ipxe")
    text = starter("eth1", IPv4Interface("192.168.7.1/24"))
    config = parse(text, tmp_path / "nodes.toml")
    assert (config.server.interface, str(config.server.address)) == ("eth1", "192.168.7.1")
    assert config.network.pool == (IPv4Address("192.168.7.188"), IPv4Address("192.168.7.250"))
    assert config.network.discover and config.minos.kernel == tmp_path / "vmlinuz"
    commented = "\n".join(line[2:] for line in text.splitlines() if line.startswith("# ["))
    assert "[groups.compute]" in commented  # the example group is there to uncomment
