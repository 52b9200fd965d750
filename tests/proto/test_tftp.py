"""TFTP: codec and transfer state machine without sockets, then real clients in namespaces."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerpy.proto.tftp import (
    Ack,
    Data,
    Error,
    ErrorCode,
    Malformed,
    OAck,
    Opcode,
    Request,
    TftpError,
    Transfer,
    check_request,
    decode,
    encode,
    parse_request,
    safe_path,
)

from netns import Link

# ---------------------------------------------------------------------------- codec


def rrq(name: str = "f", mode: str = "octet", **options: str) -> Request:
    return Request(Opcode.RRQ, name, mode, options)


@pytest.mark.parametrize(
    "packet",
    [
        rrq("boot/ipxe.efi", blksize="1428", tsize="0"),
        Request(Opcode.WRQ, "up", "octet"),
        Data(7, b"x" * 512),
        Data(0, b""),
        Ack(65535),
        Error(ErrorCode.FILE_NOT_FOUND, "nope"),
        OAck({"blksize": "1428", "tsize": "99"}),
        OAck({}),
    ],
)
def test_codec_round_trip(packet):
    assert decode(encode(packet)) == packet


def test_request_wire_format():
    wire = b"\x00\x01pxelinux.0\x00OCTET\x00BlkSize\x001428\x00tsize\x000\x00\x00\x00"
    assert parse_request(wire) == rrq("pxelinux.0", blksize="1428", tsize="0")


@pytest.mark.parametrize(
    "wire",
    [
        b"",
        b"\x00",
        b"\x00\x09abc",
        b"\x00\x01file\x00octet",  # not NUL-terminated
        b"\x00\x01file\x00",  # no mode
        b"\x00\x01\x00octet\x00",  # empty file name
        b"\x00\x01file\x00octet\x00blksize\x00",  # option without value
        b"\x00\x03\x00",  # truncated DATA
        b"\x00\x04\x00\x01\x00",  # ACK with a tail
        b"\x00\x05\x00",  # truncated ERROR
    ],
)
def test_malformed_packets_raise(wire):
    with pytest.raises(Malformed):
        decode(wire)


def test_listen_port_takes_only_requests():
    with pytest.raises(Malformed):
        parse_request(encode(Ack(1)))


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (Request(Opcode.WRQ, "f", "octet"), ErrorCode.ACCESS_VIOLATION),
        (rrq(mode="mail"), ErrorCode.ILLEGAL_OPERATION),
    ],
)
def test_refused_requests(request_, code):
    with pytest.raises(TftpError) as info:
        check_request(request_)
    assert info.value.code == code
    assert decode(info.value.packet()) == Error(code, info.value.message)


# ---------------------------------------------------------------------------- transfer


def blocks(packets: list[bytes]) -> list[int]:
    return [decode(p).block for p in packets]


def fetch(transfer: Transfer, start: list[bytes]) -> bytes:
    """Play a perfect client: ACK the last block of every window, collect the payload."""
    got, packets = [], start
    while packets:
        for p in packets:
            got.append(decode(p).payload)
        packets = transfer.receive(encode(Ack(decode(packets[-1]).block)))
    assert transfer.state == "done"
    return b"".join(got)


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 512 * 5, 512 * 5 + 7])
def test_lockstep_sizes(size):
    data = os.urandom(size)
    transfer = Transfer(rrq(), data)
    first = transfer.start()
    assert blocks(first) == [1]
    assert fetch(transfer, first) == data
    assert transfer.bytes_acked == size


def test_final_block_is_empty_for_exact_multiples():
    transfer = Transfer(rrq(), b"a" * 512)
    transfer.start()
    (last,) = transfer.receive(encode(Ack(1)))
    assert decode(last) == Data(2, b"")
    assert transfer.receive(encode(Ack(2))) == []
    assert transfer.state == "done"


def test_option_negotiation():
    transfer = Transfer(
        rrq(blksize="1428", tsize="0", timeout="3", windowsize="4", multicast=""), b"x" * 5000
    )
    (oack,) = transfer.start()
    assert decode(oack) == OAck(
        {"blksize": "1428", "windowsize": "4", "timeout": "3", "tsize": "5000"}
    )
    assert (transfer.blksize, transfer.windowsize, transfer.timeout) == (1428, 4, 3)
    assert transfer.receive(encode(Ack(1))) == []  # nothing before ACK 0
    assert transfer.expire() == [oack]  # the OACK is block 0 and retransmitted like one
    window = transfer.receive(encode(Ack(0)))
    assert blocks(window) == [1, 2, 3, 4]
    assert len(decode(window[-1]).payload) == 5000 - 3 * 1428


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"blksize": "65464"}, {"blksize": "1468"}),  # clamped to the server's limit
        ({"blksize": "7"}, {}),
        ({"blksize": "x1"}, {}),
        ({"blksize": "\uff11\uff12"}, {}),  # non-ASCII digits
        ({"blksize": "9" * 5000}, {}),
        ({"timeout": "0"}, {}),
        ({"timeout": "256"}, {}),
        ({"windowsize": "1000"}, {"windowsize": "16"}),
        ({"windowsize": "0"}, {}),
    ],
)
def test_option_limits(options, expected):
    transfer = Transfer(rrq(**options), b"data", max_blksize=1468, max_windowsize=16)
    first = decode(transfer.start()[0])
    assert first == (OAck(expected) if expected else Data(1, b"data"))


def test_client_rejects_oack():
    transfer = Transfer(rrq(blksize="1428"), b"x")
    transfer.start()
    assert transfer.receive(encode(Error(ErrorCode.BAD_OPTIONS, "no thanks"))) == []
    assert (transfer.state, transfer.reason) == ("failed", "client error 8: no thanks")


@pytest.mark.parametrize(
    ("options", "error", "state"),
    [
        ({"tsize": "0", "blksize": "1024"}, Error(0, "Early terminate"), "sized"),  # a Pi's probe
        ({"tsize": "0"}, Error(ErrorCode.BAD_OPTIONS, "no"), "failed"),  # options refused
        ({"blksize": "1024"}, Error(0, "Early terminate"), "failed"),  # no size was told
    ],
)
def test_a_size_query_ended_after_the_oack_is_done(options, error, state):
    transfer = Transfer(rrq(**options), b"x" * 5000)
    assert isinstance(decode(transfer.start()[0]), OAck)
    assert transfer.receive(encode(error)) == []
    assert transfer.state == state and transfer.bytes_acked == 0


def test_duplicate_and_stale_acks_are_ignored():
    transfer = Transfer(rrq(), b"z" * 2000)
    transfer.start()
    assert blocks(transfer.receive(encode(Ack(1)))) == [2]
    assert transfer.receive(encode(Ack(1))) == []  # no Sorcerer's Apprentice
    assert transfer.receive(encode(Ack(0))) == []
    assert transfer.receive(encode(Ack(9))) == []  # not sent yet
    assert blocks(transfer.receive(encode(Ack(2)))) == [3]


def test_window_restarts_after_partial_ack():
    transfer = Transfer(rrq(windowsize="4"), bytes(512 * 20))
    transfer.start()
    assert blocks(transfer.receive(encode(Ack(0)))) == [1, 2, 3, 4]
    assert blocks(transfer.receive(encode(Ack(2)))) == [3, 4, 5, 6]  # 3 was lost
    assert blocks(transfer.receive(encode(Ack(6)))) == [7, 8, 9, 10]
    assert transfer.receive(encode(Ack(5))) == []


def test_retransmit_with_backoff_then_give_up():
    transfer = Transfer(rrq(windowsize="2"), bytes(5000), timeout=0.5, retries=4)
    transfer.start()
    window = transfer.receive(encode(Ack(0)))
    assert transfer.expire() == window
    assert transfer.timeout == 1.0
    assert blocks(transfer.receive(encode(Ack(2)))) == [3, 4]  # progress resets the count
    assert transfer.timeout == 0.5
    waits = []
    for _ in range(4):
        assert blocks(transfer.expire()) == [3, 4]
        waits.append(transfer.timeout)
    assert waits == [1.0, 2.0, 4.0, 4.0]  # doubling, capped at 8 x base
    assert transfer.expire() == []
    assert transfer.state == "failed"
    assert "retransmissions" in transfer.reason
    assert transfer.bytes_acked == 1024


def test_final_block_retransmitted_until_acked():
    transfer = Transfer(rrq(), b"tiny")
    assert transfer.start() == transfer.expire() == [encode(Data(1, b"tiny"))]
    transfer.receive(encode(Ack(1)))
    assert transfer.state == "done"
    assert transfer.expire() == []


def test_block_numbers_wrap_past_65535():
    data = os.urandom(8 * 70_000 + 3)
    transfer = Transfer(rrq(blksize="8", windowsize="64"), data)
    transfer.start()
    first = transfer.receive(encode(Ack(0)))
    assert fetch(transfer, first) == data


def test_wrap_in_lockstep_reaches_block_zero():
    transfer = Transfer(rrq(), bytes(512 * 65_536 + 1))
    packets = transfer.start()
    for block in range(1, 65_536):
        packets = transfer.receive(encode(Ack(block)))
    assert blocks(packets) == [0]
    assert transfer.receive(encode(Ack(65_535))) == []  # the old one, not the new
    assert blocks(transfer.receive(encode(Ack(0)))) == [1]


def test_netascii_is_converted():
    transfer = Transfer(rrq(mode="netascii", tsize="0"), b"a\nb\rc\r\n")
    assert decode(transfer.start()[0]).options["tsize"] == "11"
    assert fetch(transfer, transfer.receive(encode(Ack(0)))) == b"a\r\nb\r\0c\r\0\r\n"


def test_unexpected_packets_during_transfer():
    transfer = Transfer(rrq(), b"x" * 600)
    transfer.start()
    for wire in (encode(Data(1, b"x")), encode(rrq()), b"\x00"):
        with pytest.raises(Malformed):
            transfer.receive(wire)
    assert transfer.state == "open"
    transfer.abort("server closed")
    assert (transfer.state, transfer.reason) == ("failed", "server closed")


# ---------------------------------------------------------------------------- paths


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "root" / "sub" / "f.bin").write_bytes(b"f")
    (tmp_path / "secret").write_text("secret")
    (tmp_path / "root" / "escape").symlink_to(tmp_path / "secret")
    (tmp_path / "root" / "outdir").symlink_to(tmp_path)
    (tmp_path / "root" / "inside").symlink_to("sub/f.bin")
    (tmp_path / "root" / "loop").symlink_to("loop")
    os.mkfifo(tmp_path / "root" / "fifo")
    return tmp_path / "root"


@pytest.mark.parametrize("name", ["sub/f.bin", "/sub/f.bin", "sub//./f.bin", "inside"])
def test_safe_path_allows(root, name):
    assert safe_path(root, name) == (root / "sub" / "f.bin").resolve()


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("../secret", ErrorCode.ACCESS_VIOLATION),
        ("sub/../../secret", ErrorCode.ACCESS_VIOLATION),
        ("sub/..", ErrorCode.ACCESS_VIOLATION),
        ("/etc/passwd", ErrorCode.FILE_NOT_FOUND),  # means <root>/etc/passwd
        ("escape", ErrorCode.ACCESS_VIOLATION),
        ("outdir/secret", ErrorCode.ACCESS_VIOLATION),
        ("sub/f.bin\0.txt", ErrorCode.ACCESS_VIOLATION),
        ("sub", ErrorCode.ACCESS_VIOLATION),
        ("/", ErrorCode.ACCESS_VIOLATION),
        ("fifo", ErrorCode.ACCESS_VIOLATION),
        ("missing", ErrorCode.FILE_NOT_FOUND),
        ("loop", ErrorCode.FILE_NOT_FOUND),
    ],
)
def test_safe_path_refuses(root, name, code):
    with pytest.raises(TftpError) as info:
        safe_path(root, name)
    assert info.value.code == code


# ---------------------------------------------------------------------------- real peers

HERE = Path(__file__).resolve().parent.parent
SERVER = "10.77.0.1"
SIZES = {"empty": 0, "one512": 512, "k512": 512 * 7, "k1428": 1428 * 5, "big": 3_000_000}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Lab:
    """A served root on 10.77.0.1 and a client at 10.77.0.2, each in its own namespace."""

    def __init__(self, tmp: Path) -> None:
        if os.geteuid() != 0:
            pytest.fail("protocol tests need root (run them through tests/run.sh)")
        self.tmp, self.root, self.out = tmp, tmp / "root", tmp / "out"
        self.root.mkdir()
        self.out.mkdir()
        for name, size in SIZES.items():
            (self.root / f"{name}.bin").write_bytes(os.urandom(size))
        (self.root / "text.txt").write_bytes(b"line one\nline two\r\nend\n" * 100)
        (self.root / "dir").mkdir()
        (tmp / "secret.txt").write_text("TOP SECRET\n")
        (self.root / "escape").symlink_to(tmp / "secret.txt")
        self.link = Link(client_addr="10.77.0.2/24")

    def start(self, *args: str, port: int = 69, log: str = "server.log") -> tuple:
        """Start a server (or the relay, given its argv) in the server namespace."""
        path = self.tmp / log
        argv = list(args) or [
            *(sys.executable, str(HERE / "tftp_serve.py"), str(self.root), SERVER, str(port)),
            *("--timeout", "0.3", "--interface", self.link.server_if),
        ]
        with path.open("w") as out:
            proc = self.link.server.popen(argv, stdout=out, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while "ready" not in path.read_text():
            assert time.monotonic() < deadline, f"{argv} did not start"
            time.sleep(0.02)
        return proc, path

    def get(
        self, client: str, name: str, port=69, blksize="1428", windowsize="8", mode="binary"
    ) -> tuple[Path, str, int]:
        """Fetch `name` with a real client: the local file, the client's output and status."""
        dest = self.out / f"{client}-{name.replace('/', '_')}"
        dest.unlink(missing_ok=True)
        if client == "tftp-hpa":
            argv = ["tftp", "-v", SERVER, str(port), "-m", mode, "-c", "get", name, str(dest)]
        elif client == "curl":
            url = f"tftp://{SERVER}:{port}/{name}"
            argv = ["curl", "-sS", "--path-as-is", "--tftp-blksize", blksize, "-o", str(dest), url]
        else:
            options = [f"blksize {blksize}", f"windowsize {windowsize}", "tsize 0"]
            argv = ["atftp", *(f"--option={o}" for o in options), "-g", "-r", name]
            argv += ["-l", str(dest), SERVER, str(port)]
        result = self.link.client.run(*argv, check=False, timeout=120)
        return dest, result.stdout + result.stderr, result.returncode

    def close(self) -> None:
        self.link.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("tftp"))
    try:
        lab.start()
        yield lab
    finally:
        lab.close()


