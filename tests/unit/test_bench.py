"""The benchmarks still run and still compare like with like (no timings are asserted)."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"
SCRIPTS = sorted(path.name for path in BENCH.glob("*.py"))
HELPERS = {  # bench/ modules another bench script imports (python bench/X.py puts bench/ first)
    name
    for name in SCRIPTS
    for other in BENCH.glob("*.py")
    if re.search(rf"^from {name[:-3]} import ", other.read_text(), re.M)
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_runs_from_the_checkout(script: str) -> None:
    """`python bench/X.py --help`, as the docs say to run them: usage and exit 0, nothing
    started (a helper module says nothing). Catches a bench/ file that hides a module of
    the standard library for the scripts beside it (bench/http.py did: `from http import
    HTTPStatus` failed in every script that imported aiohttp)."""
    result = subprocess.run(
        [sys.executable, f"bench/{script}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"python bench/{script} --help:\n{result.stderr}"
    if script in HELPERS:
        assert result.stdout == "", f"bench/{script} is imported by the others, yet printed"
    else:
        assert result.stdout.startswith(f"usage: {script}"), result.stdout


def test_no_module_on_a_bench_scripts_path_hides_the_standard_library() -> None:
    """bench/, tests/ and vm-lab/ go first on a bench script's sys.path."""
    for directory in ("bench", "tests", "vm-lab"):
        names = {path.stem for path in (ROOT / directory).glob("*.py")}
        hidden = sorted(names & sys.stdlib_module_names)
        assert not hidden, f"{directory}/ hides the standard library's {hidden}: rename them"


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


def test_the_storm_bench_node_file_and_client_messages(tmp_path: Path) -> None:
    """bench/storm.py's node file loads with its nodes and image; its simulated nodes'
    DHCP messages are what the server's codec reads (the run itself needs root)."""
    from layerpy.config import load
    from layerpy.proto import dhcp

    modules = {}
    for name in ("storm", "storm_client"):
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        modules[name] = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])  # (registered first: it has dataclasses)
    storm, client = modules["storm"], modules["storm_client"]
    (tmp_path / "vmlinuz").write_bytes(b"k")
    (tmp_path / "initrd").write_bytes(b"i")
    nodes = load(storm.layerpy_config(tmp_path, 500)).nodes
    assert len(nodes) == 500 and nodes["sn00500"].image == "tiny"
    assert (str(nodes["sn00500"].ip), nodes["sn00500"].mac) == (storm.ip(499), storm.mac(499))
    node = client.Node("sn00001", bytes.fromhex(storm.mac(0).replace(":", "")))
    sent = dhcp.decode(client.dhcp_packet(client.DISCOVER, node, 7, {77: b"iPXE"}))
    assert (sent.xid, sent.flags, sent.mac, sent.is_ipxe) == (7, 0x8000, storm.mac(0), True)
