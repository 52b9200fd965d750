"""The dashboard with 10 000 nodes in headless Chromium: first render, and a stream of
state changes it must keep up with.

A real ``layerpy serve`` with a node file of N nodes (DHCP off) runs in a network namespace
of its own, with Debian's Chromium beside it (driven as in the tests, tests/browser.py).
Nodes "boot" by asking for their boot script from their own address (a local route makes
every node address the namespace's own), which is what moves a node from unknown to
booting: each request is two to three changes on the event stream.

1. First render: from navigation to the grid painted (the page's ``layerpy-grid`` mark),
   token already in the tab. The reference, in the same browser and run: a static page of
   the same N cells with the same style sheet, which is what the browser needs anyway.
2. Changes: RATE boot requests a second for SECONDS. Each second the page's last applied
   change is compared with the last one made (the generator counts answers; the server's
   own sequence is read at the end): how far the page is behind, how long after the last
   change it has applied everything, and the page's long tasks (>50 ms of main thread).

Run: `.venv/bin/python bench/dashboard.py [--nodes 10000] [--rate 100] [--seconds 20]`
(as root: it makes a namespace; nothing leaves it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from browser import Browser  # noqa: E402
from netns import Netns  # noqa: E402
from nodefile import BOOT_SECTIONS, big_groups, big_ip, write_boot_files  # noqa: E402

LAYERPY = ROOT / ".venv" / "bin" / "layerpy"
PYTHON = ROOT / ".venv" / "bin" / "python"
SERVER = "10.3.255.253"
DASHBOARD = "http://127.0.0.1:8081/"

# The load: boot-script requests from node addresses at a steady rate, in the namespace.
GENERATOR = r"""
import asyncio, sys, time
server, rate, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
addresses, names = sys.argv[4].split(","), sys.argv[5].split(",")

async def boot(address, name):
    reader, writer = await asyncio.open_connection(server, 8080, local_addr=(address, 0))
    writer.write(f"GET /boot/{name}.ipxe HTTP/1.0\r\nHost: x\r\n\r\n".encode())
    status = (await reader.readline()).split()[1]
    writer.close()
    return status == b"200"

async def main():
    began, tasks = time.monotonic(), []
    for sent, (address, name) in enumerate(zip(addresses, names)):
        await asyncio.sleep(max(0, began + sent / rate - time.monotonic()))
        tasks.append(asyncio.create_task(boot(address, name)))
    done = await asyncio.gather(*tasks)
    print(f"{sum(done)} of {len(done)} answered 200")

