"""``layerpy serve`` stops soon after SIGTERM whatever its BMCs do (issue 9).

systemd kills a service 90 s after SIGTERM. A real ``layerpy serve`` runs in a namespace of
its own with 1 024 IPMI BMCs on a subnet of that namespace, in two ways:

- ``dead``: nothing ever answers there (ARP goes unanswered);
- ``died``: 1 024 stand-in BMCs (pyghmi's, one process, this file run as a script) answer
  until every node's power has been read, then are killed: every driver holds a session.

Before issue 9 the second took well over the 90 s: on shutdown each driver logged out in
turn, each waiting up to 6 s for a worker of a pool busy with polls of the dead BMCs.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerpy.client import Client, ClientError

LAYERPY = Path(sys.executable).parent / "layerpy"
SERVER = "10.70.0.1"
NODES = 1024
BMCS = [f"10.71.{1 + i // 256}.{i % 256}" for i in range(NODES)]  # 10.71.[1-4].[0-255]
PASSWORD = "stand-in-Secret-3"
FLEET = 256  # stand-in BMCs per process
BOUND = 20.0  # seconds from SIGTERM to exit, generous for a busy CI machine (target: 5)

NODE_FILE = """\
[server]
interface = "d0"
address = "{server}"
state_dir = "state"
http_port = 8080
dhcp = "off"
power_poll = 10

[network]
subnet = "10.70.0.0/16"
gateway = "{server}"
pool = "10.70.200.1-10.70.200.50"

{boot_sections}
[groups.compute]
nodes = "cn[0001-{nodes:04d}]"
ip = "10.70.[4-7].[0-255]"
power = "off"
bmc = {{ driver = "ipmi", address = "10.71.[1-4].[0-255]", user = "admin", password_file = "bmc.pass" }}
"""


def node_file(directory: Path) -> Path:
    from nodefile import BOOT_SECTIONS, write_boot_files  # here: see need_root's import

    write_boot_files(directory)
    (directory / "bmc.pass").write_text(PASSWORD + "\n")
    path = directory / "nodes.toml"
    path.write_text(NODE_FILE.format(server=SERVER, nodes=NODES, boot_sections=BOOT_SECTIONS))
    return path


def wait(condition, timeout: float, what: str, log: Path) -> float:
    begun = time.monotonic()
    while not condition():
        if time.monotonic() - begun > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return time.monotonic() - begun


@pytest.mark.netns
def test_a_stand_in_bmc_outlives_its_clients_logging_out(tmp_path: Path) -> None:
    """ipmitool logs out after each command; the fleet's BMCs must answer the next (a
    logout once ended a whole fleet process, and its nodes' power went unread)."""
    from netns import Netns, need_root

    need_root()
    ns = Netns("lpq")
    try:
        ns.run("ip", "link", "set", "lo", "up")
        ns.run("ip", "addr", "add", f"{BMCS[0]}/32", "dev", "lo")
        fleet_log = tmp_path / "fleet.log"
        with fleet_log.open("wb") as out:
            ns.popen([sys.executable, __file__, "0", "1"], stdout=out, stderr=out)
        wait(lambda: b"ready" in fleet_log.read_bytes(), 60, "a stand-in BMC", fleet_log)
        ipmitool = ["ipmitool", "-I", "lanplus", "-C", "3", "-H", BMCS[0], "-U", "admin",
                    "-P", PASSWORD, "-N", "2", "-R", "3", "power", "status"]  # fmt: skip
        for attempt in (1, 2, 3):
            answer = ns.run(*ipmitool, check=False)
            assert "Chassis Power is off" in answer.stdout, (
                f"command {attempt}: {answer.stdout}{answer.stderr}\n{fleet_log.read_text()}"
            )
    finally:
        ns.close()


