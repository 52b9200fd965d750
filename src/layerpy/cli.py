"""The ``layerpy`` command line."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from layerpy import __version__
from layerpy import install as installing
from layerpy.client import DEFAULT_SOCKET, TOKEN_VARIABLE, Client, ClientError, ServerEvent
from layerpy.config import Config, ConfigError, load
from layerpy.config.starter import starter
from layerpy.host import host_problems, interfaces
from layerpy.hostlist import fold
from layerpy.model import ImageState, PowerState, RunState
from layerpy.text import printable

DEFAULT_CONFIG = Path("/etc/layerpy/nodes.toml")
CONFIG_VARIABLE = "LAYERPY_CONFIG"

CONFIG_OPTION = click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    envvar=CONFIG_VARIABLE,
    default=DEFAULT_CONFIG,
    show_default=True,
    help=f"The node file (TOML); else ${CONFIG_VARIABLE}.",
)

OPTIONAL_CONFIG = click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    envvar=CONFIG_VARIABLE,
    default=lambda: DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None,
    help=f"The node file, the server's API socket is found from it (else ${CONFIG_VARIABLE}, "
    f"else {DEFAULT_CONFIG} if there is one).",
)


def operator_api(command: Callable[..., None]) -> Callable[..., None]:
    """Options that say where the operator API is; the command gets it as ``api``."""

    @OPTIONAL_CONFIG
    @click.option(
        "--server",
        "server",
        help="The operator API: its Unix socket (a path) or https://HOST:PORT with a token "
        f"from ${TOKEN_VARIABLE} or --token-file (default: the socket in the node file's "
        f"state directory, else {DEFAULT_SOCKET}).",
    )
    @click.option(
        "--token-file",
        type=click.Path(path_type=Path, dir_okay=False),
        help="A file holding the operator token for --server https://… (not the token "
        "itself: others can read a command line).",
    )
    @functools.wraps(command)
    def run(config_path: Path | None, server: str | None, token_file: Path | None,
            **options: Any) -> None:  # fmt: skip
        try:
            command(api=Client.find(config_path, server, token_file), **options)
        except ClientError as error:
            click.echo(f"layerpy: {error}", err=True)
            sys.exit(1)

    return run


def output_option(default: str = "table") -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``-o table|json``, the command gets it as ``output``. ``--json`` is the old spelling
    of ``-o json``, kept (hidden) for the scripts that use it."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        @click.option(
            "-o",
            "--output",
            type=click.Choice(["table", "json"]),
            default=default,
            show_default=True,
            help="table: for people (text from the network shown as plain text); json: the "
            "server's answer as it comes, for scripts.",
        )
        @click.option("--json", "as_json", is_flag=True, hidden=True, help="Same as -o json.")
        @functools.wraps(command)
        def run(output: str, as_json: bool, **options: Any) -> None:
            command(output="json" if as_json else output, **options)

        return run

    return decorate


def _print_json(data: object) -> None:
    """JSON for scripts; json escapes control characters, so it is safe on a terminal."""
    click.echo(json.dumps(data, indent=2))


# piped output is not squeezed to 80 columns: scripts and logs read whole lines
console = Console(width=None if sys.stdout.isatty() else 200)


def _load_or_exit(path: Path) -> Config:
    if not path.exists():
        click.echo(
            f"layerpy: there is no node file {path}: name one with -c FILE or "
            f"${CONFIG_VARIABLE}, or write a starter there with `layerpy init INTERFACE -o "
            f"{path}`",
            err=True,
        )
        sys.exit(2)
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
    from layerpy.heap import collector_paused
    from layerpy.host import StartRefused
    from layerpy.server import serve as run_server
    from layerpy.services import run

    with collector_paused():
        config = _load_or_exit(config_path)
    logging.basicConfig(
        level=logging.DEBUG if debug or config.server.log_requests else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    try:
        run(run_server(config, state_dir=state_dir))
    except (OSError, StartRefused) as error:
        click.echo(f"layerpy serve: {error}", err=True)
        sys.exit(1)
    # stopped: everything is closed and written. The interpreter's teardown of the heap
    # (100 000 nodes, an etcd mirror) took 11 s under load; the kernel frees it at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@main.command()
@click.argument("interface")
@click.option(
    "-o",
    "--output",
    type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
    envvar=CONFIG_VARIABLE,
    default=DEFAULT_CONFIG,
    show_default=True,
    help=f"Where to write it (else ${CONFIG_VARIABLE}; '-' prints it).",
)
@click.option("--force", is_flag=True, help="Replace the file if there is one.")
def init(interface: str, output: Path, force: bool) -> None:
    """Write a commented starter node file for serving on INTERFACE, with its address,
    subnet and a discovery pool filled in."""
    present = interfaces()
    if interface not in present:
        _fail(f"no such interface {interface}; this host has {', '.join(present)}")
    if not present[interface]:
        _fail(
            f"{interface} has no IPv4 address: give it the one the nodes will boot from "
            f"(ip address add 10.0.0.1/24 dev {interface}) and run this again"
        )
    chosen = present[interface][0]
    text = starter(interface, chosen)
    if str(output) == "-":
        click.echo(text, nl=False)
        return
    if output.exists() and not force:
        _fail(f"{output} is there already; --force replaces it, -o FILE writes elsewhere")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    others = f" (its other addresses: {', '.join(map(str, present[interface][1:]))})"
    click.echo(
        f"wrote {output} for {interface}, {chosen}{others if present[interface][1:] else ''}; "
        f"check it with `layerpy check -c {output}`"
    )


@main.command()
@click.option(
    "--prefix", type=click.Path(path_type=Path), default=installing.PREFIX, show_default=True,
    help="Where the program goes (PREFIX/bin/layerpy, PREFIX/lib/layerpy/layerpy.pyz).",
)  # fmt: skip
@click.option("--nodes", type=int, default=0, help="Size LimitNOFILE= for this many nodes.")
@click.option("--dry-run", is_flag=True, help="Say what it would do and print the unit.")
def install(prefix: Path, nodes: int, dry_run: bool) -> None:
    """Put the program and a hardened systemd unit in place (as root). Then: `layerpy init
    INTERFACE`, `layerpy check`, `systemctl enable --now layerpy`."""
    try:
        plan = installing.steps(prefix, nodes)
    except ValueError as error:
        _fail(str(error))
    if dry_run:
        for step in plan:
            click.echo(f"would {step.says}")
        click.echo(installing.unit(installing.program(prefix), nodes), nl=False)
        return
    try:
        installing.run(plan, say=click.echo)
    except (OSError, subprocess.CalledProcessError) as error:
        _fail(f"install stopped: {error}", 1)
    click.echo(
        "install: done. Next: `layerpy init INTERFACE` (writes /etc/layerpy/nodes.toml), "
        "`layerpy check`, then `systemctl enable --now layerpy`; files it reads (BMC "
        f"passwords) must be readable by the user {installing.USER}."
    )


def _fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"layerpy: {message}", err=True)
    sys.exit(code)


@main.command()
@click.argument("node")
@click.argument("path", required=False)
@CONFIG_OPTION
@output_option()
def render(node: str, path: str | None, config_path: Path, output: str) -> None:
    """The files NODE gets (path, mode, owner, size, digest) and their revision, or PATH's
    content; a secret's bytes are never shown. -o json lists the files (not a content)."""
    from layerpy.files import RenderError, files_for, revision

    config = _load_or_exit(config_path)
    if node not in config.nodes:
        _fail(f"{config.path} has no node {node}")
    try:
        made = files_for(config, node)
    except RenderError as error:
        _fail(str(error), 1)
    if path is None and output == "json":
        files = [{"path": file.path, "mode": file.mode, "owner": file.owner,
                  "size": len(file.content), "digest": file.digest, "secret": file.secret,
                  "source": str(file.source)} for file in made]  # fmt: skip
        _print_json({"node": node, "revision": revision(made), "files": files})
        return
    if path is None:
        click.echo(f"{node}: revision {revision(made)}, {len(made)} file(s)")
        for file in made:
            kind = "secret" if file.secret else "template"
            click.echo(f"  {file.path}  {file.mode:04o} {file.owner}  {len(file.content)} B  "
                       f"{file.digest[:19]}  {kind} {file.source}")  # fmt: skip
        return
    chosen = next((file for file in made if file.path == path), None)
    if chosen is None:
        _fail(f"{node} gets no {path} (`layerpy render {node}` lists what it gets)")
    if chosen.secret:
        click.echo(f"(secret: {len(chosen.content)} bytes from {chosen.source}, "
                   f"{chosen.digest}; not shown)")  # fmt: skip
        return
    click.echo(chosen.content.decode(), nl=False)


