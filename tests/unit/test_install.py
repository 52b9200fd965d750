"""`layerpy install` writes systemd/'s files (one source) with the unit's placeholders
filled in; systemd finds the unit sound and rates it safe; a wheel carries the files.
(tests/e2e/test_service.py installs from layerpy.pyz and runs the unit under systemd.)"""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from layerpy import bundle, install

ROOT = Path(__file__).resolve().parent.parent.parent
SYSTEMD = ROOT / "systemd"
PLACEHOLDER = re.compile(r"@[A-Z_]+@")
MAX_EXPOSURE = 2.5  # systemd-analyze security's scale: 0 (locked down) to 10 (unsafe)
needs_systemd_analyze = pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="needs systemd-analyze (systemd)"
)


def rendered(tmp_path: Path, nodes: int = 0) -> Path:
    """The unit install writes, for an executable layerpy in `tmp_path` (verify wants one)."""
    program = tmp_path / "bin" / "layerpy"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    path = tmp_path / "layerpy.service"
    path.write_text(install.unit(program, nodes))
    return path


def test_the_unit_installed_is_systemds_file_with_its_placeholders_filled() -> None:
    assert bundle.systemd_dir() == SYSTEMD  # an editable install reads the checkout's
    program = Path("/opt/site/bin/layerpy")
    template = (SYSTEMD / "layerpy.service").read_text().splitlines()
    unit = install.unit(program, 100_000).splitlines()
    assert len(unit) == len(template)
    changed = {old: new for old, new in zip(template, unit, strict=True) if old != new}
    assert changed == {
        "ExecStartPre=@PROGRAM@ check --quiet": f"ExecStartPre={program} check --quiet",
        "ExecStart=@PROGRAM@ serve": f"ExecStart={program} serve",
        "ExecReload=@PROGRAM@ reload": f"ExecReload={program} reload",
        "LimitNOFILE=@NOFILE@": "LimitNOFILE=1201024",  # 12 per node and 1024
    }
    assert PLACEHOLDER.findall("\n".join(template)) == ["@PROGRAM@"] * 3 + ["@NOFILE@"]
    assert "LimitNOFILE=65536" in install.unit(program, 10).splitlines()


def test_the_sysusers_line_installed_is_systemds_file(monkeypatch) -> None:
    monkeypatch.setattr(sys, "executable", "/opt/layerpy/bin/python")  # a venv it accepts
    (step,) = [step for step in install.steps(install.PREFIX, 0) if step.put
               and step.put[0] == install.SYSUSERS_PATH]  # fmt: skip
    assert step.put is not None
    assert step.put[2] == (SYSTEMD / "layerpy.sysusers.conf").read_bytes()
    assert f"\nu {install.USER} " in step.put[2].decode()


def test_the_unit_text_lives_only_in_systemd() -> None:
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "packaging").rglob("*.py")]:
        assert "NoNewPrivileges=" not in path.read_text(), f"{path} holds a unit of its own"


def test_the_unit_starts_after_a_local_etcd_without_pulling_it_in() -> None:
    """An instance of a cluster on a host with an etcd member ([cluster], docs/ha.md) starts
    once etcd does; a single server, or a host without etcd, is not changed by it."""
    lines = (SYSTEMD / "layerpy.service").read_text().splitlines()
    orders = [line for line in lines if line.startswith(("After=", "Wants=", "Requires="))]
    assert "etcd.service" in " ".join(o for o in orders if o.startswith("After=")), orders
    assert "etcd.service" not in " ".join(o for o in orders if not o.startswith("After=")), orders


@needs_systemd_analyze
def test_systemd_analyze_verify_finds_nothing_wrong(tmp_path: Path) -> None:
    unit = rendered(tmp_path)
    verified = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, ""), unit.read_text()


@needs_systemd_analyze
def test_systemd_analyze_security_rates_the_unit_safe(tmp_path: Path) -> None:
    unit = rendered(tmp_path)
    rated = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager",
         f"--threshold={MAX_EXPOSURE * 10:.0f}", str(unit)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for layerpy.service: ([\d.]+)", rated.stdout)
    assert found, rated.stdout + rated.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, rated.stdout
    assert rated.returncode == 0, rated.stdout + rated.stderr


def test_a_wheel_carries_the_systemd_files(tmp_path: Path) -> None:
    """setup.py's build step: what a `pip install ./layerpy` into a venv installs from."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("src", "systemd"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = tmp_path.glob("layerpy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for path in SYSTEMD.iterdir():
            packaged = archive.read(f"layerpy/bundled/systemd/{path.name}")
            assert packaged == path.read_bytes(), path.name
