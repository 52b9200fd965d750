"""The Slurm demo: a cluster that boots from layerpy, runs jobs and rolls to a new image.

    vm-lab/demo.sh --slurm            # shows it to a person, then keeps the lab running

Three lab VMs (cn001-cn003, 512 MB) boot the minOS, which runs the slurm image
(``debian-image.py --flavour slurm``: slurmd, munge, systemd) as a container, with
/etc/slurm/slurm.conf, /etc/hosts (templates in vm-lab/slurm/) and the munge key (a
secret) delivered by layerpy; slurmctld and munged run beside the server in the lab's
namespace (slurm_controller.py) from the same slurm.conf template. The steps, each
measured, are what tests/e2e/test_slurm.py checks:

1. ``boot``: power on to every node ``idle`` in ``sinfo``; ``srun -N3 hostname``.
2. ``change_files``: a variable of slurm.conf changes in the node file; on reload every
   node gets the new file in place and restarts slurmd in its container (``apply``).
3. ``roll``: while a job runs on cn001, the node file moves the nodes to image v2: the
   free nodes switch at once, cn001 when its job has ended (the prolog marked it busy),
   the job finishes, no node reboots, and /scratch (a persistent path) keeps what a job
   wrote there before.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from session import LAYERPY, REPO, LabSession, lab_text
from slurm_controller import (
    Controller,
    context_from_node_file,
    held_job,
    make_munge_key,
    node_files,
)

NODES = ["cn001", "cn002", "cn003"]
MEMORY_MB = 512
PERSIST = ["/var/spool/slurmd", "/var/lib/munge", "/scratch"]
ADDRESS = "10.99.0.1"  # the server's, in configs/lab.toml
DEBIAN_IMAGE = REPO / "vm-lab" / "debian-image.py"

IMAGES = """
[images.slurm]
source = "oci-layout:{layout}:v1"
systemd = true
persist = {persist}

