"""A QEMU network-boot lab inside a throw-away network namespace.

Everything lives in one namespace named ``lplab-<pid>-<n>``: a bridge carrying the server
address, one tap per VM, the QEMU processes, the RA responder and whatever the caller starts
with ``popen``. Nothing is sent from the default namespace. Teardown kills only the PIDs
started here (and anything left inside the lab's own namespace), then deletes the namespace;
it runs on ``close``, on leaving the ``with`` block, at exit and on SIGTERM.

Importable (``sys.path.insert(0, "vm-lab"); import lab``) and a CLI (``lab.py --help``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmp_power import qmp

HERE = Path(__file__).resolve().parent
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
# Secure Boot: Debian's OVMF built with it (and SMM, so the variables resist the guest) and
# variables with Microsoft's keys enrolled and Secure Boot on, as servers ship
OVMF_SECBOOT_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")
OVMF_MS_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.ms.fd")
AAVMF_CODE = Path("/usr/share/AAVMF/AAVMF_CODE.fd")  # qemu-efi-aarch64: UEFI for arm64 virt
AAVMF_VARS = Path("/usr/share/AAVMF/AAVMF_VARS.fd")
AAVMF_MS_VARS = Path("/usr/share/AAVMF/AAVMF_VARS.ms.fd")  # Microsoft's keys, Secure Boot on
# "direct": no firmware, QEMU loads the spec's kernel and initrd itself (the minOS straight)
FIRMWARES = ("bios", "uefi", "uefi-pxe", "uefi-http", "uefi-sb", "direct")
ARM64_FIRMWARES = ("uefi-pxe", "uefi-http", "uefi-sb", "direct")  # AAVMF's network boot, or none
ARCHES = ("amd64", "arm64")
NICS = ("virtio-net-pci", "e1000e", "e1000", "rtl8139", "vmxnet3")
PR_SET_PDEATHSIG = 1
BRIDGE_MAC = "02:4c:50:00:00:01"  # locally administered, fixed (see Lab._network)
ANSI = re.compile(rb"\x1b\[[0-9;?=]*[A-Za-z]")  # SeaBIOS, iPXE and OVMF colour and cursor
SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the NUL

_counter = itertools.count()
_open_labs: set[Lab] = set()


@dataclass
class VmSpec:
    name: str
    mac: str
    firmware: str = "bios"
    memory_mb: int = 256
    powered_off: bool = False  # start with the CPU stopped (-S): only its BMC turns it on
    nic: str = "virtio-net-pci"  # QEMU's NIC model: e1000e, rtl8139, vmxnet3 as on real servers
    disk: Path | None = None  # a raw image as its local disk (virtio), e.g. for persistent paths
    arch: str = "amd64"  # arm64: qemu-system-aarch64, machine virt (cortex-a72), AAVMF
    kernel: Path | None = None  # firmware "direct": the kernel, initrd and command line
    initrd: Path | None = None
    append: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"{self.name}: arch {self.arch!r} not in {ARCHES}")
        firmwares = ARM64_FIRMWARES if self.arch == "arm64" else FIRMWARES
        if self.firmware not in firmwares:
            raise ValueError(f"{self.name}: firmware {self.firmware!r} not in {firmwares}")
        if self.nic not in NICS:
            raise ValueError(f"{self.name}: NIC {self.nic!r} not in {NICS}")
        if not re.fullmatch(r"[A-Za-z0-9_]{1,11}", self.name):  # tap-<name> fits IFNAMSIZ
            raise ValueError(f"VM name {self.name!r}: 1-11 letters, digits or _")

    @property
    def tap(self) -> str:
        return f"tap-{self.name}"

    @classmethod
    def parse(cls, text: str) -> VmSpec:
        """``name:aa:bb:cc:dd:ee:ff[:firmware]``, as the CLI takes it."""
        name, *rest = text.split(":")
        if len(rest) not in (6, 7):
            raise ValueError(f"{text!r}: expected name:mac[:firmware]")
        return cls(name, ":".join(rest[:6]), *rest[6:])


def qemu_command(spec: VmSpec, run_dir: Path) -> list[str]:
    """The QEMU command line for one VM (see README.md for why each flag is there).

    The NIC keeps QEMU's default ROM (efi-virtio.rom, efi-e1000e.rom, …: iPXE, legacy and
    EFI images, from Debian's ipxe-qemu): QEMU
    patches the PCI device ID only into a default ROM, so naming any iPXE ROM explicitly
    leaves its ID 1af4:1041 on a 1af4:1000 device and SeaBIOS silently skips it.
    No ``-no-reboot``: it turns every reset, including QMP ``system_reset``, into an exit.
    ``reboot-timeout`` instead makes SeaBIOS retry a failed netboot after 1 s, forever.
    """
    run_dir = run_dir.resolve()
    nic = f"{spec.nic},netdev=net0,mac={spec.mac},bootindex=1"
    if spec.firmware in ("uefi-pxe", "uefi-http", "uefi-sb") or spec.arch == "arm64":
        nic += ",romfile="  # no iPXE ROM: OVMF's own VirtioNetDxe + PXE (or HTTP boot)
    if spec.arch == "arm64":  # QEMU's ROMs are x86 code; cortex-a72 is cheaper under TCG than max
        # an RNG: without one AAVMF offers the kernel no EFI_RNG_PROTOCOL seed and the
        # agent's Python waits ~10 s for entropy under TCG (a direct boot's DT has a seed)
        machine = ["qemu-system-aarch64", "-machine", "virt", "-cpu", "cortex-a72",
                   "-device", "virtio-rng-pci"]  # fmt: skip
    elif spec.firmware == "uefi-sb":  # the secboot OVMF needs SMM
        machine = ["qemu-system-x86_64", "-machine", "q35,smm=on"]
    else:
        machine = ["qemu-system-x86_64", "-machine", "pc"]
    cmd = [
        machine[0],
        *("-name", spec.name, *machine[1:], "-accel", "tcg", "-m", str(spec.memory_mb)),
        *("-nodefaults", "-display", "none", "-vga", "none", "-monitor", "none"),
        # the serial console: logged to a file, and a socket to type into (Vm.type)
        *(
            "-chardev",
            f"socket,id=console,path={run_dir / f'{spec.name}.console'},server=on,"
            f"wait=off,logfile={run_dir / f'{spec.name}.serial.log'}",
        ),
        *("-serial", "chardev:console"),
        *("-qmp", f"unix:{run_dir / f'{spec.name}.qmp'},server=on,wait=off"),
        *("-netdev", f"tap,id=net0,ifname={spec.tap},script=no,downscript=no", "-device", nic),
    ]
    if spec.firmware == "direct":
        if spec.kernel is None or spec.initrd is None:
            raise ValueError(f"{spec.name}: firmware direct needs a kernel and an initrd")
        cmd += ["-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", spec.append]
    else:
        cmd += ["-boot", "order=n,reboot-timeout=1000"]
    if spec.firmware == "bios":
        cmd += ["-fw_cfg", f"name=etc/sercon-port,file={run_dir / 'sercon-port'}"]
    if spec.firmware == "uefi-http":  # OVMF's boot entries: HTTPv4 only, no PXE, no IPv6
        cmd += ["-fw_cfg", "name=opt/org.tianocore/IPv4PXESupport,string=no"]
        cmd += ["-fw_cfg", "name=opt/org.tianocore/IPv6Support,string=no"]
        # AAVMF keeps its PXEv6 entry (a minute's wait for no DHCPv6) without this one
        cmd += ["-fw_cfg", "name=opt/org.tianocore/IPv6PXESupport,string=no"]
    if spec.firmware == "uefi-sb" and spec.arch == "amd64":  # variables writable from SMM only
        cmd += ["-global", "driver=cfi.pflash01,property=secure,value=on"]
    if (code := uefi_files(spec)) is not None:
        vars_copy = run_dir / f"{spec.name}.vars.fd"
        cmd += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={code[0]}"]
        cmd += ["-drive", f"if=pflash,format=raw,unit=1,file={vars_copy}"]
    if spec.disk is not None:
        cmd += ["-drive", f"if=virtio,format=raw,file={spec.disk}"]
    if spec.powered_off:
        cmd.append("-S")
    return cmd


def uefi_files(spec: VmSpec) -> tuple[Path, Path] | None:
    """The UEFI firmware's code and the template of its variables, for a UEFI VM."""
    if spec.firmware in ("bios", "direct"):
        return None
    if spec.arch == "arm64":  # one AAVMF code; the ms variables turn Secure Boot on
        return AAVMF_CODE, AAVMF_MS_VARS if spec.firmware == "uefi-sb" else AAVMF_VARS
    return (
        (OVMF_SECBOOT_CODE, OVMF_MS_VARS) if spec.firmware == "uefi-sb" else (OVMF_CODE, OVMF_VARS)
    )


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the process that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM each process group, then SIGKILL what is left after `grace` seconds."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # every child is a session leader: pgid == pid


