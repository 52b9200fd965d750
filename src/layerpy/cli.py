"""The ``layerpy`` command line."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from layerpy import __version__
from layerpy.config import Config, ConfigError, load

CONFIG_OPTION = click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    required=True,
    help="The node file (TOML).",
)

OPTIONAL_CONFIG = click.option("-c", "--config", "config_path", type=click.Path(path_type=Path))
SERVER_OPTION = click.option(
    "--server", "server_url", help="Server URL (default: 127.0.0.1 and the node file's port)."
)
# piped output is not squeezed to 80 columns: scripts and logs read whole lines
console = Console(width=None if sys.stdout.isatty() else 200)


def _load_or_exit(path: Path) -> Config:
    try:
        return load(path)
    except ConfigError as error:
        click.echo(error.render(), err=True)
        click.echo(f"{path}: {len(error.problems)} problem(s); nothing was applied.", err=True)
        sys.exit(2)


@click.group()
@click.version_option(__version__)
def main() -> None:
    """Network boot and node lifecycle for clusters and testbeds."""


@main.command()
@CONFIG_OPTION
@click.option("--debug", is_flag=True, help="Debug logging, including every request.")
@click.option(
    "--state-dir", type=click.Path(path_type=Path), help="Override server.state_dir of the file."
)
def serve(config_path: Path, debug: bool, state_dir: Path | None) -> None:
    """Run DHCP, TFTP and HTTP for the nodes in the node file."""
    from layerpy.server import serve as run_server

    config = _load_or_exit(config_path)
    logging.basicConfig(
        level=logging.DEBUG if debug or config.server.log_requests else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    try:
        asyncio.run(run_server(config, state_dir=state_dir))
    except OSError as error:
        click.echo(f"layerpy serve: {error}", err=True)
        sys.exit(1)


@main.command()
@CONFIG_OPTION
def check(config_path: Path) -> None:
    """Validate the node file and summarise it; exit 2 on any problem."""
    config = _load_or_exit(config_path)
    server, network = config.server, config.network
    groups = sorted({n.group for n in config.nodes.values() if n.group})
    console.print(f"[bold]{config.path}[/] is valid")
    console.print(f"  server   {server.address} on {server.interface or '-'}, http {server.url}")
    console.print(
        f"  dhcp     {server.dhcp}, subnet {network.subnet}, lease {network.lease_time} s"
    )
    console.print(f"  minos    {config.minos.kernel} + {config.minos.initrd}")
    console.print(f"  nodes    {len(config.nodes)} in {len(groups)} group(s) {', '.join(groups)}")
    table = Table("node", "group", "ip", "mac")
    for node in config.nodes.values():
        table.add_row(node.name, node.group or "-", str(node.ip), node.mac or "-")
    console.print(table)


@main.command()
@OPTIONAL_CONFIG
@SERVER_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def status(config_path: Path | None, server_url: str | None, as_json: bool) -> None:
    """Show every node's run state and the timeline of its current boot."""
    nodes = _api(_server_url(config_path, server_url), "/api/v1/nodes")
    if as_json:
        click.echo(json.dumps(nodes, indent=2))
        return
    table = Table("node", "mac", "ip", "state", "boots", "timeline (s since boot start)")
    for node in nodes:
        timeline = " ".join(f"{k}={v:g}" for k, v in node["timeline"].items())
        table.add_row(
            node["name"],
            node["mac"] or "-",
            node["ip"],
            node["run_state"],
            str(node["boots"]),
            timeline,
        )
    console.print(table)


@main.command()
@OPTIONAL_CONFIG
@SERVER_OPTION
def reload(config_path: Path | None, server_url: str | None) -> None:
    """Make the running server re-read its node file (all of it applies, or none of it)."""
    answer = _api(_server_url(config_path, server_url), "/api/v1/reload", method="POST")
    if "problems" in answer:
        click.echo("\n".join(answer["problems"]), err=True)
        click.echo("reload refused; the running configuration stays in force", err=True)
        sys.exit(2)
    for key in ("added", "removed", "changed"):
        click.echo(f"{key:8} {', '.join(answer[key]) or '-'}")


SERVER_OPTION = click.option(
    "--server", "server_url", help="Server URL (default: from the node file)."
)
OPTIONAL_CONFIG = click.option("-c", "--config", "config_path", type=click.Path(path_type=Path))


@main.command()
@click.argument("action", type=click.Choice(["on", "off", "cycle", "clear", "status"]))
@click.argument("nodes")
@OPTIONAL_CONFIG
@SERVER_OPTION
def power(action: str, nodes: str, config_path: Path | None, server_url: str | None) -> None:
    """Power NODES (a hostlist) on, off, cycle them, clear overrides, or show status.

    on and off change the desired state until `clear` or until the node file changes;
    the server then keeps the nodes so (a busy node is not powered off until free)."""
    base = _server_url(config_path, server_url)
    answer = _api(base, "/api/v1/power", "POST", {"nodes": nodes, "action": action})
    table = Table("node", "power", "desired", "override", "error")
    for name, state in answer.items():
        desired = state["desired"] if state["controlled"] else "(no bmc)"
        table.add_row(name, state["power"], desired, "yes" if state["override"] else "",
                      state["error"] or "")  # fmt: skip
    console.print(table)


