"""Real VMs, power-on to ready: layerpy + the minOS against dnsmasq + a busybox initramfs.

Both stacks boot the same QEMU machines (vm-lab/lab.py: SeaBIOS, the NIC's iPXE ROM,
virtio-net, 256 MB, TCG), the same kernel (minos/out/vmlinuz) with the same kernel command
line (``console=ttyS0 quiet``), each inside a lab network namespace of its own; nothing is
served on this machine's interfaces.

- **reference**: dnsmasq (DHCP; iPXE gets the URL of a boot script) and nginx (HTTP) serve
  the kernel and a busybox-only initramfs built here (busybox-static, the virtio-net
  modules taken from the minOS, an /init that mounts proc/sys/dev, loads them, runs
  ``udhcpc`` and prints ``ref: ready``).
- **layerpy**: ``layerpy serve`` (vm-lab/session.py) with a node file for these VMs boots
  the real minOS; "ready" is the agent's hello accepted by the server (the line
  ``hello accepted`` on the console; the node file gives no image, so none is pulled).

Times are seconds from QEMU's start to a line on the serial console, stamped by a
thread that tails each console log every 20 ms. The phases of a layerpy boot come from
the console (iPXE's lines, the minOS's and the agent's), from the kernel's own log
(typed at the VM's console shell once it is ready: ``dmesg``, whose clock is the
kernel's uptime) and from uptime 0, placed on the host's clock by the agent's
"starting at uptime" line. One VM, then N VMs powered on at once; both stacks in each
round, one after the other; medians over ``--rounds``.

Run: ``.venv/bin/python bench/vm_boot.py [--vms 8] [--rounds 3]`` (as root).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "vm-lab"))

from reference import nginx_config  # noqa: E402

from lab import ANSI, Lab, Vm, VmSpec  # noqa: E402
from session import LabSession  # noqa: E402

MINOS = ROOT / "minos" / "out"
CACHE = Path("/var/cache/layerpy/vm-boot-ref")
CMDLINE = "console=ttyS0 quiet"
SERVER = "10.99.0.1"
BOOT_TIMEOUT = 300.0  # a VM of eight on two busy cores under TCG
# the reference's NIC driver and what it needs, in load order
VIRTIO_NET = ("virtio_ring", "virtio", "virtio_pci_legacy_dev", "virtio_pci_modern_dev",
              "virtio_pci", "failover", "net_failover", "virtio_net")  # fmt: skip

REF_INIT = """#!/bin/busybox sh
# the reference minOS: busybox only, the NIC up by udhcpc, then a ready line
/bin/busybox mkdir -p /proc /sys /dev /bin /sbin /usr/bin /usr/sbin /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
echo "ref: /init at uptime $(cut -d' ' -f1 /proc/uptime)"
for m in {modules}; do insmod /lib/modules/$m.ko; done
ip link set lo up
ip link set eth0 up
udhcpc -i eth0 -q -f -n -t 10 -T 2 -s /udhcpc.script &&
echo "ref: ready at uptime $(cut -d' ' -f1 /proc/uptime)"
dmesg | grep -iE 'unpack|Freeing initrd|Run /init'
exec sh
"""
REF_UDHCPC = """#!/bin/sh
[ "$1" = bound ] && ip addr add "$ip/${mask:-24}" dev "$interface"
exit 0
"""

# layerpy's phases as (label, regex) on the console, in boot order
IPXE_STEPS = [
    ("ipxe", r"iPXE \(PCI"),
    ("dhcp", r"Configuring \(net0[^\n]*ok"),
    ("kernel", r"/(?:minos/kernel|vmlinuz)\.\.\.[\s\d%]*ok"),  # progress: "... 66%  ok"
    ("initrd", r"/(?:minos/)?initrd\.\.\.[\s\d%]*ok"),
]
MINOS_STEPS = [
    ("python", r"starting python at uptime (?P<up>[\d.]+)"),
    ("agent", r"starting at uptime (?P<up>[\d.]+)"),
    ("nic_up", r"is up, [a-z ]*carrier, at uptime (?P<up>[\d.]+)"),
    ("ip", r"has 10\.99\.[\d.]+ at uptime (?P<up>[\d.]+)"),
    ("ready", r"hello accepted"),
    ("init_line", r"minos: /init at uptime (?P<up>[\d.]+)"),
    ("drivers", r"drivers loaded at (?P<up>[\d.]+)"),
    ("prompt", r"\n[\w-]+:/# "),
]
REF_STEPS = [("init_line", r"ref: /init at uptime (?P<up>[\d.]+)"), ("ready", r"ref: ready")]
KERNEL_STEPS = [  # dmesg lines: [uptime] text
    ("unpack", r"\[\s*(?P<up>[\d.]+)\] (?:Trying to unpack rootfs|Unpacking initramfs)"),
    ("unpacked", r"\[\s*(?P<up>[\d.]+)\] Freeing initrd memory"),
    ("run_init", r"\[\s*(?P<up>[\d.]+)\] Run /init as init process"),
]


class Console:
    """Tails a VM's serial log; the host time (from `start`) at which each pattern first
    appeared, and its ``up`` group (a guest uptime) when it has one."""

    def __init__(self, vm: Vm, start: float, steps: list[tuple[str, str]]) -> None:
        self.path, self.start = vm.serial_log, start
        self.steps = [(label, re.compile(regex)) for label, regex in steps]
        self.seen: dict[str, float] = {}
        self.uptime: dict[str, float] = {}
        self.text = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        offset = 0
        while not self._stop.wait(0.02):
            try:
                with self.path.open("rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            now = time.monotonic() - self.start
            offset += len(chunk)
            self.text += ANSI.sub(b"", chunk).decode(errors="replace").replace("\r", "\n")
            for label, regex in self.steps:
                if label not in self.seen and (match := regex.search(self.text)):
                    self.seen[label] = now
                    if "up" in regex.groupindex:
                        self.uptime[label] = float(match["up"])

    def wait(self, label: str, timeout: float) -> float:
        """Seconds from start to `label`'s line; raises TimeoutError saying what it waited for."""
        deadline = time.monotonic() + timeout
        while label not in self.seen:
            if time.monotonic() > deadline:
                what = f"{self.path.name}: no {label!r} line in {timeout:.0f} s"
                raise TimeoutError(f"{what}:\n{self.text[-1500:]}")
            time.sleep(0.05)
        return self.seen[label]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def reference_initrd() -> Path:
    """The busybox-only initramfs (gzip, as small as it gets): built once, then cached."""
    modules = " ".join(VIRTIO_NET)
    init = REF_INIT.replace("{modules}", modules)
    out = CACHE / "ref.cpio.gz"
    stamp = CACHE / "stamp"
    source = (MINOS / "initrd").resolve()
    key = hashlib.sha256(f"{source.stat().st_mtime_ns} {init} {REF_UDHCPC}".encode()).hexdigest()
    if out.exists() and stamp.exists() and stamp.read_text() == key:
        return out
    shutil.rmtree(CACHE, ignore_errors=True)
    tree = CACHE / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "lib" / "modules").mkdir(parents=True)
    shutil.copy("/bin/busybox", tree / "bin" / "busybox")  # busybox-static's
    (tree / "init").write_text(init)
    (tree / "udhcpc.script").write_text(REF_UDHCPC)
    (tree / "init").chmod(0o755)
    (tree / "udhcpc.script").chmod(0o755)
    unpack = CACHE / "minos"
    unpack.mkdir()
    subprocess.run(f"zstd -dc {source} | cpio -idm --quiet 'lib/modules/*.ko'", shell=True,
                   cwd=unpack, check=True)  # fmt: skip
    for name in VIRTIO_NET:
        (found,) = unpack.glob(f"lib/modules/*/kernel/**/{name}.ko")
        shutil.copy(found, tree / "lib" / "modules" / f"{name}.ko")
    subprocess.run("find . | sort | cpio --quiet -H newc -o -R 0:0 | gzip -9 -n > ../ref.cpio.gz",
                   shell=True, cwd=tree, check=True)  # fmt: skip
    shutil.rmtree(unpack)
    stamp.write_text(key)
    return out