CLIENTS = ["tftp-hpa", "curl", "atftp"]


@pytest.mark.netns
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("name", [f"{n}.bin" for n in SIZES])
def test_real_clients_fetch(lab, client, name):
    dest, output, _ = lab.get(client, name)
    assert dest.exists(), output
    assert sha(dest) == sha(lab.root / name)


@pytest.mark.netns
def test_absolute_path_and_netascii(lab):
    dest, *_ = lab.get("curl", "/k512.bin")  # tftp://host//k512.bin asks for "/k512.bin"
    assert sha(dest) == sha(lab.root / "k512.bin")
    dest, *_ = lab.get("tftp-hpa", "text.txt", mode="ascii")
    assert dest.read_bytes() == (lab.root / "text.txt").read_bytes()


@pytest.mark.netns
def test_block_number_wraparound(lab):
    dest, output, _ = lab.get("atftp", "big.bin", blksize="8", windowsize="64")
    assert sha(dest) == sha(lab.root / "big.bin"), output  # 375000 blocks: wraps 5 times


@pytest.mark.netns
@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("name", ["../secret.txt", "dir/../../secret.txt", "escape", "dir"])
def test_hostile_paths_are_refused(lab, client, name):
    dest, output, status = lab.get(client, name)
    assert "TOP SECRET" not in (dest.read_text() if dest.exists() else "")
    assert status != 0 or "Error code 2" in output  # tftp-hpa exits 0 even then
    dest, *_ = lab.get(client, "k512.bin")  # and the server carries on
    assert sha(dest) == sha(lab.root / "k512.bin")


