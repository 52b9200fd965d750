"""Kernel command line parsing for the minOS agent.

The minOS gets all of its per-node settings from the kernel command line (like Kraken's
``kraken.*`` parameters), so the agent needs no config file and no fetched state to start.
"""

from __future__ import annotations

import os

from layerpy.agent.lldp import DEFAULT_WAIT as DEFAULT_LLDP_WAIT

DEFAULT_CMDLINE = "/proc/cmdline"
DEFAULT_HEARTBEAT = 5.0


def split_cmdline(text: str) -> list[str]:
    """Split like the kernel does: whitespace separates, double quotes group.

    shlex would do, but it costs an import the initramfs has to carry.
    """
    words: list[str] = []
    cur: list[str] = []
    quoted = False
    have = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
            have = True
        elif ch.isspace() and not quoted:
            if have:
                words.append("".join(cur))
            cur, have = [], False
        else:
            cur.append(ch)
            have = True
    if have:
        words.append("".join(cur))
    return words


def normalize_mac(value: str) -> str:
    """Return ``aa:bb:cc:dd:ee:ff`` for a MAC in iPXE BOOTIF or any common spelling.

    iPXE passes ``BOOTIF=01-52-54-00-12-34-56``: the leading ``01`` is the ARP hardware
    type (Ethernet), not part of the address. Returns "" for anything unparsable.
    """
    raw = value.strip().lower().replace("-", ":")
    parts = raw.split(":")
    if len(parts) == 7 and parts[0] == "01":
        parts = parts[1:]
    if len(parts) == 1 and len(raw) == 12:
        parts = [raw[i : i + 2] for i in range(0, 12, 2)]
    if len(parts) != 6:
        return ""
    try:
        octets = [int(p, 16) for p in parts]
    except ValueError:
        return ""
    if any(len(p) not in (1, 2) or not 0 <= o <= 255 for p, o in zip(parts, octets, strict=True)):
        return ""
    return ":".join(f"{o:02x}" for o in octets)


class Config:
    """What the kernel command line tells the agent; ``problems`` lists what is missing."""

    __slots__ = (
        "bootif", "heartbeat", "lldp_wait", "node", "params", "problems", "server", "token",
    )  # fmt: skip

    def __init__(self, params: dict[str, str]) -> None:
        self.params = params
        self.server = params.get("layerpy.server", "").rstrip("/")
        self.node = params.get("layerpy.node", "")
        self.token = params.get("layerpy.token", "")
        self.bootif = normalize_mac(params.get("BOOTIF", ""))
        self.heartbeat = DEFAULT_HEARTBEAT
        self.lldp_wait = DEFAULT_LLDP_WAIT
        self.problems: list[str] = []
        if not self.server:
            self.problems.append("layerpy.server= is missing")
        elif not self.server.startswith(("http://", "https://")):
            self.problems.append(f"layerpy.server={self.server} is not an http:// URL")
        if not self.node:
            self.problems.append("layerpy.node= is missing")
        if "BOOTIF" in params and not self.bootif:
            self.problems.append(f"BOOTIF={params['BOOTIF']} is not a MAC address")
        hb = params.get("layerpy.heartbeat")
        if hb is not None:
            try:
                value = float(hb)
            except ValueError:
                value = 0.0
            if value > 0:
                self.heartbeat = value
            else:
                self.problems.append(f"layerpy.heartbeat={hb} is not a positive number")
        wait = params.get("layerpy.lldp_wait")
        if wait is not None:  # seconds to listen for the switch per round; 0 turns LLDP off
            try:
                value = float(wait)
            except ValueError:
                value = -1.0
            if value >= 0:
                self.lldp_wait = value
            else:
                self.problems.append(f"layerpy.lldp_wait={wait} is not a number of seconds")

    @property
    def ok(self) -> bool:
        """Server and node are present and sane; a bad BOOTIF or heartbeat is not fatal."""
        return bool(self.server and self.node) and self.server.startswith(("http://", "https://"))

    @property
    def report_url(self) -> str:
        return f"{self.server}/api/v1/agent/report"

    def __repr__(self) -> str:
        return f"Config(server={self.server!r}, node={self.node!r}, bootif={self.bootif!r})"


def parse_cmdline(text: str) -> Config:
    """Parse a kernel command line; the last occurrence of a key wins, as in the kernel."""
    params: dict[str, str] = {}
    for word in split_cmdline(text):
        key, sep, value = word.partition("=")
        if sep:
            params[key] = value
        else:
            params.setdefault(key, "")
    return Config(params)


def read_cmdline(path: str | None = None) -> Config:
    """Read and parse the command line (``LAYERPY_CMDLINE`` overrides the path for tests)."""
    path = path or os.environ.get("LAYERPY_CMDLINE") or DEFAULT_CMDLINE
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_cmdline(f.read())
