"""Boot NIC discovery and DHCP for the minOS, using sysfs, busybox ``ip`` and ``udhcpc``.

The agent owns the network because nothing else in the minOS does: there is no init
system beyond busybox, and the NIC must come up before the node can report.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable

SYS_NET = "/sys/class/net"
RUN_DIR = "/run/layerpy"
UDHCPC_SCRIPT = "/usr/share/udhcpc/default.script"
VENDOR_CLASS = "layerpy-minos"
SIOCGIFADDR = 0x8915
ARPHRD_ETHER = 1


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def interfaces(sys_net: str = SYS_NET) -> list[tuple[str, str]]:
    """(name, mac) of the Ethernet interfaces, physical ones first, then by name."""
    try:
        names = sorted(os.listdir(sys_net))
    except OSError:
        return []
    found: list[tuple[bool, str, str]] = []
    for name in names:
        base = os.path.join(sys_net, name)
        if name == "lo" or _read(os.path.join(base, "type")) != str(ARPHRD_ETHER):
            continue
        physical = os.path.exists(os.path.join(base, "device"))
        found.append((not physical, name, _read(os.path.join(base, "address")).lower()))
    found.sort()
    return [(name, mac) for _, name, mac in found]


def pick_interface(bootif: str, sys_net: str = SYS_NET) -> tuple[str, str] | None:
    """The interface iPXE booted from (BOOTIF), else the first Ethernet interface."""
    ifs = interfaces(sys_net)
    for name, mac in ifs:
        if bootif and mac == bootif:
            return name, mac
    return ifs[0] if ifs else None


def ipv4_address(ifname: str) -> str:
    """The interface's primary IPv4 address, or "" (an ioctl: no subprocess per poll)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", ifname.encode()[:15])
            res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)
    except OSError:
        return ""
    return socket.inet_ntoa(res[20:24])


