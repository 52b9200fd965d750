"""`vm-lab/demo.sh --ha`: two ``layerpy serve`` instances on etcd share the lab, and one
takes over the other's nodes when it is killed.

The lab (vm-lab/lab.py) as the plain demo makes it: a namespace with the boot bridge br0,
the VMs and their BMCs (on bmc0). Beside it, the etcd the tests use (tests/etcd.py): three
members, each in a namespace of its own on a bridge of theirs, so that a member can die
while the cluster goes on, as at a site. Each instance gets a namespace of its own too, on
the etcd bridge (`etcd0`), with a veth onto the lab's br0 (`boot0`, its boot address) and
one onto bmc0 (`oob0`). Everything is in namespaces made here, and torn down at exit, on
Ctrl-C, SIGTERM or a failure: only the processes started here are killed.

The instances' node files are configs/lab.toml with their own [server] address and a
[cluster] table; they read no console (a VM's serial socket takes one reader, and which
instance would read it is the owner's business, not the file's).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bmc import oob_bridge, start_bmc
from lab import Lab
from session import BMC_PASSWORD, BMCS, LAYERPY, MACHINES, REPO, lab_text

sys.path.insert(0, str(REPO / "tests"))  # the etcd members the cluster tests run on
from etcd import EtcdCluster, Instance

# Each instance's own: its name and its boot address on br0 (and on bmc0: .2, .3 too).
HEADS = {"head1": "10.99.0.2", "head2": "10.99.0.3"}
ETCD_MEMBERS = 3  # one member's loss changes nothing; 1 would make etcd itself the single point


def instance_text(name: str, etcd: list[str]) -> str:
    """The lab's node file as instance `name` runs it: its own [server] and [cluster]
    tables, the rest the cluster's (the same for every instance)."""
    text = lab_text()
    own = f'interface = "boot0"\naddress = "{HEADS[name]}"'
    text = text.replace('interface = "br0"\naddress = "10.99.0.1"', own)
    if own not in text:
        raise RuntimeError("configs/lab.toml: [server] interface and address not found")
    members = ", ".join(f'"{url}"' for url in etcd)
    return text + f'\n[cluster]\netcd = [{members}]\nname = "{name}"\n'


