"""Multi-architecture images: each node runs the manifest of an image index that fits the
platform its agent reports (arm64 nodes the arm64 one), and an agent older than protocol
1.3, which reports none, still gets the amd64 one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from layerpy.catalog import Catalog
from layerpy.images import ImageStore
from layerpy.lifecycle import Lifecycle
from layerpy.proto.agent import PROTOCOL, ContractError, Report
from layerpy.proto.platform import DEFAULT, choose, of_machine

from oci import Layout, busybox_layer, file
from stores import local_store


def entry(digest: str, arch: str | None, variant: str | None = None, osname: str = "linux"):
    found = {"digest": f"sha256:{digest * 64}"[:71], "mediaType": "m", "size": 1}
    if arch is not None:
        found["platform"] = {"os": osname, "architecture": arch}
        if variant:
            found["platform"]["variant"] = variant
    return found


def test_a_machine_names_its_platform() -> None:
    assert of_machine("aarch64") == "linux/arm64/v8"
    assert of_machine("x86_64") == "linux/amd64" == DEFAULT
    assert of_machine("armv7l") == "linux/arm/v7"
    assert of_machine("Weird-CPU 9") == "linux/weirdcpu9"  # no image will fit it, plainly


@pytest.mark.parametrize(
    ("entries", "platform", "chosen"),
    [
        ([entry("a", "amd64"), entry("b", "arm64")], "linux/arm64/v8", "b"),  # no variant: v8
        ([entry("a", "arm64"), entry("b", "arm64", "v8")], "linux/arm64/v8", "a"),  # the same
        ([entry("a", "arm64", "v8")], "linux/arm64", "a"),  # a node without one: v8 too
        ([entry("a", "arm", "v6"), entry("b", "arm", "v7")], "linux/arm/v7", "b"),
        ([entry("a", "arm", "v6")], "linux/arm/v7", None),  # another variant never fits
        ([entry("a", "amd64", "v3")], "linux/amd64", None),  # nor a newer x86-64 level
        ([entry("a", "unknown", osname="unknown"), entry("b", "amd64")], "linux/amd64", "b"),
        ([entry("a", None), entry("b", "arm64")], "linux/arm64/v8", "b"),  # named beats none
        ([entry("a", None)], "linux/arm64/v8", "a"),  # a layout's only image fits all
        ([entry("a", "arm64", osname="windows")], "linux/arm64/v8", None),
    ],
)
def test_the_index_entry_that_fits(entries: list[dict], platform: str, chosen: str | None):
    got, _ = choose({"manifests": entries}, platform)
    assert got == (None if chosen is None else f"sha256:{chosen * 64}")


def test_garbage_indexes_offer_nothing() -> None:
    for index in (None, [], {"manifests": "x"}, {"manifests": [1, {"digest": 5}, {}]}):
        assert choose(index, "linux/amd64") == (None, [])


def report(platform: str | None, protocol: str = PROTOCOL) -> dict:
    body = {"node": "cn001", "token": "t", "mac": "52:54:00:99:00:11", "ip": "10.99.0.11",
            "boot_id": "b1", "seq": 1, "event": "hello", "protocol": protocol}  # fmt: skip
    return body if platform is None else {**body, "platform": platform}


def test_the_report_carries_the_platform_and_older_agents_mean_amd64() -> None:
    assert Report.from_json(report("linux/arm64/v8")).platform == "linux/arm64/v8"
    assert Report.from_json(report(None, "1.2")).platform == "linux/amd64"
    # well formed but no machine's: each platform named is a catalog table, so a node
    # naming a new one every report would make tables (and pulls) without end
    made_up = ("linux/arm64", "linux/arm64/v9", "linux/mips", "windows/amd64")
    for bad in ("arm64", "linux/arm64/v8/x", "linux/../etc", "linux/" + "a" * 40, 7, *made_up):
        with pytest.raises(ContractError, match=r"report\.platform"):
            Report.from_json(report(bad))  # type: ignore[arg-type]


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        await asyncio.sleep(0.01)


def test_each_node_is_assigned_the_manifest_of_its_platform(make_config, tmp_path) -> None:
    """cn001's agent reports linux/arm64/v8, cn002's is older (protocol 1.2, no platform):
    both want image "multi", an OCI index of an amd64 and an arm64/v8 image. The arm64
    image is pulled once an arm64 node is seen, and each node is told its own digest."""
    layout = Layout(tmp_path / "multi")
    amd = layout.image([busybox_layer(), [file("arch", "amd64")]], arch="amd64")
    arm = layout.image([busybox_layer(), [file("arch", "arm64")]], arch="arm64", variant="v8")
    layout.tag("latest", layout.index([amd, arm]))
    images = f'[images.multi]\nsource = "oci-layout:{layout.path}:latest"\n'
    nodes = '[nodes.cn001]\nimage = "multi"\n[nodes.cn002]\nimage = "multi"\n'
    config = make_config(images=images, nodes=nodes)

    async def scenario() -> dict[str, str]:
        store = local_store(config)
        catalog = Catalog(ImageStore(config.server.state_dir / "images"), store.feed)
        lifecycle = Lifecycle(store, store.backend, catalog, poll_interval=3600)
        catalog.sync(config)
        running = asyncio.create_task(lifecycle.run())
        try:
            for name, platform, protocol in (("cn001", "linux/arm64/v8", PROTOCOL),
                                             ("cn002", None, "1.2")):  # fmt: skip
                node = store.nodes[name]
                store.saw_boot_request(node, "ipxe")
                token = store.issue_token(node)
                body = report(platform, protocol)
                body.update(node=name, token=token, mac=str(node.config.mac),
                            ip=str(node.config.ip))  # fmt: skip
                store.report(body)
                store.report({**body, "seq": 2, "event": "heartbeat"})
            await until(lambda: all(lifecycle.image_spec(n) for n in ("cn001", "cn002")),
                        "both nodes assigned an image")  # fmt: skip
            return {n: lifecycle.image_spec(n).digest for n in ("cn001", "cn002")}
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await lifecycle.close()

    assigned = asyncio.run(scenario())
    assert assigned == {"cn001": arm["digest"], "cn002": amd["digest"]}