asyncio.run(main())
"""


def node_file(directory: Path, nodes: int) -> Path:
    write_boot_files(directory)
    path = directory / "nodes.toml"
    path.write_text(
        f'[server]\ninterface = "d0"\naddress = "{SERVER}"\nstate_dir = "state"\n'
        'dhcp = "off"\nheartbeat = 600\n\n[network]\nsubnet = "10.2.0.0/15"\n\n'
        + BOOT_SECTIONS + "\n" + big_groups(nodes)
    )  # fmt: skip
    return path


def last_id(stream: Path) -> int:
    """The last event number a captured stream holds."""
    tail = stream.read_bytes()[-4096:].decode(errors="replace")
    ids = [line[4:] for line in tail.splitlines() if line.startswith("id: ")]
    return int(ids[-1]) if ids else 0


def static_page(directory: Path, nodes: int) -> Path:
    """The reference: the same cells, grouped the same way, nothing else."""
    css = (ROOT / "src" / "layerpy" / "dashboard" / "dashboard.css").read_text()
    cells = "".join(f'<div class="node s-unknown" title="n{i}"></div>' for i in range(nodes))
    page = directory / "static.html"
    page.write_text(
        f"<!doctype html><html><head><style>{css}</style></head><body><main>"
        f'<section class="group"><h2>g0</h2><div class="cells">{cells}</div></section></main>'
        "<script>requestAnimationFrame(() => setTimeout(() => "
        "performance.mark('layerpy-grid'), 0));</script></body></html>"
    )
    return page


def first_render(browser: Browser, url: str) -> float:
    browser.open(url)
    return browser.wait(
        "performance.getEntriesByName('layerpy-grid').length && "
        "performance.getEntriesByName('layerpy-grid')[0].startTime",
        120, "the grid",
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--rate", type=int, default=100, help="boot requests a second")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--repeat", type=int, default=3, help="first renders of each page")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="layerpy-dash-"))
    ns = Netns("lpdash")
    browser = None
    try:
        for command in (["ip", "link", "set", "lo", "up"],
                        ["ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
                        ["ip", "link", "set", "d1", "up"],
                        ["ip", "addr", "add", f"{SERVER}/15", "dev", "d0"],
                        ["ip", "link", "set", "d0", "up"],
                        ["ip", "route", "add", "local", "10.2.0.0/16", "dev", "lo"]):  # fmt: skip
            ns.run(*command)
        config = node_file(directory, args.nodes)
        log = (directory / "serve.log").open("wb")
        ns.popen([str(LAYERPY), "serve", "-c", str(config)], stdout=log, stderr=log)
        token_file = directory / "state" / "admin.token"
        deadline = time.monotonic() + 120
        while not (directory / "state" / "api.sock").exists() or not token_file.exists():
            assert time.monotonic() < deadline, (directory / "serve.log").read_text()[-2000:]
            time.sleep(0.2)
        token = token_file.read_text().strip()
        browser = Browser(ns.name, directory / "profile", directory / "chromium.log")
        browser.open(DASHBOARD)
        browser.wait("document.readyState === 'complete'", 60, "the page")
        browser.js(f"sessionStorage.setItem('layerpy-token', {json.dumps(token)}); true")

        static = static_page(directory, args.nodes)
        # the static page is a file: Chromium reads it itself; first a warm-up of each
        first_render(browser, static.as_uri())
        first_render(browser, DASHBOARD)
        reference = sorted(first_render(browser, static.as_uri()) for _ in range(args.repeat))
        ours = sorted(first_render(browser, DASHBOARD) for _ in range(args.repeat))
        cells = browser.js("document.querySelectorAll('#grid .node').length")
        assert cells == args.nodes, f"{cells} cells for {args.nodes} nodes"

        browser.js("window.longTasks = []; new PerformanceObserver((list) => "
                   "window.longTasks.push(...list.getEntries().map((e) => e.duration)))"
                   ".observe({type: 'longtask'}); true")  # fmt: skip
        start_seq = int(browser.js("document.body.dataset.seq") or 0)
        watched = directory / "stream.sse"  # the server's changes as they are made
        with watched.open("wb") as sink:
            ns.popen(["curl", "-sN", "--unix-socket", str(directory / "state" / "api.sock"),
                      "http://x/api/v1/events/stream"], stdout=sink)  # fmt: skip
        count = min(args.nodes, int(args.rate * args.seconds))
        addresses = ",".join(big_ip(i) for i in range(count))
        names = ",".join(f"g0n{i + 1:05d}" for i in range(count))
        generator = ns.popen(
            [str(PYTHON), "-c", GENERATOR, SERVER, str(args.rate), str(args.seconds), addresses,
             names],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        while generator.poll() is None:
            time.sleep(0.5)
        output = generator.stdout.read().decode() if generator.stdout else ""
        ended = time.monotonic()
        # when did curl (a plain reader of the same stream) and the page have the last one?
        seen: dict[str, tuple[int, float]] = {}
        while time.monotonic() - ended < 60:
            now = time.monotonic()
            for who, value in (
                ("curl", last_id(watched)),
                ("page", int(browser.js("document.body.dataset.seq") or 0)),
            ):
                if seen.get(who, (None,))[0] != value:
                    seen[who] = (value, now)  # fmt: skip
            if seen["curl"][0] == seen["page"][0] and now - max(t for _, t in seen.values()) > 2:
                break
            time.sleep(0.05)
        final_seq = seen["curl"][0]
        assert seen["page"][0] == final_seq, f"the page stopped at {seen['page'][0]}"
        caught_up = {who: max(0.0, when - ended) for who, (_, when) in seen.items()}
        long_tasks = browser.js("window.longTasks") or []
    finally:
        if browser is not None:
            browser.close()
        ns.close()
        shutil.rmtree(directory, ignore_errors=True)

    changes = final_seq - start_seq
    ok = output.strip().splitlines()[-1] if output.strip() else "?"
    median = lambda values: values[len(values) // 2]  # noqa: E731
    print(f"dashboard, {args.nodes} nodes, headless Chromium, one run")
    print(
        f"first render (ms, median of {args.repeat}): static page of the same cells "
        f"{median(reference):.0f}, dashboard {median(ours):.0f} "
        f"(ratio {median(ours) / median(reference):.2f}); all: {[round(t) for t in reference]} vs "
        f"{[round(t) for t in ours]}"
    )
    print(
        f"{args.rate} boot requests/s for {args.seconds:g} s ({ok}): {changes} changes, "
        f"{changes / args.seconds:.0f}/s on the stream"
    )
    print(
        f"last change on the page {caught_up['page'] * 1000:.0f} ms after the last request "
        f"was answered; curl on the same stream {caught_up['curl'] * 1000:.0f} ms "
        f"({seen['page'][0]} and {seen['curl'][0]})"
    )
    print(
        f"long tasks during the changes: {len(long_tasks)}"
        + (f", longest {max(long_tasks):.0f} ms" if long_tasks else "")
    )


if __name__ == "__main__":
    main()
