"""The start-up warning when the kernel's ARP table cannot hold every node of the segment:
past its limit the kernel drops replies to nodes and says so only in its own log (a
1 000-node storm on two instances failed so, bench/storm.py)."""

from __future__ import annotations

from pathlib import Path

from layerpy.host import neighbour_warning


def test_more_nodes_than_the_table_holds_is_said_with_the_setting(
    make_config, tmp_path: Path
) -> None:
    config = make_config()  # two nodes, cn001 and cn002, on 10.99.0.0/24
    limit = tmp_path / "gc_thresh3"
    limit.write_text("1\n")
    warning = neighbour_warning(config, limit)
    assert warning is not None
    assert "2 nodes on 10.99.0.0/24" in warning and "holds 1 " in warning
    assert "net.ipv4.neigh.default.gc_thresh3=8" in warning


def test_room_for_every_node_or_no_such_setting_says_nothing(make_config, tmp_path: Path) -> None:
    config = make_config()
    limit = tmp_path / "gc_thresh3"
    limit.write_text("2\n")
    assert neighbour_warning(config, limit) is None
    assert neighbour_warning(config, tmp_path / "absent") is None
