"""TFTP throughput: tftpd-hpa against layerpy, same file, same client, same run.

Both servers run side by side inside a fresh pair of network namespaces (never on a host
interface) and serve one ~8 MB file to curl at blksize 1468 (a 1500-byte MTU), lock-step
since curl has no windowsize; fetches alternate between them. A last row shows layerpy
with atftp at windowsize 16, which tftpd-hpa does not offer.
Run as root: `.venv/bin/python bench/tftp.py [RUNS]`.
"""

import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from netns import Link, Netns  # noqa: E402
from packages import install_missing  # noqa: E402

SERVER, SIZE, BLKSIZE = "10.77.0.1", 8 * 1024 * 1024, "1468"


def wait_ready(ns: Netns, url: str) -> None:
    deadline = time.monotonic() + 10
    while ns.run("curl", "-sS", "-o", "/dev/null", url, check=False).returncode:
        if time.monotonic() > deadline:
            sys.exit(f"no server behind {url}")
        time.sleep(0.1)


def main(runs: int) -> None:
    install_missing({"in.tftpd": "tftpd-hpa"})
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        root.mkdir(mode=0o755)  # in.tftpd reads as "nobody"
        (root / "bench.bin").write_bytes(os.urandom(SIZE))
        (root / "bench.bin").chmod(0o644)
        digest = hashlib.sha256((root / "bench.bin").read_bytes()).hexdigest()
        out = str(Path(tmp) / "out")

        def curl(port: int) -> list[str]:
            url = f"tftp://{SERVER}:{port}/bench.bin"
            return ["curl", "-sS", "--tftp-blksize", BLKSIZE, "-o", out, url]

        atftp = ["atftp", "--option", f"blksize {BLKSIZE}", "--option", "windowsize 16"]
        cases = {
            ("tftpd-hpa", "curl"): curl(69),
            ("layerpy", "curl"): curl(1069),
            ("layerpy", "atftp ws16"): [*atftp, "-g", "-r", "bench.bin", "-l", out, SERVER, "1069"],
        }
        link = Link(client_addr="10.77.0.2/24")
        try:
            tftpd = ["in.tftpd", "-L", "-a", f"{SERVER}:69", "-s", str(root)]
            layerpy = [sys.executable, str(TESTS / "tftp_serve.py"), str(root), SERVER, "1069"]
            for server in (tftpd, layerpy):
                link.server.popen(server, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for port in (69, 1069):
                wait_ready(link.client, f"tftp://{SERVER}:{port}/bench.bin")
            times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
            for run in range(runs + 1):  # interleaved, so machine noise hits all alike
                for case, argv in cases.items():
                    start = time.perf_counter()
                    link.client.run(*argv)
                    if run == 0:  # warm-up, and a correctness check
                        if hashlib.sha256(Path(out).read_bytes()).hexdigest() != digest:
                            sys.exit(f"{case[0]} with {case[1]}: corrupt download")
                    else:
                        times[case].append(time.perf_counter() - start)
        finally:
            link.close()
    print(f"{SIZE / 1e6:.1f} MB, blksize {BLKSIZE}, {runs} runs each, median (best):")
    for (server, client), seconds in times.items():
        med, best = statistics.median(seconds), min(seconds)
        rate = SIZE / med / 1e6
        print(f"  {server:10} {client:11} {med:6.3f} s ({best:.3f} s)  {rate:6.1f} MB/s")
    ours, theirs = times["layerpy", "curl"], times["tftpd-hpa", "curl"]
    ratio, best = statistics.median(ours) / statistics.median(theirs), min(ours) / min(theirs)
    print(f"layerpy/tftpd-hpa time, both with curl: {ratio:.2f}x median, {best:.2f}x best")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
