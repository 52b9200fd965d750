"""Fuzzing the agent contract: reports and answers from any JSON (and any bytes that parse
as JSON), the node authorization header and the kernel command line. Only ContractError
(and its ProtocolMismatch) may escape a decode; a record decoded is one the contract can
encode and decode again to the same record."""

from __future__ import annotations

import dataclasses
import json

from hypothesis import event, given
from hypothesis import strategies as st

from layerpy.proto import agent
from layerpy.proto.agent import Answer, ContractError, Report

from fuzzing import FUZZ, rarely, text_or_junk

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-1, 0, 2**63 - 1, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    text_or_junk,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


seldom = st.sampled_from([False] * 39 + [True])
"""One field in forty is left out or odd: a record has some thirty, and most should pass."""

VALUES = {  # the first of each passes its field's check, the others do not (or not always)
    "node": ["cn001", "discover", "CN001", "-x"],
    "token": ["tok3n_=-", "", "a" * 129],
    "mac": ["52:54:00:99:00:11", "52-54-00-99-00-11", "52:54:00:99:00:1"],
    "ip": ["10.99.0.11", "", "10.99.0.256", "::1"],
    "boot_id": ["0f6a1b2c-1234", "g"],
    "event": ["hello", "heartbeat", "nope"],
    "protocol": [agent.PROTOCOL, "1.0", "2.0", "1", ""],
    "digest": ["sha256:" + "0" * 64, "sha256:"],
    "url": ["http://10.99.0.1:8080/i", "ftp://x"],
    "format": ["squashfs", "tar", "zip"],
    "sha256": ["a" * 64, "A" * 64, "a" * 63],
    "revision": ["0123456789abcdef", "0123"],
    "path": ["/etc/x", "/etc/../x", "etc/x", "//x", "/"],
    "mode": [0o644, 0o10000, -1],
    "owner": ["root:root", "0:0", "x"],
    "state": ["none", "running", "failed", "nope"],
    "seq": [7, 0, -1],
    "busy": [False, True, 0],
    "uptime": [12.5, -1],
    "heartbeat": [5, 0.01, 3600],
    "heard_at": [3.0, 1e10],
    "chassis_subtype": [4, -1, "4"],
    "port_subtype": [5, 2**63],
    "ttl": [120, 1.5],
    "container_pid": [42, -42],
    "lldp_ignored": [0, -1],
    "timeline": [{"dhcp": 1.0, "ready": None}, {str(n): 1 for n in range(17)}],
    "command": [["/bin/sh", "-c", "x"], []],
    "persist": [["/var/lib/x"], ["/x/../y"]],
    "Report.persist": ["/dev/sda1", ["/x"]],
    "since": [3.0, -1],
    "systemd": [False, "yes"],
    "size": [0, 1 << 20, (1 << 20) + 1, -5],
    "config": [{"Env": ["A=1"]}],
    "apply": ["systemctl restart munge", "a\nb"],
}


@st.composite
def plausible(draw: st.DrawFn, record: type, name: str):
    """A value for the field `name`: mostly one that passes its check, sometimes one of
    the contract's near misses, sometimes any JSON value at all."""
    values = VALUES.get(f"{record.__name__}.{name}") or VALUES.get(
        name, ["sw1", "x" * 600, "\x1b[2J"]
    )  # free text
    if not draw(seldom):
        return values[0]
    return draw(st.one_of(st.sampled_from(values), json_values))


