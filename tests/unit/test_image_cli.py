"""`layerpy image pull|list|inspect` on an OCI layout, through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from oci import build_image

LAYERPY = Path(sys.executable).parent / "layerpy"


def layerpy(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LAYERPY), *args], capture_output=True, text=True, check=check)


def test_pull_list_inspect(make_config, tmp_path: Path) -> None:
    layout = build_image(tmp_path / "layout", "demo", "DEMO-MARKER")
    extra = f'\n[images.demo]\nsource = "oci-layout:{layout}:latest"\n'
    config = make_config(images=extra)
    pulled = layerpy("image", "pull", "demo", "-c", str(config.path)).stdout
    assert pulled.startswith("demo: sha256:") and "2 layers" in pulled
    digest = pulled.split()[1]
    assert digest[:19] in layerpy("image", "list", "-c", str(config.path)).stdout
    shown = json.loads(layerpy("image", "inspect", "demo", "-c", str(config.path)).stdout)
    assert shown["digest"] == digest and shown["config"]["Cmd"][0] == "/bin/sh"
    missing = layerpy("image", "pull", "nope", "-c", str(config.path), check=False)
    assert missing.returncode == 2 and "one of: demo" in missing.stderr
