"""The sections that say how nodes boot and who drives the server: [server], [network],
[minos], [ipxe], [signed] and [api]."""

from __future__ import annotations

import grp
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerpy import bundle
from layerpy.config import values
from layerpy.config.reading import Reader, missing
from layerpy.config.records import (
    ARM64_IPXE,
    DHCP_MODES,
    EFI_ARCHES,
    IDENTITY_MODES,
    OTHER_DHCP,
    REBIND_MODES,
    ApiConfig,
    IpxeConfig,
    MinosConfig,
    NetworkConfig,
    NodeConfig,
    RpiConfig,
    ServerConfig,
    SignedConfig,
)
from layerpy.proto.agent import HEARTBEAT


def server(r: Reader, data: dict[str, Any], network: NetworkConfig | None) -> ServerConfig | None:
    """Where the server listens and whether it answers DHCP; its address lies in the network."""
    keys = {
        "address",
        "interface",
        "http_port",
        "tftp_port",
        "dhcp",
        "state_dir",
        "heartbeat",
        "lost_after",
        "power_poll",
        "power_on_rate",
        "log_requests",
        "identity",
        "rebind",
        "other_dhcp",
        "dhcp_probe",
        "send_timeout",
        "beat_port",
    }
    table = r.table(data, "server", keys)
    get = r.getter(table, "server")
    address = get("address", str, values.ipv4, required=True)
    dhcp = get("dhcp", str, values.choice(DHCP_MODES), default="authoritative")
    interface = get("interface", str)
    if dhcp != "off" and interface is None and "server" in data:
        r.problem("server.interface", f"is required when dhcp = {dhcp!r}")
    if dhcp == "proxy" and network and (network.pool or network.discover):
        r.problem(
            "network.pool",
            'the site\'s DHCP server hands out the addresses when dhcp = "proxy": '
            "remove network.pool and network.discover",
        )
    if address and network and address not in network.subnet:
        r.problem("server.address", f"{address} is outside network.subnet {network.subnet}")
    if address is None:
        return None
    http_port = get("http_port", int, values.port, default=8080)
    return ServerConfig(
        address=address,
        interface=interface,
        http_port=http_port,
        tftp_port=get("tftp_port", int, values.port, default=69),
        dhcp=dhcp or "authoritative",
        state_dir=r.path(get("state_dir", str, default="/var/lib/layerpy")),
        heartbeat=float(get("heartbeat", (int, float), values.positive, default=HEARTBEAT)),
        lost_after=get("lost_after", int, values.positive, default=3),
        power_poll=float(get("power_poll", (int, float), values.positive, default=10.0)),
        power_on_rate=float(get("power_on_rate", (int, float), values.not_negative, default=0)),
        log_requests=get("log_requests", bool, default=False),
        identity=get("identity", str, values.choice(IDENTITY_MODES), default="location"),
        rebind=get("rebind", str, values.choice(REBIND_MODES), default="auto"),
        other_dhcp=get("other_dhcp", str, values.choice(OTHER_DHCP), default="refuse"),
        dhcp_probe=float(get("dhcp_probe", (int, float), values.not_negative, default=4.0)),
        send_timeout=float(get("send_timeout", (int, float), values.positive, default=60.0)),
        beat_port=get("beat_port", int, values.port_or_off, default=http_port),
    )


def network(r: Reader, data: dict[str, Any]) -> NetworkConfig | None:
    """The boot network: subnet, gateway, DNS, and the pool unknown machines boot from."""
    keys = {"subnet", "gateway", "dns", "domain", "lease_time", "pool", "discover"}
    table = r.table(data, "network", keys)
    get = r.getter(table, "network")
    subnet = get("subnet", str, values.subnet, required=True)
    gateway = get("gateway", str, values.ipv4)
    dns = get("dns", list, values.ipv4_list, default=())
    pool = get("pool", str, values.pool)
    discover = get("discover", bool, default=False)
    if discover and pool is None:
        r.problem("network.discover", "needs network.pool: discovery boots use its addresses")
    if subnet:
        if gateway and gateway not in subnet:
            r.problem("network.gateway", f"{gateway} is outside network.subnet {subnet}")
        if pool and not (pool[0] in subnet and pool[1] in subnet):
            r.problem("network.pool", f"{pool[0]}-{pool[1]} is not inside {subnet}")
    if subnet is None:
        return None
    return NetworkConfig(
        subnet=subnet,
        gateway=gateway,
        dns=dns,
        domain=get("domain", str),
        lease_time=get("lease_time", int, values.lease_time, default=3600),
        pool=pool,
        discover=discover,
    )


