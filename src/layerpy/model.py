"""Node records: what the file wants (``NodeConfig``) beside what was observed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from ipaddress import IPv4Address

from layerpy.config import NodeConfig


class RunState(StrEnum):
    UNKNOWN = "unknown"
    BOOTING = "booting"
    INIT = "init"
    READY = "ready"
    LOST = "lost"
    ERROR = "error"


# The phases of one boot, in the order a PXE boot passes them.
PHASES = (
    "dhcp_discover",
    "dhcp_ack",
    "tftp",
    "script",
    "kernel",
    "initrd",
    "agent_hello",
    "ready",
)


@dataclass
class Boot:
    """One boot of a node: when each phase was first seen (wall clock seconds)."""

    started: float = field(default_factory=time.time)
    phases: dict[str, float] = field(default_factory=dict)
    token: str | None = None
    boot_id: str | None = None
    firmware: str | None = None

    def mark(self, phase: str, when: float | None = None) -> bool:
        """Record a phase once; return True the first time."""
        if phase in self.phases:
            return False
        self.phases[phase] = when if when is not None else time.time()
        return True

    def timeline(self) -> dict[str, float]:
        """Seconds since the start of the boot for every phase seen so far."""
        ordered = sorted(self.phases.items(), key=lambda item: item[1])
        return {phase: round(when - self.started, 3) for phase, when in ordered}


@dataclass
class Node:
    config: NodeConfig
    run_state: RunState = RunState.UNKNOWN
    mac: str | None = None
    ip: IPv4Address | None = None
    hostname: str | None = None
    busy: str = "unknown"
    power: str = "unknown"
    image_state: str = "unknown"  # as the agent reports it
    image_digest: str | None = None
    image_error: str | None = None
    location: dict[str, object] | None = None  # the last evidence of where it is plugged in
    conflict: str | None = None
    conflict_at: float | None = None  # when the other machine last claimed the location
    last_report: float | None = None
    boot: Boot | None = None
    boots: int = 0
    agent: dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name

    def as_json(self) -> dict[str, object]:
        boot = self.boot
        return {
            "name": self.name,
            "mac": self.mac or self.config.mac,
            "ip": str(self.ip or self.config.ip),
            "hostname": self.hostname,
            "busy": self.busy,
            "power": self.power,
            "location": self.location,
            "conflict": self.conflict,
            "image": {
                "name": self.config.image,
                "state": self.image_state,
                "digest": self.image_digest,
                "error": self.image_error,
            },
            "group": self.config.group,
            "run_state": str(self.run_state),
            "boots": self.boots,
            "last_report": self.last_report,
            "boot": None
            if boot is None
            else {
                "started": boot.started,
                "firmware": boot.firmware,
                "boot_id": boot.boot_id,
                "timeline": boot.timeline(),
            },
            "timeline": {} if boot is None else boot.timeline(),
        }
