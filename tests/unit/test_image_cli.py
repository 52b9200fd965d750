"""`layerpy image pull|list|inspect` on an OCI layout, through the real command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from oci import Layout, build_image, file

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


def test_pull_for_another_platform(make_config, tmp_path: Path) -> None:
    """--platform picks that platform's manifest of a multi-architecture index."""
    layout = Layout(tmp_path / "multi")
    found = {
        arch: layout.image([[file("arch", arch)]], arch=arch, variant=variant)
        for arch, variant in (("amd64", None), ("arm64", "v8"))
    }
    layout.tag("latest", layout.index(list(found.values())))
    config = make_config(images=f'\n[images.multi]\nsource = "oci-layout:{layout.path}:latest"\n')
    for arch, platform in (("arm64", "linux/arm64/v8"), ("amd64", "linux/amd64")):
        pulled = layerpy("image", "pull", "multi", "--platform", platform, "-c", str(config.path))
        assert pulled.stdout.split()[1] == found[arch]["digest"], pulled.stdout
    bad = layerpy("image", "pull", "multi", "--platform", "arm64", "-c", str(config.path),
                  check=False)  # fmt: skip
    assert bad.returncode == 2 and "is none of linux/amd64, linux/arm/v6" in bad.stderr, bad.stderr