SHOWN = 50  # nodes `layerpy check` lists (a table of 100 000 rows takes a minute)


@main.command()
@CONFIG_OPTION
@click.option("--all", "show_all", is_flag=True, help=f"List every node, not the first {SHOWN}.")
@click.option(
    "--file-only",
    is_flag=True,
    help="Check the file alone, not this host (for another host's file).",
)
@click.option("-q", "--quiet", is_flag=True, help="Print the problems only (for a unit's log).")
@output_option()
def check(config_path: Path, show_all: bool, file_only: bool, quiet: bool, output: str) -> None:
    """Validate the node file and summarise it, then check this host can serve it (the
    interface carries server.address, the ports are free). Exit 2 when the file has a
    problem, 3 when only the host has one."""
    if output == "json":
        _check_json(config_path, file_only)
        return
    config = _load_or_exit(config_path)
    if not quiet:
        _summarise(config, show_all)
    if file_only:
        return
    problems = host_problems(config)
    if not quiet:
        console.print(
            "  host     " + ("ready to serve it" if not problems else "[red]not ready[/]")
        )
    for problem in problems:
        click.echo(f"    {printable(problem, 500)}")
    if problems:
        sys.exit(3)


def _check_json(path: Path, file_only: bool) -> None:
    """``check -o json``: the verdict on the file (its problems, or its nodes), then on this
    host (null with --file-only); the same exit statuses as the table."""
    try:
        config = load(path)
    except ConfigError as error:
        problems = [dataclasses.asdict(problem) for problem in error.problems]
        _print_json({"file": str(path), "valid": False, "problems": problems})
        sys.exit(2)
    nodes = [{"name": node.name, "group": node.group, "ip": node.ip and str(node.ip),
              "mac": node.mac} for node in config.nodes.values()]  # fmt: skip
    host = None if file_only else host_problems(config)
    server = config.server
    cluster = config.cluster and {
        "name": config.cluster.name,
        "segment": config.cluster.segment,
        "etcd": config.cluster.etcd,
        "prefix": config.cluster.prefix,
    }
    _print_json({"file": str(config.path), "valid": True,
                 "server": {"address": str(server.address), "interface": server.interface,
                            "url": server.url, "dhcp": server.dhcp},
                 "cluster": cluster, "nodes": nodes, "host_problems": host})  # fmt: skip
    if host:
        sys.exit(3)


