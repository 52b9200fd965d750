"""A UDP relay for TFTP that drops every Nth datagram, for loss tests (this kernel has no netem).

Usage: python tests/lossy_relay.py LISTEN_ADDR LISTEN_PORT SERVER_ADDR SERVER_PORT N

TFTP answers from a fresh port per transfer (the server's TID), so the relay mirrors that:
each client gets its own upstream socket, and each server TID seen on it gets its own
client-facing socket, which the client then treats as the server's TID. The count of
datagrams runs across both directions, so both DATA and ACKs are lost.
"""

import selectors
import socket
import sys


def main(listen_addr: str, listen_port: int, server_addr: str, server_port: int, n: int) -> None:
    sel = selectors.DefaultSelector()
    count = 0
    uplinks: dict[tuple, socket.socket] = {}  # client address -> upstream socket
    clients: dict[socket.socket, tuple] = {}  # upstream socket -> client address
    mirrors: dict[tuple, socket.socket] = {}  # (upstream socket, server TID) -> client-facing
    tids: dict[socket.socket, tuple] = {}  # client-facing socket -> (upstream socket, TID)

    def udp(addr: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((addr, 0))
        sel.register(sock, selectors.EVENT_READ)
        return sock

    def forward(out: socket.socket, data: bytes, to: tuple) -> None:
        nonlocal count
        count += 1
        if count % n:
            out.sendto(data, to)

    listen = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listen.bind((listen_addr, listen_port))
    sel.register(listen, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data, src = sock.recvfrom(65536)
            except ConnectionRefusedError:
                continue
            if sock is listen:  # a request: towards the server's well-known port
                if src not in uplinks:
                    uplinks[src] = udp(server_addr)
                    clients[uplinks[src]] = src
                forward(uplinks[src], data, (server_addr, server_port))
            elif sock in clients:  # from a server TID: out through its mirror
                if (sock, src) not in mirrors:
                    mirrors[sock, src] = udp(listen_addr)
                    tids[mirrors[sock, src]] = (sock, src)
                forward(mirrors[sock, src], data, clients[sock])
            else:  # from the client to a mirrored TID
                up, tid = tids[sock]
                forward(up, data, tid)


if __name__ == "__main__":
    a, p, s, q, n = sys.argv[1:6]
    main(a, int(p), s, int(q), int(n))