@pytest.mark.netns
def test_upload_is_refused(lab):
    src = lab.tmp / "upload.bin"
    src.write_bytes(b"payload")
    out = lab.link.client.run("tftp", SERVER, "-m", "binary", "-c", "put", str(src), "up.bin")
    assert "Error code 2: read-only server" in out.stdout
    assert not (lab.root / "up.bin").exists()


@pytest.mark.netns
def test_parallel_transfers(lab):
    procs = [
        lab.link.client.popen(
            ["curl", "-sS", "-o", str(lab.out / f"p{i}"), f"tftp://{SERVER}/big.bin"]
        )
        for i in range(4)
    ]
    assert [p.wait(60) for p in procs] == [0] * 4
    assert {sha(lab.out / f"p{i}") for i in range(4)} == {sha(lab.root / "big.bin")}


# A bare-socket client: sends its RRQ twice (as impatient PXE ROMs do), fetches the file in
# lock-step, listens a little longer, and reports how many server TIDs talked to it.
TWICE = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
for _ in range(2):
    s.sendto(b"\0\1k512.bin\0octet\0", (sys.argv[1], int(sys.argv[2])))
tids, got, data = set(), 0, b"x" * 516
while len(data) == 516:
    data, peer = s.recvfrom(1000)
    tids.add(peer)
    got += len(data) - 4
    s.sendto(b"\0\4" + data[2:4], peer)