def _summarise(config: Config, show_all: bool) -> None:
    server, network = config.server, config.network
    groups = sorted({n.group for n in config.nodes.values() if n.group})
    console.print(f"[bold]{config.path}[/] is valid")
    console.print(f"  server   {server.address} on {server.interface or '-'}, http {server.url}")
    leases = (
        "the site's server gives the addresses"
        if server.dhcp == "proxy"
        else f"lease {network.lease_time} s"
    )
    console.print(f"  dhcp     {server.dhcp}, subnet {network.subnet}, {leases}")
    console.print(f"  minos    {config.minos.kernel} + {config.minos.initrd}")
    console.print(f"  nodes    {len(config.nodes)} in {len(groups)} group(s) {', '.join(groups)}")
    if config.cluster is not None:
        cluster = config.cluster
        console.print(f"  cluster  instance {cluster.name} serving {cluster.segment}, etcd "
                      f"{', '.join(cluster.etcd)} under {cluster.prefix}")  # fmt: skip
    table = Table("node", "group", "ip", "mac")
    nodes = list(config.nodes.values())
    for node in nodes if show_all else nodes[:SHOWN]:
        _row(table, node.name, node.group or "-", node.ip or "(site DHCP)", node.mac or "-")
    console.print(table)
    if len(nodes) > SHOWN and not show_all:
        console.print(f"  … and {len(nodes) - SHOWN} more (layerpy check --all lists them)")


@main.command()
@click.option(
    "--watch", is_flag=True, help="Nodes counted by state, redrawn as the server's events come."
)
@operator_api
@output_option()
def status(api: Client, output: str, watch: bool) -> None:
    """Show every node's run state and the timeline of its current boot; with --watch, the
    nodes grouped by power, run and image state, live (Ctrl-C leaves)."""
    if watch:
        if output == "json":
            _fail("--watch draws a view for people; `layerpy watch -o json` streams the events")
        _watch_status(api)
        return
    nodes = api.call("/api/v1/nodes")
    if output == "json":
        _print_json(nodes)
        return
    clustered = any("owner" in node for node in nodes)  # its owner: in a cluster only
    columns = ("node", "mac", "ip", "hostname", "state", "boots", "timeline (s since boot start)")
    table = Table(*columns[:5], *(("owner",) if clustered else ()), *columns[5:])
    for node in nodes:
        timeline = " ".join(f"{k}={v:g}" for k, v in node["timeline"].items())
        owner = (node.get("owner") or "-",) if clustered else ()
        _row(table, node["name"], node["mac"] or "-", node["ip"] or "-", node["hostname"] or "-",
             node["run_state"], *owner, node["boots"], timeline)  # fmt: skip
    console.print(table)


@main.command()
@operator_api
@output_option()
def reload(api: Client, output: str) -> None:
    """Make the running server re-read its node file (all of it applies, or none of it)."""
    answer = api.call("/api/v1/reload", method="POST")
    if output == "json":
        _print_json(answer)
        if "problems" in answer:
            sys.exit(2)
        return
    if "problems" in answer:
        click.echo("\n".join(printable(problem, 1000) for problem in answer["problems"]), err=True)
        click.echo("reload refused; the running configuration stays in force", err=True)
        sys.exit(2)
    for key in ("added", "removed", "changed"):
        click.echo(f"{key:8} {', '.join(map(printable, answer[key])) or '-'}")


@main.command()
@click.option("--list", "list_all", is_flag=True, help="Every group and host, with host variables.")
@click.option("--host", help="One host's variables.")
@operator_api
def inventory(api: Client, list_all: bool, host: str | None) -> None:
    """The nodes as an Ansible dynamic inventory: groups from the node file, and as host
    variables each node's address (ansible_host), image, location, state and vars.
    `ansible-inventory -i layerpy-inventory --list` runs it (layerpy-inventory is this
    command as the executable Ansible expects)."""
    if list_all == (host is not None):
        _fail("give --list or --host NAME (as Ansible does)")
    nodes = {node["name"]: node for node in api.call("/api/v1/nodes")}
    if host is not None:
        click.echo(json.dumps(_host_vars(nodes[host]) if host in nodes else {}, indent=1))
        return
    groups: dict[str, list[str]] = {}
    for name, node in nodes.items():
        groups.setdefault(node["group"] or "ungrouped", []).append(name)
    listed: dict[str, Any] = {"all": {"children": sorted(groups)}}
    listed.update({group: {"hosts": names} for group, names in groups.items()})
    listed["_meta"] = {"hostvars": {name: _host_vars(node) for name, node in nodes.items()}}
    click.echo(json.dumps(listed, indent=1))


