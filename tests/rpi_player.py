"""A Raspberry Pi 4's network boot played packet by packet, as its EEPROM bootloader and GPU
firmware do it (docs/hardware.md has the sequence and its sources): QEMU cannot run a Pi's
boot ROM, so the tests run this inside a client namespace against a real ``layerpy serve``.

DHCP: DISCOVER with the Pi's options (vendor class and architecture of a BIOS PXE ROM,
option 97 ``RPi4``, board revision, MAC, serial); an OFFER counts only if option 43 carries
``Raspberry Pi Boot``, as the bootloader's; REQUEST without option 60; ACK; the address is
put on the interface. TFTP from that address to option 66 (else 54): the files in the
bootloader's order, each asked with ``tsize 0`` and ``blksize 1024``, some first probed
(OACK, then an ERROR "Early terminate"), the kernel and initramfs named by the config.txt
it read. Prints one JSON document: the OFFER's and ACK's fields and every file's outcome.

Usage (as root, in the Pi's namespace; --save keeps each file read, by its base name):
    python3 tests/rpi_player.py IFACE MAC SERIAL [--model RPi4|RPi5] [--prefix serial|none]
        [--save DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import socket
import subprocess
import sys
import time
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from layerpy.proto import dhcp, tftp

VENDOR_CLASS = b"PXEClient:Arch:00000:UNDI:002001"
ASKED = bytes([1, 3, 43, 60, 66, 67, *range(128, 136)])  # option 55 of a Pi 4's DISCOVER
REVISION = 0x00C03111  # a Pi 4 B rev 1.1, 4 GB
DHCP_REQ_TIMEOUT, DHCP_TIMEOUT = 4.0, 45.0  # the EEPROM's defaults, in seconds
TFTP_TIMEOUT, TFTP_TRIES = 1.0, 5
BLKSIZE = 1024
MENU = b"Raspberry Pi Boot"


def guid(model: str, mac: str, serial: str) -> bytes:
    """Option 97: type 0, FourCC, board revision, MAC's low four bytes, serial (little-endian
    words, as captures of the old format show the serial)."""
    low = bytes.fromhex(mac.replace(":", ""))[2:]
    return (
        b"\0"
        + model.encode()
        + REVISION.to_bytes(4, "little")
        + low
        + int(serial, 16).to_bytes(4, "little")
    )


def packet(kind: int, mac: str, xid: int, options: dict[int, bytes]) -> bytes:
    chaddr = bytes.fromhex(mac.replace(":", "")).ljust(16, b"\0")
    zero = IPv4Address(0)
    message = dhcp.DhcpPacket(1, 1, 6, 0, xid, 0, 0, zero, zero, zero, zero, chaddr, bytes(64),
                              bytes(128), {dhcp.OPT_MESSAGE_TYPE: bytes((kind,)), **options})  # fmt: skip
    return dhcp.encode(message)


def described(reply: dhcp.DhcpPacket) -> dict:
    return {
        "type": reply.message_type,
        "yiaddr": str(reply.yiaddr),
        "siaddr": str(reply.siaddr),
        "file": reply.file.rstrip(b"\0").decode(errors="replace"),
        "options": {str(code): value.hex() for code, value in reply.options.items()},
    }


def ask(sock: socket.socket, data: bytes, xid: int, want: int, deadline: float) -> dhcp.DhcpPacket:
    """Broadcast `data` every DHCP_REQ_TIMEOUT until a reply of type `want` for `xid` that a
    Pi takes comes, or DHCP_TIMEOUT passes."""
    while time.monotonic() < deadline:
        sock.sendto(data, ("255.255.255.255", 67))
        until = min(deadline, time.monotonic() + DHCP_REQ_TIMEOUT)
        while (left := until - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                raw, _ = sock.recvfrom(2048)
            except TimeoutError:
                break
            try:
                reply = dhcp.decode(raw)
            except dhcp.DhcpError:
                continue
            if reply.op != 2 or reply.xid != xid or reply.message_type != want:
                continue
            # the bootloader ignores a server without its menu string in option 43
            if MENU not in reply.options.get(dhcp.OPT_VENDOR_SPECIFIC, b""):
                continue
            return reply
    raise SystemExit(f"no DHCP {'OFFER' if want == dhcp.OFFER else 'ACK'} a Pi takes")


def dora(interface: str, mac: str, options: dict[int, bytes]) -> tuple[dhcp.DhcpPacket, ...]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, interface.encode())
    sock.bind(("0.0.0.0", 68))
    xid = random.getrandbits(32)
    deadline = time.monotonic() + DHCP_TIMEOUT
    with sock:
        offer = ask(sock, packet(dhcp.DISCOVER, mac, xid, {**options, 60: VENDOR_CLASS}), xid,
                    dhcp.OFFER, deadline)  # fmt: skip
        server = offer.options[dhcp.OPT_SERVER_ID]
        request = {
            **options,
            dhcp.OPT_REQUESTED_IP: offer.yiaddr.packed,
            dhcp.OPT_SERVER_ID: server,
        }
        ack = ask(sock, packet(dhcp.REQUEST, mac, xid, request), xid, dhcp.ACK, deadline)
    return offer, ack


class Tftp:
    """The bootloader's TFTP client: one port per request, lock-step, tsize and blksize."""

    def __init__(self, own: str, server: str, save: Path | None = None) -> None:
        self.own, self.server, self.save = own, server, save

    def read(self, name: str, probe: bool = False) -> dict:
        """One request: a probe ends after the OACK with "Early terminate"; a read takes the
        whole file. The outcome: its size and digest (and text, when small), or the error."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((self.own, 0))
        sock.settimeout(TFTP_TIMEOUT)
        options = {"tsize": "0", "blksize": str(BLKSIZE)}
        last = tftp.encode(tftp.Request(tftp.Opcode.RRQ, name, "octet", options))
        peer, blksize, expected, body, tries = (self.server, 69), 512, 1, bytearray(), 0
        outcome: dict = {"name": name, "probe": probe}
        started = time.monotonic()
        with sock:
            while True:
                sock.sendto(last, peer)
                try:
                    data, addr = sock.recvfrom(70000)
                except TimeoutError:
                    tries += 1
                    if tries >= TFTP_TRIES:
                        return outcome | {"error": f"no answer after {tries} tries"}
                    continue
                answer = tftp.decode(data)
                if isinstance(answer, tftp.Error):
                    return outcome | {"error": answer.message, "code": answer.code}
                peer, tries = addr, 0
                if isinstance(answer, tftp.OAck):
                    outcome["tsize"] = int(answer.options.get("tsize", -1))
                    blksize = int(answer.options.get("blksize", 512))
                    if probe:
                        abort = tftp.Error(tftp.ErrorCode.NOT_DEFINED, "Early terminate")
                        sock.sendto(tftp.encode(abort), peer)
                        return outcome
                    last = tftp.encode(tftp.Ack(0))
                elif isinstance(answer, tftp.Data):
                    if answer.block == expected & 0xFFFF:
                        body += answer.payload
                        expected += 1
                    last = tftp.encode(tftp.Ack(answer.block))
                    if answer.block == (expected - 1) & 0xFFFF and len(answer.payload) < blksize:
                        sock.sendto(last, peer)
                        break
        outcome |= {"size": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                    "seconds": round(time.monotonic() - started, 3)}  # fmt: skip
        if self.save is not None:
            (self.save / name.rsplit("/", 1)[-1]).write_bytes(body)
        if len(body) < 4096 and name.endswith(".txt"):
            outcome["text"] = body.decode(errors="replace")
        return outcome


def boot_files(client: Tftp, prefix: str, model: str = "RPi4") -> list[dict]:
    """The files in the order a Pi 4 asks for them, its kernel and initramfs from the
    config.txt it reads. A Pi 5 has its GPU firmware in the EEPROM: no start4.elf or
    fixup4.dat, and its own device tree."""
    done: list[dict] = []
    pi5 = model == "RPi5"

    def get(name: str, probe: bool = False, then_read: bool = False) -> dict:
        done.append(client.read(prefix + name, probe=probe))
        if then_read and "error" not in done[-1]:
            done.append(client.read(prefix + name))
        return done[-1]

    if pi5:
        config = get("config.txt").get("text", "")
        get("pieeprom.sig")  # self-update
    else:
        get("start4.elf", probe=True)  # is the prefix directory there?
        config = get("config.txt").get("text", "")
        get("pieeprom.sig")  # self-update
        get("recover4.elf")
        get("start4.elf")
        get("fixup4.dat")
        # start4.elf runs from here on
        config = get("config.txt").get("text", config)
        get("dt-blob.bin")
        get("bootcfg.txt")
    get("bcm2712-rpi-5-b.dtb" if pi5 else "bcm2711-rpi-4-b.dtb", probe=True, then_read=True)
    get("overlays/overlay_map.dtb")
    get("config.txt")
    get("cmdline.txt", probe=True, then_read=True)
    kernel = re.search(r"^kernel=(\S+)$", config, re.M)
    get(kernel.group(1) if kernel else "kernel8.img", probe=True, then_read=True)
    initramfs = re.search(r"^initramfs (\S+)", config, re.M)
    if initramfs:
        get(initramfs.group(1), probe=True, then_read=True)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("interface")
    parser.add_argument("mac")
    parser.add_argument("serial")
    parser.add_argument("--model", default="RPi4", choices=("RPi4", "RPi5"))
    parser.add_argument("--prefix", default="serial", choices=("serial", "none"))
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    options = {dhcp.OPT_PARAM_LIST: ASKED, dhcp.OPT_CLIENT_ARCH: b"\0\0",
               dhcp.OPT_CLIENT_NDI: b"\x01\x02\x01",
               dhcp.OPT_UUID: guid(args.model, args.mac, args.serial)}  # fmt: skip
    started = time.monotonic()
    offer, ack = dora(args.interface, args.mac, options)
    mask = ack.options.get(dhcp.OPT_SUBNET_MASK, bytes((255, 255, 255, 0)))
    length = IPv4Network(f"0.0.0.0/{IPv4Address(mask)}").prefixlen
    subprocess.run(["ip", "addr", "replace", f"{ack.yiaddr}/{length}", "dev", args.interface],
                   check=True)  # fmt: skip
    named = ack.options.get(dhcp.OPT_TFTP_SERVER, b"").decode(errors="replace")
    server = named or str(IPv4Address(ack.options[dhcp.OPT_SERVER_ID]))
    prefix = f"{args.serial}/" if args.prefix == "serial" else ""
    files = boot_files(Tftp(str(ack.yiaddr), server, args.save), prefix, args.model)
    json.dump({"offer": described(offer), "ack": described(ack), "tftp_server": server,
               "files": files, "seconds": time.monotonic() - started}, sys.stdout)  # fmt: skip


if __name__ == "__main__":
    main()
