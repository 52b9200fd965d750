"""The vocabulary, defined once: node states and boot phases, and the record of what was
observed of a node. The mutation table, the API, the CLI and the docs use these names."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from ipaddress import IPv4Address
from typing import Any

from layerpy.config import NodeConfig
from layerpy.proto.agent import ImageState

__all__ = ["Boot", "Busy", "ImageState", "Node", "Phase", "PowerState", "RunState"]


class PowerState(StrEnum):
    """From BMC polls; ``hang`` is the engine's conclusion about a node that is on but
    neither booting nor reporting."""

    UNKNOWN = "unknown"
    OFF = "off"
    ON = "on"
    HANG = "hang"
    ERROR = "error"


class RunState(StrEnum):
    """From the boot services and agent reports: DHCP from boot firmware starts a boot,
    the agent's hello makes it init, its reports ready, missed reports lost."""

    UNKNOWN = "unknown"
    BOOTING = "booting"
    INIT = "init"
    READY = "ready"
    LOST = "lost"
    ERROR = "error"


class Busy(StrEnum):
    """From agent reports: a job on the node marks it busy, and busy nodes are drained
    before anything disruptive."""

    UNKNOWN = "unknown"
    FREE = "free"
    BUSY = "busy"


class Phase(StrEnum):
    """The phases of one boot, in the order a PXE boot passes them."""

    DHCP_DISCOVER = "dhcp_discover"
    DHCP_ACK = "dhcp_ack"
    TFTP = "tftp"
    SCRIPT = "script"
    KERNEL = "kernel"
    INITRD = "initrd"
    AGENT_HELLO = "agent_hello"
    READY = "ready"


@dataclass
class Boot:
    """One boot of a node: when each phase was first seen (wall clock seconds). Only the
    node store writes it (``NodeStore.apply``)."""

    started: float = field(default_factory=time.time)
    phases: dict[Phase, float] = field(default_factory=dict)
    token_digest: str | None = field(default=None, repr=False)  # of its boot token
    boot_id: str | None = None
    firmware: str | None = None
    resumed: bool = False  # read back after a restart: its agent was reporting before
    # the DHCP transactions (xid) of the DISCOVERs seen in this boot: a client's retries
    # keep their xid, so a late retransmission is this boot's, not a new one (kept few)
    xids: frozenset[int] = frozenset()

    def timeline(self) -> dict[str, float]:
        """Seconds since the start of the boot for every phase seen so far."""
        ordered = sorted(self.phases.items(), key=lambda item: item[1])
        return {str(phase): round(when - self.started, 3) for phase, when in ordered}


@dataclass
class Node:
    """What the file wants of a node (``config``) beside what was observed of it. Only the
    node store's ``apply`` (``layerpy.nodes.store``) assigns the observed fields."""

    config: NodeConfig
    power: PowerState = PowerState.UNKNOWN
    power_error: str | None = None  # the BMC's last failure, until it answers again
    run_state: RunState = RunState.UNKNOWN
    busy: Busy = Busy.UNKNOWN
    image_state: ImageState = ImageState.UNKNOWN  # as the agent reports it
    image_digest: str | None = None
    image_error: str | None = None
    files_revision: str | None = None  # the node's files in place, as its agent reports
    files_error: str | None = None
    mac: str | None = None
    ip: IPv4Address | None = None
    hostname: str | None = None
    location: dict[str, Any] | None = None  # the last evidence of where it is plugged in
    conflict: str | None = None
    conflict_at: float | None = None  # when the other machine last claimed the location
    binding: dict[str, Any] | None = None  # the last change of its machine: MAC, previous, how
    rebind_pending: dict[str, Any] | None = None  # new hardware waiting for `layerpy bind`
    problem: str | None = None  # what its agent gets wrong (e.g. another protocol version)
    secure_boot: bool | None = None  # as its agent reports the firmware's word; None: unsaid
    console_problem: str | None = None  # a panic, oops... seen on its console in this boot
    console_seen: frozenset[str] = frozenset()  # the kinds of problem seen in this boot
    last_report: float | None = None
    heard_by: str | None = None  # the instance of a cluster its agent reports to
    boot: Boot | None = None
    boots: int = 0
    agent: dict[str, Any] = field(default_factory=dict)  # version, timeline, persist, platform
    agent_uptime: float | None = None  # the agent's at its last report: a heartbeat's news
    agent_seq: int | None = None
    owner: str | None = None  # in a cluster, the instance owning it ("": none yet)

    @property
    def name(self) -> str:
        return self.config.name

    def as_json(self) -> dict[str, Any]:
        boot = self.boot
        timeline = {} if boot is None else boot.timeline()
        return {
            "name": self.name,
            "mac": self.mac or self.config.mac,
            "ip": str(address) if (address := self.ip or self.config.ip) else None,
            "hostname": self.hostname,
            "busy": self.busy,
            "power": self.power,
            "power_error": self.power_error,
            "location": self.location,
            "conflict": self.conflict,
            "binding": self.binding,
            "rebind_pending": self.rebind_pending,
            "problem": self.problem,
            "console_problem": self.console_problem,
            "secure_boot": self.secure_boot,
            "image": {
                "name": self.config.image,
                "state": self.image_state,
                "digest": self.image_digest,
                "error": self.image_error,
            },
            "files": {"revision": self.files_revision, "error": self.files_error},
            "group": self.config.group,
            "vars": self.config.vars,
            "run_state": self.run_state,
            "boots": self.boots,
            "last_report": self.last_report,
            "agent": {"uptime": self.agent_uptime, "seq": self.agent_seq, **self.agent}
            if self.agent
            else {},
            "boot": None
            if boot is None
            else {
                "started": boot.started,
                "firmware": boot.firmware,
                "boot_id": boot.boot_id,
                "timeline": timeline,
            },
            "timeline": timeline,
        } | ({} if self.owner is None else {"owner": self.owner})