def _host_vars(node: dict[str, Any]) -> dict[str, Any]:
    """A node's host variables: its own vars, then what layerpy knows (layerpy_*)."""
    seen = node["location"]  # where it was last found plugged in, if it was
    found = {
        "ansible_host": node["ip"], "layerpy_ip": node["ip"], "layerpy_mac": node["mac"],
        "layerpy_image": node["image"]["name"], "layerpy_image_state": node["image"]["state"],
        "layerpy_location": f"{seen['switch']}:{seen['port']}" if seen else None,
        "layerpy_state": node["run_state"], "layerpy_power": node["power"],
    }  # fmt: skip
    return {**node["vars"], **{key: value for key, value in found.items() if value is not None}}


def inventory_main() -> None:
    """``layerpy-inventory``: the executable an Ansible inventory script must be."""
    main(["inventory", *sys.argv[1:]])


@main.command()
@click.argument("action", type=click.Choice(["on", "off", "cycle", "clear", "status"]))
@click.argument("nodes")
@click.option("--force", is_flag=True, help="cycle busy nodes too (running jobs die).")
@operator_api
@output_option()
def power(api: Client, action: str, nodes: str, force: bool, output: str) -> None:
    """Power NODES (a hostlist: cn[001-004],login; limits in docs/api.md) on, off, cycle
    them, clear overrides, or show status.

    on and off change the desired state until `clear` or until the node file changes;
    the server then keeps the nodes so (a busy node is not powered off until free, and
    not cycled unless --force)."""
    body = {"nodes": nodes, "action": action, "force": force}
    answer = api.call("/api/v1/power", "POST", body)
    if output == "json":
        _print_json(answer)
        return
    table = Table("node", "power", "desired", "override", "error")
    for name, state in answer.items():
        desired = state["desired"] if state["controlled"] else "(no bmc)"
        _row(table, name, state["power"], desired, "yes" if state["override"] else "",
             state["skipped"] or state["error"] or "")  # fmt: skip
    console.print(table)


@main.command()
@click.argument("node")
@click.argument("mac")
@operator_api
@output_option()
def bind(api: Client, node: str, mac: str, output: str) -> None:
    """The machine with MAC is NODE from now on: confirms a machine's LLDP claim to a
    node's port or new hardware waiting under rebind = "confirm", or names new hardware
    where no relay can vouch for it."""
    answer = api.call("/api/v1/bind", "POST", {"node": node, "mac": mac})
    if output == "json":
        _print_json(answer)
        return
    click.echo(f"{printable(node)} is {printable(mac)} from now on")


@main.command()
@operator_api
@output_option()
def plan(api: Client, output: str) -> None:
    """For each node: what is (dsc), what should be (cfg), and the engine's path between."""
    entries = api.call("/api/v1/plan")
    if output == "json":
        _print_json(entries)
        return
    table = Table("node", "dsc", "cfg", "path")
    for entry in entries:
        path = entry["path"]
        shown = path if isinstance(path, str) else " → ".join(path) or "(converged)"
        _row(table, entry["name"], _values(entry["dsc"]), _values(entry["cfg"]), shown)
    console.print(table)


@main.command()
@click.argument("node")
@operator_api
@output_option(default="json")
def explain(api: Client, node: str, output: str) -> None:
    """Why a node (or each of a hostlist's) is as it is: cfg vs dsc, the mutation in
    flight, recent failures. JSON unless -o table: scripts read it."""
    answer = api.call(f"/api/v1/nodes/{quote(node, safe='[],')}/explain")
    if output == "json":
        _print_json(answer)
        return
    for entry in answer if isinstance(answer, list) else [answer]:
        _print_fields(entry)


def _print_fields(entry: dict[str, Any]) -> None:
    """One object as a two-column table, nested values compacted to one line."""
    table = Table("field", "value")
    for key, value in entry.items():
        _row(table, key, _compact(value))
    console.print(table)


@main.group()
def image() -> None:
    """Pull and look at system images (in the state directory's image store)."""


STATE_DIR_OPTION = click.option(
    "--state-dir", type=click.Path(path_type=Path), help="Override server.state_dir of the file."
)


def _platform(ctx: click.Context, param: click.Parameter, value: str) -> str:
    from layerpy.proto.platform import KNOWN

    if value not in KNOWN:
        raise click.BadParameter(f"{value!r} is none of {', '.join(sorted(KNOWN))}")
    return value


def _store(config: Config, state_dir: Path | None) -> Any:
    from layerpy.images import ImageStore

    return ImageStore((state_dir or config.server.state_dir) / "images")


@image.command("pull")
@click.argument("name")
@click.option("--platform", default="linux/amd64", show_default=True, callback=_platform,
              help="the nodes' platform: which image of a multi-architecture index, "
              "e.g. linux/arm64/v8")  # fmt: skip