def existing(r: Reader, hint: str) -> Callable[[str], Path]:
    """A path key's converter: the path (relative to the file) of a file that must be
    there; `hint` says how to make it."""

    def convert(value: str) -> Path:
        path = r.path(value)
        if why := missing(path):
            raise ValueError(f"{path} {why} ({hint})")
        return path

    return convert


def minos(r: Reader, data: dict[str, Any]) -> MinosConfig | None:
    """The minOS every node boots, and the arm64 one (``[minos.arm64]``) arm64 firmware
    gets; their files must be built already. Named files, else the bundled ones."""

    built = existing(r, "build the minOS with minos/build.sh")

    def files(table: dict[str, Any], prefix: str) -> tuple[Path, Path] | None:
        get = r.getter(table, prefix)
        kernel, initrd = get("kernel", str, built), get("initrd", str, built)
        for key in ("kernel", "initrd"):
            if key not in table:
                r.problem(f"{prefix}.{key}", "missing: name the kernel and the initrd, or neither")
        return (kernel, initrd) if kernel and initrd else None

    table = r.table(data, "minos", {"kernel", "initrd", "cmdline", "arm64"})
    cmdline = r.getter(table, "minos")("cmdline", str, default="")
    arm64_table = table.get("arm64", {})
    if not r.is_table(arm64_table, "minos.arm64"):
        arm64_table = {}
    r.unknown_keys(arm64_table, "minos.arm64", {"kernel", "initrd"})
    arm64 = files(arm64_table, "minos.arm64") if arm64_table else bundle.minos("arm64")
    if "kernel" in table or "initrd" in table:
        named = files(table, "minos")
        return MinosConfig(*named, cmdline, arm64) if named else None
    bundled = bundle.minos()
    if bundled is None:
        r.problem(
            "minos",
            "no kernel and initrd named, and this layerpy has no minOS of its own (build one "
            "with minos/build.sh, or use layerpy.pyz, which carries one)",
        )
        return None
    return MinosConfig(*bundled, cmdline, arm64)


def rpi(r: Reader, data: dict[str, Any], minos: MinosConfig | None) -> RpiConfig | None:
    """Raspberry Pi network boot, when the file has [rpi]: the firmware directory (filled by
    vm-lab/rpi-firmware.sh, or by hand) and the kernel and initramfs Pis boot (by default
    the arm64 minOS of [minos.arm64])."""
    if "rpi" not in data:
        return None

    present = existing(r, "build the arm64 minOS: minos/build.sh --arch arm64")

    def firmware(value: str) -> Path:
        path = r.path(value)
        if not (path / "start4.elf").is_file():
            raise ValueError(f"{path} has no start4.elf (run vm-lab/rpi-firmware.sh, or fill it "
                             "as docs/hardware.md says)")  # fmt: skip
        return path

    table = r.table(data, "rpi", {"dir", "kernel", "initrd", "cmdline", "config"})
    get = r.getter(table, "rpi")
    directory = get("dir", str, firmware)
    if "dir" not in table:  # a default is not converted: check it as if it were written
        try:
            directory = firmware(str(bundle.rpi_dir()))
        except ValueError as error:
            r.problem("rpi.dir", f"(default) {error}")
    arm64 = minos.arm64 if minos is not None else None
    kernel = get("kernel", str, present, default=arm64 and arm64[0])
    initrd = get("initrd", str, present, default=arm64 and arm64[1])
    if arm64 is None and not (kernel and initrd):
        for key in ("kernel", "initrd"):
            if key not in table:
                r.problem(f"rpi.{key}", "missing, and there is no arm64 minOS to default to "
                          "(build one: minos/build.sh --arch arm64)")  # fmt: skip
    cmdline = get("cmdline", str, values.command_line, default="")
    config = get("config", str, default="")
    if directory is None or kernel is None or initrd is None:
        return None
    return RpiConfig(directory, kernel, initrd, cmdline or "", config or "")


def arm64_ipxe(directory: Path) -> str | None:
    """The arm64 iPXE when the directory has Debian's (vm-lab/ipxe-arm64.sh puts it beside
    the x86 ones; layerpy.pyz carries it), else none: arm64 then gets the signed loaders."""
    try:
        return ARM64_IPXE if (directory / ARM64_IPXE).is_file() else None
    except OSError:  # a directory name too long, say: ipxe.dir's own check says so
        return None


