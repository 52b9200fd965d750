"""An agent moves between instances (issue 27): a real agent running a real container
reports to two real ``layerpy serve`` processes in one namespace, both knowing its boot
token (the second starts on a copy of the first's state directory, as instances on etcd
will share it); the first is killed, and the agent reports to the second within seconds
while its container runs on, the same process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from oci import build_image
from test_http import LAYERPY, Host, api, boot_token, serving

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not os.path.exists("/bin/busybox"), reason="needs /bin/busybox"),
]

FIRST, SECOND = "http://10.66.0.1:8080", "http://10.66.0.2:8080"
# the agent as the minOS runs it, but with the container's console a file
AGENT = """
import sys
from layerpy.agent.container import Runner
from layerpy.agent.core import Agent, Log, read_cmdline
cfg = read_cmdline()
log = Log(cfg.node)
runner = Runner(sys.argv[1], log, cfg.node, console=sys.argv[2])
Agent(cfg, log, no_net=True, state_dir=sys.argv[1], runner=runner).run()
"""


def wait_for(condition: Callable[[], object], timeout: float, what: str, log: Path) -> float:
    """Seconds it took; the failure names what was waited for and shows the agent's log."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"no {what} after {timeout:g} s; agent log:\n{log.read_text()}")
        time.sleep(0.1)
    return time.monotonic() - start


def node(host: Host) -> dict:
    code, text = api(host, "/api/v1/nodes/cn001")
    return json.loads(text) if code == 200 else {}


def container(state: Path) -> tuple[int, int] | None:
    """The container's process as the agent recorded it: PID and start time."""
    try:
        record = json.loads((state / "container.json").read_text())
    except (OSError, ValueError):
        return None
    return record["pid"], record["start"]


def kill_started_under(state: Path) -> None:
    """The agent's container outlives the agent by design: kill what runs from `state`
    (only this test's processes name its temporary directory)."""
    needle = str(state.resolve()).encode()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def test_an_agent_moves_to_another_instance_and_its_container_runs_on(
    make_config, tmp_path: Path
) -> None:
    layout = build_image(tmp_path / "oci", "sleeper", "SLEEPER-IMAGE")
    image = (f'\n[images.sleeper]\nsource = "oci-layout:{layout}:latest"\n'
             'command = ["/bin/sh", "-c", "exec sleep 1000000"]\n')  # fmt: skip
    config = make_config(server="10.66.0.1", interface="d0", more=image)
    text = config.path.read_text().replace('nodes = "cn[001-002]"\n',
                                           'nodes = "cn[001-002]"\nimage = "sleeper"\n')  # fmt: skip
    config.path.write_text(text)
    second_file = tmp_path / "second.toml"  # the other instance's own [server] and [api]
    second_file.write_text(
        text.replace('address = "10.66.0.1"', 'address = "10.66.0.2"').replace(
            'state_dir = "state"', 'state_dir = "state-2"\ndhcp = "off"'
        )
        + "\n[api]\nlisten = []\n"
    )
    state = tmp_path / "agent"
    log = tmp_path / "agent.log"
    try:
        with serving(config, tmp_path) as first:
            first.ns.run("ip", "addr", "add", "10.66.0.2/24", "dev", "d0")
            token = boot_token(first, "cn001", "10.66.0.11")
            cmdline = tmp_path / "cmdline"
            cmdline.write_text(
                f"layerpy.server={FIRST},{SECOND} layerpy.node=cn001 layerpy.token={token} "
                "layerpy.heartbeat=1 layerpy.lldp_wait=0 BOOTIF=01-52-54-00-99-00-11\n"
            )
            env = {**os.environ, "LAYERPY_CMDLINE": str(cmdline), "LAYERPY_NO_NET": "1"}
            with log.open("wb") as out:
                agent = first.ns.popen(
                    [sys.executable, "-c", AGENT, str(state), str(tmp_path / "console")],
                    stdout=out, stderr=out, env=env,
                )  # fmt: skip
            wait_for(lambda: node(first).get("image", {}).get("state") == "active", 90,
                     "container active, as the first server hears", log)  # fmt: skip
            running = container(state)
            assert running is not None

            # the second instance, with what the first knows (token, image assigned)
            shutil.copytree(tmp_path / "state", tmp_path / "state-2",
                            ignore=shutil.ignore_patterns("*.sock"))  # fmt: skip
            with (tmp_path / "serve-2.log").open("wb") as out:
                command = [str(LAYERPY), "serve", "-c", str(second_file)]
                serve = first.ns.popen(command, stdout=out, stderr=out)
            second = Host(first.ns, tmp_path / "state-2" / "api.sock", serve)
            wait_for(lambda: '"sha256:' in api(second, "/api/v1/images")[1], 60,
                     "image ready on the second server", tmp_path / "serve-2.log")  # fmt: skip
            heard = node(second).get("last_report")

            first.serve.kill()  # the first instance dies: no goodbye
            first.serve.wait()
            took = wait_for(lambda: node(second).get("last_report") != heard, 15,
                            "report reaching the second server", log)  # fmt: skip
            assert took < 10, f"the agent took {took:.1f} s to move"
            assert node(second)["image"]["state"] == "active"
            assert container(state) == running  # the same container process, not restarted
            os.kill(running[0], 0)  # and alive
            lines = log.read_text().splitlines()
            moves = [line for line in lines if "stopped answering" in line]
            assert len(moves) == 1 and moves[0].endswith(f"moving to {SECOND}"), lines
            assert sum(" active in " in line for line in lines) == 1, lines  # one pull, one start
            agent.kill()
    finally:
        kill_started_under(state)
