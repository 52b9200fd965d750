"""Fixtures the protocol tests share: a real ``layerpy serve`` in a namespace of its own
(test_http.serving), alone or with node consoles played by the test (test_live.SerialLine)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_live import SerialLine, wait_for

from test_http import Host, serving


@pytest.fixture
def host(make_config, tmp_path: Path) -> Iterator[Host]:
    with serving(make_config(server="10.66.0.1", interface="d0"), tmp_path) as served:
        yield served


@pytest.fixture
def console_host(make_config, tmp_path: Path) -> Iterator[tuple[Host, SerialLine]]:
    """The server with cn001's serial line a Unix socket the test speaks on, connected."""
    line = SerialLine(tmp_path / "cn001.console")
    bmc = f'bmc = {{ driver = "none", console = "{tmp_path}/{{node}}.console" }}\n'
    try:
        with serving(make_config(server="10.66.0.1", interface="d0", bmc=bmc), tmp_path) as host:
            wait_for(lambda: line.peer is not None, 20, "the server on cn001's console")
            yield host, line
    finally:
        line.close()