def specs(count: int) -> list[VmSpec]:
    return [VmSpec(f"vb{i + 1:02d}", f"52:54:00:77:00:{i + 0x11:02x}") for i in range(count)]


def node_file(run_dir: Path, count: int, initrd: Path) -> Path:
    """The lab's server settings (configs/lab.toml) for `count` VMs that run from the start."""
    macs = ", ".join(f'"{spec.mac}"' for spec in specs(count))
    path = run_dir / "nodes.toml"
    path.write_text(f"""\
[server]
interface = "br0"
address = "{SERVER}"
http_port = 8080
dhcp = "authoritative"
heartbeat = 2
lost_after = 3
dhcp_probe = 1

[network]
subnet = "10.99.0.0/24"
gateway = "{SERVER}"
dns = ["{SERVER}"]
domain = "lab"
lease_time = 3600
pool = "10.99.0.200-10.99.0.250"

[minos]
kernel = "{MINOS / "vmlinuz"}"
initrd = "{initrd}"
cmdline = "{CMDLINE}"

[ipxe]
dir = "/usr/lib/ipxe"

[groups.vb]
nodes = "vb[01-{count:02d}]"
ip = "10.99.0.[11-{10 + count}]"
mac = [{macs}]
""")
    return path


def start_reference(lab: Lab, initrd: Path, count: int) -> None:
    """dnsmasq (DHCP only: the iPXE ROM gets the script's URL) and nginx, in `lab`'s
    namespace, with addresses fixed per MAC as layerpy's node file fixes them."""
    run = lab.run_dir
    www = run / "www"
    www.mkdir()
    (www / "vmlinuz").symlink_to(MINOS / "vmlinuz")
    (www / "initrd").symlink_to(initrd)
    url = f"http://{SERVER}:8080"
    script = f"#!ipxe\nkernel {url}/vmlinuz initrd=initrd {CMDLINE}\ninitrd {url}/initrd\nboot\n"
    (www / "boot.ipxe").write_text(script)
    hosts = "".join(f"dhcp-host={s.mac},10.99.0.{11 + i}\n" for i, s in enumerate(specs(count)))
    conf = run / "dnsmasq.conf"
    conf.write_text(f"""\
port=0
interface={lab.bridge}
bind-interfaces
dhcp-authoritative
dhcp-range=10.99.0.0,static,255.255.255.0,1h
{hosts}dhcp-leasefile={run}/dnsmasq.leases
dhcp-match=set:ipxe,175
dhcp-boot=tag:ipxe,http://{SERVER}:8080/boot.ipxe
dhcp-option=tag:ipxe,encap:175,176,1
pid-file={run}/dnsmasq.pid
user=root
""")
    nginx = nginx_config(run, f"listen {SERVER}:8080; root {www};", 64)
    lab.popen(["dnsmasq", "-k", f"--conf-file={conf}"], log=run / "dnsmasq.log")
    lab.popen(["nginx", "-c", str(nginx)], log=run / "nginx.log")
    deadline = time.monotonic() + 30
    while not all((run / f"{name}.pid").exists() for name in ("dnsmasq", "nginx")):
        if time.monotonic() > deadline:
            raise TimeoutError("dnsmasq and nginx pid files: not within 30 s")
        time.sleep(0.05)