@CONFIG_OPTION
@STATE_DIR_OPTION
@output_option()
def image_pull(
    name: str, platform: str, config_path: Path, state_dir: Path | None, output: str
) -> None:
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
            pulled = asyncio.run(_store(config, state_dir).pull(name, source, advance, platform))
        except ImageError as error:
            click.echo(f"layerpy image pull: {error}", err=True)
            sys.exit(1)
    if output == "json":
        _print_json(dataclasses.asdict(pulled))
        return
    click.echo(
        f"{name}: {pulled.digest} ({pulled.layers} layers, rootfs {pulled.rootfs_size:,} bytes,"
        f" {pulled.seconds:.1f} s)"
    )


@image.command("set")
@click.argument("nodes")
@click.argument("name")
@operator_api
@output_option()
def image_set(api: Client, nodes: str, name: str, output: str) -> None:
    """Run image NAME on NODES now (no reboot; busy nodes first drain), until
    `layerpy power clear NODES` or the node file changes."""
    answer = api.call("/api/v1/image", "POST", {"nodes": nodes, "image": name})
    if output == "json":
        _print_json(answer)
        return
    for node, state in answer.items():
        click.echo(f"{printable(node)}: wants image {printable(state['image_wanted'])}")


@image.command("list")
@CONFIG_OPTION
@STATE_DIR_OPTION
@output_option()
def image_list(config_path: Path, state_dir: Path | None, output: str) -> None:
    """The images in the store, oldest first."""
    images = _store(_load_or_exit(config_path), state_dir).list()
    if output == "json":
        _print_json([dataclasses.asdict(found) for found in images])
        return
    table = Table("digest", "source", "layers", "rootfs", "squashfs", "pulled")
    for found in images:
        squashfs = f"{found.squashfs_size:,}" if found.squashfs_size else "-"
        pulled = time.strftime("%Y-%m-%d %H:%M", time.localtime(found.pulled_at))
        _row(table, found.digest[:19], found.source, found.layers, f"{found.rootfs_size:,}",
             squashfs, pulled)  # fmt: skip
    console.print(table)


@image.command("inspect")
@click.argument("image_ref")
@CONFIG_OPTION
@STATE_DIR_OPTION
@output_option(default="json")
def image_inspect(image_ref: str, config_path: Path, state_dir: Path | None, output: str) -> None:
    """One image, by digest or by the node file's name for it (JSON unless -o table)."""
    store = _store(_load_or_exit(config_path), state_dir)
    found = store.get(image_ref) or store.named(image_ref)
    if found is None:
        click.echo(f"no image {image_ref!r} in {store.root} (pull it first)", err=True)
        sys.exit(1)
    shown = json.loads(json.dumps(dataclasses.asdict(found), default=str))  # paths as text
    if output == "json":
        _print_json(shown)
        return
    _print_fields(shown)


@main.group()
def token() -> None:
    """Operator tokens for the API over TCP (the head node's CLI needs none)."""


def _tokens(config_path: Path, state_dir: Path | None) -> Any:
    from layerpy.auth import Tokens

    return Tokens(state_dir or _load_or_exit(config_path).server.state_dir)


@token.command("add")
@click.argument("name")
@click.option("--scope", type=click.Choice(["read", "admin"]), default="read", show_default=True,
              help="read: look only; admin: also power, images, reload.")  # fmt: skip
@CONFIG_OPTION
@STATE_DIR_OPTION
def token_add(name: str, scope: str, config_path: Path, state_dir: Path | None) -> None:
    """Make token NAME and print its secret, once: it is kept only as a digest."""
    from layerpy.auth import Scope, TokenError

    try:
        secret = _tokens(config_path, state_dir).create(name, Scope(scope))
    except TokenError as error:
        click.echo(f"layerpy token add: {error}", err=True)
        sys.exit(1)
    click.echo(secret)


@token.command("list")
@CONFIG_OPTION
@STATE_DIR_OPTION
@output_option()
def token_list(config_path: Path, state_dir: Path | None, output: str) -> None:
    """The tokens: names, scopes and when they were made (never the secrets)."""
    records = _tokens(config_path, state_dir).records()
    if output == "json":
        _print_json([{"name": r.name, "scope": r.scope, "created": r.created} for r in records])
        return
    table = Table("name", "scope", "created")
    for record in records:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.created))
        _row(table, record.name, record.scope, created)
    console.print(table)


@token.command("revoke")
@click.argument("name")
@CONFIG_OPTION
@STATE_DIR_OPTION
def token_revoke(name: str, config_path: Path, state_dir: Path | None) -> None:
    """Revoke token NAME; the running server refuses it from its next request on."""
    from layerpy.auth import TokenError

    try:
        _tokens(config_path, state_dir).revoke(name)
    except TokenError as error:
        click.echo(f"layerpy token revoke: {error}", err=True)
        sys.exit(1)
    click.echo(f"revoked {name}")


# -- live views: the event stream, status --watch, consoles ---------------------------------

