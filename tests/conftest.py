import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from netns import Link  # noqa: E402


def need_root() -> None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("protocol tests need root and iproute2 (run them through tests/run.sh)")


@pytest.fixture
def link():
    """A server namespace and a client namespace joined by a veth pair."""
    need_root()
    pair = Link(client_addr=None)
    yield pair
    pair.close()
