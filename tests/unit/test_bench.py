"""The benchmarks still run and still compare like with like (no timings are asserted)."""

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