@st.composite
def records(draw: st.DrawFn, cls: type, depth: int = 0) -> dict:
    """A JSON object with the record's own keys (now and then one left out, or extra ones),
    each with a plausible value or a nested record."""
    obj = {}
    for f in dataclasses.fields(cls):
        if f.name != "protocol" and draw(seldom):
            continue  # left out: a required one makes a ContractError
        nested = {"lldp": agent.Lldp, "image": _image_record(cls), "files": _files_record(cls),
                  "identity": agent.Identity}.get(f.name)  # fmt: skip
        choice = plausible(cls, f.name)
        if nested is not None and depth < 2 and not draw(seldom):
            choice = records(nested, depth + 1)
        if f.name == "files" and cls is agent.FilesSpec:
            choice = st.lists(records(agent.FileSpec, depth + 1), max_size=3)
        obj[f.name] = draw(choice)
    if draw(rarely):
        obj.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2)))
    return obj


def _image_record(cls: type) -> type:
    return agent.ImageStatus if cls is Report else agent.ImageSpec


def _files_record(cls: type) -> type:
    return agent.FilesStatus if cls is Report else agent.FilesSpec


def check_decodes(cls: type, obj) -> None:
    try:
        record = cls.from_json(obj)
    except ContractError as error:
        assert str(error)
        event(type(error).__name__)
        return
    event("decoded")
    assert cls.from_json(json.loads(json.dumps(agent.encode(record)))) == record


@FUZZ
@given(st.one_of(records(Report), json_values))
def test_reports(obj) -> None:
    check_decodes(Report, obj)


@FUZZ
@given(st.one_of(records(Answer), json_values))
def test_answers(obj) -> None:
    check_decodes(Answer, obj)


@FUZZ
@given(st.one_of(records(Report).map(json.dumps).map(str.encode), st.binary(max_size=200)))
def test_report_bytes(data: bytes) -> None:
    """What the HTTP layer does with a body: parse, then decode (a ValueError is its 400)."""
    try:
        obj = json.loads(data)
    except ValueError:
        return
    check_decodes(Report, obj)


@FUZZ
@given(st.one_of(st.builds("Layerpy-Node {} {}".format, text_or_junk, text_or_junk), text_or_junk))
def test_node_authorization(header: str) -> None:
    identity = agent.parse_node_authorization(header)
    if identity is not None:
        assert agent.parse_node_authorization(agent.node_authorization(identity)) == identity


words = st.one_of(
    st.sampled_from(["layerpy.server=http://10.99.0.1:8080", "layerpy.node=cn001", 'a="b c"',
                     "layerpy.heartbeat=nan", "layerpy.heartbeat=1e400", "layerpy.lldp_wait=-0",
                     "BOOTIF=01-52-54-00-99-00-11", "BOOTIF=zz", "layerpy.persist=/dev/sda1",
                     "layerpy.persist=;rm", '"', "=", "layerpy.token=x",
                     "layerpy.server=http://10.99.0.1:8080,https://h-2.lan/lp,http://[fd00::1]:80",
                     "layerpy.server=http://u:p@h,ftp://h,,http://h:0,http://h:70000",
                     "layerpy.server=" + ",".join(f"http://h{i}" for i in range(12))]),
    text_or_junk,
)  # fmt: skip


@FUZZ
@given(st.lists(words, max_size=8).map(" ".join))
def test_cmdline(text: str) -> None:
    """Parsing never fails; what it keeps is sane and what it formats parses back."""
    line = agent.Cmdline.parse(text)
    assert 0.1 <= line.heartbeat <= 3600 and 0 <= line.lldp_wait <= 3600
    assert line.bootif == "" or agent.normalize_mac(line.bootif) == line.bootif
    assert line.persist == "" or agent.is_disk(line.persist)
    assert len(line.servers) <= agent.MAX_SERVERS and line.server == (line.servers or ("",))[0]
    assert all(agent.server_url(url, "fuzz") == url for url in line.servers)
    event("ok" if line.ok else "problems")
    if line.ok and not any(
        ch.isspace() or ch == '"' for ch in line.server + line.node + line.token
    ):
        again = agent.Cmdline.parse(line.format())
        assert (again.servers, again.node, again.token, again.bootif, again.persist) == (
            line.servers, line.node, line.token, line.bootif, line.persist)  # fmt: skip
