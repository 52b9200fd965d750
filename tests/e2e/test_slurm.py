"""The Slurm demo as a test (issue 13): a Slurm image built from Debian packages boots on
three lab VMs with slurm.conf, /etc/hosts and the munge key rendered and delivered by
layerpy; slurmctld beside the server sees them idle and runs jobs; a changed file is
applied in place; a rolling update to v2 waits for the job on a busy node, reboots
nothing, and keeps the persistent paths (vm-lab/slurm_lab.py has the steps; the demo
runs the same). About 5 minutes under TCG; times go to <run dir>/timings.json."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from session import LAYERPY
from slurm_lab import NODES, SlurmLab

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("mmdebstrap") and shutil.which("slurmctld") and shutil.which("munged")),
        reason="needs mmdebstrap, slurmctld and munge (vm-lab/setup.sh installs them)",
    ),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    lab = SlurmLab(tmp_path_factory.mktemp("slurm"))
    yield lab
    lab.close()
    (lab.run_dir / "timings.json").write_text(json.dumps(lab.timings, indent=1))
    print(f"slurm e2e timings ({lab.run_dir}): {json.dumps(lab.timings)}", flush=True)


def test_the_cluster_boots_to_idle_and_runs_a_job(slurm) -> None:
    assert sorted(slurm.boot()) == NODES
    keys = slurm.controller.srun("-N3", "stat", "-c", "%U:%G %a", "/etc/munge/munge.key")
    assert keys.stdout.split("\n")[:3] == ["munge:munge 400"] * 3
    hosts = slurm.controller.srun("-N1", "-w", "cn002", "getent", "hosts", "cn003", "layerpy")
    assert hosts.stdout.split() == ["10.99.0.13", "cn003", "10.99.0.1", "layerpy"]
    render = [str(LAYERPY), "render", "cn001", "/etc/munge/munge.key", "-c", str(slurm.config)]
    shown = subprocess.run(render, capture_output=True, text=True, check=True).stdout
    assert shown.startswith("(secret: 1024 bytes from")  # all an operator sees of it


def test_a_changed_file_is_applied_in_place(slurm) -> None:
    assert slurm.change_files() == ["SlurmdDebug=verbose"] * 3


def test_a_rolling_update_waits_for_the_job_and_keeps_state(slurm) -> None:
    job, kept = slurm.roll()
    assert job.returncode == 0, job.stdout
    assert "job done on cn001" in job.stdout
    assert sorted(kept) == NODES  # what each node wrote to /scratch before the roll
    release = slurm.controller.srun("-N3", "cat", "/etc/image-release").stdout
    assert release.count("VERSION=v2") == 3