def boot(lab: Lab, count: int, steps: list[tuple[str, str]]) -> list[Console]:
    """Start `count` VMs at once; their consoles, once every one printed its ready line."""
    start = time.monotonic()
    vms = [lab.add_vm(spec) for spec in specs(count)]
    consoles = [Console(vm, start, steps) for vm in vms]
    for console in consoles:
        console.wait("ready", BOOT_TIMEOUT)
    return consoles


def kernel_log(vm: Vm, console: Console) -> None:
    """Type ``dmesg`` at the minOS's console shell for the kernel's own timestamps."""
    vm.type("\n")
    console.wait("prompt", 60)
    vm.type("dmesg | grep -iE 'unpack|Freeing initrd|Run /init'\n")
    console.wait("run_init", 60)


def run_reference(run_dir: Path, initrd: Path, count: int) -> list[Console]:
    with Lab(run_dir) as lab:
        start_reference(lab, initrd, count)
        consoles = boot(lab, count, IPXE_STEPS + REF_STEPS + KERNEL_STEPS)
        for console in consoles:
            console.wait("run_init", 30)  # the reference's /init prints them after ready
            console.close()
    return consoles


def run_layerpy(run_dir: Path, count: int, minos: Path, dmesg: bool) -> list[Console]:
    run_dir.mkdir(parents=True)
    with LabSession(run_dir, node_file(run_dir, count, minos)) as session:
        consoles = boot(session.lab, count, IPXE_STEPS + MINOS_STEPS + KERNEL_STEPS)
        names = [spec.name for spec in specs(count)]
        session.wait_state(names, "ready", 60)  # the server agrees
        if dmesg:
            kernel_log(session.lab.vms[names[0]], consoles[0])
        for console in consoles:
            console.close()
    return consoles


