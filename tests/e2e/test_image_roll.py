"""System images run by the minOS as containers, swapped without a reboot (issue 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oci import build_image
from session import LabSession, lab_text

pytestmark = pytest.mark.e2e
REGISTRY = "127.0.0.1:5000"  # inside the lab's namespace, where layerpy serve runs


def node_file(run_dir: Path) -> Path:
    text = lab_text()
    text = text.replace('power = "on"\n', 'power = "on"\nimage = "a"\n')
    for name in ("a", "b", "c"):
        text += (
            f'\n[images.{name}]\nsource = "registry://{REGISTRY}/lab/{name}:1"\ninsecure = true\n'
        )
    path = run_dir / "nodes.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    run_dir = tmp_path_factory.mktemp("images")
    layouts = {
        name: build_image(run_dir / f"layout-{name}", name, f"IMAGE-{name.upper()}-MARKER")
        for name in ("a", "b", "c")
    }

    def registry(lab) -> None:
        """Debian's docker-registry inside the lab, holding images a, b and a corrupt c."""
        data = run_dir / "registry"
        config = {"version": "0.1", "log": {"level": "warn", "accesslog": {"disabled": True}},
                  "storage": {"filesystem": {"rootdirectory": str(data)}},
                  "http": {"addr": REGISTRY}}  # fmt: skip
        (run_dir / "registry.yml").write_text(json.dumps(config))
        lab.popen(["docker-registry", "serve", str(run_dir / "registry.yml")],
                  log=run_dir / "registry.log")  # fmt: skip
        lab.run(["sh", "-c", f"for i in $(seq 50); do curl -sf http://{REGISTRY}/v2/ && exit; "
                 "sleep 0.1; done; exit 1"])  # fmt: skip
        for name, layout in layouts.items():
            lab.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false",
                     f"oci:{layout}:latest", f"docker://{REGISTRY}/lab/{name}:1"])  # fmt: skip
        # c's top layer (the one with its marker) is damaged in the registry's storage
        index = json.loads((layouts["c"] / "index.json").read_text())
        manifest_blob = index["manifests"][0]["digest"].removeprefix("sha256:")
        manifest = json.loads((layouts["c"] / "blobs/sha256" / manifest_blob).read_text())
        top = manifest["layers"][-1]["digest"].removeprefix("sha256:")
        blob = data / "docker/registry/v2/blobs/sha256" / top[:2] / top / "data"
        damaged = bytearray(blob.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        blob.write_bytes(bytes(damaged))

    session = LabSession(run_dir, config=node_file(run_dir), before_serve=registry)
    yield session
    session.close()


def image_of(lab, name: str = "cn001") -> dict:
    return lab.nodes()[name]["image"]


def served_by(lab, ip: str = "10.99.0.11") -> str:
    return lab.lab.run(["curl", "-s", "--max-time", "3", f"http://{ip}/"], check=False).stdout


def digest_of(lab, image: str) -> str:
    return next(i["digest"] for i in lab.api("/api/v1/images") if i["name"] == image)


def test_node_boots_and_runs_its_image(lab) -> None:
    vm = lab.start("cn001")[0]
    lab.wait_state(["cn001"], "ready", timeout=90)
    lab.wait(lambda: image_of(lab)["state"] == "active", 90, "image a active")
    assert image_of(lab)["digest"] == digest_of(lab, "a")
    assert vm.wait_serial("IMAGE-A-MARKER", 10)
    assert served_by(lab).strip() == "IMAGE-A-MARKER"  # busybox httpd inside the container


def test_changing_the_image_swaps_it_without_a_reboot(lab) -> None:
    boot_id = lab.nodes()["cn001"]["boot"]["boot_id"]
    lab.config.write_text(lab.config.read_text().replace('image = "a"', 'image = "b"'))
    lab.cli("reload", "-c", str(lab.config))
    lab.wait(lambda: image_of(lab)["digest"] == digest_of(lab, "b")
             and image_of(lab)["state"] == "active", 90, "image b active")  # fmt: skip
    assert lab.lab.vms["cn001"].wait_serial("IMAGE-B-MARKER", 10)
    assert served_by(lab).strip() == "IMAGE-B-MARKER"
    node = lab.nodes()["cn001"]
    assert (node["boot"]["boot_id"], node["boots"]) == (boot_id, 1)  # same kernel, same boot
    assert "image.activate" in lab.serve_log.read_text()


def test_corrupt_image_leaves_the_node_on_its_image_with_the_reason(lab) -> None:
    lab.config.write_text(lab.config.read_text().replace('image = "b"', 'image = "c"'))
    lab.cli("reload", "-c", str(lab.config))
    lab.wait(lambda: json.loads(lab.cli("explain", "cn001"))["image_problem"], 60,
             "the broken pull is reported")  # fmt: skip
    problem = json.loads(lab.cli("explain", "cn001"))["image_problem"]
    assert "c:" in problem and "sha256" in problem, problem
    assert image_of(lab)["digest"] == digest_of(lab, "b") and image_of(lab)["state"] == "active"
    assert served_by(lab).strip() == "IMAGE-B-MARKER"


def test_the_api_rolls_an_image_too(lab) -> None:
    out = lab.cli("image", "set", "cn001", "a")
    assert out.strip() == "cn001: wants image a"
    lab.wait(lambda: image_of(lab)["digest"] == digest_of(lab, "a")
             and image_of(lab)["state"] == "active", 90, "back on image a")  # fmt: skip
    assert served_by(lab).strip() == "IMAGE-A-MARKER"
    assert lab.nodes()["cn001"]["boots"] == 1
