"""Listen for the switch's LLDP advertisement: which chassis and port this node is plugged into.

Standard library only (it runs in the minOS). Switches advertise every 30 s by default, so
the agent waits a little longer than that (``layerpy.proto.agent.LLDP_WAIT``) before it
reports without a neighbour. Needs AF_PACKET (CONFIG_PACKET=y in Debian's kernels) and root.
"""

from __future__ import annotations

import socket
import struct
import time

from layerpy.proto.lldp import ETH_P_LLDP, LLDP_MULTICAST, LldpError, Neighbor, parse_frame

SOL_PACKET = 263  # <linux/socket.h>; the socket module does not export these
PACKET_ADD_MEMBERSHIP = 1
PACKET_MR_MULTICAST = 0
PACKET_OUTGOING = 4  # sll_pkttype of a frame this host sent itself


def listen(ifname: str, timeout: float, ignored: list[str] | None = None) -> Neighbor | None:
    """The first valid LLDP neighbour heard on `ifname` within `timeout` seconds, else None.

    Malformed frames are skipped; their errors are appended to `ignored` when given, so the
    caller can count and report them. The NIC is told to accept the LLDP multicast
    addresses, which a multicast filter (or a real NIC) would otherwise drop.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_LLDP)) as sock:
        sock.bind((ifname, ETH_P_LLDP))
        index = socket.if_nametoindex(ifname)
        for mac in LLDP_MULTICAST:
            mreq = struct.pack("iHH8s", index, PACKET_MR_MULTICAST, len(mac), mac)
            sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                frame, address = sock.recvfrom(9216)
            except TimeoutError:
                break
            if address[2] == PACKET_OUTGOING:
                continue
            try:
                return parse_frame(frame)
            except LldpError as error:
                if ignored is not None:
                    ignored.append(str(error))
    return None