def _delete_netns(name: str) -> None:
    """SIGKILL whatever still runs inside namespace `name` (only a lab's own), then delete it."""
    for pid in _sh("ip", "netns", "pids", name, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    _sh("ip", "netns", "del", name, check=False)


def wait_file(
    path: Path,
    pattern: str,
    timeout: float,
    start: int = 0,
    alive: Callable[[], bool] | None = None,
) -> bool:
    """Poll `path` from byte `start` until regex `pattern` matches (ANSI escapes removed).

    Gives up early once ``alive()`` turns false and the file has nothing new to offer.
    """
    regex = re.compile(pattern.encode())
    deadline = time.monotonic() + timeout
    while True:
        running = alive is None or alive()
        try:
            with path.open("rb") as f:
                f.seek(start)
                if regex.search(ANSI.sub(b"", f.read())):
                    return True
        except FileNotFoundError:
            pass
        if not running or time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


class Vm:
    """One QEMU process in the lab, with its serial log and QMP socket."""

    def __init__(self, spec: VmSpec, proc: subprocess.Popen, run_dir: Path) -> None:
        self.spec = spec
        self.proc = proc
        self.pid = proc.pid
        self.serial_log = run_dir / f"{spec.name}.serial.log"
        self.qmp_path = run_dir / f"{spec.name}.qmp"
        self.mark = 0  # wait_serial searches from here; reset() moves it to the log's end

    def alive(self) -> bool:
        return self.proc.poll() is None

    def qmp(self, command: str) -> Any:
        """Run one QMP command (on a fresh connection) and return its ``return`` value."""
        return qmp(self.qmp_path, command)[0]

    def reset(self) -> None:
        """A hard reboot (QMP system_reset); later wait_serial calls see only the new boot."""
        self.mark = self.serial_log.stat().st_size
        self.qmp("system_reset")

    def stop(self) -> None:
        self.qmp("stop")

    def cont(self) -> None:
        self.qmp("cont")

    def kill(self) -> None:
        terminate([self.proc])

    def wait_serial(self, pattern: str, timeout: float) -> bool:
        """True once regex `pattern` appears on the serial console since ``self.mark``."""
        return wait_file(self.serial_log, pattern, timeout, self.mark, self.alive)

    def type(self, text: str) -> None:
        """Type `text` on the serial console, as a person at the console would."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as console:
            console.connect(str(self.serial_log.with_name(f"{self.spec.name}.console")))
            for char in text.encode():
                console.sendall(bytes((char,)))
                time.sleep(0.002)  # a 16550 UART's receive FIFO is only 16 bytes


class Lab:
    """A namespace with a bridge, taps, VMs and tracked helper processes."""

    def __init__(
        self,
        run_dir: Path,
        *,
        subnet_address: str = "10.99.0.1/24",
        bridge: str = "br0",
        ra: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if len(str(self.run_dir / f"{'x' * 11}.qmp")) > SUN_PATH_MAX:
            raise ValueError(f"run_dir too long for a QMP unix socket path: {self.run_dir}")
        self.bridge = bridge
        self.address = subnet_address.split("/")[0]
        self.netns = f"lplab-{os.getpid()}-{next(_counter)}"
        self.vms: dict[str, Vm] = {}
        self.procs: list[subprocess.Popen] = []
        (self.run_dir / "sercon-port").write_bytes(b"\xf8\x03")  # COM1 0x3f8, little endian
        _sh("ip", "netns", "add", self.netns)
        _open_labs.add(self)
        _exit_on_sigterm()
        try:
            self._network(subnet_address)
            if ra:
                ra_cmd = [sys.executable, str(HERE / "ra.py"), bridge]
                self.popen(ra_cmd, log=self.run_dir / "ra.log")
        except BaseException:
            self.close()
            raise

    def _network(self, subnet_address: str) -> None:
        """lo, and a quiet bridge: no STP, no forward delay, LLDP forwarded, IPv6 link-local.

        The bridge gets a fixed MAC: left alone it takes the lowest port MAC, so the server's
        MAC would change under the guests' ARP caches whenever a VM is added. No DAD: the
        link-local address (the RA source) is usable as soon as a tap brings carrier up.
        """
        br = self.bridge
        self.run(["ip", "link", "set", "lo", "up"])
        opts = ["stp_state", "0", "forward_delay", "0", "group_fwd_mask", "0x4000"]
        opts += ["mcast_snooping", "0"]  # multicast floods like on a hub: RS reach ra.py
        self.run(["ip", "link", "add", br, "address", BRIDGE_MAC, "type", "bridge", *opts])
        self.run(["sysctl", "-qw", f"net.ipv6.conf.{br}.disable_ipv6=0"])
        self.run(["sysctl", "-qw", f"net.ipv6.conf.{br}.accept_ra=0"])
        self.run(["sysctl", "-qw", f"net.ipv6.conf.{br}.accept_dad=0"])
        self.run(["ip", "addr", "add", subnet_address, "dev", br])
        self.run(["ip", "link", "set", br, "up"])

    def cmd(self, cmd: list[str]) -> list[str]:
        """`cmd` wrapped to run inside the namespace (``ip netns exec`` execs, keeping the PID)."""
        return ["ip", "netns", "exec", self.netns, *cmd]

    def run(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
        """Run one command inside the namespace; checked and captured unless told otherwise."""
        kw = {"check": True, "capture_output": True, "text": True, "timeout": 60} | kw
        return subprocess.run(self.cmd(cmd), **kw)

    def popen(self, cmd: list[str], log: Path | None = None, **kw: Any) -> subprocess.Popen:
        """Start a tracked process inside the namespace, output to `log` if given."""
        with open(log, "ab") if log else contextlib.nullcontext() as out:
            proc = subprocess.Popen(
                self.cmd(cmd), stdout=out, stderr=out, start_new_session=True, **kw
            )
        self.procs.append(proc)
        return proc

    def add_vm(self, spec: VmSpec) -> Vm:
        """Start a VM on its own tap; the tap and UEFI VARS survive a kill and re-add."""
        if spec.name in self.vms and self.vms[spec.name].alive():
            raise ValueError(f"{spec.name} is already running")
        if self.run(["ip", "link", "show", spec.tap], check=False).returncode:
            self.run(["ip", "tuntap", "add", "dev", spec.tap, "mode", "tap"])
            # a bridge port needs no IPv6 of its own: keeps the host's RS/DAD off the VM
            self.run(["sysctl", "-qw", f"net.ipv6.conf.{spec.tap}.disable_ipv6=1"])
            self.run(["ip", "link", "set", spec.tap, "master", self.bridge, "up"])
        firmware = uefi_files(spec)
        if firmware is not None and not (self.run_dir / f"{spec.name}.vars.fd").exists():
            shutil.copyfile(firmware[1], self.run_dir / f"{spec.name}.vars.fd")
        qmp_path = self.run_dir / f"{spec.name}.qmp"
        qmp_path.unlink(missing_ok=True)
        proc = self.popen(
            qemu_command(spec, self.run_dir), log=self.run_dir / f"{spec.name}.qemu.log"
        )
        vm = self.vms[spec.name] = Vm(spec, proc, self.run_dir)
        deadline = time.monotonic() + 30
        while not qmp_path.exists():
            if not vm.alive() or time.monotonic() > deadline:
                log = (self.run_dir / f"{spec.name}.qemu.log").read_text(errors="replace")
                raise RuntimeError(f"{spec.name}: QEMU did not come up:\n{log[-2000:]}")
            time.sleep(0.05)
        return vm

    def close(self) -> None:
        """Kill what the lab started, sweep its namespace, delete it. Idempotent."""
        if self not in _open_labs:
            return
        terminate(self.procs)
        _delete_netns(self.netns)
        _open_labs.discard(self)

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)


def _close_all() -> None:
    for lab in list(_open_labs):
        lab.close()


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so ``with`` blocks, finally and atexit tear labs down.

    Only when nobody else handles SIGTERM and only from the main thread (signal's rule).
    SIGINT already raises KeyboardInterrupt.
    """
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


atexit.register(_close_all)


def cleanup_stale() -> list[str]:
    """Delete labs whose creating process is gone (it was SIGKILLed): kill what is inside."""
    removed = []
    for line in _sh("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0]
        owner = re.fullmatch(r"lplab-(\d+)-\d+", name)
        if not owner or Path(f"/proc/{owner[1]}").exists():
            continue
        _delete_netns(name)
        removed.append(name)
    return removed


# --- self-test: boot each firmware against a stand-in server -------------------------------


def standin_server(lab: Lab) -> None:
    """busybox udhcpd + tftp-hpa on the lab bridge, serving ipxe.efi: enough to watch each
    firmware get a lease and (UEFI PXE) chain-load iPXE, before layerpy serves anything.

    /usr/lib/ipxe/ipxe.efi is a symlink to /boot/ipxe.efi, outside any TFTP root: copy it.
    """
    root = lab.run_dir / "tftp"
    root.mkdir(exist_ok=True)
    shutil.copyfile("/usr/lib/ipxe/ipxe.efi", root / "ipxe.efi")
    prefix = lab.address.rsplit(".", 1)[0]
    conf = lab.run_dir / "udhcpd.conf"
    conf.write_text(
        f"interface {lab.bridge}\nstart {prefix}.100\nend {prefix}.110\n"
        f"lease_file {lab.run_dir / 'udhcpd.leases'}\npidfile {lab.run_dir / 'udhcpd.pid'}\n"
        f"opt subnet 255.255.255.0\nsiaddr {lab.address}\nboot_file ipxe.efi\n"
        "opt 175 b00101\n"  # iPXE encapsulated 176 (no-pxedhcp) = 1: no ProxyDHCP wait
    )
    (lab.run_dir / "udhcpd.leases").touch()
    lab.popen(["busybox", "udhcpd", "-f", "-a", "0", str(conf)], log=lab.run_dir / "udhcpd.log")
    tftpd = ["in.tftpd", "--foreground", "--listen", "--address", f"{lab.address}:69"]
    lab.popen([*tftpd, "--secure", str(root)], log=lab.run_dir / "tftpd.log")


# What each firmware prints on its serial console on the way to a configured iPXE.
MILESTONES = {
    "bios": [("SeaBIOS", "SeaBIOS"), ("iPXE ROM", r"iPXE \(PCI")],
    "uefi": [("iPXE EFI", r"iPXE 1\.")],
    "uefi-pxe": [
        ("OVMF PXE", r">>Start PXE over IPv4"),
        ("PXE lease", r"Station IP address is"),
        ("TFTP NBP", r"NBP filesize is [1-9]"),
        ("iPXE EFI", r"iPXE 1\."),
    ],
}
IFCONF = [("ifconf start", r"Configuring \(net0"), ("ifconf ok", r"Configuring \(net0.*ok")]


def watch(steps: list[tuple[str, Path, str]], since: float, timeout: float) -> dict[str, float]:
    """Seconds from `since` until each (label, file, regex) first matches, watched together."""
    times: dict[str, float] = {}
    while len(times) < len(steps) and time.monotonic() - since < timeout:
        for label, path, pattern in steps:
            if label not in times and wait_file(path, pattern, 0):
                times[label] = time.monotonic() - since
        time.sleep(0.05)
    return times


def boot_once(
    run_dir: Path, firmware: str, ra: bool, timeout: float = 120
) -> tuple[dict[str, float], int]:
    """Boot one VM in a fresh lab, then stop/cont and reset it.

    Returns seconds from QEMU start to each milestone reached, and QEMU's pid.
    """
    shutil.rmtree(run_dir, ignore_errors=True)  # logs are appended to: start clean
    with Lab(run_dir, ra=ra) as lab:
        standin_server(lab)
        start = time.monotonic()
        vm = lab.add_vm(VmSpec("vm1", "52:54:00:99:00:11", firmware))
        steps = [(label, vm.serial_log, regex) for label, regex in MILESTONES[firmware] + IFCONF]
        steps.append(("1st OFFER", lab.run_dir / "udhcpd.log", "sending OFFER"))
        times = watch(steps, start, timeout)
        vm.stop()
        if vm.qmp("query-status")["status"] == "paused":
            vm.cont()
            start = time.monotonic()
            vm.reset()  # the same QEMU must boot again: no -no-reboot
            if vm.wait_serial(MILESTONES[firmware][0][1], timeout):
                times["stop/cont+reset to 1st"] = time.monotonic() - start
    return times, vm.pid


def selftest(run_dir: Path) -> bool:
    """Boot every firmware with and without the RA responder; check teardown left nothing."""
    qemu_pids: list[int] = []
    ok = True
    for firmware in MILESTONES:  # the stand-in server offers no HTTP boot
        for ra in (True, False):
            case_dir = run_dir / f"{firmware}-{'ra' if ra else 'nora'}"
            times, pid = boot_once(case_dir, firmware, ra)
            qemu_pids.append(pid)
            ok &= len(times) == len(MILESTONES[firmware]) + len(IFCONF) + 2
            ifconf = times.get("ifconf ok", 0) - times.get("ifconf start", 0)
            steps = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
            print(f"{case_dir.name:14} ifconf {ifconf:5.1f}s | {steps}", flush=True)
    prefix = f"lplab-{os.getpid()}-"
    mine = [n for n in _sh("ip", "netns", "list").stdout.split() if n.startswith(prefix)]
    alive = [pid for pid in qemu_pids if Path(f"/proc/{pid}").exists()]
    print(f"after teardown: lab namespaces {mine}, QEMU pids {qemu_pids} still alive {alive}")
    return ok and not mine and not alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a lab with VMs and keep it until Ctrl-C or SIGTERM")
    up.add_argument("--vms", required=True, help=f"name:mac[:{'|'.join(FIRMWARES)}],...")
    up.add_argument("--run-dir", type=Path, required=True)
    up.add_argument("--address", default="10.99.0.1/24", help="bridge address (server side)")
    up.add_argument("--no-ra", action="store_true", help="no router advertisements")
    test = sub.add_parser("selftest", help="boot each firmware against busybox udhcpd")
    test.add_argument("--run-dir", type=Path, default=Path("/tmp/lplab-selftest"))
    sub.add_parser("cleanup", help="delete labs left by processes that were SIGKILLed")
    args = parser.parse_args(argv)
    if args.command == "selftest":
        return 0 if selftest(args.run_dir) else 1
    if args.command == "cleanup":
        print("\n".join(cleanup_stale()) or "nothing stale")
        return 0
    specs = [VmSpec.parse(text) for text in args.vms.split(",")]
    with Lab(args.run_dir, subnet_address=args.address, ra=not args.no_ra) as lab:
        for spec in specs:
            vm = lab.add_vm(spec)
            print(f"{spec.name}: pid {vm.pid} serial {vm.serial_log} qmp {vm.qmp_path}")
        print(f"netns {lab.netns}: ip netns exec {lab.netns} ...  (Ctrl-C tears down)", flush=True)
        while True:
            signal.pause()


if __name__ == "__main__":
    sys.exit(main())
