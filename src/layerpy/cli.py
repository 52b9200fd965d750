"""The ``layerpy`` command line."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from layerpy import __version__
from layerpy import install as installing
from layerpy.client import DEFAULT_SOCKET, TOKEN_VARIABLE, Client, ClientError
from layerpy.config import Config, ConfigError, load
from layerpy.config.starter import starter
from layerpy.host import host_problems, interfaces
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
    from layerpy.server import StartRefused, collector_paused
    from layerpy.server import serve as run_server

    with collector_paused():
        config = _load_or_exit(config_path)
    logging.basicConfig(
        level=logging.DEBUG if debug or config.server.log_requests else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    try:
        asyncio.run(run_server(config, state_dir=state_dir))
    except (OSError, StartRefused) as error:
        click.echo(f"layerpy serve: {error}", err=True)
        sys.exit(1)


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
def render(node: str, path: str | None, config_path: Path) -> None:
    """The files NODE gets (path, mode, owner, size, digest) and their revision, or PATH's
    content; a secret's bytes are never shown."""
    from layerpy.files import RenderError, files_for, revision

    config = _load_or_exit(config_path)
    if node not in config.nodes:
        _fail(f"{config.path} has no node {node}")
    try:
        made = files_for(config, node)
    except RenderError as error:
        _fail(str(error), 1)
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
def check(config_path: Path, show_all: bool, file_only: bool, quiet: bool) -> None:
    """Validate the node file and summarise it, then check this host can serve it (the
    interface carries server.address, the ports are free). Exit 2 when the file has a
    problem, 3 when only the host has one."""
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
    table = Table("node", "group", "ip", "mac")
    nodes = list(config.nodes.values())
    for node in nodes if show_all else nodes[:SHOWN]:
        _row(table, node.name, node.group or "-", node.ip or "(site DHCP)", node.mac or "-")
    console.print(table)
    if len(nodes) > SHOWN and not show_all:
        console.print(f"  … and {len(nodes) - SHOWN} more (layerpy check --all lists them)")


@main.command()
@operator_api
@click.option("--json", "as_json", is_flag=True, help="Print the raw JSON.")
def status(api: Client, as_json: bool) -> None:
    """Show every node's run state and the timeline of its current boot."""
    nodes = api.call("/api/v1/nodes")
    if as_json:
        click.echo(json.dumps(nodes, indent=2))  # JSON escapes control characters
        return
    columns = ("node", "mac", "ip", "hostname", "state", "boots", "timeline (s since boot start)")
    table = Table(*columns)
    for node in nodes:
        timeline = " ".join(f"{k}={v:g}" for k, v in node["timeline"].items())
        _row(table, node["name"], node["mac"] or "-", node["ip"] or "-", node["hostname"] or "-",
             node["run_state"], node["boots"], timeline)  # fmt: skip
    console.print(table)


@main.command()
@operator_api
def reload(api: Client) -> None:
    """Make the running server re-read its node file (all of it applies, or none of it)."""
    answer = api.call("/api/v1/reload", method="POST")
    if "problems" in answer:
        click.echo("\n".join(printable(problem, 1000) for problem in answer["problems"]), err=True)
        click.echo("reload refused; the running configuration stays in force", err=True)
        sys.exit(2)
    for key in ("added", "removed", "changed"):
        click.echo(f"{key:8} {', '.join(answer[key]) or '-'}")


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
def power(api: Client, action: str, nodes: str, force: bool) -> None:
    """Power NODES (a hostlist) on, off, cycle them, clear overrides, or show status.

    on and off change the desired state until `clear` or until the node file changes;
    the server then keeps the nodes so (a busy node is not powered off until free, and
    not cycled unless --force)."""
    body = {"nodes": nodes, "action": action, "force": force}
    answer = api.call("/api/v1/power", "POST", body)
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
def bind(api: Client, node: str, mac: str) -> None:
    """The machine with MAC is NODE from now on: confirms a machine's LLDP claim to a
    node's port, or names new hardware where no relay can vouch for it."""
    api.call("/api/v1/bind", "POST", {"node": node, "mac": mac})
    click.echo(f"{printable(node)} is {printable(mac)} from now on")


@main.command()
@operator_api
def plan(api: Client) -> None:
    """For each node: what is (dsc), what should be (cfg), and the engine's path between."""
    table = Table("node", "dsc", "cfg", "path")
    for entry in api.call("/api/v1/plan"):
        path = entry["path"]
        shown = path if isinstance(path, str) else " → ".join(path) or "(converged)"
        _row(table, entry["name"], _values(entry["dsc"]), _values(entry["cfg"]), shown)
    console.print(table)


@main.command()
@click.argument("node")
@operator_api
def explain(api: Client, node: str) -> None:
    """Why a node is as it is: cfg vs dsc, the mutation in flight, recent failures."""
    answer = api.call(f"/api/v1/nodes/{quote(node, safe='[],')}/explain")
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
@operator_api
def image_set(api: Client, nodes: str, name: str) -> None:
    """Run image NAME on NODES now (no reboot; busy nodes first drain), until
    `layerpy power clear NODES` or the node file changes."""
    answer = api.call("/api/v1/image", "POST", {"nodes": nodes, "image": name})
    for node, state in answer.items():
        click.echo(f"{node}: wants image {printable(state['image_wanted'])}")


@image.command("list")
@CONFIG_OPTION
@STATE_DIR_OPTION
def image_list(config_path: Path, state_dir: Path | None) -> None:
    """The images in the store, oldest first."""
    table = Table("digest", "source", "layers", "rootfs", "squashfs", "pulled")
    for found in _store(_load_or_exit(config_path), state_dir).list():
        squashfs = f"{found.squashfs_size:,}" if found.squashfs_size else "-"
        pulled = time.strftime("%Y-%m-%d %H:%M", time.localtime(found.pulled_at))
        _row(table, found.digest[:19], found.source, found.layers, f"{found.rootfs_size:,}",
             squashfs, pulled)  # fmt: skip
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
def token_list(config_path: Path, state_dir: Path | None) -> None:
    """The tokens: names, scopes and when they were made (never the secrets)."""
    table = Table("name", "scope", "created")
    for record in _tokens(config_path, state_dir).records():
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


def _values(values: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in values.items())


def _row(table: Table, *cells: object) -> None:
    """A table row of text from the network: shown as is, never as markup or escapes."""
    table.add_row(*(Text(printable(cell)) for cell in cells))
