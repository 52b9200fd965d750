"""Persistent paths on a node's own disk (issue 13): with ``persist_disk`` the agent keeps
an image's persistent paths on the node's disk (found by its file system label) instead
of RAM, so they outlive a power cycle; the node reports where it keeps them. The lab VM
gets a raw disk formatted ext4 here; its image counts its starts in /data."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from oci import build_image
from session import LabSession, lab_text

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not shutil.which("mkfs.ext4"), reason="needs e2fsprogs"),
]

LABEL = "lpstate"
COUNT = "n=$(cat /data/count 2>/dev/null || echo 0); n=$((n + 1)); echo $n > /data/count; "
COUNT += "echo PERSIST-COUNT $n; exec sleep 100000"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("persist")
    disk = run_dir / "cn001.disk"
    with disk.open("wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-L", LABEL, str(disk)], check=True)
    layout = build_image(run_dir / "oci", "counter", "COUNTER-IMAGE")
    text = lab_text()
    text = text.replace('power = "on"\n', 'power = "on"\nimage = "counter"\n', 1)
    text += f'\n[nodes.cn001]\npersist_disk = "LABEL={LABEL}"\n'
    text += f'\n[images.counter]\nsource = "oci-layout:{layout}:latest"\n'
    text += f'command = ["/bin/sh", "-c", "{COUNT}"]\npersist = ["/data"]\n'
    config = run_dir / "nodes.toml"
    config.write_text(text)
    session = LabSession(run_dir, config)
    session.start("cn001", disks={"cn001": disk})
    yield session
    session.close()


def on_disk(disk, path: str) -> str:
    """A file's content as the disk image holds it now (debugfs reads it, read-only)."""
    done = subprocess.run(["debugfs", "-R", f"cat {path}", str(disk)], capture_output=True,
                          text=True, check=False)  # fmt: skip
    return done.stdout.strip()


def test_a_disk_keeps_the_persistent_paths_across_a_power_cycle(lab) -> None:
    vm = lab.lab.vms["cn001"]
    lab.wait_state(["cn001"], "ready", timeout=180)
    assert vm.wait_serial(r"\[counter\] PERSIST-COUNT 1\b", 120)
    assert vm.wait_serial(rf"persistent paths on LABEL={LABEL}", 5)
    assert lab.nodes()["cn001"]["agent"]["persist"] == f"disk LABEL={LABEL}"
    lab.wait(lambda: on_disk(lab.run_dir / "cn001.disk", "/data/count") == "1", 60,
             "the count written to the disk (ext4 commits every 5 s)")  # fmt: skip
    boots = lab.nodes()["cn001"]["boots"]
    vm.mark = vm.serial_log.stat().st_size
    lab.cli("power", "cycle", "cn001")
    lab.wait(lambda: lab.nodes()["cn001"]["boots"] > boots, 120, "cn001 booted again")
    assert vm.wait_serial(r"\[counter\] PERSIST-COUNT 2\b", 180)  # in RAM it would be 1