s.settimeout(0.5)
try:
    tids.add(s.recvfrom(1000)[1])
except TimeoutError:
    pass
print(len(tids), got)
"""


@pytest.mark.netns
def test_bad_datagrams_and_duplicate_requests(lab):
    server, log = lab.start(port=1069, log="junk.log")
    junk = [b"", b"\x00", b"\x00\x09xx", b"\x00\x01noterm", b"\x00\x04\x00\x01", b"\xff" * 600]
    script = (
        "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for b in {junk!r}: s.sendto(b, ('{SERVER}', 1069))"
    )
    lab.link.client.run(sys.executable, "-c", script)
    out = lab.link.client.run(sys.executable, "-c", TWICE, SERVER, "1069").stdout
    assert out.split() == ["1", str(SIZES["k512"])]
    dest, *_ = lab.get("curl", "k1428.bin", port=1069)
    assert sha(dest) == sha(lab.root / "k1428.bin")
    server.terminate()
    server.wait(10)
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    stats = events.pop()
    assert stats["kind"] == "stats"
    assert (stats["malformed"], stats["requests"], stats["transfers_ok"]) == (len(junk), 3, 2)
    dropped = [e for e in events if e["kind"] == "malformed"]  # each one reported as well
    assert len(dropped) == len(junk) and all(e["reason"] for e in dropped)
    events = [e for e in events if e["kind"] != "malformed"]
    assert [e["kind"] for e in events] == ["ready", "start", "done", "start", "done"]
    assert events[-1]["bytes"] == SIZES["k1428"]


@pytest.mark.netns
@pytest.mark.parametrize(
    ("client", "windowsize", "port"),
    [("tftp-hpa", "1", 7001), ("atftp", "1", 7002), ("atftp", "4", 7003)],
)
def test_transfer_survives_loss(lab, client, windowsize, port):
    """Every 7th datagram is dropped, both ways, by a relay in front of the server.

    curl is left out: it asks for a 6 s retransmit timeout, which the server honours.
    """
    (lab.root / "lossy.bin").write_bytes(os.urandom(20_000))
    relay = [sys.executable, str(HERE / "lossy_relay.py"), SERVER, str(port), SERVER, "69", "7"]
    lab.start(*relay, log=f"relay{port}")
    dest, output, _ = lab.get(client, "lossy.bin", port, blksize="1024", windowsize=windowsize)
    assert dest.exists(), output
    assert sha(dest) == sha(lab.root / "lossy.bin")


# 1 000 RRQs for a 20 MB file from 40 addresses, never acknowledged: the sockets stay open
# (closing them would end the transfers at once through ICMP port unreachable).
STALL = r"""
import socket, sys, time
server, port, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
for i in range(1000):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((f"10.77.0.{first + i % 40}", 0))
    s.sendto(b"\0\1huge.bin\0octet\0", (server, port))
    held.append(s)
