"""The agent <-> server contract, in one place: imported by the minOS agent and the server.

Observations flow up in a :class:`Report`, intent flows down in an :class:`Answer` (the
heartbeat, the :class:`ImageSpec` to run, the node's own files as a :class:`FilesSpec` of
digests whose bytes it fetches from ``FILES_PATH``, and for a machine booted to be
discovered the :class:`Identity` it carries on as). The kernel command line
(:class:`Cmdline`) hands the agent its server, name and token. Every record validates what
it receives and names the field at fault; every JSON field name of the contract is spelled
here and nowhere else (a record's field names *are* its JSON keys). Standard library only:
it runs in the minOS.

The contract carries ``PROTOCOL`` (major.minor). A peer that meets another major version
says so in one line and ignores the message; a minor version only adds optional fields.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from enum import StrEnum
from typing import Any

from layerpy.proto import beat
from layerpy.proto import platform as platforms

# 1.1: files and persistent paths; 1.2: the answer's servers; 1.3: the report's platform and
# secure_boot; 1.4: the answer's beat (datagram heartbeats, layerpy.proto.beat)
PROTOCOL = "1.4"
REPORT_PATH = "/api/v1/agent/report"
FILES_PATH = "/api/v1/agent/files/"  # + a file's digest: one of the node's own files
HEARTBEAT = 5.0  # seconds between reports unless the node file says otherwise
LLDP_WAIT = 35.0  # seconds the agent listens for the switch per round: one 30 s interval + slack
MAX_TEXT = 500  # characters kept of free text (errors, names) from the other side
MAX_TIMELINE = 16  # entries in an agent's timeline
MAX_FILES = 256  # files a node gets; paths an image keeps across image changes
MAX_FILE = 1 << 20  # bytes of one of a node's files (a template, a secret, a rendered file)
MAX_SERVERS = 8  # instances an agent knows for its segment

_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_TOKEN = re.compile(r"[A-Za-z0-9_=-]{1,128}")
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_REVISION = re.compile(r"[0-9a-f]{16}")
_DISK = re.compile(r"/dev/[A-Za-z0-9/_.-]{1,60}|LABEL=[A-Za-z0-9_.-]{1,16}")
OWNER = re.compile(r"(?:[a-z_][a-z0-9_-]{0,31}|\d{1,9}):(?:[a-z_][a-z0-9_-]{0,31}|\d{1,9})")
_IPV4 = re.compile(r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)")
# a server's base URL: http(s), a host name or address (IPv6 in brackets), a port, a plain
# path; no credentials, query or fragment (and no comma: the command line's separator)
_SERVER = re.compile(
    r"https?://([A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
    r"(:[1-9][0-9]{0,4})?(/[A-Za-z0-9._~/%-]{0,200})?"
)


def is_disk(value: str) -> bool:
    """A node's disk as the node file and the command line name it: /dev/... or LABEL=..."""
    return bool(_DISK.fullmatch(value)) and ".." not in value


class ContractError(ValueError):
    """A message that breaks the contract; the text names the field at fault."""


class ProtocolMismatch(ContractError):
    """The peer speaks another major version of the contract; ``node`` and ``token`` are
    who it claims to be (unchecked)."""

    def __init__(self, message: str, node: str | None = None, token: str | None = None) -> None:
        super().__init__(message)
        self.node, self.token = node, token


class ImageState(StrEnum):
    """A node's system image. The agent reports none..error; ``unknown`` (nothing heard
    since the last power change) and ``stale`` (active, but not the digest the node file
    wants) are the server's readings of those reports."""

    UNKNOWN = "unknown"
    NONE = "none"
    PULLING = "pulling"
    ACTIVE = "active"
    UPDATING = "updating"
    ERROR = "error"
    STALE = "stale"


class Milestone(StrEnum):
    """The agent's own timeline of a boot (uptime seconds), reported in ``Report.timeline``."""

    AGENT_START = "agent_start"
    NIC_UP = "nic_up"
    IP_ACQUIRED = "ip_acquired"
    HELLO = "hello"
    IDENTITY = "identity"  # when a discovered machine became its node


class Event(StrEnum):
    """Why a report was sent: the first of a boot, a changed observation, or the beat."""

    HELLO = "hello"
    CHANGE = "change"
    HEARTBEAT = "heartbeat"


# -- field checks: each takes the value and where it is, returns it clean or raises ---------

