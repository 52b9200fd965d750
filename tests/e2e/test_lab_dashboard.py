"""A lab VM watched the way an admin watches it (issue 14): the dashboard in headless
Chromium turns its cell green as it boots, the server captures its serial console from
QEMU's socket, a real kernel panic typed through ``layerpy console``'s WebSocket makes it
lost at once (not after missed heartbeats) and the engine power-cycles it back, and a
power action clicked in the dashboard reaches the VM. Screenshots in
test-artifacts/lab-dashboard/."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from browser import Browser
from session import REPO, LabSession, lab_config

pytestmark = pytest.mark.e2e

ARTIFACTS = REPO / "test-artifacts" / "lab-dashboard"
DASHBOARD = "http://127.0.0.1:8081/"  # the operator listener, inside the lab's namespace


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("lab-dashboard")
    session = LabSession(run_dir, config=lab_config(run_dir, consoles=True))
    yield session
    session.close()


@pytest.fixture(scope="module")
def browser(lab: LabSession, tmp_path_factory: pytest.TempPathFactory):
    where = tmp_path_factory.mktemp("chromium")
    opened = Browser(lab.lab.netns, where / "profile", where / "chromium.log")
    yield opened
    opened.close()


def cell(name: str) -> str:
    return f"document.querySelector('#grid .node[data-name={name}]')"


async def type_at_console(socket: Path, node: str, *lines: str) -> None:
    """Type lines at a node's console through the server, as `layerpy console` does."""
    connector = aiohttp.UnixConnector(path=str(socket))
    async with aiohttp.ClientSession(connector=connector) as session:
        url = f"http://layerpy/api/v1/nodes/{node}/console/attach"
        async with session.ws_connect(url) as ws:
            for line in lines:
                await ws.send_bytes(line.encode())
                await asyncio.sleep(0.5)  # a person's pace: the shell reads a line at a time


def test_the_dashboard_follows_a_vm_booting(lab: LabSession, browser: Browser) -> None:
    token = (lab.run_dir / "state" / "admin.token").read_text().strip()
    browser.open(DASHBOARD)
    browser.wait("document.getElementById('login').open", 60, "the login dialog")
    browser.js(f"document.getElementById('token').value = {json.dumps(token)};"
               "document.getElementById('login-form').requestSubmit(); true")  # fmt: skip
    browser.wait("document.querySelectorAll('#grid .node').length === 4", 60, "four node cells")
    before = browser.js(f"getComputedStyle({cell('cn001')}).backgroundColor")
    browser.screenshot(ARTIFACTS / "1-before-boot.png")

    lab.start("cn001")  # off until the server powers it on
    browser.wait(f"{cell('cn001')}.classList.contains('s-booting')", 120, "cn001 booting (blue)")
    browser.wait(f"{cell('cn001')}.classList.contains('s-ready')", 180, "cn001 ready (green)")
    after = browser.js(f"getComputedStyle({cell('cn001')}).backgroundColor")
    assert (before, after) == ("rgb(181, 186, 193)", "rgb(46, 157, 74)")  # unknown -> good
    browser.js(f"{cell('cn001')}.click(); true")
    browser.wait("document.getElementById('console').textContent.includes('node cn001')", 60,
                 "cn001's captured boot messages in its panel")  # fmt: skip
    browser.screenshot(ARTIFACTS / "2-ready.png")


def test_a_kernel_panic_is_seen_on_the_console_and_recovered(lab: LabSession) -> None:
    assert lab.nodes()["cn001"]["run_state"] == "ready"
    lines = ["\r", "echo c > /proc/sysrq-trigger\r"]
    asyncio.run(type_at_console(lab.socket, "cn001", *lines))
    lab.wait(lambda: lab.nodes()["cn001"]["run_state"] in ("lost", "unknown", "booting"), 60,
             "cn001 lost after its panic")  # fmt: skip
    log = lab.serve_log.read_text()
    assert "cn001: run_state ready -> lost: kernel panic on the console" in log
    assert "no report for" not in log  # found on the console, not by missed heartbeats
    lab.wait(lambda: lab.nodes()["cn001"]["boots"] == 2, 120, "cn001 power-cycled and booting")
    lab.wait_state(["cn001"], "ready", timeout=180)
    tail = lab.cli("console", "cn001", "--log")
    assert "Kernel panic - not syncing: sysrq triggered crash" in tail
    failures = [f["mutation"] for f in json.loads(lab.cli("explain", "cn001"))["failures"]]
    assert "boot.recover" in failures


def test_a_power_action_clicked_in_the_dashboard_reaches_the_vm(
    lab: LabSession, browser: Browser
) -> None:
    browser.js(f"{cell('cn001')}.click(); true")
    browser.wait("document.getElementById('panel-name').textContent === 'cn001'", 30, "a panel")
    browser.js("document.querySelector('[data-power=off]').click(); true")
    lab.wait(lambda: lab.nodes()["cn001"]["power"] == "off", 60, "cn001 powered off")
    assert lab.lab.vms["cn001"].qmp("query-status")["running"] is False
    browser.js("document.getElementById('colour-by').value = 'power';"
               "document.getElementById('colour-by').dispatchEvent(new Event('change')); true")  # fmt: skip
    browser.wait(f"{cell('cn001')}.classList.contains('s-off')", 30, "cn001 shown off")
    browser.screenshot(ARTIFACTS / "3-powered-off.png")
    assert not [line for line in browser.console if "exception" in line], browser.console
