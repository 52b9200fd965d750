"""The lab with a ``layerpy serve`` inside it: what the demo and the e2e tests run.

Talks to the server the way an admin on the head node would: the CLI, and curl, over the
operator API's Unix socket in the run's state directory (a socket file reaches into the
lab's namespace; nothing goes over the network).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bmc import start_bmc
from lab import Lab, Vm, VmSpec
from site_dhcp import start_site_dhcp

REPO = Path(__file__).resolve().parent.parent
LAB_CONFIG = REPO / "configs" / "lab.toml"
PROXY_CONFIG = REPO / "configs" / "lab-proxy.toml"  # beside a site's DHCP server
LAYERPY = REPO / ".venv" / "bin" / "layerpy"

BMC_PASSWORD = REPO / "configs" / "lab-bmc.pass"

# The lab's machines, as configs/lab.toml knows them: cn* start powered off, each with a
# BMC at 10.99.1.1N that layerpy drives; the stray's MAC is in no file and it has no BMC.
MACHINES = {
    "cn001": VmSpec("cn001", "52:54:00:99:00:11", "bios", powered_off=True),
    "cn002": VmSpec("cn002", "52:54:00:99:00:12", "bios", powered_off=True),
    "cn003": VmSpec("cn003", "52:54:00:99:00:13", "uefi", powered_off=True),
    "cn004": VmSpec("cn004", "52:54:00:99:00:14", "uefi-pxe", powered_off=True),
    "stray": VmSpec("stray", "52:54:00:99:00:99", "bios"),
    # an arm64 UEFI server (QEMU virt + AAVMF), in no node file of configs/: tests add it
    "arm001": VmSpec("arm001", "52:54:00:99:00:21", "uefi-pxe", arch="arm64", memory_mb=512),
}
BMCS = {"cn001": "10.99.1.11", "cn002": "10.99.1.12", "cn003": "10.99.1.13", "cn004": "10.99.1.14"}


def lab_text(run_dir: Path | None = None, *, base: Path = LAB_CONFIG) -> str:
    """A lab node file's text with its relative paths made absolute (for a copy kept in a
    run directory); with `run_dir`, the VMs' serial consoles captured by the server (QEMU's
    serial socket of each VM: then nothing else may type into it, as ``Vm.type`` does)."""
    text = base.read_text().replace('"../minos/', f'"{REPO}/minos/')
    bmc_password = f'"{REPO}/configs/lab-bmc.pass"'
    if run_dir is not None:
        bmc_password += f', console = "{Path(run_dir).resolve()}/{{node}}.console"'
    return text.replace('"lab-bmc.pass"', bmc_password)


def lab_config(run_dir: Path, *, consoles: bool = False) -> Path:
    """lab_text() written to `run_dir`/nodes.toml."""
    config = Path(run_dir) / "nodes.toml"
    config.write_text(lab_text(run_dir if consoles else None))
    return config


class LabSession:
    """A running lab: namespace, bridge, ``layerpy serve`` and the VMs started so far."""

    def __init__(
        self,
        run_dir: Path,
        config: Path = LAB_CONFIG,
        before_serve: Callable[[Lab], object] | None = None,
    ) -> None:
        """`before_serve(lab)` runs inside the new lab before the server starts (to start
        what the server needs at once, such as a registry)."""
        self.run_dir = Path(run_dir).resolve()
        self.config = config
        self.lab = Lab(self.run_dir)
        self.bmcs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            if before_serve is not None:
                before_serve(self.lab)
            self.serve_log = self.run_dir / "serve.log"
            self.socket = self.run_dir / "state" / "api.sock"
            self.serve()
        except BaseException:
            self.lab.close()
            raise

    def serve(self) -> int:
        """Start ``layerpy serve`` on the run's state directory (again after ``crash()``:
        the same one); returns where its lines begin in ``serve_log``, once it serves."""
        start = self.serve_log.stat().st_size if self.serve_log.exists() else 0
        command = [str(LAYERPY), "serve", "-c", str(self.config),
                   "--state-dir", str(self.run_dir / "state")]  # fmt: skip
        self.server = self.lab.popen(command, log=self.serve_log)

        def serving() -> bool:
            with self.serve_log.open("rb") as log:
                log.seek(start)
                return b"layerpy.server: serving" in log.read()

        self.wait(serving, 60, "layerpy serve up (DHCP after its look for others)")
        return start

    def crash(self) -> None:
        """SIGKILL the server, as a crash (no goodbye to nodes, BMCs or files)."""
        self.server.kill()
        self.server.wait(timeout=30)

    def api(self, path: str, *, quiet: bool = False) -> Any:
        """GET a JSON document from the server, or None when it does not answer."""
        command = ["curl", "-sf", "--max-time", "5", "--unix-socket", str(self.socket)]
        result = self.lab.run([*command, f"http://layerpy{path}"], check=False)
        if result.returncode:
            if not quiet and self.server.poll() is not None:
                raise RuntimeError(f"layerpy serve exited:\n{self.serve_log.read_text()[-3000:]}")
            return None
        return json.loads(result.stdout)

    def cli(self, *args: str, check: bool = True) -> str:
        """A ``layerpy`` command against this lab's server (its output; stderr too if it
        failed and `check` is off)."""
        result = self.lab.run([str(LAYERPY), *args, "--server", str(self.socket)], check=check)
        return result.stdout if not result.returncode else result.stdout + result.stderr

    def direct_append(self, node: str, address: str, console: str = "ttyAMA0") -> str:
        """For a VM whose QEMU loads the minOS itself (firmware "direct"): the kernel
        arguments a loader would get from the node's boot script, fetched from the node's
        own address (put on the bridge for this one request, then removed)."""
        lab = self.lab
        lab.run(["ip", "addr", "add", f"{address}/32", "dev", lab.bridge])
        try:
            url = f"http://{lab.address}:8080/boot/{node}.ipxe"
            script = lab.run(["curl", "-sf", "--max-time", "10", "--interface", address, url])
        finally:
            lab.run(["ip", "addr", "del", f"{address}/32", "dev", lab.bridge])
        kernel = next(line for line in script.stdout.splitlines() if line.startswith("kernel "))
        ours = [word for word in kernel.split()[2:] if word.startswith(("layerpy.", "BOOTIF="))]
        return " ".join([f"console={console}", *ours])

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {node["name"]: node for node in self.api("/api/v1/nodes") or []}

    def start(
        self,
        *names: str,
        firmware: dict[str, str] | None = None,
        nic: dict[str, str] | None = None,
        memory_mb: int | None = None,
        disks: dict[str, Path] | None = None,
    ) -> list[Vm]:
        """Start lab machines (with another `firmware` or `nic` model, or a local disk (a
        raw image), for some, by name, and `memory_mb` for all); the ones with a BMC stay
        off until layerpy powers them on."""
        firmware, nic, disks = firmware or {}, nic or {}, disks or {}
        specs = [
            replace(MACHINES[name], firmware=firmware.get(name, MACHINES[name].firmware),
                    nic=nic.get(name, MACHINES[name].nic), disk=disks.get(name),
                    memory_mb=memory_mb or MACHINES[name].memory_mb)
            for name in names
        ]  # fmt: skip
        vms = [self.lab.add_vm(spec) for spec in specs]
        for name in names:
            if name in BMCS:
                self.bmcs[name] = start_bmc(self.lab, name, BMCS[name], BMC_PASSWORD)
        return vms

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll until `condition` holds; return the seconds it took or raise TimeoutError."""
        started = time.monotonic()
        while not condition():
            if self.server.poll() is not None:
                raise RuntimeError(f"layerpy serve exited:\n{self.serve_log.read_text()[-3000:]}")
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            time.sleep(0.5)
        return time.monotonic() - started

    def wait_state(self, names: list[str], state: str, timeout: float) -> float:
        def reached() -> bool:
            nodes = self.nodes()
            return all(nodes.get(name, {}).get("run_state") == state for name in names)

        return self.wait(reached, timeout, f"{', '.join(names)} {state}")

    def close(self) -> None:
        self.lab.close()

    def __enter__(self) -> LabSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_site_dhcp_for_proxy_lab(lab: Lab) -> None:
    """The site's server for configs/lab-proxy.toml: it reserves cn001's address there."""
    start_site_dhcp(lab, {MACHINES["cn001"].mac: "10.99.0.11"})


