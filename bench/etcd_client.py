"""etcd client speed: layerpy's client (JSON gateway over aiohttp) against aetcd (gRPC), same run.

Starts a 1-member etcd (/usr/bin/etcd) on loopback ports of its own in a temporary directory,
then per client: put latency (one put at a time: median and p99) and transaction throughput
(`--inflight` create-if-absent transactions at a time, each on a key of its own). aetcd is
the reference when installed (`.venv/bin/pip install aetcd`: it is not a dependency);
`etcdctl put` in a loop is measured always, as the floor a shell script gets (process start
included). Run: `.venv/bin/python bench/etcd_client.py [--puts N] [--txns N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from layerpy.cluster.etcd import Compare, Etcd, Op

try:
    import aetcd
except ImportError:
    aetcd = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_etcd(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    client, peer = free_port(), free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = (directory / "etcd.log").open("wb")
    proc = subprocess.Popen(
        ["etcd", "--name", "bench", "--data-dir", str(directory / "data"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"bench={peer_url}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while subprocess.run(["etcdctl", "--endpoints", url, "endpoint", "health"],
                         capture_output=True).returncode != 0:  # fmt: skip
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"etcd did not become healthy: see {directory / 'etcd.log'}")
        time.sleep(0.1)
    return proc, url


async def latencies(put: Callable[[int], Awaitable[object]], count: int) -> list[float]:
    times = []
    for i in range(count):
        started = time.perf_counter()
        await put(i)
        times.append(time.perf_counter() - started)
    return times


async def throughput(txn: Callable[[int], Awaitable[bool]], count: int, inflight: int) -> float:
    keys = iter(range(count))

    async def worker() -> None:
        for i in keys:
            assert await txn(i), f"transaction {i} failed"

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return count / (time.perf_counter() - started)


Result = tuple[list[float], float]  # put latencies (s), transactions per second


async def measure_layerpy(url: str, puts: int, txns: int, inflight: int) -> Result:
    etcd = Etcd([url])
    await etcd.open()
    try:
        times = await latencies(lambda i: etcd.put(f"/bench/lp/put/{i}", b"x" * 200), puts)

        async def txn(i: int) -> bool:
            key = f"/bench/lp/txn/{i}"
            result = await etcd.txn([Compare.version(key, "==", 0)], [Op.put(key, b"x" * 200)])
            return result.succeeded

        return times, await throughput(txn, txns, inflight)
    finally:
        await etcd.close()


async def measure_aetcd(url: str, puts: int, txns: int, inflight: int) -> Result:
    host, port = url.removeprefix("http://").split(":")
    async with aetcd.Client(host=host, port=int(port)) as client:
        times = await latencies(
            lambda i: client.put(f"/bench/ae/put/{i}".encode(), b"x" * 200), puts
        )

        async def txn(i: int) -> bool:
            key = f"/bench/ae/txn/{i}".encode()
            ops = client.transactions
            succeeded, _ = await client.transaction(
                compare=[ops.version(key) == 0], success=[ops.put(key, b"x" * 200)], failure=[]
            )
            return succeeded

        return times, await throughput(txn, txns, inflight)


def measure_etcdctl(url: str, puts: int) -> list[float]:
    times = []
    for i in range(puts):
        started = time.perf_counter()
        subprocess.run(["etcdctl", "--endpoints", url, "put", f"/bench/ctl/{i}", "x" * 200],
                       check=True, capture_output=True)  # fmt: skip
        times.append(time.perf_counter() - started)
    return times


def p99(times: list[float]) -> float:
    return sorted(times)[max(0, round(len(times) * 0.99) - 1)]


def line(name: str, times: list[float], rate: float | None) -> str:
    txn = f"{rate:8.0f} txn/s" if rate is not None else "           -"
    median = statistics.median(times) * 1e3
    return f"{name:9} put median {median:6.2f} ms  p99 {p99(times) * 1e3:6.2f} ms  {txn}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--puts", type=int, default=500, help="sequential puts per client")
    parser.add_argument("--txns", type=int, default=3000, help="transactions per client")
    parser.add_argument("--inflight", type=int, default=32, help="transactions at a time")
    parser.add_argument("--ctl-puts", type=int, default=50, help="etcdctl puts (process each)")
    args = parser.parse_args()
    if not shutil.which("etcd") or not shutil.which("etcdctl"):
        raise SystemExit("needs etcd and etcdctl (Debian: etcd-server etcd-client)")
    with tempfile.TemporaryDirectory(prefix="lp-etcd-bench-") as tmp:
        proc, url = start_etcd(Path(tmp))
        try:
            ours = asyncio.run(measure_layerpy(url, args.puts, args.txns, args.inflight))
            print(line("layerpy", *ours), flush=True)
            if aetcd is not None:
                theirs = asyncio.run(measure_aetcd(url, args.puts, args.txns, args.inflight))
                print(line("aetcd", *theirs))
                put_ratio = statistics.median(ours[0]) / statistics.median(theirs[0])
                txn_ratio = ours[1] / theirs[1]
                print(f"ratio layerpy/aetcd: put median {put_ratio:.2f}, txn/s {txn_ratio:.2f}")
            else:
                print("aetcd: not installed (.venv/bin/pip install aetcd to compare)")
            ctl = measure_etcdctl(url, args.ctl_puts)
            print(line("etcdctl", ctl, None))
            ctl_ratio = statistics.median(ours[0]) / statistics.median(ctl)
            print(f"ratio layerpy/etcdctl: put median {ctl_ratio:.2f}")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
