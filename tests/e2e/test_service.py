"""layerpy as a head node's systemd service (issue 12), under a real systemd: a Debian
bookworm container (Essential packages, python3, systemd; systemd-nspawn) in a network
namespace of its own, with a boot interface boot0. There, ``python3 layerpy.pyz install``
puts the program and the unit in place, ``layerpy init boot0`` writes the node file, and
systemd starts the service (ready when it says READY=1), reloads it (SIGHUP), restarts it
after a ``kill -9`` and stops it; the journal tells each step, the process holds only
CAP_NET_BIND_SERVICE as the user layerpy, the unit written is the pyz's copy of systemd/'s,
``systemd-analyze verify`` finds nothing in it and ``systemd-analyze security`` rates it.
Times go to <tmp>/timings.json.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from headnode import Container, copy_into, root
from netns import Netns, need_root

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("mmdebstrap") and shutil.which("systemd-nspawn")),
        reason="needs mmdebstrap and systemd-nspawn (systemd-container)",
    ),
]

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
CAP_NET_BIND_SERVICE = 1 << 10
GROUP = '\n[groups.compute]\nnodes = "cn[001-003]"\nip = "10.80.0.[11-13]"\n'
TIMINGS: dict[str, float | str] = {}


@pytest.fixture(scope="module")
def host(tmp_path_factory, pyz):
    need_root()
    tmp = tmp_path_factory.mktemp("service")
    netns = Netns("lpsvc")
    container = None
    try:
        netns.run("ip", "link", "add", "boot0", "type", "veth", "peer", "name", "wire0")
        netns.run("ip", "addr", "add", "10.80.0.1/24", "dev", "boot0")
        for name in ("boot0", "wire0"):  # both ends inside: what boot0 sends stays here
            netns.run("ip", "link", "set", name, "up")
        started = time.monotonic()
        tree = root(tmp / "root", systemd=True)
        copy_into(tree, pyz, "/root/layerpy.pyz")
        TIMINGS["root_s"] = round(time.monotonic() - started, 1)
        container = Container(tree, netns.name, tmp / "console.log")
        yield container
    finally:
        if container is not None:
            journal = container.run("journalctl", "-u", "layerpy", "--no-pager").stdout
            (tmp / "journal.txt").write_text(journal)
            container.close()
        netns.close()
        (tmp / "timings.json").write_text(json.dumps(TIMINGS, indent=1))
        print(f"service e2e: {TIMINGS}")


def ok(container: Container, *command: str) -> str:
    done = container.run(*command)
    assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"
    return done.stdout


def show(container: Container, prop: str) -> str:
    return ok(container, "systemctl", "show", "-p", prop, "--value", "layerpy").strip()


def test_install_then_start_under_systemd(host: Container) -> None:
    said = ok(host, "python3", "/root/layerpy.pyz", "install")
    assert "install: write /etc/systemd/system/layerpy.service" in said
    assert ok(host, "id", "-un", "layerpy").strip() == "layerpy"
    ok(host, "layerpy", "init", "boot0")
    nodes = host.run("cat", "/etc/layerpy/nodes.toml").stdout
    ok(host, "sh", "-c", f"printf '%s' '{GROUP}' >> /etc/layerpy/nodes.toml")
    assert 'address = "10.80.0.1"' in nodes
    checked = ok(host, "layerpy", "check")
    assert "ready to serve it" in checked
    started = time.monotonic()
    ok(host, "systemctl", "start", "layerpy")  # Type=notify: returns at READY=1
    TIMINGS["start_s"] = round(time.monotonic() - started, 2)
    assert show(host, "ActiveState") == "active"
    assert show(host, "StatusText") == "serving 3 nodes"
    pid = show(host, "MainPID")
    status = ok(host, "cat", f"/proc/{pid}/status")
    assert (
        re.search(r"^Uid:\s+(\d+)", status, re.M).group(1)
        == ok(host, "id", "-u", "layerpy").strip()
    )  # type: ignore[union-attr]
    effective = int(re.search(r"^CapEff:\s+([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    assert effective == CAP_NET_BIND_SERVICE, f"capabilities {effective:#x}"


def test_the_files_installed_are_systemds(host: Container) -> None:
    """One source: systemd/ in the checkout, carried by the pyz, the placeholders filled."""
    unit = (SYSTEMD / "layerpy.service").read_text()
    unit = unit.replace("@PROGRAM@", "/usr/local/bin/layerpy").replace("@NOFILE@", "65536")
    assert ok(host, "cat", "/etc/systemd/system/layerpy.service") == unit
    sysusers = (SYSTEMD / "layerpy.sysusers.conf").read_text()
    assert ok(host, "cat", "/etc/sysusers.d/layerpy.conf") == sysusers


def test_reload_applies_the_edited_file(host: Container) -> None:
    ok(host, "sed", "-i", "s/cn\\[001-003\\]/cn[001-004]/; s/10.80.0.\\[11-13\\]/10.80.0.[11-14]/",
       "/etc/layerpy/nodes.toml")  # fmt: skip
    pid = show(host, "MainPID")
    ok(host, "systemctl", "reload", "layerpy")
    host.wait(lambda: show(host, "StatusText") == "serving 4 nodes", 60, "READY after the reload")
    assert show(host, "MainPID") == pid  # reloaded, not restarted
    journal = ok(host, "journalctl", "-u", "layerpy", "--no-pager")
    assert "added cn004" in journal
    ok(host, "cp", "/etc/layerpy/nodes.toml", "/root/nodes.good")
    ok(host, "sh", "-c", "echo 'ip = \"10.80.9.9\"' >> /etc/layerpy/nodes.toml")  # off the subnet
    refused = host.run("systemctl", "reload", "layerpy")
    assert refused.returncode != 0, "a broken node file was reloaded"
    assert show(host, "ActiveState") == "active" and show(host, "MainPID") == pid
    assert show(host, "StatusText") == "serving 4 nodes"  # READY again, the old file in force
    ok(host, "cp", "/root/nodes.good", "/etc/layerpy/nodes.toml")


def test_a_killed_server_comes_back(host: Container) -> None:
    pid = show(host, "MainPID")
    killed = time.monotonic()
    ok(host, "sh", "-c", f"kill -9 {pid}")  # the shell's own kill: no procps here
    host.wait(lambda: show(host, "MainPID") not in ("0", pid) and show(host, "ActiveState") == "active"
              and show(host, "StatusText").startswith("serving"), 60, "systemd to restart layerpy")  # fmt: skip
    TIMINGS["restart_after_kill_s"] = round(time.monotonic() - killed, 1)
    assert show(host, "NRestarts") == "1"


def test_stop_is_prompt_and_the_journal_tells_it_all(host: Container) -> None:
    started = time.monotonic()
    ok(host, "systemctl", "stop", "layerpy")
    took = time.monotonic() - started
    TIMINGS["stop_s"] = round(took, 2)
    assert took < 10, f"stop took {took:.1f} s"
    assert show(host, "ActiveState") == "inactive"
    journal = ok(host, "journalctl", "-u", "layerpy", "--no-pager")
    for line in ("layerpy.server: serving 3 nodes", "reloaded /etc/layerpy/nodes.toml",
                 "layerpy.server: stopping", "Main process exited, code=killed, status=9/KILL"):  # fmt: skip
        assert line in journal, f"{line!r} not in the journal:\n{journal[-3000:]}"


def test_the_unit_is_sound_and_rated_safe(host: Container) -> None:
    verified = host.run("systemd-analyze", "verify", "layerpy.service")
    assert (verified.returncode, verified.stdout + verified.stderr) == (0, "")
    rated = host.run("systemd-analyze", "security", "--no-pager", "layerpy.service")
    found = re.search(r"Overall exposure level for layerpy.service: ([\d.]+)", rated.stdout)
    assert found, rated.stdout + rated.stderr
    TIMINGS["exposure"] = found.group(1)
    assert float(found.group(1)) <= 2.5, rated.stdout
