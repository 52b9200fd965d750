"""layerpy.pyz on a bare machine (issue 12): built from this checkout, copied into a
Debian bookworm root holding only its Essential packages and python3, and run there by
/usr/bin/python3 (systemd-nspawn, in the lab's network namespace) with a node file that
names neither a minOS nor iPXE binaries. A lab VM boots to ready from what the file
carries, the server never seeing the checkout or the venv. Times in <tmp>/timings.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from layerpy.client import Client, ClientError

from headnode import copy_into, root, wait_for
from lab import Lab, VmSpec

REPO = Path(__file__).resolve().parents[2]
CACHE = Path("/var/cache/layerpy")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("mmdebstrap") and shutil.which("systemd-nspawn")),
        reason="needs mmdebstrap and systemd-nspawn (systemd-container)",
    ),
]

NODES = """\
[server]
interface = "br0"
address = "10.99.0.1"
dhcp_probe = 1
heartbeat = 2

[network]
subnet = "10.99.0.0/24"
gateway = "10.99.0.1"

[minos]
cmdline = "console=ttyS0"

[nodes.cn001]
ip = "10.99.0.11"
mac = "52:54:00:99:00:11"
"""


# Boot files the server in the bare root serves from the pyz alone (by HTTP, or TFTP for
# what only the signed path fetches), and where they came from
CARRIED = {
    "http://10.99.0.1:8080/minos/arm64/kernel": REPO / "minos" / "out-arm64" / "vmlinuz",
    "http://10.99.0.1:8080/minos/arm64/initrd": REPO / "minos" / "out-arm64" / "initrd",
    "http://10.99.0.1:8080/ipxe/ipxe-arm64.efi": CACHE / "ipxe" / "ipxe-arm64.efi",
    "tftp://10.99.0.1/shimaa64.efi": CACHE / "signed" / "shimaa64.efi",
    "tftp://10.99.0.1/grubx64.efi": CACHE / "signed" / "grubx64.efi",
}


def test_the_pyz_alone_boots_a_node_to_ready(tmp_path, pyz) -> None:
    timings: dict[str, float] = {}
    tree = root(tmp_path / "root", systemd=False)
    copy_into(tree, pyz, "/opt/layerpy.pyz")
    (tree / "etc" / "layerpy").mkdir()
    (tree / "etc" / "layerpy" / "nodes.toml").write_text(NODES)
    assert (
        not (tree / "usr" / "lib" / "ipxe").exists()
        and not (tree / "usr" / "bin" / "pip3").exists()
    )
    log = tmp_path / "serve.log"
    with Lab(tmp_path / "lab") as lab:
        command = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--as-pid2",
                   f"--network-namespace-path=/run/netns/{lab.netns}", "-D", str(tree),
                   "/usr/bin/python3", "/opt/layerpy.pyz", "serve"]  # fmt: skip
        started = time.monotonic()
        with log.open("wb") as out:
            server = subprocess.Popen(command, stdout=out, stderr=out, start_new_session=True)
        try:
            wait_for(lambda: b"layerpy.server: serving 1 nodes" in log.read_bytes(), 120,
                 "the server in the bare root to serve", server, log)  # fmt: skip
            timings["first_start_s"] = round(time.monotonic() - started, 1)  # unpacks itself
            lab.add_vm(VmSpec("cn001", "52:54:00:99:00:11", "bios"))
            api = Client(str(tree / "var" / "lib" / "layerpy" / "api.sock"))
            booted = time.monotonic()
            wait_for(lambda: run_state(api) == "ready", 300, "cn001 ready", server, log)
            timings["vm_to_ready_s"] = round(time.monotonic() - booted, 1)
            socket = ["curl", "-sf", "--unix-socket", str(tree / "var/lib/layerpy/api.sock")]
            page = subprocess.run([*socket, "http://layerpy/"], capture_output=True, text=True)
            assert "<title>layerpy</title>" in page.stdout  # the dashboard's files are in it
            shown = subprocess.run([*socket, "http://layerpy/metrics"], capture_output=True,
                                   text=True).stdout  # fmt: skip
            assert 'layerpy_nodes_run{state="ready"} 1.0' in shown.splitlines()  # and prometheus
            for served, source in CARRIED.items():  # the arm64 and signed boot files too
                fetched = tmp_path / "fetched"
                lab.run(["curl", "-sf", "-o", str(fetched), served])
                assert fetched.read_bytes() == source.read_bytes(), f"{served} is not {source}"
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(30)
    kernel = (tree / "root" / ".shiv").glob(
        "layerpy.pyz_*/site-packages/layerpy/bundled/minos/vmlinuz"
    )
    assert list(kernel), "the pyz did not unpack its own minOS in the bare root"
    (tmp_path / "timings.json").write_text(json.dumps(timings))
    print(f"pyz e2e: {timings}")


def run_state(api: Client) -> str | None:
    try:
        nodes = api.call("/api/v1/nodes")
    except ClientError:
        return None
    return next((n["run_state"] for n in nodes if n["name"] == "cn001"), None)
