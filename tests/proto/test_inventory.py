"""``layerpy inventory`` as Ansible reads it (issue 13): Debian's ansible-inventory runs the
``layerpy-inventory`` executable against a running ``layerpy serve`` (in a namespace of its
own) and gets the node file's groups, each node's address as ansible_host, its image,
state and vars as host variables."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns import Link, need_root
from nodefile import write_boot_files

pytestmark = pytest.mark.skipif(not shutil.which("ansible-inventory"), reason="needs ansible-core")

BIN = Path(sys.executable).parent
NODES = """\
[server]
interface = "{interface}"
address = "10.82.0.1"
dhcp_probe = 0
state_dir = "state"

[network]
subnet = "10.82.0.0/24"

[minos]
kernel = "vmlinuz"
initrd = "initrd"

[ipxe]
dir = "ipxe"

[api]
listen = []

[images.slurm]
source = "oci-layout:nowhere:v1"

[groups.compute]
nodes = "cn[001-002]"
ip = "10.82.0.[11-12]"
image = "slurm"
vars = {{ partition = "batch" }}

[nodes.login]
ip = "10.82.0.5"
vars = {{ role = "login" }}
"""


@pytest.fixture
def served(tmp_path):
    need_root()
    link = Link("10.82.0.1/24")
    write_boot_files(tmp_path)
    path = tmp_path / "nodes.toml"
    path.write_text(NODES.format(interface=link.server_if))
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = link.server.popen(
            [str(BIN / "layerpy"), "serve", "-c", str(path)], stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 60
        while b"layerpy.server: serving" not in log.read_bytes():
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no server after 60 s:\n{log.read_text()}"
            time.sleep(0.1)
        yield path
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)
        link.close()


def ansible(path: Path, *args: str) -> dict:
    env = {**os.environ, "LAYERPY_CONFIG": str(path), "ANSIBLE_LOCAL_TEMP": str(path.parent / "ans"),
           "ANSIBLE_HOME": str(path.parent / "ans")}  # fmt: skip
    done = subprocess.run(["ansible-inventory", "-i", str(BIN / "layerpy-inventory"), *args],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_ansible_reads_groups_and_host_variables(served) -> None:
    listed = ansible(served, "--list")
    assert listed["compute"]["hosts"] == ["cn001", "cn002"]
    assert listed["ungrouped"]["hosts"] == ["login"]
    cn002 = listed["_meta"]["hostvars"]["cn002"]
    assert cn002["ansible_host"] == "10.82.0.12" and cn002["partition"] == "batch"
    assert (cn002["layerpy_image"], cn002["layerpy_state"]) == ("slurm", "unknown")
    assert ansible(served, "--host", "login") == {
        "ansible_host": "10.82.0.5", "layerpy_ip": "10.82.0.5", "layerpy_image_state": "unknown",
        "layerpy_state": "unknown", "layerpy_power": "unknown", "role": "login",
    }  # fmt: skip
