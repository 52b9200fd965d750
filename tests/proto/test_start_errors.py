"""A new user's first steps, on a real interface in a namespace of its own (issue 12):
``layerpy init`` writes a node file that ``layerpy check`` accepts as it is, and what stops
a start is named in the node file's terms (the interface, the port and who holds it, the
missing file), by ``check`` (exit 3 for the host, 2 for the file) and by ``serve`` (exit 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from netns import Link, need_root

LAYERPY = Path(sys.executable).parent / "layerpy"
ADDRESS = "10.78.0.1"


@pytest.fixture
def link():
    need_root()
    made = Link(f"{ADDRESS}/24")
    yield made
    made.close()


def layerpy(link: Link, *args: str) -> subprocess.CompletedProcess[str]:
    return link.server.run(str(LAYERPY), *args, check=False, timeout=120)


def starter(link: Link, tmp_path: Path) -> Path:
    path = tmp_path / "nodes.toml"
    made = layerpy(link, "init", link.server_if, "-o", str(path))
    assert made.returncode == 0, made.stderr
    return path


def test_init_writes_a_file_that_check_accepts_on_this_host(link, tmp_path) -> None:
    path = starter(link, tmp_path)
    text = path.read_text()
    assert f'interface = "{link.server_if}"' in text and f'address = "{ADDRESS}"' in text
    assert 'subnet = "10.78.0.0/24"' in text and 'pool = "10.78.0.188-10.78.0.250"' in text
    checked = layerpy(link, "check", "-c", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ready to serve it" in checked.stdout
    again = layerpy(link, "init", link.server_if, "-o", str(path))
    assert again.returncode == 2 and "is there already; --force replaces it" in again.stderr
    missing = layerpy(link, "init", "eth9", "-o", str(tmp_path / "other.toml"))
    assert missing.returncode == 2
    assert f"no such interface eth9; this host has lo, {link.server_if}" in missing.stderr


HOLD = """\
import socket, sys, time
kind = socket.SOCK_DGRAM if sys.argv[1] == "udp" else socket.SOCK_STREAM
held = socket.socket(socket.AF_INET, kind)
held.bind((sys.argv[2], int(sys.argv[3])))
if kind == socket.SOCK_STREAM:
    held.listen()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("kind", "port", "service"), [("udp", 69, "TFTP"), ("tcp", 8080, "HTTP")])
def test_a_port_another_program_holds_is_named(link, tmp_path, kind, port, service) -> None:
    path = starter(link, tmp_path)
    holder = link.server.popen(
        [sys.executable, "-c", HOLD, kind, ADDRESS, str(port)], stdout=subprocess.PIPE
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n", "holder failed"
    said = f"{service} port {port} on {ADDRESS} is taken by another program"
    checked = layerpy(link, "check", "-c", str(path))
    assert checked.returncode == 3 and said in checked.stdout, checked.stdout + checked.stderr
    served = layerpy(link, "serve", "-c", str(path), "--state-dir", str(tmp_path / "state"))
    assert served.returncode == 1, served.stderr
    assert f"layerpy serve: {said}" in served.stderr


def test_an_interface_this_host_lacks_is_named(link, tmp_path) -> None:
    path = starter(link, tmp_path)
    path.write_text(
        path.read_text().replace(f'interface = "{link.server_if}"', 'interface = "eth9"')
    )
    said = f"no such interface eth9 (server.interface); this host has lo, {link.server_if}"
    checked = layerpy(link, "check", "-c", str(path))
    assert checked.returncode == 3 and said in checked.stdout, checked.stdout + checked.stderr
    served = layerpy(link, "serve", "-c", str(path), "--state-dir", str(tmp_path / "state"))
    assert served.returncode == 1 and f"layerpy serve: {said}" in served.stderr, served.stderr


def test_the_node_file_defaults_to_the_environment_then_etc(link, tmp_path) -> None:
    absent = tmp_path / "absent.toml"
    told = link.server.run("env", f"LAYERPY_CONFIG={absent}", str(LAYERPY), "check", check=False)
    assert told.returncode == 2
    assert (
        f"there is no node file {absent}: name one with -c FILE or $LAYERPY_CONFIG" in told.stderr
    )
    path = starter(link, tmp_path)
    found = link.server.run("env", f"LAYERPY_CONFIG={path}", str(LAYERPY), "check", check=False)
    assert found.returncode == 0 and f"{path} is valid" in found.stdout.replace("\n", "")
