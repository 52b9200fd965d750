import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "vm-lab"))

from session import LabSession


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    """One lab (namespace, bridge, `layerpy serve`) per test module, always torn down."""
    session = LabSession(tmp_path_factory.mktemp("lab", numbered=True))
    yield session
    session.close()
