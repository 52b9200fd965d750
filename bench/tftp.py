"""TFTP: layerpy against tftpd-hpa and atftpd, same file, same clients, same run.

The three servers run side by side in a fresh pair of network namespaces (never on a host
interface) and serve one 16 MiB file: lock-step to curl at blksize 1468 (a 1500-byte MTU)
and 512 (what a PXE ROM may ask), and with windowsize 8 to atftp (RFC 7440; tftpd-hpa
does not offer it). Fetches alternate between the servers, so machine noise hits all
alike. Each server's CPU is read from /proc before and after each fetch.
Run as root: `.venv/bin/python bench/tftp.py [RUNS]`.

atftpd conflicts with tftpd-hpa as a Debian package, so its binary is unpacked from the
.deb into a cache directory instead of installed.
"""

import argparse
import contextlib
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

from reference import cpu_seconds  # noqa: E402

from netns import Link, Netns  # noqa: E402
from packages import install_missing  # noqa: E402

SERVER, SIZE = "10.77.0.1", 16 * 1024 * 1024
PORTS = {"tftpd-hpa": 69, "atftpd": 70, "layerpy": 1069}
CACHE = Path("/var/cache/layerpy-bench")
TICK = os.sysconf("SC_CLK_TCK")
# Every server on one core, every client on the other: each block's round trip then pays
# the same wake-ups, whichever server it is, and the time differs by the servers' work.
SERVER_CPU, CLIENT_CPU = ["taskset", "-c", "0"], ["taskset", "-c", "1"]


def atftpd_binary() -> Path:
    """atftpd from its .deb, unpacked once into CACHE (never installed, never started)."""
    binary = CACHE / "atftpd" / "usr" / "sbin" / "atftpd"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["apt-get", "download", "-q", "atftpd"], cwd=tmp, check=True)
            (deb,) = Path(tmp).glob("atftpd_*.deb")
            subprocess.run(["dpkg-deb", "-x", str(deb), str(CACHE / "atftpd")], check=True)
    return binary


def children(pid: int) -> list[int]:
    """The processes `pid` forked (atftpd's threads come and go meanwhile)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def fetch(ns: Netns, argv: list[str], server: int) -> tuple[float, float]:
    """Run one client; its time and the server's CPU meanwhile.

    tftpd-hpa ignores SIGCHLD, so the CPU of its per-transfer children never reaches its
    own: they are sampled every 2 ms while they live (the last 2 ms of one may be missed).
    """
    before, forked = cpu_seconds(server), {}
    start = time.perf_counter()
    client = subprocess.Popen(
        ns.cmd(*CLIENT_CPU, *argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline, ended = time.monotonic() + 120, 0.0
    while not ended or children(server):
        for child in children(server):
            with contextlib.suppress(OSError):  # gone between the listing and the read
                forked[child] = cpu_seconds(child)
        if not ended and client.poll() is not None:
            ended = time.perf_counter()
        if time.monotonic() > deadline:
            sys.exit(f"{argv}: neither the client nor the server's child ended within 120 s")
        time.sleep(0.002)
    if client.returncode:
        sys.exit(f"{' '.join(argv)} failed: {client.stderr.read().decode()}")
    return ended - start, cpu_seconds(server) - before + sum(forked.values())


def wait_ready(ns: Netns, url: str) -> None:
    deadline = time.monotonic() + 10
    while ns.run("curl", "-sS", "-o", "/dev/null", url, check=False).returncode:
        if time.monotonic() > deadline:
            sys.exit(f"no server answered at {url} within 10 s")
        time.sleep(0.1)


def cases(out: str) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """Each case: the servers it runs against, and the client's command for each."""

    def curl(blksize: int) -> dict[str, list[str]]:
        return {
            server: [
                "curl",
                "-sS",
                "--tftp-blksize",
                str(blksize),
                "-o",
                out,
                f"tftp://{SERVER}:{port}/bench.bin",
            ]
            for server, port in PORTS.items()
        }

    window = {
        server: [
            "atftp",
            "--option",
            "blksize 1468",
            "--option",
            "windowsize 8",
            "-g",
            "-r",
            "bench.bin",
            "-l",
            out,
            SERVER,
            str(PORTS[server]),
        ]
        for server in ("atftpd", "layerpy")
    }
    return {"lock-step 1468": curl(1468), "lock-step 512": curl(512), "windowsize 8": window}


def main(runs: int) -> None:
    install_missing({"in.tftpd": "tftpd-hpa", "atftp": "atftp", "curl": "curl"})
    atftpd = atftpd_binary()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        root.mkdir(mode=0o755)  # in.tftpd reads as "tftp"
        (root / "bench.bin").write_bytes(os.urandom(SIZE))
        (root / "bench.bin").chmod(0o644)
        digest = hashlib.sha256((root / "bench.bin").read_bytes()).hexdigest()
        out = str(Path(tmp) / "out")
        link = Link(client_addr="10.77.0.2/24")
        try:
            commands = {
                "tftpd-hpa": ["in.tftpd", "-L", "-a", f"{SERVER}:69", "-s", str(root)],
                "atftpd": [
                    str(atftpd),
                    "--daemon",
                    "--no-fork",
                    "--port",
                    "70",
                    "--bind-address",
                    SERVER,
                    "--user",
                    "root.root",
                    "--logfile",
                    "/dev/null",
                    str(root),
                ],
                "layerpy": [
                    sys.executable,
                    str(TESTS / "tftp_serve.py"),
                    str(root),
                    SERVER,
                    "1069",
                ],
            }
            pids = {}
            for server, argv in commands.items():
                proc = link.server.popen(
                    [*SERVER_CPU, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                pids[server] = proc.pid
                wait_ready(link.client, f"tftp://{SERVER}:{PORTS[server]}/bench.bin")
            table = cases(out)
            times = {(case, s): [] for case, clients in table.items() for s in clients}
            cpus = {key: [] for key in times}
            for run in range(runs + 1):  # run 0 warms up and checks the bytes
                for case, clients in table.items():
                    for server, argv in clients.items():
                        elapsed, cpu = fetch(link.client, argv, pids[server])
                        if run == 0:
                            got = hashlib.sha256(Path(out).read_bytes()).hexdigest()
                            if got != digest:
                                sys.exit(f"{server}, {case}: corrupt download")
                            continue
                        times[case, server].append(elapsed)
                        cpus[case, server].append(cpu)
        finally:
            link.close()
    report(runs, table, times, cpus)


def report(runs, table, times, cpus) -> None:
    print(f"{SIZE >> 20} MiB file, {runs} runs each, medians: time, server CPU, MB/s")
    for case, clients in table.items():
        print(f"{case}:")
        for server in clients:
            wall, cpu = (statistics.median(d[case, server]) for d in (times, cpus))
            print(f"  {server:10} {wall:6.3f} s  CPU {cpu:5.2f} s  {SIZE / wall / 1e6:6.1f} MB/s")
        ours = statistics.median(times[case, "layerpy"]), statistics.median(cpus[case, "layerpy"])
        for server in clients:
            if server == "layerpy":
                continue
            theirs = statistics.median(times[case, server]), statistics.median(cpus[case, server])
            print(
                f"  layerpy/{server}: time {ours[0] / theirs[0]:.2f}x, "
                f"CPU {ours[1] / max(theirs[1], 1 / TICK):.2f}x"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="?", type=int, default=5, help="(default 5)")
    main(parser.parse_args().runs)
