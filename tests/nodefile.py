"""Node files for tests: the boot files every node file names, written as small stand-ins."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BOOT_SECTIONS = """\
[minos]
kernel = "vmlinuz"
initrd = "initrd"
cmdline = "console=ttyS0"

[minos.arm64]
kernel = "vmlinuz-arm64"
initrd = "initrd-arm64"

[ipxe]
dir = "ipxe"

[signed]
dir = "signed"
"""


def write_boot_files(directory: Path) -> None:
    """The kernels, initrds (x86-64 and arm64), iPXE binaries and signed loaders
    BOOT_SECTIONS names, as stand-in bytes."""
    for name in ("vmlinuz", "initrd", "vmlinuz-arm64", "initrd-arm64"):
        (directory / name).write_bytes(name.encode() * 1000)
    (directory / "ipxe").mkdir(exist_ok=True)
    for name in ("undionly.kpxe", "snponly.efi"):
        (directory / "ipxe" / name).write_bytes(b"\x90" * 3000)
    (directory / "signed").mkdir(exist_ok=True)  # Debian's signed loaders, x86 only
    for name in ("shimx64.efi", "grubx64.efi"):
        (directory / "signed" / name).write_bytes(b"\x4d\x5a" * 1500)


@dataclass(frozen=True)
class InstanceFile:
    """A cluster instance's folder (the boot files in it) and its node file: ``tables``,
    its own [server] and [cluster], then the cluster's rest."""

    folder: Path
    tables: str

    @property
    def path(self) -> Path:
        return self.folder / "nodes.toml"

    def text(self, rest: str) -> str:
        """This instance's node file with ``rest`` as the cluster's part."""
        return self.tables + rest


def instance_file(folder: Path, name: str, server: str, endpoints: Sequence[str], prefix: str,
                  rest: str, cluster: str = "") -> InstanceFile:  # fmt: skip
    """``folder`` made and its node file written: [server] of the lines ``server``,
    [cluster] on ``endpoints`` as ``name`` under ``prefix`` (and the lines ``cluster``)."""
    folder.mkdir(exist_ok=True)
    write_boot_files(folder)
    members = ", ".join(f'"{url}"' for url in endpoints)
    tables = (
        f"[server]\n{server}\n"
        f'[cluster]\netcd = [{members}]\nname = "{name}"\nprefix = "{prefix}"\n{cluster}\n'
    )
    made = InstanceFile(folder, tables)
    made.path.write_text(made.text(rest))
    return made


GROUP = 25_000  # nodes per group of a big node file: 100 /24s of 250 addresses
BASE_MAC = 0x525400000000


def big_mac(index: int) -> str:
    """Machine i's MAC in a big node file: 52:54:00:00:00:00 + i (as perfdhcp counts)."""
    return ":".join(f"{byte:02x}" for byte in (BASE_MAC + index).to_bytes(6))


def big_ip(index: int) -> str:
    """Machine i's address: group 0 10.2.[0-99].[1-250], 1 10.2.[100-199], 2 10.3.[0-99],
    3 10.3.[100-199], in MAC order (as the host lists expand)."""
    group, i = divmod(index, GROUP)
    return f"10.{2 + group // 2}.{100 * (group % 2) + i // 250}.{i % 250 + 1}"


def big_groups(nodes: int) -> str:
    """[groups.gN] tables for `nodes` machines (fewer than a group, or whole groups of
    GROUP, at most four), a few lines each: host lists and MAC ranges."""
    tables = []
    for group in range(max(1, nodes // GROUP)):
        size, first = min(nodes, GROUP), group * GROUP
        last_ip = big_ip(first + size - 1).rsplit(".", 2)
        third = 100 * (group % 2)
        tables.append(
            f'[groups.g{group}]\nnodes = "g{group}n[00001-{size:05d}]"\n'
            f'ip = "10.{2 + group // 2}.[{third}-{last_ip[1]}].[1-{min(size, 250)}]"\n'
            f'mac = "{big_mac(first)}-{big_mac(first + size - 1)}"\npower = "on"\n'
        )
    return "\n".join(tables)


def big_node_file(directory: Path, nodes: int, interface: str = "test0") -> Path:
    """A whole node file of `nodes` machines (see big_groups), with its boot files, for a
    server that is built in-process and never listens on `interface`."""
    write_boot_files(directory)
    path = directory / "nodes.toml"
    path.write_text(
        f'[server]\ninterface = "{interface}"\naddress = "10.3.255.253"\nstate_dir = "state"\n'
        'dhcp_probe = 0\n\n[api]\nlisten = []\n\n[network]\nsubnet = "10.2.0.0/15"\n\n'
        + BOOT_SECTIONS + "\n" + big_groups(nodes)
    )  # fmt: skip
    return path
