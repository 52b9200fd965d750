#!/usr/bin/env python3
"""Power a lab VM through its QMP socket, as a PDU's command-line tool powers an outlet:
for layerpy's ``command`` power driver (docs/config.md) and by hand.

    qmp_power.py SOCKET on|off|cycle|status

The lab's power model (bmc.py's and layerpy's qemu driver's): "off" is QEMU's prelaunch
state (started with ``-S``, or stopped and reset), so the next "on" boots afresh. On is
``system_reset`` + ``cont`` when off; off is ``stop`` + ``system_reset`` when on; cycle is
``system_reset`` + ``cont``. ``status`` prints QEMU's run state as it is (running, paused,
prelaunch, shutdown, …), for the node file's ``status_on`` and ``status_off`` patterns to
read. Exit code 0, or 1 with one line on stderr when QEMU cannot be reached or refuses.
Standard library only.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

OFF_STATES = {"prelaunch", "shutdown"}  # QEMU run states of a machine that is not powered


def qmp(path: Path, *commands: str) -> list[Any]:
    """Run QMP commands on one fresh connection: QEMU's QMP socket serves one client at a
    time, so holding it would lock out the lab and layerpy's qemu driver."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        stream = sock.makefile("rwb")
        json.loads(stream.readline())  # greeting
        results = []
        for name in ("qmp_capabilities", *commands):
            stream.write(json.dumps({"execute": name}).encode() + b"\n")
            stream.flush()
            while True:  # skip asynchronous events
                reply = json.loads(stream.readline() or b'{"error": {"desc": "EOF"}}')
                if "return" in reply or "error" in reply:
                    break
            if "error" in reply:
                raise RuntimeError(f"QMP {name}: {reply['error']['desc']}")
            results.append(reply["return"])
    return results[1:]


def power(path: Path, operation: str) -> str | None:
    """Do `operation`; QEMU's run state for "status", else None."""
    (status,) = qmp(path, "query-status")
    state = status["status"]
    if operation == "status":
        return state
    if (operation == "on" and state in OFF_STATES) or operation == "cycle":
        qmp(path, "system_reset", "cont")
    elif operation == "off" and state not in OFF_STATES:
        qmp(path, "stop", "system_reset")
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("on", "off", "cycle", "status"):
        print("usage: qmp_power.py SOCKET on|off|cycle|status", file=sys.stderr)
        return 2
    try:
        state = power(Path(argv[0]), argv[1])
    except (OSError, RuntimeError, ValueError) as error:  # ValueError: not JSON
        print(f"qmp_power: {argv[0]}: {error}", file=sys.stderr)
        return 1
    if state is not None:
        print(state)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