print("sent", flush=True)
sys.stdin.read()  # until the test is done measuring
"""


def rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))


@pytest.mark.netns
def test_stalled_transfers_hold_no_file_and_give_up(lab):
    """Each transfer used to read its whole file: 1 000 stalled ones took RSS to gigabytes.
    Now a transfer holds the packets in flight; the silent ones give up after their
    retries, and a real client is served throughout."""
    (lab.root / "huge.bin").write_bytes(os.urandom(20_000_000))
    for i in range(40):
        lab.link.client.run("ip", "addr", "replace", f"10.77.0.{100 + i}/24", "dev",
                            lab.link.client_if)  # fmt: skip
    server, log = lab.start(port=2069, log="stall.log")
    before = rss_kb(server.pid)
    stall = lab.link.client.popen([sys.executable, "-c", STALL, SERVER, "2069", "100"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert stall.stdout.readline() == b"sent\n"

        def started() -> int:
            return sum('"kind": "start"' in line for line in log.read_text().splitlines())

        peak = before
        deadline = time.monotonic() + 60
        while started() < 1000:
            assert time.monotonic() < deadline, f"{started()} of 1000 transfers started"
            peak = max(peak, rss_kb(server.pid))
            time.sleep(0.05)
        peak = max(peak, rss_kb(server.pid))
        dest, output, _ = lab.get("curl", "k512.bin", port=2069)  # served meanwhile
        assert sha(dest) == sha(lab.root / "k512.bin"), output
    finally:
        stall.stdin.close()
        stall.wait(30)
    print(f"\nRSS {before / 1024:.0f} MB before, {peak / 1024:.0f} MB with 1000 stalled transfers")
    assert peak - before < 100 * 1024

    def failed() -> int:
        return sum('"kind": "failed"' in line for line in log.read_text().splitlines())

    deadline = time.monotonic() + 120
    while failed() < 1000:  # gave up on every silent client (or saw it go away)
        assert time.monotonic() < deadline, f"{failed()} of 1000 stalled transfers ended"
        time.sleep(0.2)
    server.terminate()
    server.wait(10)


@pytest.mark.netns
def test_one_address_gets_a_bounded_number_of_transfers(lab):
    lab.link.client.run("ip", "addr", "replace", "10.77.0.100/24", "dev", lab.link.client_if)
    server, log = lab.start(port=3069, log="crowd.log")
    script = STALL.replace("first + i % 40", "first")
    crowd = lab.link.client.popen([sys.executable, "-c", script, SERVER, "3069", "100"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert crowd.stdout.readline() == b"sent\n"

        def kinds() -> list[str]:  # whole lines only: the server may be mid-line
            lines = log.read_text().rpartition("\n")[0].splitlines()
            return [json.loads(line)["kind"] for line in lines if line.startswith("{")]

        deadline = time.monotonic() + 60
        while kinds().count("start") + kinds().count("refused") < 1000:
            assert time.monotonic() < deadline, kinds()[-5:]
            time.sleep(0.1)
        assert kinds().count("start") == 32 and kinds().count("refused") == 968
        dest, output, _ = lab.get("curl", "k512.bin", port=3069)  # another address: served
        assert sha(dest) == sha(lab.root / "k512.bin"), output
    finally:
        crowd.stdin.close()
        crowd.wait(30)
        server.terminate()
        server.wait(10)
