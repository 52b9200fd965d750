"""Prepared DHCP replies, sans I/O: a request read only as far as its answer needs, and the
answer made by patching a template that the reference path's own answer gave.

The reference path (``decode``, policy's verdict, ``dhcp_server.decide``, ``encode``) costs
some 40 µs of Python a packet. Most packets are of a few kinds (a known node's DISCOVER and
REQUEST, a pool client's, renewals) whose answer differs from the last one of the same
*shape* only in what the client itself put in: its transaction id, hardware address,
ciaddr, the client id it wants echoed, and (from a pool) the address it gets. :func:`scan`
reads those and the shape, or says the request is anything else (then the reference path
answers it); a :data:`Template` renders the reply with them patched in.

What the shape holds is everything else of the request that the reference path reads:
htype, hlen, hops, flags, giaddr and every option but the client's own values (message
type, requested address, server identifier, client id, hostname, and a UUID that is no
Raspberry Pi's). A relay agent option (82), option overload (52), a repeated option, a Pi's
option 97 or anything malformed is not scanned at all.
"""

from __future__ import annotations

from typing import NamedTuple

from layerpy.proto.dhcp import (
    ACK,
    DISCOVER,
    MIN_LEN,
    OPT_CLIENT_ID,
    OPT_END,
    OPT_HOSTNAME,
    OPT_MESSAGE_TYPE,
    OPT_OVERLOAD,
    OPT_PAD,
    OPT_RELAY_AGENT,
    OPT_REQUESTED_IP,
    OPT_SERVER_ID,
    OPT_UUID,
    REQUEST,
    DhcpPacket,
    Offer,
    encode_options,
    encoded_size,
    max_size,
    offered_options,
    rpi_guid,
)

MAGIC = bytes.fromhex("63825363")
NOWHERE = bytes(4)  # 0.0.0.0
_END = bytes((OPT_END,))
_PADDING = bytes(MIN_LEN)
_KINDS = (DISCOVER, REQUEST)
_OWN = frozenset((OPT_MESSAGE_TYPE, OPT_REQUESTED_IP, OPT_SERVER_ID, OPT_CLIENT_ID, OPT_HOSTNAME))
_REFUSED = frozenset((OPT_OVERLOAD, OPT_RELAY_AGENT))


class Scan(NamedTuple):
    """What a request is, read from its bytes: a DISCOVER or REQUEST, its shape, and the
    client's own values."""

    kind: int  # DISCOVER or REQUEST
    shape: bytes
    relayed: bool  # giaddr is set (the sender then matters: is it that relay?)
    mac: str
    ciaddr: bytes  # 4 bytes
    requested: bytes | None  # option 50, 4 bytes
    server_id: bytes | None  # option 54, 4 bytes
    echo: bytes  # option 61 as it was sent, echoed as it was (RFC 6842); b"" without


def scan(data: bytes) -> Scan | None:
    """The request's shape and own values, or None for anything that is not a well-formed
    DISCOVER or REQUEST of an Ethernet client that a template can answer."""
    if len(data) < 240 or data[0] != 1 or data[2] != 6 or data[236:240] != MAGIC:
        return None
    kept: list[bytes] = []
    seen: set[int] = set()
    kind = requested = server_id = None
    echo = b""
    pos, end = 240, len(data)
    while pos < end:
        code = data[pos]
        if code == OPT_PAD:
            pos += 1
            continue
        if code == OPT_END:
            break
        if pos + 1 == end:
            return None
        stop = pos + 2 + data[pos + 1]
        if stop > end or code in seen or code in _REFUSED:
            return None
        seen.add(code)
        if code not in _OWN:
            if code == OPT_UUID and rpi_guid(data[pos + 2 : stop]) is not None:
                return None  # a Raspberry Pi's: policy may know the machine by its serial
            if code != OPT_UUID:
                kept.append(data[pos:stop])
        elif code == OPT_MESSAGE_TYPE:
            kind = data[pos + 2] if stop == pos + 3 else None
        elif code == OPT_REQUESTED_IP:
            requested = data[pos + 2 : stop]
        elif code == OPT_SERVER_ID:
            server_id = data[pos + 2 : stop]
        elif code == OPT_CLIENT_ID:
            echo = data[pos:stop]
        pos = stop
    if kind not in _KINDS or (requested is not None and len(requested) != 4):
        return None
    if server_id is not None and len(server_id) != 4:
        return None
    giaddr = data[24:28]
    shape = b"".join((data[1:4], data[10:12], giaddr, *kept))
    mac = data[28:34].hex(":")
    return Scan(kind, shape, giaddr != NOWHERE, mac, data[12:16], requested, server_id, echo)  # type: ignore[arg-type]


Template = tuple[bytes, bytes, bytes, bytes, bytes, bytes, int, int]
"""An OFFER or ACK as the reference path encodes it, cut where a request's own values go:
head (op, htype, hlen, hops), secs and flags, yiaddr (a pool's is each client's own),
siaddr and giaddr, body (sname, file, magic cookie), the options after the message type
without the client id echoed (the same for both answers), the size of the whole without
the client id, and the largest reply the client takes. A plain tuple of bytes and ints,
which the garbage collector stops tracking: a server keeps one per node that asked, and
100 000 objects it had to walk made its full collections stall DHCP for tens of ms."""


def template(request: DhcpPacket, reply: DhcpPacket, offer: Offer) -> Template | None:
    """The template of `reply`, which build_reply made of `request` and `offer`; None when
    a client id would not fit in it (the reference then drops options)."""
    if reply.message_type is None:
        return None
    options = offered_options(request, offer, reply.message_type)
    size = encoded_size(options)
    limit = max_size(request)
    if size + len(request.options.get(OPT_CLIENT_ID, b"")) + 2 > limit:
        return None
    r = reply
    return (
        bytes((r.op, r.htype, r.hlen, r.hops)),
        bytes(2) + r.flags.to_bytes(2),
        r.yiaddr.packed,
        r.siaddr.packed + r.giaddr.packed,
        r.sname + r.file + MAGIC,
        encode_options(options)[3:],  # the message type is first, 3 bytes
        size,
        limit,
    )


def render(
    made: Template, kind: int, xid: bytes, ciaddr: bytes, yiaddr: bytes, chaddr: bytes,
    echo: bytes,
) -> bytes | None:  # fmt: skip
    """The reply of message type `kind` (OFFER or ACK) for these values of a request
    (chaddr all 16 bytes); None when the client id does not fit."""
    head, flags, _, middle, body, options, size, limit = made
    if size + len(echo) > limit:
        return None
    out = b"".join((
        head, xid, flags, ciaddr if kind == ACK else NOWHERE, yiaddr, middle, chaddr, body,
        bytes((OPT_MESSAGE_TYPE, 1, kind)), options, echo, _END,
    ))  # fmt: skip
    return out if len(out) >= MIN_LEN else out + _PADDING[: MIN_LEN - len(out)]
