"""``layerpy init``: a commented node file for one interface of this host, which
``layerpy check`` accepts as it is and an admin then edits (groups, BMCs, images)."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface

from layerpy import bundle

POOL_SIZE = 100  # addresses for machines no node claims yet, at most a quarter of the subnet


def discovery_pool(interface: IPv4Interface) -> tuple[IPv4Address, IPv4Address] | None:
    """A block at the top of the subnet (below its last five addresses), or at the bottom
    when the server sits up there; None when the subnet is too small to spare one."""
    network = interface.network
    size = min(POOL_SIZE, (network.num_addresses - 2) // 4)
    if size < 2:
        return None
    last = network.broadcast_address - 5
    first = last - (size - 1)
    if first <= interface.ip <= last:
        first = network.network_address + 10
        last = first + (size - 1)
    return first, last


def starter(name: str, interface: IPv4Interface) -> str:
    """The node file text for serving on interface `name`, which carries `interface`."""
    address, subnet = interface.ip, interface.network
    pool = discovery_pool(interface)
    pool_line = (
        f'pool = "{pool[0]}-{pool[1]}"   # machines no node claims boot the minOS from here'
        if pool
        else '# pool = "FIRST-LAST"  (this subnet is too small for a discovery pool)'
    )
    minos = bundle.minos()
    minos_lines = (
        f"# kernel and initrd: the minOS layerpy carries ({minos[0].parent}); name others\n"
        "# here to boot those (both, or neither)"
        if minos
        else "# this layerpy carries no minOS: build one (minos/build.sh) and name it here\n"
        'kernel = "/path/to/vmlinuz"\ninitrd = "/path/to/initrd"'
    )
    return f"""\
# layerpy node file for {name} ({interface}), written by `layerpy init`.
# `layerpy check` validates it and this host; `layerpy serve` serves it.
# Every setting: docs/config.md.

[server]
interface = "{name}"
address = "{address}"
# authoritative: layerpy hands out the addresses on {subnet} (it refuses to start if
#   another DHCP server answers there, unless other_dhcp = "expected");
# proxy: the site's DHCP server gives addresses, layerpy only says what to boot;
# off: no DHCP at all (nodes find the boot script some other way).
dhcp = "authoritative"
state_dir = "/var/lib/layerpy"   # leases, tokens, images, the API socket
http_port = 8080

[network]
subnet = "{subnet}"
# gateway = "{address}"   # the router the nodes use, if any
# dns = ["{address}"]
lease_time = 3600
{pool_line}
discover = true   # unknown machines boot the minOS and show up in `layerpy status`

[minos]
{minos_lines}
cmdline = ""   # more kernel arguments for it, e.g. "console=ttyS0"

[ipxe]
# dir: the iPXE binaries layerpy carries, else Debian's ipxe package's ({bundle.ipxe_dir()})
bios = "undionly.kpxe"
uefi = "snponly.efi"

# Nodes, by group (hostlists expand: cn[001-004], 10.0.0.[11-14]):
# [groups.compute]
# nodes = "cn[001-004]"
# ip = "10.0.0.[11-14]"   # in network.subnet
# mac = "52:54:00:00:00:01-52:54:00:00:00:04"
# power = "on"
# [groups.compute.bmc]
# driver = "ipmi"
# address = "10.0.1.[11-14]"
# user = "admin"
# password_file = "bmc.pass"   # beside this file, mode 0600
# or, without a BMC: a PDU outlet, a PoE port, a smart plug, by command (docs/config.md)
# driver = "command"
# address = "[1-4]"            # the outlets, in step with the nodes
# on = "snmpset -v2c -c private pdu1 .1.3.6.1.4.1.318.1.1.4.4.2.1.3.{{address}} i 1"
# off = "snmpset -v2c -c private pdu1 .1.3.6.1.4.1.318.1.1.4.4.2.1.3.{{address}} i 2"
# status = "snmpget -v2c -c private -Oqv pdu1 .1.3.6.1.4.1.318.1.1.4.4.2.1.3.{{address}}"
# status_on = '^\\s*1\\s*$'
# status_off = '^\\s*2\\s*$'
"""
