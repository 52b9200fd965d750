"""Read-only TFTP without I/O: packet codec, one state machine per read, path policy.

RFC 1350 (transfers), 2347 (option negotiation), 2348 (blksize), 2349 (timeout, tsize) and
7440 (windowsize). The asyncio adapter feeds datagrams and timer expiries in and sends the
packets that come back; nothing here touches a socket or a clock, and only `safe_path`
looks at the filesystem.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Protocol


class Opcode(IntEnum):
    RRQ = 1
    WRQ = 2
    DATA = 3
    ACK = 4
    ERROR = 5
    OACK = 6


class ErrorCode(IntEnum):
    NOT_DEFINED = 0
    FILE_NOT_FOUND = 1
    ACCESS_VIOLATION = 2
    DISK_FULL = 3
    ILLEGAL_OPERATION = 4
    UNKNOWN_TID = 5
    FILE_EXISTS = 6
    NO_SUCH_USER = 7
    BAD_OPTIONS = 8


class TftpError(Exception):
    """A refusal that becomes an ERROR packet for the peer."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def packet(self) -> bytes:
        return encode(Error(self.code, self.message))


class Malformed(TftpError):
    """Bytes that are not a TFTP packet: dropped, never answered."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.ILLEGAL_OPERATION, message)


@dataclass(frozen=True)
class Request:
    opcode: Opcode  # RRQ or WRQ
    filename: str
    mode: str
    options: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Data:
    block: int
    payload: bytes


@dataclass(frozen=True)
class Ack:
    block: int


@dataclass(frozen=True)
class Error:
    code: int
    message: str


@dataclass(frozen=True)
class OAck:
    options: dict[str, str]


Packet = Request | Data | Ack | Error | OAck

# Names travel as bytes; surrogateescape maps any byte sequence to str and back unchanged,
# the way the filesystem layer does.
_ENC = ("utf-8", "surrogateescape")
_HEAD = struct.Struct("!HH")
_ACK, _DATA = Opcode.ACK.to_bytes(2, "big"), int(Opcode.DATA)


def _strings(body: bytes) -> list[str]:
    if not body.endswith(b"\0"):
        raise Malformed("string field is not NUL-terminated")
    fields = body[:-1].split(b"\0")
    # Some PXE ROMs pad requests with extra NULs; empty trailing fields carry nothing.
    while len(fields) > 2 and not fields[-1]:
        fields.pop()
    return [f.decode(*_ENC) for f in fields]


def _options(fields: list[str]) -> dict[str, str]:
    if len(fields) % 2:
        raise Malformed("option without a value")
    return {name.lower(): value for name, value in zip(fields[::2], fields[1::2], strict=True)}


def decode(packet: bytes) -> Packet:
    """Parse one datagram; anything that is not a well-formed packet raises Malformed."""
    if len(packet) < 2:
        raise Malformed(f"{len(packet)}-byte datagram")
    try:
        opcode = Opcode(int.from_bytes(packet[:2], "big"))
    except ValueError:
        raise Malformed(f"unknown opcode {packet[0] << 8 | packet[1]}") from None
    body = packet[2:]
    if opcode in (Opcode.RRQ, Opcode.WRQ):
        fields = _strings(body)
        if len(fields) < 2 or not fields[0]:
            raise Malformed("request without file name or mode")
        return Request(opcode, fields[0], fields[1].lower(), _options(fields[2:]))
    if opcode == Opcode.OACK:
        return OAck(_options(_strings(body)) if body else {})
    if len(body) < 2:
        raise Malformed(f"truncated {opcode.name}")
    number = int.from_bytes(body[:2], "big")
    if opcode == Opcode.DATA:
        return Data(number, body[2:])
    if opcode == Opcode.ACK:
        if len(body) != 2:
            raise Malformed(f"{len(packet)}-byte ACK")
        return Ack(number)
    message = body[2:].split(b"\0", 1)[0]
    return Error(number, message.decode("utf-8", "replace"))


def _join(fields: list[str]) -> bytes:
    return b"".join(f.encode(*_ENC) + b"\0" for f in fields)


def encode(packet: Packet) -> bytes:
    if isinstance(packet, Request):
        pairs = [s for item in packet.options.items() for s in item]
        return packet.opcode.to_bytes(2, "big") + _join([packet.filename, packet.mode, *pairs])
    if isinstance(packet, Data):
        return _HEAD.pack(Opcode.DATA, packet.block & 0xFFFF) + packet.payload
    if isinstance(packet, Ack):
        return _HEAD.pack(Opcode.ACK, packet.block & 0xFFFF)
    if isinstance(packet, Error):
        return _HEAD.pack(Opcode.ERROR, packet.code) + _join([packet.message])
    pairs = [s for item in packet.options.items() for s in item]
    return Opcode.OACK.to_bytes(2, "big") + _join(pairs)


def parse_request(datagram: bytes) -> Request:
    """The request in a datagram sent to the listen port; anything else is Malformed."""
    request = decode(datagram)
    if not isinstance(request, Request):
        raise Malformed(f"{type(request).__name__} sent to the listen port")
    return request


def check_request(request: Request) -> None:
    """Refuse what a read-only octet/netascii server cannot serve."""
    if request.opcode == Opcode.WRQ:
        raise TftpError(ErrorCode.ACCESS_VIOLATION, "read-only server")
    if request.mode not in ("octet", "netascii"):
        raise TftpError(ErrorCode.ILLEGAL_OPERATION, f"unsupported mode {request.mode!r}")


def safe_path(root: Path, requested: str) -> Path:
    """The regular file under root that `requested` names, or a TftpError.

    A leading "/" means "from root" (PXE ROMs often ask for "/ipxe.efi"); ".." is refused
    outright, and symlinks may point anywhere inside root but never out of it.
    """
    if "\0" in requested:
        raise TftpError(ErrorCode.ACCESS_VIOLATION, "NUL in file name")
    parts = [p for p in requested.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise TftpError(ErrorCode.ACCESS_VIOLATION, "'..' in file name")
    base = root.resolve()
    try:
        path = base.joinpath(*parts).resolve(strict=True)
    except (OSError, RuntimeError):  # RuntimeError: symlink loop
        raise TftpError(ErrorCode.FILE_NOT_FOUND, "file not found") from None
    if not path.is_relative_to(base):
        raise TftpError(ErrorCode.ACCESS_VIOLATION, "outside the root")
    if not path.is_file():
        raise TftpError(ErrorCode.ACCESS_VIOLATION, "not a regular file")
    return path


def _number(options: dict[str, str], name: str, low: int, high: int) -> int | None:
    """An option's integer value, or None when absent or out of range (so: declined)."""
    value = options.get(name, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 6):
        return None
    return int(value) if low <= int(value) <= high else None