EVENTS_STREAM = "/api/v1/events/stream"
COALESCE = 0.3  # status --watch re-reads the nodes at most this often, however many events
LOAD_SHARE = 10  # ...and waits 10 times as long as a listing took (10 000 nodes: ~2 s)
POLL = 2.0  # and this often when the event stream cannot be had
RETRY_LONGEST = 10.0  # watch --retry waits at most this long between attempts
LOG_LINES = 200  # console --log prints this many last lines unless told
PROBLEMS_SHOWN = 5
# the aspects of a node status --watch groups by: (name, how to read it, the usual order)
ASPECTS: tuple[tuple[str, Callable[[dict[str, Any]], object], tuple[str, ...]], ...] = (
    ("power", lambda node: node["power"], tuple(PowerState)),
    ("run", lambda node: node["run_state"], tuple(RunState)),
    ("image", lambda node: node["image"]["state"], tuple(ImageState)),
)


def status_groups(nodes: Iterable[dict[str, Any]]) -> list[tuple[str, str, int, str]]:
    """(aspect, state, how many, folded hostlist) for each state some node is in, aspect by
    aspect, states in their usual order (unheard-of ones last)."""
    nodes = list(nodes)
    groups = []
    for aspect, read, order in ASPECTS:
        names: dict[str, list[str]] = {}
        for node in nodes:
            names.setdefault(str(read(node)), []).append(node["name"])
        ranked = sorted(names, key=lambda state: (order.index(state) if state in order else
                                                  len(order), state))  # fmt: skip
        groups.extend((aspect, state, len(names[state]), fold(names[state])) for state in ranked)
    return groups


def status_line(groups: list[tuple[str, str, int, str]], aspect: str) -> str:
    """One aspect as a sentence: ``cn[001-128] ready, cn129 lost``."""
    return ", ".join(f"{hosts} {state}" for name, state, _, hosts in groups if name == aspect)


def node_problems(nodes: Iterable[dict[str, Any]]) -> list[str]:
    """What an operator should look at: a BMC error, a conflict, an image or files error,
    a problem of the agent; one line per node."""
    found = []
    for node in nodes:
        said = [node.get("power_error"), node.get("conflict"), node.get("problem"),
                node["image"].get("error"), node.get("files", {}).get("error")]  # fmt: skip
        if reasons := [str(reason) for reason in said if reason]:
            found.append(f"{node['name']}: {'; '.join(reasons)}")
    return found


def _status_view(nodes: list[dict[str, Any]], trouble: str | None) -> tuple[Any, Any]:
    """What status --watch shows, and what it shows apart from the clock (to redraw a pipe
    only on a change)."""
    from rich.console import Group

    groups = status_groups(nodes)
    table = Table(box=None, show_header=False, pad_edge=False)
    for index, (aspect, state, count, hosts) in enumerate(groups):
        first = index == 0 or groups[index - 1][0] != aspect  # the aspect once, on its first row
        table.add_row(Text(aspect if first else ""), Text(printable(state)),
                      Text(str(count), justify="right"), Text(printable(hosts, 2000)))  # fmt: skip
    problems = node_problems(nodes)
    lines = [Text(printable(problem, 300), style="yellow") for problem in problems[:PROBLEMS_SHOWN]]
    if len(problems) > PROBLEMS_SHOWN:
        lines.append(Text(f"… and {len(problems) - PROBLEMS_SHOWN} more (layerpy status)"))
    if trouble:
        lines.append(Text(printable(trouble, 500), style="red"))
    now = datetime.now().strftime("%H:%M:%S")
    head = Text(f"{len(nodes)} nodes at {now}", style="bold")
    return Group(head, table, *lines), (groups, problems, trouble)


class _Opened:
    """The event stream is open (again): whatever happened meanwhile must be re-read."""


OPENED = _Opened()


def _pump(api: Client, updates: queue.Queue[object]) -> None:
    """status --watch's reader: events, OPENED, or the ClientError that lost the stream, on
    ``updates``; it reopens a lost stream every POLL, unless the server refused it."""
    while True:
        try:
            events = api.events(EVENTS_STREAM)
            updates.put(OPENED)
            for event in events:
                updates.put(event)
        except ClientError as error:
            updates.put(error)
            if error.status is not None and error.status < 500:
                return  # a server without the stream, or a token that may not read it: poll
        time.sleep(POLL)


def _watch_status(api: Client) -> None:
    """Redraw on events (a few times a second at most), on a gap, when the stream opens;
    every POLL when it cannot be had."""
    from rich.live import Live

    updates: queue.Queue[object] = queue.Queue()
    threading.Thread(target=_pump, args=(api, updates), daemon=True).start()
    nodes: list[dict[str, Any]] = []
    streaming, due, last_read, shown, cost = False, 0.0, 0.0, None, 0.0
    lost: str | None = None  # why there is no event stream
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    try:
        with live or contextlib.nullcontext():
            while True:
                if due is not None and time.monotonic() >= due:
                    trouble = f"no events ({lost}): re-read every {POLL:g} s" if lost else None
                    began = time.monotonic()
                    try:
                        nodes, failed = api.call("/api/v1/nodes"), False
                        cost = time.monotonic() - began
                    except ClientError as error:
                        trouble, failed = f"{error} (trying again every {POLL:g} s)", True
                    view, seen = _status_view(nodes, trouble)
                    if live is not None:
                        live.update(view, refresh=True)
                    elif seen != shown:  # a pipe or a log: a new view only when one differs
                        console.print(view)
                    shown, last_read = seen, time.monotonic()
                    due = None if streaming and not failed else last_read + POLL
                timeout = None if due is None else max(0.0, due - time.monotonic())
                try:
                    item = updates.get(timeout=timeout)
                except queue.Empty:
                    continue
                if item is OPENED or isinstance(item, ClientError):
                    streaming, due = item is OPENED, time.monotonic()
                    lost = None if streaming else str(item)
                elif due is None:  # an event or a gap: the nodes changed; re-read soon, but
                    due = last_read + max(COALESCE, LOAD_SHARE * cost)  # a big listing less often
    except KeyboardInterrupt:
        return


