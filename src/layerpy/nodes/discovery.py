"""Machines that asked to boot but match no node: listed for the operator, and with
``network.discover`` booted into the minOS so their agent can say where they are plugged in.

Bounded: a flood of made-up MACs evicts the machines seen longest ago, never grows memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, ValuesView
from dataclasses import dataclass, field, fields
from typing import Any

from layerpy import digests

DISCOVERY = "discover"  # the node name a machine no node claims boots under
MAX_MACHINES = 4096


@dataclass(slots=True)  # one object per machine, no dict: less for the collector to walk
class UnknownMachine:
    mac: str
    first_seen: float
    last_seen: float
    requests: int = 0
    firmware: str | None = None
    vendor_class: str | None = None
    conflict: str | None = None
    claim: str | None = None  # the node its LLDP names, waiting for confirmation
    token_digest: str | None = field(default=None, repr=False)  # of its discovery boot's

    def as_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "token_digest"}


class Discovery:
    def __init__(self, limit: int = MAX_MACHINES) -> None:
        self.machines: OrderedDict[str, UnknownMachine] = OrderedDict()
        self.limit = limit

    def get(self, mac: str) -> UnknownMachine | None:
        return self.machines.get(mac)

    def seen(self, mac: str, now: float) -> tuple[UnknownMachine, bool]:
        """The machine, refreshed; True when it is new."""
        machine = self.machines.get(mac)
        new = machine is None
        if machine is None:
            machine = self.machines[mac] = UnknownMachine(mac, now, now)
            while len(self.machines) > self.limit:
                self.machines.popitem(last=False)
        else:
            self.machines.move_to_end(mac)
        machine.last_seen = now
        return machine, new

    def issue_token(self, mac: str) -> str | None:
        """A new discovery token for this machine; only its digest is kept."""
        machine = self.machines.get(mac)
        if machine is None:
            return None
        token = digests.new()
        machine.token_digest = digests.digest(token)
        return token

    def check_token(self, mac: str, token: str) -> UnknownMachine | None:
        machine = self.machines.get(mac)
        return machine if machine and digests.matches(machine.token_digest, token) else None

    def forget(self, mac: str) -> None:
        self.machines.pop(mac, None)

    def __contains__(self, mac: object) -> bool:
        return mac in self.machines

    def __getitem__(self, mac: str) -> UnknownMachine:
        return self.machines[mac]

    def __iter__(self) -> Iterator[str]:
        return iter(self.machines)

    def values(self) -> ValuesView[UnknownMachine]:
        return self.machines.values()
