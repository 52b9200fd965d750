"""The Secure Boot path of ``layerpy serve`` with real peers (curl's TFTP and HTTP) in a
namespace of its own: the signed loaders and a node's GRUB config by TFTP, the config only
to the node's own address, no iPXE script for it, and a node reporting Secure Boot off
shown as a problem in explain and /metrics."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from layerpy.nodes.reports import SECURE_BOOT_OFF

from test_http import BASE, Host, api, curl, report, serving

pytestmark = pytest.mark.netns
TFTP = "tftp://10.66.0.1"


@pytest.fixture
def secure(make_config, tmp_path: Path) -> Iterator[Host]:
    config = make_config(
        server="10.66.0.1", interface="d0", secure="\n[nodes.cn001]\nsecure_boot = true\n"
    )
    with serving(config, tmp_path) as served:
        yield served


def tftp(host: Host, name: str, source: str) -> tuple[int, bytes]:
    """curl's TFTP client from `source`: its exit code and what it fetched."""
    command = host.ns.cmd("curl", "-sS", "--interface", source, f"{TFTP}/{name}")
    result = subprocess.run(command, capture_output=True, timeout=60)
    return result.returncode, result.stdout


def test_the_signed_path_by_tftp(secure: Host, tmp_path: Path) -> None:
    for name in ("shimx64.efi", "grubx64.efi"):
        assert tftp(secure, name, "10.66.0.11") == (0, (tmp_path / "signed" / name).read_bytes())
    code, grub = tftp(secure, "grub/grub.cfg", "10.66.0.11")
    assert code == 0
    text = grub.decode()
    assert "linux (tftp,10.66.0.1)/minos/kernel 'console=ttyS0' " in text
    assert f"'layerpy.server={BASE}' 'layerpy.node=cn001' " in text
    token = re.search(r"'layerpy\.token=([^']+)'", text).group(1)
    assert tftp(secure, "minos/kernel", "10.66.0.11") == (0, (tmp_path / "vmlinuz").read_bytes())
    assert tftp(secure, "/minos/initrd", "10.66.0.11") == (0, (tmp_path / "initrd").read_bytes())
    # another machine gets no GRUB config, and cn002's is cn002's
    code, _ = tftp(secure, "grub/grub.cfg", "10.66.0.99")
    assert code != 0
    # cn002's config only once its boot waits for one (its firmware fetched its loader):
    # before, a read from its address, forged or not, gets nothing and changes nothing
    assert tftp(secure, "grub/grub.cfg", "10.66.0.12")[0] != 0
    assert tftp(secure, "shimx64.efi", "10.66.0.12")[0] == 0
    assert b"'layerpy.node=cn002'" in tftp(secure, "grub/grub.cfg", "10.66.0.12")[1]
    # no iPXE script for a node that boots signed only
    code, body = curl(secure, f"{BASE}/boot/cn001.ipxe", source="10.66.0.11")
    assert code == 403 and "signed path only" in body
    # the token GRUB handed the kernel is the boot's; its agent reports Secure Boot off
    assert report(secure, token=token, secure_boot=False)[0] == 200
    # a read from its address now, forged or not, hands out no new token: the agent's holds
    assert tftp(secure, "grub/grub.cfg", "10.66.0.11")[1] in (b"", grub)
    node = json.loads(api(secure, "/api/v1/nodes/cn001")[1])
    assert node["secure_boot"] is False and node["problem"] == SECURE_BOOT_OFF
    assert {"kernel", "initrd", "agent_hello"} <= set(node["timeline"])
    explained = json.loads(api(secure, "/api/v1/nodes/cn001/explain")[1])
    assert explained["secure_boot"] == {"wanted": True, "reported": False}
    deadline = time.monotonic() + 10
    want = {'layerpy_nodes_secure_boot{state="off"} 1.0', "layerpy_nodes_secure_boot_missing 1.0"}
    while not want <= set(metrics := api(secure, "/metrics")[1].splitlines()):
        assert time.monotonic() < deadline, "\n".join(m for m in metrics if "secure" in m)
        time.sleep(0.2)
    assert report(secure, token=token, secure_boot=True, event="heartbeat", seq=2)[0] == 200
    node = json.loads(api(secure, "/api/v1/nodes/cn001")[1])
    assert node["secure_boot"] is True and node["problem"] is None
