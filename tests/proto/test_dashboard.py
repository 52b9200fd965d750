"""The dashboard in real headless Chromium against a real ``layerpy serve`` (no VMs: a node
is booted by curl, as its firmware and agent would). Screenshots go to
test-artifacts/dashboard/."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from browser import Browser
from test_http import LAYERPY, TCP_API, Host, api, boot_token, report, serving

pytestmark = pytest.mark.netns

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"


@pytest.fixture
def browser(host: Host, tmp_path: Path) -> Iterator[Browser]:
    opened = Browser(host.ns.name, tmp_path / "profile", tmp_path / "chromium.log")
    yield opened
    opened.close()


def log_in(browser: Browser, token: str) -> None:
    """As a person does: the page asks for a token, they paste it."""
    browser.open(f"{TCP_API}/")
    browser.wait("document.getElementById('login').open", 60, "the login dialog")
    browser.js(f"document.getElementById('token').value = {json.dumps(token)};"
               "document.getElementById('login-form').requestSubmit(); true")  # fmt: skip


def cell(name: str) -> str:
    return f"document.querySelector('#grid .node[data-name={name}]')"


def test_the_grid_follows_a_boot_and_an_operator_acts(
    host: Host, browser: Browser, tmp_path: Path
) -> None:
    admin = (tmp_path / "state" / "admin.token").read_text().strip()
    log_in(browser, admin)
    browser.wait("document.querySelectorAll('#grid .node').length === 2", 60, "two node cells")
    assert browser.js(f"{cell('cn001')}.className") == "node s-unknown wide"
    assert browser.js("document.getElementById('who').textContent") == "token admin (admin)"
    browser.screenshot(ARTIFACTS / "1-start.png")

    token = boot_token(host, "cn001", "10.66.0.11")
    assert report(host, token=token, hostname=HOSTILE)[0] == 200
    browser.wait(f"{cell('cn001')}.classList.contains('s-init')", 30, "cn001 in init (hello)")
    assert report(host, token=token, event="heartbeat", seq=2, hostname=HOSTILE)[0] == 200
    browser.wait(f"{cell('cn001')}.classList.contains('s-ready')", 30, "cn001 ready")
    colour = browser.js(f"getComputedStyle({cell('cn001')}).backgroundColor")
    assert colour == "rgb(46, 157, 74)"  # --good
    assert "1 ready" in browser.js("document.getElementById('summary').textContent")

    browser.js(f"{cell('cn001')}.click(); true")
    browser.wait("document.getElementById('facts').textContent.includes('onerror')", 30,
                 "cn001's facts, its hostname among them")  # fmt: skip
    assert browser.js("document.querySelectorAll('#panel img').length") == 0  # text, not HTML
    assert browser.js("document.title") == "layerpy"
    browser.wait("document.getElementById('timeline').textContent.includes('agent_hello')", 30,
                 "the boot timeline")  # fmt: skip
    browser.wait("document.getElementById('explain').textContent.includes('\"power\"')", 30,
                 "explain")  # fmt: skip
    assert browser.js("document.getElementById('why').textContent")  # its gist in words
    assert "no console" in browser.js("document.getElementById('console').textContent")
    browser.screenshot(ARTIFACTS / "2-ready-panel.png")

    browser.js("document.querySelector('[data-power=off]').click(); true")
    browser.wait("document.getElementById('action-result').textContent.includes('done')", 30,
                 "the power action's answer")  # fmt: skip
    status = json.loads(api(host, "/api/v1/nodes/cn001/explain")[1])
    assert status["override"] is True  # (no BMC here: nothing to power off)
    browser.wait("document.getElementById('events').textContent.includes('power off cn001')", 30,
                 "the operator's call among cn001's events")  # fmt: skip
    browser.screenshot(ARTIFACTS / "3-powered-off.png")
    assert not [line for line in browser.console if "exception" in line], browser.console


def test_a_reader_sees_no_actions_and_a_bad_token_is_asked_again(
    host: Host, browser: Browser, tmp_path: Path
) -> None:
    log_in(browser, "lpy_not-a-token")
    browser.wait("document.getElementById('login-error').textContent.includes('not')", 30,
                 "the login asked again")  # fmt: skip
    config = ["-c", str(tmp_path / "nodes.toml")]
    viewer = host.ns.run(str(LAYERPY), "token", "add", "viewer", *config).stdout.strip()
    browser.js(f"document.getElementById('token').value = {json.dumps(viewer)};"
               "document.getElementById('login-form').requestSubmit(); true")  # fmt: skip
    browser.wait("document.querySelectorAll('#grid .node').length === 2", 60, "two node cells")
    browser.js(f"{cell('cn002')}.click(); true")
    browser.wait("document.getElementById('panel-name').textContent === 'cn002'", 30, "a panel")
    assert browser.js("document.getElementById('actions').hidden") is True
    assert browser.js("document.getElementById('who').textContent") == "token viewer (read)"


def test_nodes_are_grouped_by_the_switch_port_they_were_seen_at(
    make_config, tmp_path: Path
) -> None:
    located = {
        "location": 'location = "sw1:swp[1-2]"\n',
        "switch": '\n[switches.sw1]\nchassis_id = "02:00:00:00:0a:01"\n',
    }
    config = make_config(server="10.66.0.1", interface="d0", **located)
    with serving(config, tmp_path) as host:
        opened = Browser(host.ns.name, tmp_path / "profile", tmp_path / "chromium.log")
        try:
            log_in(opened, (tmp_path / "state" / "admin.token").read_text().strip())
            opened.wait("document.querySelectorAll('#grid .node').length === 2", 60, "cells")
            token = boot_token(host, "cn001", "10.66.0.11")
            lldp = {"chassis_id": "02:00:00:00:0a:01", "port_id": "swp1"}
            assert report(host, token=token, lldp=lldp)[0] == 200
            opened.js("document.getElementById('group-by').value = 'switch';"
                      "document.getElementById('group-by').dispatchEvent(new Event('change'));"
                      "true")  # fmt: skip
            sections = (
                "[...document.querySelectorAll('#grid section')].map((s) => "
                "s.querySelector('h2').firstChild.textContent + ': ' + "
                "[...s.querySelectorAll('.node')].map((c) => c.title).join(','))"
            )
            opened.wait(f"{sections}.includes('switch sw1: cn001 (port swp1)')", 30,
                        "cn001 under its switch")  # fmt: skip
            assert opened.js(sections) == [
                "(no location seen): cn002",
                "switch sw1: cn001 (port swp1)",
            ]
            opened.screenshot(ARTIFACTS / "4-by-switch.png")
        finally:
            opened.close()
