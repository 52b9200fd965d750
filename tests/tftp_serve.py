"""Run layerpy's TFTP server for tests and benchmarks, events as JSON lines on stdout.

Usage: python tests/tftp_serve.py ROOT ADDRESS [PORT] [--timeout S] [--interface IF]
Prints {"kind": "ready"} once listening and, on SIGTERM, {"kind": "stats", ...} before exiting.
"""

import argparse
import asyncio
import json
import logging
import signal
from dataclasses import asdict
from pathlib import Path

from layerpy.services import run
from layerpy.services.tftp import TftpBudget, TftpEvent, start_tftp

# room for the tests' crowds (1 000 stalled transfers, 32 from one address); `layerpy serve`
# takes its budget from the descriptor plan instead
CROWDS = TftpBudget(total=1024, per_address=32)


def show(record: dict) -> None:
    print(json.dumps(record), flush=True)


async def serve(args: argparse.Namespace) -> None:
    def on_event(event: TftpEvent) -> None:
        show(asdict(event))

    server = await start_tftp(
        args.root,
        args.address,
        args.port,
        interface=args.interface,
        on_event=on_event,
        budget=CROWDS,
        timeout=args.timeout,
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    show({"kind": "ready"})
    await stop.wait()
    server.close()
    show({"kind": "stats", **asdict(server.stats)})


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("address")
    parser.add_argument("port", type=int, nargs="?", default=69)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--interface")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO)
    run(serve(args))