def event_line(event: dict[str, Any]) -> str:
    """One event for people: local time to the millisecond, node, kind, fields, message;
    everything that came over the network made printable."""
    at = datetime.fromtimestamp(float(event.get("time") or 0)).strftime("%H:%M:%S.%f")[:-3]
    node = printable(event.get("node") or "-", 64)
    kind = printable(event.get("kind") or "?", 32)
    fields = printable(_compact(event.get("fields") or {}), 400)
    message = printable(event.get("message") or "", 400)
    return " ".join(part for part in (at, f"{node:<8}", f"{kind:<8}", fields, message) if part)


def _show_event(event: ServerEvent, output: str) -> None:
    if event.event == "gap":
        if output == "json":
            click.echo(json.dumps({"kind": "gap"}))
        else:
            click.echo("-- events were lost here (the stream fell behind): `layerpy status` "
                       "shows where the nodes are now")  # fmt: skip
        return
    try:
        data = json.loads(event.data)
        if not isinstance(data, dict):
            raise ValueError("not an object")
    except ValueError:
        click.echo(f"layerpy watch: an event that is not a JSON object: "
                   f"{printable(event.data, 200)}", err=True)  # fmt: skip
        return
    click.echo(json.dumps(data) if output == "json" else event_line(data))


@main.command()
@click.argument("nodes", required=False)
@click.option(
    "--retry",
    is_flag=True,
    help="When the server goes away, reconnect and resume after the last event seen.",
)
@operator_api
@output_option()
def watch(api: Client, nodes: str | None, retry: bool, output: str) -> None:
    """Print the server's events as they come, one a line (-o json: one JSON object a
    line): every change of NODES (a hostlist; else of every node, and cluster-wide ones).
    Ctrl-C leaves; when the server goes away it says so and exits 1, unless --retry."""
    path = EVENTS_STREAM + (f"?nodes={quote(nodes, safe='[],')}" if nodes else "")
    last_id: str | None = None
    delay = 1.0
    try:
        while True:
            try:
                # after a restart the server answers an old Last-Event-ID with a gap
                events = api.events(path, last_id)
                delay = 1.0
                for event in events:
                    last_id = event.id or last_id
                    _show_event(event, output)
            except ClientError as error:
                if error.status is not None and error.status < 500:
                    raise  # refused: retrying would not change the answer
                if not retry:
                    _fail(f"watch: the server went away ({error}); --retry reconnects", 1)
                click.echo(f"layerpy watch: {error}; reconnecting in {delay:g} s", err=True)
                time.sleep(delay)
                delay = min(delay * 2, RETRY_LONGEST)
    except KeyboardInterrupt:
        return


@main.command()
@operator_api
@output_option()
def events(api: Client, output: str) -> None:
    """The recent identity events (bound, replaced, moved, conflict, claim) and operator
    actions, oldest first; `layerpy watch` follows every change live."""
    found = api.call("/api/v1/events")
    if output == "json":
        _print_json(found)
        return
    table = Table("time", "node", "kind", "message")
    for event in found:
        at = datetime.fromtimestamp(float(event["time"])).strftime("%Y-%m-%d %H:%M:%S")
        _row(table, at, event["node"] or "-", event["kind"], event["message"])
    console.print(table)


@main.command()
@operator_api
@output_option()
def unknown(api: Client, output: str) -> None:
    """Machines that asked to boot but are no node of the file (yet): their MAC for
    `layerpy bind NODE MAC`, what they claim, when they were seen."""
    machines = api.call("/api/v1/unknown")
    if output == "json":
        _print_json(machines)
        return
    table = Table("mac", "requests", "first seen", "last seen", "firmware", "claims", "conflict")
    for machine in machines:
        first, last = (datetime.fromtimestamp(float(machine[key])).strftime("%m-%d %H:%M:%S")
                       for key in ("first_seen", "last_seen"))  # fmt: skip
        _row(table, machine["mac"], machine["requests"], first, last, machine["firmware"] or "-",
             machine["claim"] or "-", machine["conflict"] or "-")  # fmt: skip
    console.print(table)


