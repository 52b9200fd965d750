"""The load generator of bench/http_requests.py: fetches an iPXE boot script as iPXE does,
one request at a time, and times each from its connect to its last byte.

Started once in the client namespace (pinned by its caller); it says "ready", then takes
commands on stdin, one a line: ``PORT MODE COUNT`` (MODE ``close``: a new connection per
request, as iPXE makes; ``keep``: one kept-alive connection for all of them). For each it
prints one JSON line: the status of the last answer, its body's length, and every
request's latency in microseconds. Blocking sockets, no library: the client's own cost
must not vary with the server's answer beyond what the bytes say.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time


def request(server: str, port: int, path: str) -> bytes:
    """What iPXE 1.21 sends for a script (keep-alive asked, as it always does)."""
    return (
        f"GET {path} HTTP/1.1\r\nConnection: keep-alive\r\nUser-Agent: iPXE/1.21.1+\r\n"
        f"Host: {server}:{port}\r\n\r\n"
    ).encode()


def answer(sock: socket.socket) -> tuple[int, bytes, bool]:
    """One response (Content-Length framed): its status, its body, and whether the server
    closes the connection after it (nginx does after keepalive_requests)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed inside the headers: {data[:200]!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    fields = {k.strip().lower(): v.strip() for k, _, v in (x.partition(b":") for x in lines[1:])}
    length = int(fields[b"content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed inside the body")
        body += chunk
    return status, body, fields.get(b"connection", b"").lower() == b"close"


def run(server: str, path: str, port: int, mode: str, count: int) -> dict:
    sent = request(server, port, path)
    latencies: list[float] = []
    status, body = 0, b""
    kept: socket.socket | None = None
    try:
        for _ in range(count):
            began = time.perf_counter()
            sock = kept or socket.create_connection((server, port))
            sock.sendall(sent)
            status, body, closing = answer(sock)
            kept = sock if mode == "keep" and not closing else None
            if kept is None:
                sock.close()
            latencies.append((time.perf_counter() - began) * 1e6)
    finally:
        if kept is not None:
            kept.close()
    return {"status": status, "length": len(body), "latencies_us": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", help="the server's address")
    parser.add_argument("path", help="the script's path, e.g. /boot/bn001.ipxe")
    args = parser.parse_args()
    print("ready", flush=True)
    for line in sys.stdin:
        port, mode, count = line.split()
        print(json.dumps(run(args.server, args.path, int(port), mode, int(count))), flush=True)


if __name__ == "__main__":
    main()
