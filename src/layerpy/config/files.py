"""The [files."PATH"] tables: what each node gets inside its system image, and the
[groups.NAME.vars] and [nodes.NAME.vars] its templates see (read in nodes.py).

    [files."/etc/slurm/slurm.conf"]
    template = "templates/slurm.conf.j2"   # Jinja2, rendered per node on the server
    mode = "0644"                          # default 0644; secrets 0400
    owner = "slurm:slurm"                  # default root:root
    apply = "systemctl restart slurmd"     # run in the node's container after a change
    images = ["slurm"]                     # only nodes running these images,
    groups = ["compute"]                   # of these groups,
    nodes = "cn[001-004]"                  # with these names (all three optional)

    [files."/etc/munge/munge.key"]
    secret = "secrets/munge.key"           # the bytes as they are; never world-readable
"""

from __future__ import annotations

import errno
import os
import re
from typing import Any

from layerpy import hostlist
from layerpy.config import values
from layerpy.config.reading import Reader, open_to_all
from layerpy.config.records import Config, FileConfig, ImageConfig, NodeConfig
from layerpy.proto.agent import MAX_FILE, OWNER

FILE_KEYS = {"template", "secret", "mode", "owner", "apply", "images", "groups", "nodes"}


def read(
    r: Reader, data: dict[str, Any], images: dict[str, ImageConfig], nodes: dict[str, NodeConfig]
) -> dict[str, FileConfig]:
    files = {}
    groups = {node.group for node in nodes.values() if node.group}
    for path, prefix, get in r.named_tables(data, "files", FILE_KEYS):
        try:
            values.image_path(path)
        except ValueError as problem:
            r.problem(prefix, str(problem))
            continue
        template, secret = get("template", str, r.path), get("secret", str, r.path)
        if (template is None) == (secret is None):
            r.problem(prefix, "needs a template or a secret (one of them)")
            continue
        source = template or secret
        mode = get("mode", str, _mode, default=0o400 if secret else 0o644)
        owner = get("owner", str, _owner, default="root:root")
        apply = get("apply", str, values.command_line)
        chosen_images = get("images", list, values.string_list)
        chosen_groups = get("groups", list, values.string_list)
        chosen_nodes = get("nodes", str, hostlist.expand)
        chosen = {"images": chosen_images, "groups": chosen_groups, "nodes": chosen_nodes}
        known = {"images": set(images), "groups": groups, "nodes": set(nodes)}
        for key, names in chosen.items():
            unknown = sorted(set(names or ()) - known[key])
            if unknown:
                r.problem(f"{prefix}.{key}", f"names no such {key[:-1]}: {', '.join(unknown)}")
        if secret is not None and mode is not None and mode & 0o077:
            r.problem(
                f"{prefix}.mode", f"{mode:04o} lets others read a secret on the node (0400 or 0600)"
            )
        kept = [
            (image.name, top) for image in images.values() for top in image.persist
            if (chosen_images is None or image.name in chosen_images)
            and (path == top or path.startswith(top + "/") or top.startswith(path + "/"))
        ]  # fmt: skip
        if kept:
            r.problem(prefix, f"meets {kept[0][1]}, which image {kept[0][0]} keeps across "
                      "image changes (persist): the node's own copy would hide it")  # fmt: skip
        if not _source_ok(r, prefix, source, secret is not None):
            continue
        files[path] = FileConfig(
            path, source, secret is not None, mode if mode is not None else 0o644,
            owner or "root:root", apply,
            frozenset(chosen_images) if chosen_images is not None else None,
            frozenset(chosen_groups) if chosen_groups is not None else None,
            frozenset(chosen_nodes) if chosen_nodes is not None else None,
        )  # fmt: skip
    return files


def check_renders(r: Reader, config: Config) -> None:
    """Make every node's files: a template that fails for one node refuses the whole
    file, at load, not at that node's next boot."""
    from layerpy.files import render_problems

    for path, problem in render_problems(config).items():
        r.problem(f'files."{path}"', problem)


def _mode(value: str) -> int:
    if not re.fullmatch(r"0?[0-7]{3,4}", value) or int(value, 8) > 0o7777:
        raise ValueError(f'{value!r} must be an octal mode like "0644"')
    return int(value, 8)


def _owner(value: str) -> str:
    """user or user:group; the contract's pattern says what a node accepts."""
    owner = value if ":" in value else f"{value}:{value}"
    if not OWNER.fullmatch(owner):
        raise ValueError(f"{value!r} must be user or user:group (names or numbers)")
    return owner


def _source_ok(r: Reader, prefix: str, source: Any, secret: bool) -> bool:
    key = f"{prefix}.{'secret' if secret else 'template'}"
    try:
        info = source.stat()
        # a secret's bytes are read only when a node's files are made, not to check it
        text = source.read_bytes() if info.st_size <= MAX_FILE and not secret else b""
        if secret and not os.access(source, os.R_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as error:
        r.problem(key, f"cannot read {source}: {error.strerror}")
        return False
    if info.st_size > MAX_FILE:
        r.problem(key, f"{source} is over {MAX_FILE} bytes")
        return False
    if secret:
        if why := open_to_all(source, info.st_mode):
            r.problem(key, why)
            return False
        return True
    from jinja2 import TemplateSyntaxError

    from layerpy.files import compile_template

    try:
        compile_template(text.decode("utf-8"))
    except UnicodeDecodeError:
        r.problem(key, f"{source} is not UTF-8 text")
        return False
    except TemplateSyntaxError as error:
        r.problem(key, f"{source} line {error.lineno}: {error.message}")
        return False
    return True