@main.command()
@operator_api
@output_option()
def cluster(api: Client, output: str) -> None:
    """The instances of the cluster (with [cluster] in the node file): their health, their
    segment and the nodes each owns; without [cluster], says this server is alone."""
    answer = api.call("/api/v1/cluster")
    if output == "json":
        _print_json(answer)
        return
    if not answer.get("cluster"):
        click.echo(printable(answer.get("message", "this server is a single instance")))
        return
    if answer["source"] != "etcd":
        click.echo(printable(answer["source"], 300), err=True)
    table = Table("instance", "health", "segment", "url", "version", "nodes")
    for row in cluster_rows(answer, time.time()):
        _row(table, *row)
    console.print(table)
    if answer["unowned"]:
        click.echo(f"unowned: {printable(fold(answer['unowned']), 1000)}")


def cluster_rows(answer: dict[str, Any], now: float) -> list[tuple[str, ...]]:
    """One row per instance: name (``*`` for the one answering), health, segment, URL,
    version, its nodes as a count and a hostlist."""
    rows = []
    for entry in answer["instances"]:
        if entry["alive"]:
            health = "alive"
            if "lease_fresh_for" in entry:
                fresh = entry["lease_fresh_for"]
                health = f"alive, lease fresh {fresh:g} s" if fresh else "lost etcd: not acting"
        elif entry["last_seen"] is not None:
            health = f"gone {now - entry['last_seen']:.0f} s ago"
        else:
            health = "gone"
        nodes = entry["nodes"]
        rows.append((
            entry["name"] + (" *" if entry["self"] else ""),
            health,
            entry["segment"] or ("-" if entry["segment"] is None else "all"),
            entry["url"] or "-",
            entry["version"] or "-",
            (f"{len(nodes)} {fold(nodes)}" if nodes else "0")
            + (" + the discovery pool" if entry.get("pools") else ""),
        ))  # fmt: skip
    return rows


@main.command("console")
@click.argument("node")
@click.option("--log", "show_log", is_flag=True, help="Print the captured log and exit.")
@click.option(
    "--lines", type=click.IntRange(min=1),
    help=f"With --log: this many last lines (default {LOG_LINES}).",
)  # fmt: skip
@click.option(
    "--bytes", "size", type=click.IntRange(min=1),
    help="With --log: the last this many bytes instead (the server keeps up to 2 MiB a node).",
)  # fmt: skip
@operator_api
def console_command(
    api: Client, node: str, show_log: bool, lines: int | None, size: int | None
) -> None:
    """Attach to NODE's serial console (Ctrl-] then . detaches), or print its log (--log).
    What the node prints reaches the terminal without the escape sequences that could
    retitle it, write the clipboard or type into it; colours and cursor moves stay."""
    from layerpy.terminal import harmless

    base = f"/api/v1/nodes/{quote(node, safe='')}/console"
    if show_log:
        if lines and size:
            _fail("give --lines or --bytes, not both")
        log = api.fetch(base + (f"?bytes={size}" if size else ""))
        sys.stdout.buffer.write(harmless(log if size else last_lines(log, lines or LOG_LINES)))
        sys.stdout.flush()
        return
    if lines or size:
        _fail("--lines and --bytes go with --log (attached, the server sends the recent tail)")
    try:
        ended = asyncio.run(_attach(api, node, base + "/attach"))
    except ClientError as error:
        if error.status in (404, 409):  # the log endpoint says why in words
            api.fetch(f"{base}?bytes=1")
        raise
    except KeyboardInterrupt:  # stdin is no terminal (else Ctrl-C went to the node)
        ended = None
    except asyncio.CancelledError:  # SIGTERM or SIGHUP, the terminal restored
        ended = "stopped by a signal"
    if ended is not None:
        _fail(ended, 1)


def last_lines(data: bytes, count: int) -> bytes:
    """The last ``count`` lines of ``data`` (the last one may be unfinished)."""
    pieces = data.split(b"\n")
    return b"\n".join(pieces[-count - 1 :] if pieces[-1] == b"" else pieces[-count:])


async def _attach(api: Client, node: str, path: str) -> str | None:
    """One console session; None when the operator detached, else why it ended."""
    from layerpy.terminal import DETACH_HINT, Session, raw_mode

    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    for stop in (signal.SIGTERM, signal.SIGHUP):  # end through the finally that restores
        loop.add_signal_handler(stop, task.cancel)
    async with api.websocket(path) as socket:
        session = Session(socket, sys.stdin.fileno(), sys.stdout.buffer)
        click.echo(f"[attached to {printable(node)} console; {DETACH_HINT} to detach]", err=True)
        with raw_mode(session.stdin) if session.raw else contextlib.nullcontext():
            detached = await session.run()
        if detached:
            click.echo(f"[detached from {printable(node)}]", err=True)
    return session.ended


def _values(values: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())


def _compact(value: object) -> str:
    """A value of the API's JSON on one line: key=value pairs for an object, commas for a
    list, '-' for null."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return " ".join(f"{key}={_compact(item)}" for key, item in value.items())
    if isinstance(value, list):
        return ", ".join(_compact(item) for item in value)
    return json.dumps(value)


def _row(table: Table, *cells: object) -> None:
    """A table row of text from the network: shown as is, never as markup or escapes."""
    table.add_row(*(Text(printable(cell)) for cell in cells))