@main.command()
@OPTIONAL_CONFIG
@SERVER_OPTION
def plan(config_path: Path | None, server_url: str | None) -> None:
    """For each node: what is (dsc), what should be (cfg), and the engine's path between."""
    table = Table("node", "dsc", "cfg", "path")
    for entry in _api(_server_url(config_path, server_url), "/api/v1/plan"):
        path = entry["path"]
        shown = path if isinstance(path, str) else " → ".join(path) or "(converged)"
        table.add_row(entry["name"], _values(entry["dsc"]), _values(entry["cfg"]), shown)
    console.print(table)


@main.command()
@click.argument("node")
@OPTIONAL_CONFIG
@SERVER_OPTION
def explain(node: str, config_path: Path | None, server_url: str | None) -> None:
    """Why a node is as it is: cfg vs dsc, the mutation in flight, recent failures."""
    answer = _api(_server_url(config_path, server_url), f"/api/v1/nodes/{node}/explain")
    click.echo(json.dumps(answer, indent=2))


@main.group()
def image() -> None:
    """Pull and look at system images (in the state directory's image store)."""


STATE_DIR_OPTION = click.option(
    "--state-dir", type=click.Path(path_type=Path), help="Override server.state_dir of the file."
)


def _store(config: Config, state_dir: Path | None) -> Any:
    from layerpy.images import ImageStore

    return ImageStore((state_dir or config.server.state_dir) / "images")


@image.command("pull")
@click.argument("name")
@CONFIG_OPTION
@STATE_DIR_OPTION
def image_pull(name: str, config_path: Path, state_dir: Path | None) -> None:
    """Pull NAME, an image of the node file or a source (registry://…, oci-layout:…)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    from layerpy.images import ImageError, parse_source

    config = _load_or_exit(config_path)
    try:
        source = config.images[name].source if name in config.images else parse_source(name)
    except ValueError as error:
        raise click.BadParameter(f"{error}; or one of: {', '.join(config.images)}") from None
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as progress:
        task = progress.add_task(f"pulling {name}", total=None)

        def advance(done: int, total: int | None) -> None:
            progress.update(task, completed=done, total=total)

        try:
            pulled = asyncio.run(_store(config, state_dir).pull(name, source, advance))
        except ImageError as error:
            click.echo(f"layerpy image pull: {error}", err=True)
            sys.exit(1)
    click.echo(
        f"{name}: {pulled.digest} ({pulled.layers} layers, rootfs {pulled.rootfs_size:,} bytes,"
        f" {pulled.seconds:.1f} s)"
    )


@image.command("set")
@click.argument("nodes")
@click.argument("name")
@OPTIONAL_CONFIG
@SERVER_OPTION
def image_set(nodes: str, name: str, config_path: Path | None, server_url: str | None) -> None:
    """Run image NAME on NODES now (no reboot; busy nodes first drain), until
    `layerpy power clear NODES` or the node file changes."""
    base = _server_url(config_path, server_url)
    answer = _api(base, "/api/v1/image", "POST", {"nodes": nodes, "image": name})
    for node, state in answer.items():
        click.echo(f"{node}: wants image {state['image_wanted']}")


@image.command("list")
@CONFIG_OPTION
@STATE_DIR_OPTION
def image_list(config_path: Path, state_dir: Path | None) -> None:
    """The images in the store, oldest first."""
    table = Table("digest", "source", "layers", "rootfs", "squashfs", "pulled")
    for found in _store(_load_or_exit(config_path), state_dir).list():
        squashfs = f"{found.squashfs_size:,}" if found.squashfs_size else "-"
        pulled = time.strftime("%Y-%m-%d %H:%M", time.localtime(found.pulled_at))
        table.add_row(found.digest[:19], found.source, str(found.layers),
                      f"{found.rootfs_size:,}", squashfs, pulled)  # fmt: skip
    console.print(table)


@image.command("inspect")
@click.argument("image_ref")
@CONFIG_OPTION
@STATE_DIR_OPTION
def image_inspect(image_ref: str, config_path: Path, state_dir: Path | None) -> None:
    """One image as JSON, by digest or by the node file's name for it."""
    store = _store(_load_or_exit(config_path), state_dir)
    found = store.get(image_ref) or store.named(image_ref)
    if found is None:
        click.echo(f"no image {image_ref!r} in {store.root} (pull it first)", err=True)
        sys.exit(1)
    click.echo(json.dumps(dataclasses.asdict(found), indent=2, default=str))


def _values(values: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())


def _server_url(config_path: Path | None, server_url: str | None) -> str:
    """Where the running server answers: only its port is read from the node file, so
    a broken file can still be reloaded (and refused by the server)."""
    if server_url:
        return server_url.rstrip("/")
    if config_path is None:
        raise click.UsageError("give the node file (-c) or --server URL")
    try:
        port = tomllib.loads(config_path.read_text()).get("server", {}).get("http_port", 8080)
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        port = 8080
    return f"http://127.0.0.1:{port}"


def _api(base: str, path: str, method: str = "GET", body: Any = None) -> Any:
    """Call the running server; a JSON error answer is returned like a success."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        if error.headers.get_content_type() == "application/json":
            return json.load(error)
        click.echo(f"{base}{path}: {error.code} {error.read().decode(errors='replace')}", err=True)
        sys.exit(1)
    except (urllib.error.URLError, OSError) as error:
        click.echo(f"cannot reach the layerpy server at {base}: {error}", err=True)
        sys.exit(1)