class Head:
    """One ``layerpy serve`` instance in its namespace, its state and log in `run_dir`/name."""

    def __init__(self, name: str, place: Instance, etcd: list[str], run_dir: Path) -> None:
        self.name, self.place = name, place
        self.dir = run_dir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config = self.dir / "nodes.toml"
        self.config.write_text(instance_text(name, etcd))
        self.log = self.dir / "serve.log"
        self.socket = self.dir / "state" / "api.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def serve(self) -> None:
        state = self.dir / "state"
        command = [str(LAYERPY), "serve", "-c", str(self.config), "--state-dir", str(state)]
        with self.log.open("ab") as log:
            self.proc = self.place.netns.popen(command, stdout=log, stderr=subprocess.STDOUT)

    def reaches_etcd(self, endpoints: list[str]) -> bool:
        """Every member answers a linearizable read from this instance's namespace."""
        health = ["env", "ETCDCTL_API=3", "etcdctl", "--endpoints", ",".join(endpoints)]
        return not self.place.netns.run(*health, "endpoint", "health", check=False).returncode

    def serving(self) -> bool:
        self.check()
        return b"layerpy.server: serving" in self.log.read_bytes()

    def check(self) -> None:
        """Raise, with its log's end, if the instance died without being killed here."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """kill -9, as a crash: no goodbye to etcd (its lease expires on its own)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None

    def cli(self, *args: str) -> str:
        """A ``layerpy`` command against this instance (its API's Unix socket)."""
        command = [str(LAYERPY), *args, "--server", str(self.socket)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        return result.stdout + (result.stderr if result.returncode else "")

    def api(self, path: str) -> Any:
        """A JSON document from this instance, or None when it does not answer."""
        command = ["curl", "-sf", "--max-time", "5", "--unix-socket", str(self.socket)]
        result = subprocess.run([*command, f"http://layerpy{path}"], capture_output=True)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def owners(self) -> dict[str, str]:
        """node -> owning instance, as this instance reads it from etcd."""
        answer = self.api("/api/v1/cluster") or {}
        return {
            node: entry["name"]
            for entry in answer.get("instances", [])
            if entry.get("alive")
            for node in entry["nodes"]
        }

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {node["name"]: node for node in self.api("/api/v1/nodes") or []}


class HaLab:
    """The lab, a 3-member etcd and two instances, all serving when built."""

    def __init__(self, run_dir: Path, vms: list[str]) -> None:
        self.run_dir = run_dir.resolve()
        self.lab = Lab(self.run_dir)
        self.etcd: EtcdCluster | None = None
        self.heads: dict[str, Head] = {}
        try:
            self.etcd = EtcdCluster(self.run_dir / "etcd", ETCD_MEMBERS)
            oob = oob_bridge(self.lab)
            for index, (name, address) in enumerate(HEADS.items()):
                place = self.etcd.add_instance()
                place.connect(self.lab.netns, self.lab.bridge, "boot0", f"{address}/24")
                place.connect(self.lab.netns, oob, "oob0", f"10.99.1.{2 + index}/24")
                self.heads[name] = Head(name, place, self.etcd.endpoints, self.run_dir)
            for head in self.heads.values():
                reached = functools.partial(head.reaches_etcd, self.etcd.endpoints)
                self.wait(reached, 60, f"etcd's members answering {head.name}")
                head.serve()
            for head in self.heads.values():
                self.wait(head.serving, 90, f"{head.name} serving (joined the cluster)")
            for name in vms:
                self.lab.add_vm(MACHINES[name])
                if name in BMCS:
                    start_bmc(self.lab, name, BMCS[name], BMC_PASSWORD)
        except BaseException:
            self.close()
            raise

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> float:
        """Poll until `condition` holds (an instance not killed here must stay up); the
        seconds it took, or TimeoutError naming what was waited for."""
        started = time.monotonic()
        while not condition():
            for head in self.heads.values():
                head.check()
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            time.sleep(0.5)
        return time.monotonic() - started

    def close(self) -> None:
        """The lab (VMs, BMCs), then the instances' and etcd's namespaces and processes."""
        self.lab.close()
        if self.etcd is not None:
            self.etcd.close()


def failover(ha: HaLab, names: list[str], timeout: float) -> int:
    """Boot `names`, kill -9 the instance owning the first, show the other take over."""
    say = functools.partial(print, flush=True)
    first, second = ha.heads.values()
    if names:

        def ready() -> bool:
            nodes = first.nodes()
            return all(nodes.get(name, {}).get("run_state") == "ready" for name in names)

        took = ha.wait(ready, timeout, f"{', '.join(names)} ready")
        say(f"{len(names)} nodes ready after {took:.1f} s")
    node = names[0] if names else "cn001"
    ha.wait(lambda: node in first.owners(), 30, f"{node} owned")
    owner = ha.heads[first.owners()[node]]
    survivor = second if owner is first else first
    say(f"before: `layerpy cluster` on {survivor.name}\n{survivor.cli('cluster')}")
    theirs = sorted(n for n, o in survivor.owners().items() if o == owner.name)
    before = survivor.nodes().get(node, {})
    say(f"kill -9 {owner.name}, owner of {', '.join(theirs)}")
    killed, killed_at = time.monotonic(), time.time()
    owner.kill()

    def taken() -> bool:
        owners = survivor.owners()
        return all(owners.get(n) == survivor.name for n in theirs)

    took = ha.wait(taken, 30, f"{survivor.name} owning {', '.join(theirs)}")
    say(f"{survivor.name} owns {', '.join(theirs)} {took:.1f} s after the kill")
    if names:

        def reporting() -> bool:  # its agent reports to the survivor now
            after = survivor.nodes().get(node, {})
            heard = after.get("last_report") or 0  # the other one is dead: a report since
            return heard > killed_at + 1 and after.get("run_state") == "ready"  # is to this one

        ha.wait(reporting, 60, f"{node}'s agent reporting to {survivor.name}")
        after = survivor.nodes()[node]
        say(f"{node}: {after['run_state']}, boots {before.get('boots')} -> {after['boots']} "
            f"(not booted again), its agent reports to {survivor.name} "
            f"{time.monotonic() - killed:.1f} s after the kill")  # fmt: skip
        if after["boots"] != before.get("boots"):
            say(f"FAILED: {node} booted again during the take-over")
            return 1
    say(f"after: `layerpy cluster` on {survivor.name}\n{survivor.cli('cluster')}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="Two layerpy instances on etcd; a failover.")
    parser.add_argument("--vms", default="cn001,cn002", help="lab machines to boot ('' for none)")
    parser.add_argument(
        "--until-failover", action="store_true", help="exit 0 once the failover is shown"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the VMs to boot")
    parser.add_argument("--run-dir", type=Path, default=REPO / "vm-lab" / "run-ha")
    args = parser.parse_args()
    names = [name for name in args.vms.split(",") if name]
    ha = HaLab(args.run_dir, names)
    try:
        print(f"lab {ha.lab.netns}, etcd {', '.join(ha.etcd.endpoints)}: logs in {ha.run_dir}",
              flush=True)  # fmt: skip
        print(f"instances serving: {', '.join(ha.heads)}", flush=True)
        try:
            result = failover(ha, names, args.timeout)
        except (TimeoutError, RuntimeError) as error:
            print(f"FAILED: {error}", file=sys.stderr)
            return 1
        if args.until_failover:
            return result
        print("the lab keeps running; Ctrl-C ends it and removes everything", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        ha.close()


if __name__ == "__main__":
    sys.exit(main())