Check = Callable[[Any, str], Any]


def _kind(value: Any, kind: type | tuple[type, ...], what: str, where: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ContractError(f"{where} must be {what}, not {type(value).__name__}")
    return value


def _pattern(regex: re.Pattern[str], what: str) -> Check:
    def check(value: Any, where: str) -> str:
        if not regex.fullmatch(_kind(value, str, "a string", where)):
            raise ContractError(f"{where} is not {what}: {value[:40]!r}")
        return value

    return check


def _text(value: Any, where: str) -> str:
    """Free text: printable, one line, bounded (it reaches logs and terminals)."""
    text = _kind(value, str, "a string", where)[:MAX_TEXT]
    if text.isprintable():  # (the common case: nothing to replace)
        return text
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _number(low: float, high: float) -> Check:
    def check(value: Any, where: str) -> float:
        number = _kind(value, (int, float), "a number", where)
        if not low <= number <= high:
            raise ContractError(f"{where} must lie in {low:g}..{high:g}, not {number}")
        return float(number)

    return check


def _integer(value: Any, where: str) -> int:
    number = _kind(value, int, "an integer", where)
    if not 0 <= number < 2**63:
        raise ContractError(f"{where} must be a non-negative integer, not {number}")
    return number


def _boolean(value: Any, where: str) -> bool:
    return _kind(value, bool, "true or false", where)


def _optional(check: Check) -> Check:
    return lambda value, where: None if value is None else check(value, where)


def _choice(enum: type[StrEnum]) -> Check:
    def check(value: Any, where: str) -> StrEnum:
        text = _kind(value, str, "a string", where)  # outside the try: a ContractError is
        try:  # a ValueError too, and must not be taken for an unknown choice
            return enum(text)
        except ValueError:
            known = ", ".join(enum)
            raise ContractError(f"{where} must be one of {known}, not {text[:40]!r}") from None

    return check


def _platform(value: Any, where: str) -> str:
    """One of the platforms an agent names (platforms.KNOWN), as it names them."""
    text = _kind(value, str, "a string", where)
    if text not in platforms.KNOWN:
        known = ", ".join(sorted(platforms.KNOWN))
        raise ContractError(f"{where} must be one of {known}, not {text[:40]!r}")
    return text


def _record(cls: type) -> Check:
    return lambda value, where: decode(cls, value, where)


_seconds = _optional(_number(0, 1e9))


def _timeline(value: Any, where: str) -> dict[str, float | None]:
    entries = _kind(value, dict, "an object", where)
    if len(entries) > MAX_TIMELINE:
        raise ContractError(f"{where} has more than {MAX_TIMELINE} entries")
    return {_text(k, where)[:40]: _seconds(v, f"{where}.{k[:40]}") for k, v in entries.items()}


def _object(value: Any, where: str) -> dict[str, Any]:
    return _kind(value, dict, "an object", where)


def _words(value: Any, where: str) -> tuple[str, ...] | None:
    items = _kind(value, (list, tuple), "a list", where)
    if not items or not all(isinstance(item, str) for item in items):
        raise ContractError(f"{where} must be a non-empty list of strings")
    return tuple(items)


def _records(cls: type) -> Check:
    """A bounded list of records, as a tuple."""

    def check(value: Any, where: str) -> tuple[Any, ...]:
        items = _kind(value, (list, tuple), "a list", where)
        if len(items) > MAX_FILES:
            raise ContractError(f"{where} has more than {MAX_FILES} entries")
        return tuple(decode(cls, item, f"{where}[{i}]") for i, item in enumerate(items))

    return check


def _path(value: Any, where: str) -> str:
    """An absolute, normalised path of something inside an image (no .., no //)."""
    path = _kind(value, str, "a string", where)
    parts = path.split("/")
    if (
        not 1 < len(path) <= 255 or parts[0] or not all(parts[1:])
        or any(p in (".", "..") for p in parts) or not path.isprintable()
    ):  # fmt: skip
        raise ContractError(f"{where} is not an absolute, normalised path: {path[:60]!r}")
    return path


def _paths(value: Any, where: str) -> tuple[str, ...]:
    items = _kind(value, (list, tuple), "a list", where)
    if len(items) > MAX_FILES:
        raise ContractError(f"{where} has more than {MAX_FILES} entries")
    return tuple(_path(item, f"{where}[{i}]") for i, item in enumerate(items))


def _command_line(value: Any, where: str) -> str:
    """A shell command line: one printable line, whole (it is run, not shown)."""
    line = _kind(value, str, "a string", where)
    if not line.isprintable() or not 0 < len(line) <= 1000:
        raise ContractError(f"{where} must be one printable line of at most 1000 characters")
    return line


def _file_size(value: Any, where: str) -> int:
    size = _integer(value, where)
    if size > MAX_FILE:
        raise ContractError(f"{where} is over {MAX_FILE} bytes: {size}")
    return size


def _mode(value: Any, where: str) -> int:
    mode = _integer(value, where)
    if mode > 0o7777:
        raise ContractError(f"{where} is not a file mode: {mode:o}")
    return mode


def _ip(value: Any, where: str) -> str:
    """An IPv4 address, or "" for a node that has none yet."""
    return value if value == "" else _pattern(_IPV4, "an IPv4 address")(value, where)


def server_url(value: Any, where: str) -> str:
    """A server's base URL, without the trailing slash; strict, as a forged one reaches
    every request the agent makes."""
    url = _kind(value, str, "a string", where)
    match = _SERVER.fullmatch(url)
    if not match or int((match.group(3) or ":0")[1:]) > 65535:
        raise ContractError(f"{where} is not an http(s) URL of a server: {url[:60]!r}")
    return url.rstrip("/")


def _servers(value: Any, where: str) -> tuple[str, ...]:
    """1 to ``MAX_SERVERS`` distinct server URLs, in order."""
    items = _kind(value, (list, tuple), "a list", where)
    if not 0 < len(items) <= MAX_SERVERS:
        raise ContractError(f"{where} must name 1 to {MAX_SERVERS} servers, not {len(items)}")
    return tuple(dict.fromkeys(server_url(item, f"{where}[{i}]") for i, item in enumerate(items)))


def _mac(value: Any, where: str) -> str:
    return _pattern(_MAC, "a MAC address like 52:54:00:12:34:56")(
        _kind(value, str, "a string", where).lower(), where
    )


_node_name = _pattern(_NAME, "a node name")


def _token(value: Any, where: str) -> str:
    """A token; never echoed in the error (a mangled one may still hold a real token)."""
    if not _TOKEN.fullmatch(_kind(value, str, "a string", where)):
        raise ContractError(f"{where} is not a token ({len(value)} characters, not all of "
                            "A-Z a-z 0-9 _ = -, or too many)")  # fmt: skip
    return value


def _field(check: Check, default: Any = MISSING) -> Any:
    """A contract field: how it is checked, and its default when it may be left out."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(), metadata={"check": check})
    return field(default=default, metadata={"check": check})


def decode(cls: type, obj: Any, where: str) -> Any:
    """A record from JSON: every field checked, unknown keys ignored (a newer minor)."""
    obj = _kind(obj, dict, "an object", where)
    values = {}
    for name, check, required, at in _plan(cls, where):
        if name in obj:
            values[name] = check(obj[name], at)
        elif required:
            raise ContractError(f"{at} is missing")
    return cls(**values)


@functools.lru_cache(maxsize=1024)
def _plan(cls: type, where: str) -> tuple[tuple[str, Check, bool, str], ...]:
    """How decode reads a record's fields at `where`: each one's name, check, whether it
    is required, and where it is (made once, not per record: a report per heartbeat)."""
    return tuple(
        (f.name, f.metadata["check"], f.default is MISSING and f.default_factory is MISSING,
         f"{where}.{f.name}")
        for f in fields(cls)
    )  # fmt: skip


def encode(value: Any) -> Any:
    """JSON for a record (or anything holding records)."""
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: encode(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple | list):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {key: encode(item) for key, item in value.items()}
    return str(value) if isinstance(value, StrEnum) else value


def _check_protocol(obj: Any, what: str) -> None:
    if not isinstance(obj, dict):
        raise ContractError(f"{what} must be a JSON object")
    theirs = obj.get("protocol")
    if not isinstance(theirs, str) or theirs.split(".")[0] != PROTOCOL.split(".")[0]:
        node, token = (v if isinstance(v := obj.get(k), str) else None for k in ("node", "token"))
        raise ProtocolMismatch(
            f"{what} speaks layerpy agent protocol {str(theirs)[:20]}, this side {PROTOCOL}: "
            "run the same layerpy release on the server and in the minOS",
            node,
            token,
        )


# -- the records ------------------------------------------------------------------------


@dataclass(frozen=True)
class Lldp:
    """The switch port the node heard advertised: where it is plugged in."""

    chassis_id: str = _field(_text)
    port_id: str = _field(_text)
    chassis_subtype: int | None = _field(_optional(_integer), None)
    port_subtype: int | None = _field(_optional(_integer), None)
    system_name: str | None = _field(_optional(_text), None)
    port_description: str | None = _field(_optional(_text), None)
    ttl: int | None = _field(_optional(_integer), None)
    heard_at: float | None = _field(_optional(_number(0, 1e9)), None)  # agent uptime


@dataclass(frozen=True)
class ImageStatus:
    """The agent's image, as it reports it."""

    state: ImageState = _field(_choice(ImageState), ImageState.NONE)
    name: str | None = _field(_optional(_text), None)
    digest: str | None = _field(_optional(_text), None)
    error: str | None = _field(_optional(_text), None)
    container_pid: int | None = _field(_optional(_integer), None)
    since: float | None = _field(_optional(_number(0, 1e9)), None)  # agent uptime


@dataclass(frozen=True)
class FilesStatus:
    """The node's files, as the agent reports them: the revision in place in the running
    image, and why the wanted one is not (or its ``apply`` failed)."""

    revision: str | None = _field(_optional(_pattern(_REVISION, "a files revision")), None)
    error: str | None = _field(_optional(_text), None)


@dataclass(frozen=True)
class Report:
    """What an agent tells the server, at hello, on a change and every heartbeat."""

    node: str = _field(_node_name)
    token: str = _field(_token)
    mac: str = _field(_mac)
    ip: str = _field(_ip)
    boot_id: str = _field(_pattern(re.compile(r"[0-9a-f-]{0,64}"), "a boot id"))
    seq: int = _field(_integer)
    event: Event = _field(_choice(Event))
    hostname: str | None = _field(_optional(_text), None)
    busy: bool = _field(_boolean, False)
    uptime: float | None = _field(_optional(_number(0, 1e9)), None)
    timeline: dict[str, float | None] = _field(_timeline, {})
    lldp: Lldp | None = _field(_optional(_record(Lldp)), None)
    lldp_ignored: int = _field(_integer, 0)
    agent_version: str | None = _field(_optional(_text), None)
    image: ImageStatus = _field(_record(ImageStatus), ImageStatus())
    files: FilesStatus = _field(_record(FilesStatus), FilesStatus())
    persist: str | None = _field(_optional(_text), None)  # where persistent paths are kept
    # whether the firmware booted the node with Secure Boot on (1.3); None: not said (an
    # older agent, or UEFI variables it cannot read)
    secure_boot: bool | None = _field(_optional(_boolean), None)
    # the node's OCI platform (1.3), which image of a multi-architecture index it runs; an
    # older agent sends none: it ran only on amd64
    platform: str = _field(_platform, platforms.DEFAULT)
    protocol: str = _field(_text, PROTOCOL)

    @classmethod
    def from_json(cls, obj: Any) -> Report:
        """Raises ProtocolMismatch for another major version, ContractError otherwise."""
        _check_protocol(obj, "the report")
        return decode(cls, obj, "report")


@dataclass(frozen=True)
class ImageSpec:
    """The system image an agent is told to run: where to fetch it, how to check and run it."""

    name: str = _field(_text)
    digest: str = _field(_pattern(_DIGEST, "a sha256: digest"))
    url: str = _field(_pattern(re.compile(r"https?://[\x21-\x7e]{1,400}"), "an http URL"))
    format: str = _field(_pattern(re.compile(r"squashfs|tar"), "squashfs or tar"))
    sha256: str = _field(_pattern(_SHA256, "64 hex digits"))
    size: int | None = _field(_optional(_integer), None)
    config: dict[str, Any] = _field(_object, {})  # the OCI image config (Env, Cmd, ...)
    systemd: bool = _field(_boolean, False)
    command: tuple[str, ...] | None = _field(_optional(_words), None)
    persist: tuple[str, ...] = _field(_paths, ())  # kept by the node across image changes


@dataclass(frozen=True)
class FileSpec:
    """One file the node places into its image; its bytes come from ``FILES_PATH`` +
    digest and are checked against it."""

    path: str = _field(_path)
    digest: str = _field(_pattern(_DIGEST, "a sha256: digest"))
    size: int = _field(_file_size)
    mode: int = _field(_mode)
    owner: str = _field(_pattern(OWNER, "user:group"))  # names are the image's
    apply: str | None = _field(_optional(_command_line), None)  # run in the container


@dataclass(frozen=True)
class FilesSpec:
    """All of a node's files, and one revision naming them (it changes with any byte)."""

    revision: str = _field(_pattern(_REVISION, "a files revision"))
    files: tuple[FileSpec, ...] = _field(_records(FileSpec), ())


@dataclass(frozen=True)
class Identity:
    """The node a discovered machine carries on as, with that node's boot token."""

    node: str = _field(_node_name)
    token: str = _field(_token)


def _port(value: Any, where: str) -> int:
    port = _integer(value, where)
    if not 0 < port < 65536:
        raise ContractError(f"{where} is not a port: {port}")
    return port


def _beat_key(value: Any, where: str) -> str:
    """A beat key; never echoed in the error."""
    if not beat.is_key(value):
        raise ContractError(f"{where} is not a beat key (32 hex digits)")
    return value


@dataclass(frozen=True)
class BeatOffer:
    """Where and how the agent may send unchanged heartbeats as datagrams (1.4): the UDP
    port on its server's host, and this boot's key to sign them with."""

    port: int = _field(_port)
    key: str = _field(_beat_key)


@dataclass(frozen=True)
class Answer:
    """The server's reply to a report: the desired state for the agent."""

    node: str = _field(_node_name)
    heartbeat: float = _field(_number(0.1, 3600), HEARTBEAT)
    image: ImageSpec | None = _field(_optional(_record(ImageSpec)), None)
    files: FilesSpec | None = _field(_optional(_record(FilesSpec)), None)  # None: no word
    identity: Identity | None = _field(_optional(_record(Identity)), None)
    # every instance serving the node's segment (1.2): who the agent moves to when its own
    # stops answering; None: no word, keep the list it has
    servers: tuple[str, ...] | None = _field(_optional(_servers), None)
    # datagram heartbeats (1.4); None: report every beat over HTTP
    beat: BeatOffer | None = _field(_optional(_record(BeatOffer)), None)
    protocol: str = _field(_text, PROTOCOL)

    @classmethod
    def from_json(cls, obj: Any) -> Answer:
        _check_protocol(obj, "the server's answer")
        return decode(cls, obj, "answer")


# -- a node's own files ---------------------------------------------------------------------

NODE_AUTH_SCHEME = "Layerpy-Node"  # Authorization: Layerpy-Node <node> <boot token>


def node_authorization(identity: Identity) -> str:
    """The Authorization header value a node sends for the files only it may have (its
    image, its own files): the server checks the token like a report's."""
    return f"{NODE_AUTH_SCHEME} {identity.node} {identity.token}"


def parse_node_authorization(header: str | None) -> Identity | None:
    """The identity a node claims in its Authorization header (unchecked), or None."""
    scheme, node, token = [*(header or "").split(" "), "", ""][:3]
    if scheme != NODE_AUTH_SCHEME:
        return None
    try:
        return decode(Identity, {"node": node, "token": token}, "authorization")
    except ContractError:
        return None


# -- the kernel command line --------------------------------------------------------------


def split_cmdline(text: str) -> list[str]:
    """Split like the kernel does: whitespace separates, double quotes group (shlex would
    do, but costs an import the initramfs has to carry)."""
    words: list[str] = []
    cur: list[str] = []
    quoted = have = False
    for ch in text:
        if ch == '"':
            quoted, have = not quoted, True
        elif ch.isspace() and not quoted:
            if have:
                words.append("".join(cur))
            cur, have = [], False
        else:
            cur.append(ch)
            have = True
    if have:
        words.append("".join(cur))
    return words


def normalize_mac(value: str) -> str:
    """``aa:bb:cc:dd:ee:ff`` for a MAC in iPXE's BOOTIF (``01-`` is the ARP hardware type,
    Ethernet) or any common spelling; "" for anything else."""
    raw = value.strip().lower().replace("-", ":")
    parts = raw.split(":")
    if len(parts) == 7 and parts[0] == "01":
        parts = parts[1:]
    if len(parts) == 1 and len(raw) == 12:
        parts = [raw[i : i + 2] for i in range(0, 12, 2)]
    if len(parts) != 6 or not all(re.fullmatch(r"[0-9a-f]{1,2}", p) for p in parts):
        return ""
    return ":".join(f"{int(p, 16):02x}" for p in parts)


@dataclass
class Cmdline:
    """The minOS's settings, all from the kernel command line (like Kraken's ``kraken.*``):
    the agent needs no config file and no fetched state to start. Parsing never fails:
    ``problems`` says what is missing or ignored.

    ``layerpy.server=`` names every instance serving the node's segment, comma-separated
    (one URL is the whole of it with a single server): ``server`` is the first,
    ``servers`` all of them in order."""

    server: str = ""
    node: str = ""
    token: str = ""
    bootif: str = ""  # the MAC the firmware booted from
    heartbeat: float = HEARTBEAT
    lldp_wait: float = LLDP_WAIT  # 0 turns LLDP off
    persist: str = ""  # the disk for persistent paths (/dev/... or LABEL=...), "" for RAM
    params: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    servers: tuple[str, ...] = ()  # () is (server,)

    def __post_init__(self) -> None:
        """``server`` is always the first of ``servers``; either may be given."""
        self.servers = self.servers or ((self.server,) if self.server else ())
        self.server = self.servers[0] if self.servers else ""

    def format(self) -> str:
        """The words for the kernel command line (values are checked names, URLs, tokens)."""
        words = [
            f"layerpy.server={','.join(self.servers)}",
            f"layerpy.node={self.node}",
            f"layerpy.token={self.token}",
            f"layerpy.heartbeat={self.heartbeat:g}",
        ]
        if self.lldp_wait != LLDP_WAIT:
            words.append(f"layerpy.lldp_wait={self.lldp_wait:g}")
        if self.persist:
            words.append(f"layerpy.persist={self.persist}")
        if self.bootif:
            words.append("BOOTIF=01-" + self.bootif.replace(":", "-"))
        return " ".join(words)

    @classmethod
    def parse(cls, text: str) -> Cmdline:
        """The last occurrence of a key wins, as in the kernel."""
        params: dict[str, str] = {}
        for word in split_cmdline(text):
            key, sep, value = word.partition("=")
            if sep:
                params[key] = value
            else:
                params.setdefault(key, "")
        get = params.get
        line = cls(
            node=get("layerpy.node", ""),
            token=get("layerpy.token", ""),
            bootif=normalize_mac(get("BOOTIF", "")),
            params=params,
        )
        line._parse_servers(get("layerpy.server", ""))
        if not line.node:
            line.problems.append("layerpy.node= is missing")
        if "BOOTIF" in params and not line.bootif:
            line.problems.append(f"BOOTIF={params['BOOTIF']} is not a MAC address")
        persist = get("layerpy.persist", "")
        if is_disk(persist):
            line.persist = persist
        elif persist:
            line.problems.append(f"layerpy.persist={persist[:70]} is no disk; keeping state in RAM")
        for key, low in (("heartbeat", 0.1), ("lldp_wait", 0.0)):
            raw = get(f"layerpy.{key}")
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                value = -1.0
            if low <= value <= 3600:
                setattr(line, key, value)
            else:
                line.problems.append(f"layerpy.{key}={raw} is not a number of seconds")
        return line

    def _parse_servers(self, raw: str) -> None:
        """Keep every valid URL of the first ``MAX_SERVERS``; say what was dropped."""
        if not raw:
            self.problems.append("layerpy.server= is missing")
            return
        words = raw.split(",")
        if len(words) > MAX_SERVERS:
            self.problems.append(f"layerpy.server= names {len(words)} servers; "
                                 f"keeping the first {MAX_SERVERS}")  # fmt: skip
        kept: list[str] = []
        for word in words[:MAX_SERVERS]:
            try:
                kept.append(server_url(word, "layerpy.server"))
            except ContractError:
                why = "is not an http:// URL (nor https://) of a host, port and path only"
                self.problems.append(f"layerpy.server={word[:70]!r} {why}; dropped")
        self.servers = tuple(dict.fromkeys(kept))
        self.server = self.servers[0] if self.servers else ""

    @property
    def ok(self) -> bool:
        """Server and node are present and sane; a bad BOOTIF or heartbeat is not fatal."""
        return bool(self.node) and bool(self.servers)

    @property
    def report_url(self) -> str:
        return self.server + REPORT_PATH
