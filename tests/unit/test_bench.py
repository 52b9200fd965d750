"""The benchmarks still run and still compare like with like (no timings are asserted)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent.parent / "bench"


def test_dhcp_codec_bench_builds_the_same_reply_on_both_sides() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / "dhcp_codec.py"), "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ratio layerpy/dpkt" in result.stdout


def test_a_100_000_node_file_is_a_few_dozen_lines(tmp_path: Path) -> None:
    """MAC and address ranges: the loop-lag bench's 100 000 nodes in four groups."""
    from layerpy.config import load

    spec = importlib.util.spec_from_file_location("loop_lag", BENCH / "loop_lag.py")
    assert spec is not None and spec.loader is not None
    loop_lag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_lag)
    path = loop_lag.node_file(tmp_path, 100_000)
    assert len(path.read_text().splitlines()) < 60
    nodes = load(path).nodes
    assert len(nodes) == 100_000
    last = nodes["g3n25000"]
    assert (str(last.ip), last.mac) == ("10.3.199.250", "52:54:00:01:86:9f")
    assert len({node.mac for node in nodes.values()}) == 100_000