class Content(Protocol):
    """What a transfer sends: its length, and the bytes of a span of it. ``bytes`` is
    one; the server passes a file read block by block, so a transfer holds no more of
    it than the packets in flight."""

    def __len__(self) -> int: ...
    def __getitem__(self, span: slice, /) -> bytes: ...


class Transfer:
    """One read, from the request to the last ACK.

    Blocks are counted from 1 without limit; only the wire carries them modulo 65536, so a
    file longer than 65535 blocks wraps to block 0 like tftp-hpa and iPXE expect. Block 0
    stands for the OACK. `receive` and `expire` return the packets to send; the caller
    (re)starts its timer (`timeout` seconds) whenever they return any and stops once
    `state` leaves "open".
    """

    def __init__(
        self,
        request: Request,
        data: Content,
        *,
        timeout: float = 1.0,
        retries: int = 5,
        max_blksize: int = 65464,
        max_windowsize: int = 64,
    ) -> None:
        if request.mode == "netascii":  # the caller keeps such files small
            whole = data[0 : len(data)]
            data = whole.replace(b"\r", b"\r\0").replace(b"\n", b"\r\n")
        self.size = len(data)
        self._data = data
        self.retries = retries
        self.state = "open"  # then "done", "failed", or "sized" (the client took the size only)
        self.reason = ""
        self.blksize, self.windowsize, self.timeout = 512, 1, timeout
        opts, accepted = request.options, {}
        if (value := _number(opts, "blksize", 8, 65464)) is not None:
            self.blksize = min(value, max_blksize)
            accepted["blksize"] = str(self.blksize)
        if (value := _number(opts, "windowsize", 1, 65535)) is not None:
            self.windowsize = min(value, max_windowsize)
            accepted["windowsize"] = str(self.windowsize)
        if (value := _number(opts, "timeout", 1, 255)) is not None:
            self.timeout = value
            accepted["timeout"] = opts["timeout"]
        if "tsize" in opts and self.size:  # curl rejects "tsize 0"; declining is allowed
            accepted["tsize"] = str(self.size)
        self._oack = encode(OAck(accepted)) if accepted else b""
        self._tsize = "tsize" in accepted
        self._last = self.size // self.blksize + 1  # the final block is short, maybe empty
        self._acked = -1 if accepted else 0  # highest block acknowledged
        self._sent = 0  # highest block sent
        self._tries = 0
        self._base_timeout = self.timeout

    @property
    def bytes_acked(self) -> int:
        return min(max(self._acked, 0) * self.blksize, self.size)

    def start(self) -> list[bytes]:
        return [self._oack] if self._oack else self._window()

    def receive(self, datagram: bytes) -> list[bytes]:
        """Handle a datagram from the client; raises Malformed for anything but ACK/ERROR."""
        if len(datagram) == 4 and datagram[:2] == _ACK:  # one per block: read in place
            number = datagram[2] << 8 | datagram[3]
        else:
            packet = decode(datagram)
            if isinstance(packet, Error):
                if self._size_asked(packet):
                    self.state, self.reason = "sized", f"size only ({packet.message[:40]})"
                    return []
                self.abort(f"client error {packet.code}: {packet.message}")
                return []
            if not isinstance(packet, Ack):
                raise Malformed(f"unexpected {type(packet).__name__} from the client")
            number = packet.block
        if self.state != "open":
            return []
        # Map the 16-bit number onto the outstanding range (acked, sent]; duplicates and
        # stale ACKs fall outside and are ignored, so no Sorcerer's Apprentice storm.
        block = self._acked + ((number - self._acked) & 0xFFFF)
        if block == self._acked or block > self._sent:
            return []
        self._acked, self._tries, self.timeout = block, 0, self._base_timeout
        if block == self._last:
            self.state = "done"
            return []
        # A full window acknowledged moves on; a partial one (RFC 7440: the client lost a
        # block) restarts from the first block it did not get.
        return self._window()

    def _size_asked(self, error: Error) -> bool:
        """Whether the client only wanted the file's size: it ends the transfer right after
        an OACK that told it (RFC 2349), as a Raspberry Pi's bootloader does before each
        read ("Early terminate") and EDK2's GetFileSize does; refusing the options (code 8)
        is a failure."""
        return (
            self.state == "open"
            and self._acked < 0
            and self._tsize
            and error.code != ErrorCode.BAD_OPTIONS
        )

    def expire(self) -> list[bytes]:
        """The timer ran out: resend everything outstanding, or give up.

        The wait doubles on each retry (RFC 1123 4.2.3.2), up to 8 times the base, so the
        server outlasts clients that only re-ACK after their own, longer timeout.
        """
        if self.state != "open":
            return []
        self._tries += 1
        if self._tries > self.retries:
            self.abort(f"no ACK after {self.retries} retransmissions")
            return []
        self.timeout = min(self.timeout * 2, self._base_timeout * 8)
        return list(map(self._packet, range(self._acked + 1, self._sent + 1)))

    def abort(self, reason: str) -> None:
        """Fail an open transfer (client error, retries exhausted, unreachable, shutdown)."""
        if self.state == "open":
            self.state, self.reason = "failed", reason

    def _window(self) -> list[bytes]:
        self._sent = min(self._acked + self.windowsize, self._last)
        return list(map(self._packet, range(self._acked + 1, self._sent + 1)))

    def _packet(self, block: int) -> bytes:
        if block == 0:
            return self._oack
        start = (block - 1) * self.blksize
        return _HEAD.pack(_DATA, block & 0xFFFF) + self._data[start : start + self.blksize]
