import subprocess
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


@pytest.fixture(scope="session")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """layerpy.pyz built from this checkout by packaging/pyz.py (about 10 s)."""
    out = tmp_path_factory.mktemp("pyz") / "layerpy.pyz"
    script = Path(__file__).resolve().parents[2] / "packaging" / "pyz.py"
    built = subprocess.run([sys.executable, str(script), "-o", str(out)], capture_output=True,
                           text=True, timeout=600)  # fmt: skip
    assert built.returncode == 0, f"packaging/pyz.py failed:\n{built.stdout}{built.stderr}"
    print(built.stdout, end="")
    return out