def print_status(session: LabSession) -> None:
    print(session.cli("status", check=False), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="Boot lab VMs from layerpy serve.")
    parser.add_argument("--vms", default="cn001,cn002,cn003", help="which lab machines to boot")
    parser.add_argument(
        "--until-ready",
        action="store_true",
        help="exit 0 once every VM is ready, non-zero on failure",
    )
    parser.add_argument(
        "--proxy",
        action="store_true",
        help="a site's DHCP server (dnsmasq) hands out the addresses, layerpy is ProxyDHCP",
    )
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--run-dir", type=Path, default=REPO / "vm-lab" / "run")
    args = parser.parse_args()
    names = args.vms.split(",")
    if args.proxy:
        session = LabSession(args.run_dir, PROXY_CONFIG, start_site_dhcp_for_proxy_lab)
    else:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        session = LabSession(args.run_dir, lab_config(args.run_dir, consoles=True))
    with session:
        print(f"lab {session.lab.netns}: logs in {session.run_dir}", flush=True)
        session.start(*names)
        try:
            took = session.wait_state(names, "ready", args.timeout)
        except (TimeoutError, RuntimeError) as error:
            print(f"FAILED: {error}", file=sys.stderr)
            print_status(session)
            return 1
        print(f"all {len(names)} nodes ready after {took:.1f} s", flush=True)
        print_status(session)
        print(
            f"a node's console: {LAYERPY} console {names[0]} --server {session.socket}\n"
            f"the dashboard: ip netns exec {session.lab.netns} chromium --no-sandbox "
            f"http://127.0.0.1:8081/ (token: {session.run_dir}/state/admin.token)",
            flush=True,
        )
        if args.until_ready:
            return 0
        print("the lab keeps running; Ctrl-C ends it and removes everything", flush=True)
        try:
            while True:
                time.sleep(10)
                print_status(session)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    sys.exit(main())