def source_address(url_host: str, port: int) -> str:
    """The local address the kernel would use towards the server (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((url_host, port or 80))
            return s.getsockname()[0]
    except OSError:
        return ""


def read_lease(ifname: str, run_dir: str = RUN_DIR) -> dict[str, str]:
    """Facts the udhcpc script wrote (``key=value`` lines in lease-<if>.env)."""
    lease: dict[str, str] = {}
    text = _read(os.path.join(run_dir, f"lease-{ifname}.env"))
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            lease[key.strip()] = value.strip()
    return lease


def _pid_alive(pidfile: str) -> int:
    try:
        pid = int(_read(pidfile) or "0")
    except ValueError:
        return 0
    if pid <= 0:
        return 0
    try:
        os.kill(pid, 0)
    except OSError:
        return 0
    return pid


class Nic:
    """Brings the boot NIC up and keeps a udhcpc daemon running on it."""

    def __init__(
        self,
        bootif: str,
        hostname: str,
        log: Callable[[str], None],
        uptime: Callable[[], float],
        script: str = UDHCPC_SCRIPT,
        run_dir: str = RUN_DIR,
    ) -> None:
        self.bootif = bootif
        self.hostname = hostname
        self.log = log
        self.uptime = uptime
        self.script = os.environ.get("LAYERPY_UDHCPC_SCRIPT", script)
        self.run_dir = run_dir
        self.name = ""
        self.mac = ""
        self.nic_up: float | None = None
        self.ip_acquired: float | None = None

    @property
    def pidfile(self) -> str:
        return f"/run/udhcpc.{self.name}.pid"

    def find(self, sleep: Callable[[float], object], retry: float = 5.0) -> None:
        """Wait until the boot NIC exists; the driver may still be probing."""
        warned = False
        while True:
            found = pick_interface(self.bootif)
            if found:
                self.name, self.mac = found
                if self.bootif and self.mac != self.bootif:
                    self.log(
                        f"no interface has BOOTIF {self.bootif}; using {self.name} ({self.mac})"
                    )
                return
            if not warned:
                want = f"with MAC {self.bootif}" if self.bootif else "(no BOOTIF given)"
                self.log(f"no Ethernet interface found {want}; waiting, retry every {retry:g} s")
                warned = True
            sleep(retry)

    def link_up(self, sleep: Callable[[float], object], carrier_wait: float = 10.0) -> None:
        """``ip link set up`` and wait (bounded) for carrier, to time ``nic_up`` honestly."""
        subprocess.run(["ip", "link", "set", "dev", self.name, "up"], check=False)
        deadline = time.monotonic() + carrier_wait
        while _read(f"{SYS_NET}/{self.name}/carrier") != "1" and time.monotonic() < deadline:
            sleep(0.1)
        if self.nic_up is None:
            self.nic_up = self.uptime()
        state = "carrier" if _read(f"{SYS_NET}/{self.name}/carrier") == "1" else "no carrier"
        self.log(f"{self.name} ({self.mac}) is up, {state}, at uptime {self.nic_up:.2f} s")

    def udhcpc_running(self) -> bool:
        return bool(self.name) and _pid_alive(self.pidfile) > 0

    def start_udhcpc(self) -> None:
        """Start busybox udhcpc; with ``-b`` it returns once leased or after ~20 s."""
        os.makedirs(self.run_dir, exist_ok=True)
        cmd = [
            "udhcpc", "-i", self.name, "-s", self.script,
            "-x", f"hostname:{self.hostname}", "-V", VENDOR_CLASS,
            "-b", "-p", self.pidfile, "-t", "10", "-T", "2",
        ]  # fmt: skip
        self.log("starting " + " ".join(cmd))
        try:
            subprocess.run(cmd, check=False, timeout=90)
        except (OSError, subprocess.SubprocessError) as e:
            self.log(f"udhcpc failed to run: {e}")

    def stop_udhcpc(self) -> None:
        pid = _pid_alive(self.pidfile)
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)

    def address(self) -> str:
        return ipv4_address(self.name) if self.name else ""

    def wait_address(self, sleep: Callable[[float], object], wait: float) -> str:
        """Poll (bounded) until the NIC has an IPv4 address; log it with the lease's facts."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            ip = self.address()
            if ip:
                self.ip_acquired = self.uptime()
                lease = read_lease(self.name, self.run_dir)
                facts = ", ".join(
                    f"{k} {lease[k]}"
                    for k in ("mask", "router", "serverid", "lease")
                    if lease.get(k)
                )
                self.log(
                    f"{self.name} has {ip} at uptime {self.ip_acquired:.2f} s"
                    + (f" ({facts})" if facts else "")
                )
                return ip
            sleep(0.2)
        return ""

    def bring_up(self, sleep: Callable[[float], object], wait: float = 30.0) -> str:
        """Find the NIC, set it up, run DHCP until it has an address; returns the address."""
        self.find(sleep)
        self.link_up(sleep)
        while True:
            if not self.udhcpc_running():
                self.start_udhcpc()
            ip = self.wait_address(sleep, wait)
            if ip:
                return ip
            self.log(f"no IPv4 address on {self.name} after {wait:g} s; restarting udhcpc")
            self.stop_udhcpc()
            sleep(1.0)

    def redo_dhcp(self, hostname: str, sleep: Callable[[float], object], wait: float = 30.0) -> str:
        """Drop the lease and ask afresh as `hostname`: a new identity has its own address.

        The lease file goes first, so that the script's deconfig drops the address. The
        running udhcpc is told to release (SIGUSR2, so the server frees the old address)
        and then to exit (SIGTERM; it handles them in that order). A new udhcpc starts with a
        DISCOVER that carries the new hostname. Returns the new address, "" if none came in
        `wait` seconds (udhcpc keeps trying in the background).
        """
        self.hostname = hostname
        with contextlib.suppress(OSError):  # the script keeps the address of a lease on file
            os.unlink(os.path.join(self.run_dir, f"lease-{self.name}.env"))
        pid = _pid_alive(self.pidfile)
        if pid:
            for sig in (signal.SIGUSR2, signal.SIGTERM):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 5.0
            while _pid_alive(self.pidfile) == pid and time.monotonic() < deadline:
                sleep(0.1)
        self.start_udhcpc()
        ip = self.wait_address(sleep, wait)
        if not ip:
            self.log(f"no IPv4 address on {self.name} after {wait:g} s; udhcpc keeps trying")
        return ip

    def keep_dhcp(self) -> None:
        """Restart udhcpc if it died, so leases keep being renewed."""
        if self.name and not self.udhcpc_running():
            self.log(f"udhcpc on {self.name} is not running; restarting it")
            self.start_udhcpc()