def ipxe(r: Reader, data: dict[str, Any], server: ServerConfig | None) -> IpxeConfig:
    """The iPXE binaries; TFTP serves only files inside their directory."""
    table = r.table(data, "ipxe", {"dir", "bios", "uefi", "arm64"})
    get = r.getter(table, "ipxe")
    defaults = IpxeConfig()
    directory = get("dir", str, r.path, default=bundle.ipxe_dir())
    config = IpxeConfig(
        directory,
        get("bios", str, values.plain_file_name, default=defaults.bios),
        get("uefi", str, values.plain_file_name, default=defaults.uefi),
        get("arm64", str, values.plain_file_name, default=arm64_ipxe(directory)),
    )
    if server and server.dhcp != "off":
        named = (("bios", config.bios), ("uefi", config.uefi), ("arm64", config.arm64))
        for key, name in ((key, name) for key, name in named if name is not None):
            path = directory / name
            if why := missing(path):
                r.problem(
                    f"ipxe.{key}",
                    f"{path} {why} (install Debian's ipxe package, run vm-lab/ipxe-arm64.sh "
                    "for arm64, or set ipxe.dir)",
                )
            elif not path.resolve().is_relative_to(directory.resolve()):
                r.problem(
                    f"ipxe.{key}",
                    f"{path} links to {path.resolve()}, outside ipxe.dir, and TFTP serves "
                    "only what is inside it (pick another file or point ipxe.dir there)",
                )
    return config


def signed(
    r: Reader, data: dict[str, Any], server: ServerConfig | None, nodes: dict[str, NodeConfig]
) -> SignedConfig:
    """Debian's signed shim and GRUB; a node with ``secure_boot = true`` needs them (those of
    one EFI architecture at least: which one a machine is, only its DHCP request says)."""
    table = r.table(data, "signed", {"dir"})
    get = r.getter(table, "signed")
    config = SignedConfig(get("dir", str, r.path, default=bundle.signed_dir()))
    secure = next((node for node in nodes.values() if node.secure_boot), None)
    needed = secure is not None and server is not None and server.dhcp != "off"
    if needed and not any(config.has(arch) for arch in EFI_ARCHES):
        assert secure is not None
        where = f"groups.{secure.group}" if secure.group else f"nodes.{secure.name}"
        pairs = ", ".join(f"{config.shim(a)} and {config.grub(a)}" for a in EFI_ARCHES)
        r.problem(
            f"{where}.secure_boot",
            f"{secure.name} boots by the signed path, but {config.directory} holds neither "
            f"{pairs} (run vm-lab/signed-loaders.sh, or set signed.dir)",
        )
    return config


def api(r: Reader, data: dict[str, Any]) -> ApiConfig:
    """The operator API's socket and listeners; no token goes over plain HTTP off loopback
    unless the file says so."""
    keys = {"socket", "socket_group", "listen", "tls_cert", "tls_key", "plain_http", "origins"}
    table = r.table(data, "api", keys)
    get = r.getter(table, "api")
    defaults = ApiConfig()
    config = ApiConfig(
        socket=get("socket", str, r.path),
        socket_group=get("socket_group", str),
        listen=get("listen", list, values.endpoints, default=defaults.listen),
        tls_cert=get("tls_cert", str, r.path),
        tls_key=get("tls_key", str, r.path),
        plain_http=get("plain_http", bool, default=False),
        origins=get("origins", list, values.origins, default=()),
    )
    if config.socket_group is not None and not _group_exists(config.socket_group):
        r.problem("api.socket_group", f"no group named {config.socket_group!r} on this machine")
    elif config.socket_group is not None and config.socket is None:
        r.problem(
            "api.socket_group",
            "the group cannot reach a socket inside the state directory (mode 0700): "
            "set api.socket too, e.g. /run/layerpy/api.sock",
        )
    if (config.tls_cert is None) != (config.tls_key is None):
        r.problem("api", "give both tls_cert and tls_key, or neither")
    for key, path in (("tls_cert", config.tls_cert), ("tls_key", config.tls_key)):
        if path is not None and (why := missing(path)):
            r.problem(f"api.{key}", f"{path} {why}")
    exposed = [f"{host}:{port}" for host, port in config.listen if not host.is_loopback]
    if exposed and config.tls_cert is None and not config.plain_http:
        r.problem(
            "api.listen",
            f"{', '.join(exposed)} is not loopback: operator tokens would cross the network "
            "in clear; give tls_cert and tls_key, or set plain_http = true",
        )
    return config


def _group_exists(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True