def phases(console: Console) -> dict[str, float]:
    """Host seconds from QEMU start for each phase; kernel-side ones placed by uptime 0."""
    seen, up = console.seen, console.uptime
    anchor = next((k for k in ("agent", "init_line") if k in up), None)
    zero = seen[anchor] - up[anchor] if anchor else None
    out = {k: v for k, v in seen.items() if k in dict(IPXE_STEPS)}
    if zero is not None:
        out["uptime 0"] = zero
        for label, value in up.items():
            out[label] = zero + value
    out["ready"] = seen["ready"]
    return out


TABLE = [  # (label, what it is) in boot order
    ("ipxe", "iPXE ROM starts"),
    ("dhcp", "iPXE configured (DHCP)"),
    ("kernel", "kernel fetched (HTTP)"),
    ("initrd", "initrd fetched (HTTP)"),
    ("uptime 0", "kernel running (uptime 0)"),
    ("unpack", "initramfs unpack starts"),
    ("unpacked", "initramfs unpacked"),
    ("run_init", "kernel runs /init"),
    ("init_line", "/init's first line"),
    ("drivers", "/init loaded drivers"),
    ("python", "agent process starts"),
    ("agent", "agent main() runs"),
    ("nic_up", "agent: NIC up"),
    ("ip", "agent: address (udhcpc)"),
    ("ready", "READY (hello accepted)"),
]


def show_one(results: dict[str, list[dict[str, float]]]) -> None:
    print(f"\n1 VM, seconds from QEMU start (median of {len(results['layerpy'])}):")
    print(f"{'phase':27} {'reference':>10} {'layerpy':>10}")
    for label, what in TABLE:
        cells = []
        for stack in ("reference", "layerpy"):
            values = [r[label] for r in results[stack] if label in r]
            cells.append(f"{statistics.median(values):10.2f}" if values else f"{'-':>10}")
        print(f"{what:27} {cells[0]} {cells[1]}")
    ref = statistics.median(r["ready"] for r in results["reference"])
    ours = statistics.median(r["ready"] for r in results["layerpy"])
    print(f"ready: layerpy {ours:.2f} s, reference {ref:.2f} s: {ours / ref:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=8, help="VMs powered on at once (0: none)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--initrd", type=Path, default=MINOS / "initrd",
                        help="the minOS initramfs to boot (to compare builds)")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the logs (the path is said)")
    args = parser.parse_args()
    if not 0 <= args.vms <= 99:
        parser.error("--vms: 0 to 99")
    initrd = reference_initrd()
    print(f"reference initramfs {initrd} {initrd.stat().st_size} bytes; minOS "
          f"{args.initrd} {args.initrd.resolve().stat().st_size} bytes", flush=True)  # fmt: skip
    base = Path(tempfile.mkdtemp(prefix="lpvb-"))
    one: dict[str, list[dict[str, float]]] = {"reference": [], "layerpy": []}
    many: dict[str, list[float]] = {"reference": [], "layerpy": []}
    try:
        for n in range(args.rounds):
            ref = run_reference(base / f"r{n}-ref1", initrd, 1)
            one["reference"].append(phases(ref[0]))
            ours = run_layerpy(base / f"r{n}-lp1", 1, args.initrd, dmesg=True)
            one["layerpy"].append(phases(ours[0]))
            line = f"round {n + 1}: 1 VM ready: reference {ref[0].seen['ready']:.2f} s, "
            line += f"layerpy {ours[0].seen['ready']:.2f} s"
            if args.vms:
                ref = run_reference(base / f"r{n}-refN", initrd, args.vms)
                many["reference"].append(max(c.seen["ready"] for c in ref))
                ours = run_layerpy(base / f"r{n}-lpN", args.vms, args.initrd, dmesg=False)
                many["layerpy"].append(max(c.seen["ready"] for c in ours))
                line += f"; {args.vms} VMs all ready: reference {many['reference'][-1]:.2f} s, "
                line += f"layerpy {many['layerpy'][-1]:.2f} s"
            print(line, flush=True)
        show_one(one)
        if args.vms:
            ref, ours = (statistics.median(many[k]) for k in ("reference", "layerpy"))
            print(f"{args.vms} VMs at once, all ready: layerpy {ours:.2f} s, reference "
                  f"{ref:.2f} s: {ours / ref:.2f}x")  # fmt: skip
    finally:
        if args.keep:
            print(f"logs in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
