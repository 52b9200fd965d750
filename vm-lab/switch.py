"""The lab's LLDP "switch": advertises one chassis, and a port id per VM tap.

A frame sent on a tap reaches only the VM behind it (the bridge is not involved), so each
tap gets its own Port ID ("swp1", "swp2", ...) under a single Chassis ID: what a node would
hear from a real top-of-rack switch, and what location addressing names it by.

Runs inside the lab namespace: ``switch.py [--interval S] tap-cn001=swp1 tap-cn002=swp2``,
or ``start_switch(lab, {"tap-cn001": "swp1"})`` from Python. A tap that does not exist yet
(its VM not added) is skipped until it does. Uses layerpy's LLDP codec, which is standard
library only, so any Python 3.11 runs this file.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "src"))  # runs without the venv too

from layerpy.proto.lldp import CHASSIS_MAC, ETH_P_LLDP, PORT_INTERFACE_NAME, Neighbor, build_frame

from lab import Lab

HERE = Path(__file__).resolve().parent
CHASSIS = "02:00:00:00:0a:01"
TTL_HOLD = 4  # 802.1AB msgTxHold: a neighbour expires after four missed advertisements


def frames(ports: dict[str, str], chassis: str, name: str, interval: float) -> dict[str, bytes]:
    """One LLDP frame per tap, all from the chassis MAC, each naming its own port."""
    ttl = min(0xFFFF, round(interval * TTL_HOLD))
    mac = bytes.fromhex(chassis.replace(":", ""))
    return {
        tap: build_frame(
            mac,
            Neighbor(chassis, CHASSIS_MAC, port, PORT_INTERFACE_NAME, ttl, name, f"{name} {port}"),
        )
        for tap, port in ports.items()
    }


def run(ports: dict[str, str], chassis: str, name: str, interval: float) -> None:
    """Send every frame, then again every `interval` seconds, until killed."""
    by_tap = frames(ports, chassis, name, interval)
    failing: set[str] = set()  # report a missing tap once, not every interval
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as sock:
        while True:
            for tap, frame in by_tap.items():
                try:
                    sock.sendto(frame, (tap, ETH_P_LLDP))
                    failing.discard(tap)
                except OSError as error:
                    if tap not in failing:
                        print(f"{tap}: {error}", file=sys.stderr, flush=True)
                    failing.add(tap)
            time.sleep(interval)


def start_switch(
    lab: Lab, ports: dict[str, str], chassis: str = CHASSIS, interval: float = 5, name: str = "sw1"
) -> subprocess.Popen:
    """Run the switch inside `lab`'s namespace (a tracked process, killed with the lab)."""
    cmd = [sys.executable, str(HERE / "switch.py"), "--chassis", chassis, "--name", name]
    cmd += ["--interval", str(interval), *(f"{tap}={port}" for tap, port in ports.items())]
    return lab.popen(cmd, log=lab.run_dir / f"switch-{name}.log")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ports", nargs="+", metavar="TAP=PORT", help="e.g. tap-cn001=swp1")
    parser.add_argument("--chassis", default=CHASSIS, help="chassis MAC (subtype 4)")
    parser.add_argument("--name", default="sw1", help="system name")
    parser.add_argument("--interval", type=float, default=5, help="seconds between frames")
    args = parser.parse_args(argv)
    if not all(text.count("=") == 1 for text in args.ports):
        parser.error("ports are given as TAP=PORT")
    run(dict(text.split("=") for text in args.ports), args.chassis, args.name, args.interval)


if __name__ == "__main__":
    main()
