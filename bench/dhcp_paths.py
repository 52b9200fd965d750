"""DHCP in process: the fast path (prepared replies) against the reference path, same run.

Two DHCP services on the same node file, each with its own node store and state directory,
one with prepared replies and one without (``prepared=False``), are fed the same relayed
DORAs as bench/dhcp_kea.py's perfdhcp sends them (DISCOVER with options 53 and 55; REQUEST
with 50, 54 and 55; giaddr the file's relay), through ``datagram_received``, with no
socket: what each costs in Python, per DORA, CPU time of this process. Both modes of the
Kea bench: static (100 000 nodes in four groups; each node's DORA twice, the first to
teach the fast path, the second timed) and pool (new clients from a pool of 262 000, every
lease journalled; every DORA timed, each client new). Every answer of the fast path is
checked against the reference path's (byte for byte).
Run: `.venv/bin/python bench/dhcp_paths.py [--clients N] [--mode static|pool]`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from ipaddress import IPv4Address
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from layerpy.config import load  # noqa: E402
from layerpy.proto import dhcp  # noqa: E402
from layerpy.services.dhcp import DhcpService  # noqa: E402
from layerpy.stats import Stats  # noqa: E402

from nodefile import BOOT_SECTIONS, big_groups, big_mac, write_boot_files  # noqa: E402
from stores import local_policy  # noqa: E402

NODES = 100_000
MODES = {  # server, relay, network table (as bench/dhcp_kea.py configures them)
    "static": ("10.3.255.253", "10.3.255.254", 'subnet = "10.2.0.0/15"\n'),
    "pool": ("10.7.255.253", "10.7.255.254",
             'subnet = "10.4.0.0/14"\npool = "10.4.0.10-10.7.255.250"\ndiscover = true\n'),
}  # fmt: skip
PARAMETERS = bytes((1, 28, 2, 3, 15, 6, 12))  # perfdhcp's option 55


def node_file(directory: Path, mode: str) -> Path:
    server, relay, network = MODES[mode]
    write_boot_files(directory)
    path = directory / "nodes.toml"
    path.write_text(
        f'[server]\ninterface = "x0"\naddress = "{server}"\ndhcp_probe = 0\n'
        f'state_dir = "state"\n\n[api]\nlisten = []\n\n[network]\n{network}lease_time = 300\n'
        f'{BOOT_SECTIONS}\n[switches.bench]\nrelay = "{relay}"\n\n'
        + (big_groups(NODES) if mode == "static" else "")
    )
    return path


def datagram(mode: str, kind: int, index: int, address: bytes = b"") -> bytes:
    server, relay, _ = MODES[mode]
    options = {dhcp.OPT_MESSAGE_TYPE: bytes((kind,))}
    if kind == dhcp.REQUEST:
        options[dhcp.OPT_REQUESTED_IP] = address
        options[dhcp.OPT_SERVER_ID] = IPv4Address(server).packed
    options[dhcp.OPT_PARAM_LIST] = PARAMETERS
    chaddr = bytes.fromhex(big_mac(index).replace(":", "")).ljust(16, b"\0")
    return dhcp.encode(dhcp.DhcpPacket(
        1, 1, 6, 1, 0x10000 + index, 0, 0, dhcp.ANY, dhcp.ANY, dhcp.ANY, IPv4Address(relay),
        chaddr, bytes(64), bytes(128), options,
    ))  # fmt: skip


class Side:
    def __init__(self, path: Path, prepared: bool) -> None:
        config = load(path)
        self.sent: list[bytes] = []
        self.service = DhcpService(
            local_policy(config), config.server.address, Stats(), False,
            send=lambda data, _to: self.sent.append(data) or True, prepared=prepared,
        )  # fmt: skip
        self.relay = (MODES["static"][1] if "10.2." in str(config.network.subnet)
                      else MODES["pool"][1], 67)  # fmt: skip

    def dora(self, discover: bytes, request: bytes) -> tuple[bytes, bytes]:
        """One client's DORA (the REQUEST asks for the address offered); OFFER and ACK."""
        self.sent.clear()
        self.service.datagram_received(discover, self.relay)
        offer = self.sent[-1]
        asked = request[:_ASKED] + offer[16:20] + request[_ASKED + 4 :]
        self.service.datagram_received(asked, self.relay)
        return offer, self.sent[-1]


_ASKED = 245  # where a REQUEST's option 50 value is: after the message type (240-242)


def timed(work: Callable[[], object]) -> float:
    began = time.process_time()
    work()
    return time.process_time() - began


def run(mode: str, clients: int) -> None:
    with tempfile.TemporaryDirectory() as fast_dir, tempfile.TemporaryDirectory() as ref_dir:
        sides = {}
        for name, folder, prepared in (("fast", fast_dir, True), ("reference", ref_dir, False)):
            path = node_file(Path(folder), mode)
            began = time.perf_counter()
            sides[name] = Side(path, prepared)
            print(f"{mode}: {name} ready in {time.perf_counter() - began:.2f} s", flush=True)
        fast, reference = sides["fast"], sides["reference"]
        doras = [(datagram(mode, dhcp.DISCOVER, index), datagram(mode, dhcp.REQUEST, index,
                  bytes(4))) for index in range(clients)]  # fmt: skip
        if mode == "static":  # the first DORA of each node teaches the fast path
            for discover, request in doras:
                fast.dora(discover, request)
                reference.dora(discover, request)
        answers: dict[str, list[tuple[bytes, bytes]]] = {"fast": [], "reference": []}
        seconds = {}
        for name, side in sides.items():
            seconds[name] = timed(lambda s=side, n=name: answers[n].extend(
                s.dora(*dora) for dora in doras))  # fmt: skip
        pairs = zip(answers["fast"], answers["reference"], strict=True)
        for index, (ours, theirs) in enumerate(pairs):
            assert ours == theirs, f"client {index}: the paths answered differently"
        hits = fast.service.fast.hits if fast.service.fast is not None else 0
        per = {name: 1e6 * s / clients for name, s in seconds.items()}
        print(
            f"{mode}: {clients} DORAs, CPU per DORA: fast {per['fast']:.1f} us, reference "
            f"{per['reference']:.1f} us ({per['reference'] / per['fast']:.2f}x); "
            f"{hits} answers prepared, all equal to the reference's",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20_000, help="DORAs per side")
    parser.add_argument("--mode", choices=sorted(MODES), help="only this mode")
    args = parser.parse_args()
    for mode in MODES:
        if args.mode in (None, mode):
            run(mode, min(args.clients, NODES))


if __name__ == "__main__":
    main()
