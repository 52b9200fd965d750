"""Fuzzing the TFTP core: the codec and request checks on any datagram, the path policy
on any name, and the transfer state machine fed any datagrams and timer expiries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.proto import tftp

from fuzzing import FUZZ, rarely

names = st.one_of(
    st.sampled_from(["undionly.kpxe", "/snponly.efi", "sub/file", "../etc/passwd", "link-out",
                     "loop", "sub", "", ".", "//", "a\0b", "\udcff.efi", "x" * 5000]),
    st.text(max_size=40),
)  # fmt: skip
options = st.dictionaries(
    st.sampled_from(["blksize", "windowsize", "timeout", "tsize", "BlkSize", "x"]),
    st.one_of(st.sampled_from(["0", "1", "7", "8", "512", "1468", "65464", "65465", "999999",
                               "1e3", "-1", " 8", "٣", ""]), st.text(max_size=8)),
    max_size=5,
)  # fmt: skip


def request_bytes(opcode: int, name: str, mode: str, opts: dict[str, str]) -> bytes:
    fields = [name, mode, *(s for item in opts.items() for s in item)]
    return opcode.to_bytes(2) + b"".join(f.encode("utf-8", "surrogatepass") + b"\0" for f in fields)


requests = st.builds(
    request_bytes,
    st.sampled_from([1, 1, 2, 6]),
    names,
    st.sampled_from(["octet", "netascii", "OCTET", "mail", ""]),
    options,
)
datagrams = st.one_of(requests, st.binary(max_size=80))


@FUZZ
@given(datagrams)
def test_codec_raises_only_malformed(data: bytes) -> None:
    try:
        packet = tftp.decode(data)
    except tftp.Malformed:
        event("malformed")
        return
    event(type(packet).__name__)
    if isinstance(packet, tftp.Request | tftp.OAck) and "" in packet.options.values():
        return  # an empty last value reads as padding: no round trip (and no harm)
    again = tftp.decode(tftp.encode(packet))
    if isinstance(packet, tftp.Error):
        assert again.code == packet.code  # the message is cut at its first NUL
    else:
        assert again == packet
    try:
        request = tftp.parse_request(data)
        tftp.check_request(request)
    except tftp.TftpError as error:
        assert tftp.decode(error.packet())  # a refusal encodes as an ERROR packet
        return


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A TFTP root with a file, a subdirectory, a symlink out of it and a symlink loop."""
    base = tmp_path_factory.mktemp("tftp")
    (base / "root" / "sub").mkdir(parents=True)
    (base / "root" / "undionly.kpxe").write_bytes(b"x")
    (base / "root" / "sub" / "file").write_bytes(b"y")
    (base / "secret").write_bytes(b"z")
    os.symlink(base / "secret", base / "root" / "link-out")
    os.symlink("loop", base / "root" / "loop")
    return base / "root"


@FUZZ
@given(names)
def test_safe_path_stays_in_the_root(root: Path, name: str) -> None:
    try:
        path = tftp.safe_path(root, name)
    except tftp.TftpError:
        return
    assert path.is_relative_to(root.resolve()) and path.is_file()


events = st.lists(
    st.one_of(
        st.integers(0, 0x1FFFF).map(lambda n: tftp.encode(tftp.Ack(n))),  # any ACK
        st.just("ack-next"),  # the ACK a good client sends next
        st.just("expire"),
        st.binary(max_size=12),
        st.builds(tftp.Error, st.integers(0, 9), st.text(max_size=10)).map(tftp.encode),
    ),
    max_size=40,
)


@FUZZ
@given(
    st.sampled_from(["octet", "netascii"]),
    options,
    st.one_of(st.binary(max_size=3000), st.integers(0, 4).map(lambda n: b"\n\r" * (256 * n))),
    events,
)
def test_transfer_takes_any_datagram(mode: str, opts, data: bytes, steps) -> None:
    """Only Malformed escapes; the state only moves forward; every packet sent is the OACK
    or a DATA block of at most blksize bytes; a cooperative client gets the whole file."""
    transfer = tftp.Transfer(tftp.Request(tftp.Opcode.RRQ, "f", mode, opts), data, retries=3)
    sent = transfer.start()
    assert sent
    last = 0
    for step in steps:
        state = transfer.state
        if step == "ack-next":
            last = _last_block(sent, last)
            step = tftp.encode(tftp.Ack(last))
        if step == "expire":
            sent = transfer.expire() or sent
        else:
            try:
                sent = transfer.receive(step) or sent
            except tftp.Malformed:
                event("malformed")
        assert state == "open" or transfer.state == state  # done and failed are final
        for packet in sent:
            decoded = tftp.decode(packet)
            assert isinstance(decoded, tftp.OAck | tftp.Data)
            if isinstance(decoded, tftp.Data):
                assert len(decoded.payload) <= transfer.blksize
        assert 0 <= transfer.bytes_acked <= transfer.size
    event(transfer.state)
    if transfer.state == "done":
        assert transfer.bytes_acked == transfer.size


def _last_block(sent: list[bytes], previous: int) -> int:
    """The number of the last DATA block among `sent` (0 for the OACK alone)."""
    blocks = [p for p in map(tftp.decode, sent) if isinstance(p, tftp.Data)]
    return blocks[-1].block if blocks else previous


@FUZZ
@given(st.sampled_from(["octet", "netascii"]), options, st.binary(max_size=5000), rarely)
def test_cooperative_client_gets_the_file(mode: str, opts, data: bytes, lose: bool) -> None:
    """Acknowledging the last block of every window (or, now and then, losing a window and
    waiting for the timer) brings the whole file, in order."""
    transfer = tftp.Transfer(tftp.Request(tftp.Opcode.RRQ, "f", mode, opts), data)
    expected = data if mode == "octet" else data.replace(b"\r", b"\r\0").replace(b"\n", b"\r\n")
    received: dict[int, bytes] = {}
    sent, last = transfer.start(), 0
    for _ in range(len(expected) // 8 + 20):
        if transfer.state != "open":
            break
        if lose:
            lose, sent = False, transfer.expire()
            continue
        for packet in sent:
            block = tftp.decode(packet)
            if isinstance(block, tftp.Data):
                received.setdefault(block.block, block.payload)
        last = _last_block(sent, last)
        sent = transfer.receive(tftp.encode(tftp.Ack(last)))
    assert transfer.state == "done"
    assert b"".join(received[n] for n in sorted(received)) == expected
