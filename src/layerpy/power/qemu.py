"""QEMU's QMP as a power switch, for labs without BMCs.

"Off" is QEMU's ``prelaunch`` run state: started with ``-S``, or stopped and reset, so the
next "on" boots afresh from the firmware. QEMU keeps that state, so it survives a restart of
layerpy and agrees with the lab's BMC. A VM paused behind our back (``stop``) reads "on"
and hangs, like a wedged machine, until a cycle. One connection per operation: QEMU's QMP
socket serves one client at a time, and holding it would lock out the lab and its BMC.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from layerpy.power.base import PowerError, PowerSpec

TIMEOUT = 5.0  # seconds per operation
OFF_STATES = {"prelaunch", "shutdown"}


class QemuDriver:
    def __init__(self, node: str, spec: PowerSpec) -> None:
        assert spec.address
        self.node = node
        self.path = spec.address

    async def status(self) -> str:
        (status,) = await self._qmp("query-status")
        return "off" if status["status"] in OFF_STATES else "on"

    async def on(self) -> None:
        if await self.status() == "off":
            await self._qmp("system_reset", "cont")

    async def off(self) -> None:
        if await self.status() == "on":
            await self._qmp("stop", "system_reset")

    async def cycle(self) -> None:
        """A hard reset that also thaws a paused VM and powers on one that is off."""
        await self._qmp("system_reset", "cont")

    async def boot_network_once(self) -> None:
        """Nothing to do: lab VMs always boot from the network."""

    async def close(self) -> None:
        pass

    async def _qmp(self, *commands: str) -> list[Any]:
        """Run `commands` on one fresh QMP connection; their return values."""
        try:
            async with asyncio.timeout(TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(self.path)
                try:
                    await reader.readline()  # greeting
                    results = []
                    for command in ("qmp_capabilities", *commands):
                        writer.write(json.dumps({"execute": command}).encode() + b"\n")
                        results.append(await self._reply(reader, command))
                    return results[1:]
                finally:
                    writer.close()
                    await writer.wait_closed()  # frees QEMU's one client slot now
        except TimeoutError:
            reason = f"no answer in {TIMEOUT:g} s (is another client holding it?)"
        except OSError as error:
            reason = f"{error.strerror or error} (is the VM running?)"
        raise PowerError(f"{self.node}: QMP {self.path}: {reason}")

    async def _reply(self, reader: asyncio.StreamReader, command: str) -> Any:
        while True:  # skip asynchronous events
            line = await reader.readline()
            if not line:
                raise PowerError(f"{self.node}: QMP {self.path}: closed during {command}")
            reply = json.loads(line)
            if "error" in reply:
                desc = reply["error"].get("desc")
                raise PowerError(f"{self.node}: QMP {self.path}: {command}: {desc}")
            if "return" in reply:
                return reply["return"]