@pytest.mark.netns
@pytest.mark.parametrize("bmcs", ["dead", "died"])
def test_serve_exits_within_seconds_of_sigterm_with_1024_dead_bmcs(
    tmp_path: Path, bmcs: str
) -> None:
    from netns import Netns, need_root  # here: this file also runs as the stand-ins' script

    need_root()
    config = node_file(tmp_path)
    ns = Netns("lpq")
    try:
        ns.run("ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1")
        ns.run("ip", "link", "set", "d1", "up")
        for address in (f"{SERVER}/16", "10.71.255.254/16"):  # the BMC subnet is on d0's link
            ns.run("ip", "addr", "add", address, "dev", "d0")
        ns.run("ip", "link", "set", "d0", "up")
        fleet = []
        if bmcs == "died":
            batch = tmp_path / "addresses.batch"
            batch.write_text("".join(f"addr add {a}/32 dev d1\n" for a in BMCS))
            ns.run("ip", "-batch", str(batch))
            fleet_log = tmp_path / "fleet.log"
            with fleet_log.open("wb") as out:  # pyghmi's select() takes fds below 1024 only
                fleet = [
                    ns.popen([sys.executable, __file__, str(first), str(FLEET)], stdout=out,
                             stderr=out)
                    for first in range(0, NODES, FLEET)
                ]  # fmt: skip
            ready = lambda: fleet_log.read_bytes().count(b"ready") == len(fleet)  # noqa: E731
            wait(ready, 60, "stand-in BMCs", fleet_log)
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            command = [str(LAYERPY), "serve", "-c", str(config), "--state-dir", str(tmp_path)]
            serve = ns.popen(command, stdout=out, stderr=out, cwd=tmp_path)

        api = Client(str(tmp_path / "api.sock"))

        def powers() -> list[str]:
            assert serve.poll() is None, f"serve exited early:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(ClientError):
                return [node["power"] for node in api.call("/api/v1/nodes")]
            return []

        wait(lambda: len(powers()) == NODES, 90, "serve answering with every node", log)
        if fleet:
            took = wait(lambda: all(p in ("on", "off") for p in powers()), 300, "all read", log)
            print(f"\nevery one of {NODES} BMCs read in {took:.0f} s")
            for process in fleet:  # every BMC dies at once, each driver holding a session
                process.kill()
                process.wait()
        # polls are running, and some have already failed: workers are stuck on dead BMCs
        wait(lambda: "error" in powers(), 90, "a failed poll", log)

        begun = time.monotonic()
        serve.send_signal(signal.SIGTERM)  # `ip netns exec` execs: this is serve's pid
        try:
            serve.wait(BOUND)
        except subprocess.TimeoutExpired:
            message = f"layerpy serve still running {BOUND:g} s after SIGTERM"
            raise AssertionError(f"{message}\n{log.read_text()[-3000:]}") from None
        took = time.monotonic() - begun
        print(f"\nlayerpy serve, {NODES} BMCs {bmcs}: exited {took:.1f} s after SIGTERM")
        assert serve.returncode == 0, log.read_text()[-3000:]
    finally:
        ns.close()


# --- the stand-in BMCs, run inside the namespace --------------------------------------------


def fleet(first: int, count: int) -> None:
    """One pyghmi BMC per address of BMCS[first:first + count], with a power flag only."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vm-lab"))
    from bmc import Suite3Bmc

    class StandIn(Suite3Bmc):
        powered = False

        def get_power_state(self) -> str:
            return "on" if self.powered else "off"

        def power_on(self) -> None:
            self.powered = True

        def power_off(self) -> None:
            self.powered = False

        def power_reset(self) -> None:
            self.powered = True

        power_cycle = power_reset

        def set_boot_device(self, bootdevice: str) -> None:
            pass

    stand_ins = [StandIn({"admin": PASSWORD}, port=623, address=a) for a in BMCS[first:][:count]]
    print(f"ready: {len(stand_ins)} BMCs", flush=True)
    StandIn.listen()


if __name__ == "__main__":
    fleet(int(sys.argv[1]), int(sys.argv[2]))
