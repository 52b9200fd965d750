"""DHCP codec speed: layerpy against dpkt on one realistic iPXE DISCOVER, same run.

Each op is what the server does per packet: decode the request, build the OFFER, encode it.
dpkt has no reply builder, so its side builds the same options by hand.
Run: `.venv/bin/python bench/dhcp_codec.py [OPS]`.
"""

import argparse
import timeit
from ipaddress import IPv4Address

import dpkt

from layerpy.proto.dhcp import Offer, build_reply, decode, encode

MAC = bytes.fromhex("525400123456")
OPTIONS = [
    (53, b"\x01"),
    (57, b"\x05\xc0"),
    (93, b"\x00\x07"),
    (94, b"\x01\x03\x10"),
    (60, b"PXEClient:Arch:00007:UNDI:003016"),
    (77, b"iPXE"),
    (55, bytes([1, 3, 6, 7, 12, 15, 17, 26, 43, 60, 66, 67, 119, 175])),
    (175, b"\xb1\x05\x01\x80\x86\x10\x0e\xeb\x03\x01\x00\x00"),
    (61, b"\x01" + MAC),
    (97, b"\x00" + bytes(range(16))),
]
DISCOVER = bytes(dpkt.dhcp.DHCP(op=1, xid=0x1234ABCD, chaddr=MAC, opts=OPTIONS))
OFFER = Offer(
    address=IPv4Address("10.99.0.11"),
    server_id=IPv4Address("10.99.0.1"),
    subnet_mask=IPv4Address("255.255.255.0"),
    lease_time=3600,
    router=IPv4Address("10.99.0.1"),
    dns=(IPv4Address("10.99.0.1"),),
    domain="lab",
    hostname="cn001",
    next_server=IPv4Address("10.99.0.1"),
    bootfile="http://10.99.0.1:8080/boot/cn001.ipxe",
    ipxe_no_pxedhcp=True,
)


def layerpy_op() -> bytes:
    return encode(build_reply(decode(DISCOVER), OFFER))


def dpkt_op() -> bytes:
    request = dpkt.dhcp.DHCP(DISCOVER)
    o = OFFER
    reply = dpkt.dhcp.DHCP(
        op=2,
        xid=request.xid,
        flags=request.flags,
        giaddr=request.giaddr,
        chaddr=request.chaddr,
        yiaddr=int(o.address),
        siaddr=int(o.next_server),
        file=o.bootfile.encode(),
        opts=(
            (53, b"\x02"),
            (54, o.server_id.packed),
            (51, o.lease_time.to_bytes(4)),
            (1, o.subnet_mask.packed),
            (3, o.router.packed),
            (6, b"".join(a.packed for a in o.dns)),
            (15, o.domain.encode()),
            (12, o.hostname.encode()),
            (66, str(o.next_server).encode()),
            (67, o.bootfile.encode()),
            (60, b"PXEClient"),
            (43, b"\x06\x01\x08\xff"),  # PXE discovery control: boot the offered file
            (175, b"\xb0\x01\x01"),
            (61, dict(request.opts)[61]),  # RFC 6842 echo
        ),
    )
    return bytes(reply)


def per_op_us(fn, n: int) -> float:
    """Best of five runs, so a scheduler hiccup does not decide the ratio."""
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


FIELDS = [name for name, *_ in dpkt.dhcp.DHCP.__hdr__]  # op, hrd, ..., file, magic


def differences() -> list[str]:
    """Where the two replies differ (header fields, then options); empty when the same."""
    ours, theirs = dpkt.dhcp.DHCP(layerpy_op()), dpkt.dhcp.DHCP(dpkt_op())
    found = [
        f"{name}: layerpy {getattr(ours, name)!r}, dpkt {getattr(theirs, name)!r}"
        for name in FIELDS
        if getattr(ours, name) != getattr(theirs, name)
    ]
    ours_opts, theirs_opts = dict(ours.opts), dict(theirs.opts)
    for code in sorted(ours_opts.keys() | theirs_opts.keys()):
        if ours_opts.get(code) != theirs_opts.get(code):
            found.append(
                f"option {code}: layerpy {ours_opts.get(code)!r}, dpkt {theirs_opts.get(code)!r}"
            )
    return found


def main(n: int) -> None:
    diff = differences()
    assert not diff, "both sides must build the same reply: " + "; ".join(diff)
    ours, theirs = per_op_us(layerpy_op, n), per_op_us(dpkt_op, n)
    decode_only = per_op_us(lambda: decode(DISCOVER), n)
    print(f"{'layerpy decode':<28}{decode_only:8.2f} us/op")
    print(f"{'layerpy decode+reply+encode':<28}{ours:8.2f} us/op")
    print(f"{'dpkt decode+reply+encode':<28}{theirs:8.2f} us/op")
    print(f"{'ratio layerpy/dpkt':<28}{ours / theirs:8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="?", type=int, default=20000, help="per side (default 20000)")
    main(parser.parse_args().ops)