[images.slurm2]
source = "oci-layout:{layout}:v2"
systemd = true
persist = {persist}
"""


def build_image(run_dir: Path) -> dict[str, Any]:
    """The slurm image's OCI layout (v1 and v2) in `run_dir`/slurm-oci: cached after the
    first build (mmdebstrap through apt's mirror, ~20 s)."""
    built = subprocess.run(
        [sys.executable, str(DEBIAN_IMAGE), "--flavour", "slurm", str(run_dir / "slurm-oci")],
        capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    if built.returncode:
        raise RuntimeError(f"slurm image build failed:\n{built.stderr}{built.stdout}")
    return json.loads(built.stdout)


def node_file(run_dir: Path, key: Path, image: str = "slurm") -> Path:
    """configs/lab.toml with the compute group cut to three nodes running `image`, and
    the slurm images and files."""
    text = lab_text()
    for four, three in (('"cn[001-004]"', '"cn[001-003]"'), ("[11-14]", "[11-13]"),
                        (', "52:54:00:99:00:14"]', "]")):  # fmt: skip
        assert four in text, four
        text = text.replace(four, three)
    text = text.replace('power = "on"\n', f'power = "on"\nimage = "{image}"\n', 1)
    text += IMAGES.format(layout=run_dir / "slurm-oci", persist=json.dumps(PERSIST))
    text += node_files(key)
    path = run_dir / "nodes.toml"
    path.write_text(text)
    return path


class SlurmLab:
    """The lab, the layerpy server, the Slurm controller; the steps of the demo."""

    def __init__(self, run_dir: Path, say: Any = print) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.say = say
        self.timings: dict[str, float] = {}
        started = time.monotonic()
        self.image = build_image(self.run_dir)
        self.note("image build (cached: well under 1 s)", time.monotonic() - started)
        self.key = make_munge_key(self.run_dir / "munge.key")
        self.config = node_file(self.run_dir, self.key)
        self.session = LabSession(self.run_dir, self.config)
        try:
            context = context_from_node_file(self.config, "cn001")
            self.controller = Controller(self.session.lab, self.run_dir / "slurm", self.key,
                                         context)  # fmt: skip
        except BaseException:
            self.session.close()
            raise

    def close(self) -> None:
        try:
            self.controller.close()
        finally:
            self.session.close()

    def note(self, what: str, seconds: float) -> None:
        self.timings[what] = round(seconds, 1)
        self.say(f"slurm demo: {what}: {seconds:.1f} s")

    # -- what the nodes are, as layerpy sees them --

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {name: node for name, node in self.session.nodes().items() if name in NODES}

    def digest(self, image: str) -> str:
        images = self.session.api("/api/v1/images") or []
        return next((i["digest"] for i in images if i["name"] == image), "") or ""

    def running(self, image: str, names: list[str] = NODES) -> bool:
        """Every node of `names` runs `image` with the files it should have."""
        digest, nodes = self.digest(image), self.nodes()
        explained = {n: self.session.api(f"/api/v1/nodes/{n}/explain") or {} for n in names}
        return bool(digest) and all(
            nodes[n]["image"]["digest"] == digest and nodes[n]["image"]["state"] == "active"
            and explained[n].get("files", {}).get("running") is not None
            and explained[n]["files"]["running"] == explained[n]["files"]["wanted"]
            for n in names
        )  # fmt: skip

    def wait_slurmd_back(self, before: dict[str, str], timeout: float = 300) -> None:
        """Every node's slurmd started anew since `before` and registered, and idle."""
        self.session.wait(
            lambda: all(self.controller.slurmd_started().get(n) != before.get(n) for n in NODES),
            timeout, "every slurmd restarted and registered",
        )  # fmt: skip
        self.controller.wait_nodes(NODES, "idle", timeout)

    def edit(self, old: str, new: str) -> None:
        """Change the node file as an admin would (the reload comes after)."""
        text = self.config.read_text()
        assert old in text, old
        self.config.write_text(text.replace(old, new, 1))

    # -- the steps --

    def boot(self) -> list[str]:
        """Returns what ``srun -N3 hostname`` printed."""
        started = time.monotonic()
        self.session.start(*NODES, memory_mb=MEMORY_MB)
        self.session.wait_state(NODES, "ready", timeout=300)
        self.note("power on to all ready", time.monotonic() - started)
        self.session.wait(lambda: self.running("slurm"), 600, "slurm v1 active with its files")
        self.note("power on to image and files in place", time.monotonic() - started)
        self.controller.wait_nodes(NODES, "idle", 300)
        self.note("power on to sinfo idle", time.monotonic() - started)
        self.say(self.controller.sinfo())
        names = self.controller.srun("-N3", "hostname").stdout.split()
        self.say(f"srun -N3 hostname: {' '.join(sorted(names))}")
        self.controller.srun("-N3", "sh", "-c", "hostname > /scratch/marker")
        return names

    def change_files(self) -> list[str]:
        """slurmd_debug = "verbose" for the group: a new slurm.conf, applied in place.
        Returns the SlurmdDebug line of each node's slurm.conf."""
        before = {n: (node["image"]["digest"], node["boots"]) for n, node in self.nodes().items()}
        slurmd = self.controller.slurmd_started()
        self.edit('power = "on"\n', 'power = "on"\nvars = { slurmd_debug = "verbose" }\n')
        started = time.monotonic()
        self.session.cli("reload", "-c", str(self.config))
        wanted = self.session.api("/api/v1/nodes/cn001/explain")["files"]["wanted"]

        def applied() -> bool:
            return all(
                (node["files"]["revision"], node["files"]["error"]) == (wanted, None)
                for node in self.nodes().values()
            )  # fmt: skip

        self.session.wait(applied, 120, f"files revision {wanted} in place on every node")
        self.note("reload to new slurm.conf applied on all nodes", time.monotonic() - started)
        after = {n: (node["image"]["digest"], node["boots"]) for n, node in self.nodes().items()}
        assert before == after, f"the change was not in place: {before} -> {after}"
        self.wait_slurmd_back(slurmd)
        conf = self.controller.srun("-N3", "grep", "^SlurmdDebug", "/etc/slurm/slurm.conf")
        self.say(f"on the nodes now: {sorted(set(conf.stdout.split()))}")
        return conf.stdout.split()

    def roll(self) -> tuple[subprocess.CompletedProcess, list[str]]:
        """Image v2 while a job runs on cn001; returns the job's outcome and what each
        node's /scratch/marker holds afterwards."""
        before = {n: (node["boots"], node["boot"]["boot_id"]) for n, node in self.nodes().items()}
        slurmd = self.controller.slurmd_started()
        job_log = self.run_dir / "job.log"
        # the last step's jobs must be over: their prologs' busy would pass for this job's
        self.session.wait(lambda: all(n["busy"] == "free" for n in self.nodes().values()), 120,
                          "every node free (the last step's jobs ended)")  # fmt: skip
        job = self.controller.srun_background("-N1", "-w", "cn001", "bash", "-c",
                                              held_job(ADDRESS), log=job_log)  # fmt: skip
        self.session.wait(lambda: self.nodes()["cn001"]["busy"] == "busy", 120,
                          "cn001 busy (the job's prolog)")  # fmt: skip
        self.say("a job runs on cn001 (busy); rolling the nodes to slurm v2")
        self.edit('image = "slurm"\n', 'image = "slurm2"\n')
        started = time.monotonic()
        self.session.cli("reload", "-c", str(self.config))
        self.session.wait(lambda: self.running("slurm2", ["cn002", "cn003"]), 300,
                          "cn002 and cn003 on slurm v2")  # fmt: skip
        self.note("reload to the free nodes on v2", time.monotonic() - started)
        assert self.running("slurm", ["cn001"]), (
            f"cn001 left v1 while its job ran: {self.nodes()['cn001']['image']}, "
            f"{self.session.api('/api/v1/nodes/cn001/explain')}"
        )
        assert job.poll() is None, job_log.read_text()
        self.say("cn002 and cn003 run v2; cn001 still runs v1 and its job: releasing the job")
        release = self.controller.release(ADDRESS)
        try:
            outcome = job.wait(120)
        finally:
            release.kill()
            release.wait()
        ended = time.monotonic()
        self.session.wait(lambda: self.running("slurm2"), 300, "cn001 on slurm v2 after its job")
        self.note("job end to cn001 on v2", time.monotonic() - ended)
        after = {n: (node["boots"], node["boot"]["boot_id"]) for n, node in self.nodes().items()}
        assert before == after, f"a node rebooted: {before} -> {after}"
        self.wait_slurmd_back(slurmd)
        self.note("job end to sinfo idle on v2", time.monotonic() - ended)
        kept = self.controller.srun("-N3", "cat", "/scratch/marker").stdout.split()
        self.say(f"/scratch/marker on the nodes after the roll: {' '.join(sorted(kept))}")
        return subprocess.CompletedProcess(job.args, outcome, job_log.read_text(), ""), kept


def main() -> int:
    parser = argparse.ArgumentParser(description="The Slurm demo (vm-lab/demo.sh --slurm).")
    parser.add_argument("--until-ready", action="store_true",
                        help="exit 0 once every step worked, non-zero on failure")  # fmt: skip
    parser.add_argument("--run-dir", type=Path, default=REPO / "vm-lab" / "run")
    args = parser.parse_args()
    return demo(args.run_dir, args.until_ready)


def demo(run_dir: Path, until_ready: bool) -> int:
    """``vm-lab/demo.sh --slurm``: the three steps, narrated; then the lab stays up for a
    person to try (Ctrl-C ends it), unless `until_ready`."""
    lab = SlurmLab(run_dir)
    try:
        lab.say(f"lab {lab.session.lab.netns}: logs in {lab.run_dir}")
        lab.boot()
        lab.change_files()
        job, kept = lab.roll()
        lab.say(f"the job during the roll: exit {job.returncode}: {job.stdout.strip()}")
        lab.say(f"timings: {json.dumps(lab.timings)}")
        if until_ready:
            return 0 if job.returncode == 0 and sorted(kept) == NODES else 1
        conf = lab.controller.conf
        lab.say(
            "the cluster keeps running; try, as root:\n"
            f"  ip netns exec {lab.session.lab.netns} env SLURM_CONF={conf} srun -N3 hostname\n"
            f"  {LAYERPY} status --server {lab.session.socket}\n"
            "Ctrl-C ends it and removes everything"
        )
        while True:
            time.sleep(10)
    except KeyboardInterrupt:
        return 0
    except (TimeoutError, RuntimeError, AssertionError) as error:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        lab.close()


if __name__ == "__main__":
    sys.exit(main())
