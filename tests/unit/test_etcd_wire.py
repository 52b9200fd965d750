"""The etcd gateway's JSON, without etcd: answers as etcd 3.4.23 sent them (copied from curl)."""

import base64

import pytest

from layerpy.cluster import wire
from layerpy.cluster.wire import Compare, EtcdError, KeyValue, Op, WatchEvent

HEADER = {"cluster_id": "15118495548433857066", "member_id": "1366", "revision": "3", "raft_term": "2"}  # fmt: skip
KV = {"key": "L3gvYQ==", "create_revision": "2", "mod_revision": "2", "version": "1", "value": "aGVsbG8="}  # fmt: skip


def b64(text: bytes) -> str:
    return base64.b64encode(text).decode()


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        ("/a/", b"/a0"),
        ("a\udcff", b"b"),
        ("\xff", b"\xc3\xc0"),
        ("", b"\0"),
        ("/x\udcff", b"/y"),
        ("\udcff\udcff", b"\0"),
    ],
)
def test_prefix_end_is_the_first_key_after_the_prefix(prefix: str, end: bytes) -> None:
    assert wire.prefix_end(prefix) == end


def test_a_key_that_is_not_utf8_round_trips() -> None:
    kv = wire.key_value({**KV, "key": b64(b"/x/\xff\xfe")})
    assert wire.encode_key(kv.key) == b"/x/\xff\xfe"


def test_a_range_answer_reads_into_key_values_and_zero_fields_default() -> None:
    answer = {"header": HEADER, "kvs": [KV, {"key": b64(b"/e"), "mod_revision": 3}], "count": "2"}
    assert wire.revision(answer) == 3
    assert wire.key_values(answer) == [
        KeyValue("/x/a", b"hello", 2, 2, 1, 0),
        KeyValue("/e", b"", 3, 0, 0, 0),
    ]
    assert wire.key_values({"header": HEADER}) == []
    assert not wire.more(answer)


@pytest.mark.parametrize(
    "kv",
    [
        {**KV, "value": "not base64!"},
        {**KV, "mod_revision": "2x"},
        {**KV, "version": True},
        {**KV, "key": 5},
        "a string",
    ],
)
def test_a_malformed_answer_raises_rather_than_half_reading(kv: object) -> None:
    with pytest.raises(EtcdError):
        wire.key_values({"header": HEADER, "kvs": [kv]})


def test_compares_and_ops_are_the_gateways_json() -> None:
    assert Compare.version("/k", "==", 0).to_json() == {
        "key": b64(b"/k"), "target": "VERSION", "result": "EQUAL", "version": "0"
    }  # fmt: skip
    assert Compare.mod_revision("/k", "<", 7).to_json()["mod_revision"] == "7"
    assert Compare.create_revision("/k", ">", 7).to_json()["result"] == "GREATER"
    assert Compare.value("/k", "!=", b"v").to_json()["value"] == b64(b"v")
    with pytest.raises(ValueError, match="operator"):
        Compare.version("/k", "=", 0)
    assert Op.put("/k", b"v", lease=12).to_json() == {
        "request_put": {"key": b64(b"/k"), "value": b64(b"v"), "lease": "12"}
    }
    assert Op.get("/k").to_json() == {"request_range": {"key": b64(b"/k")}}
    assert Op.delete_prefix("/p/").to_json() == {
        "request_delete_range": {"key": b64(b"/p/"), "range_end": b64(b"/p0")}
    }


def test_a_failed_txn_answer_carries_the_gets_of_the_failure_branch() -> None:
    answer = {
        "header": HEADER,
        "responses": [
            {"response_range": {"header": {"revision": "3"}, "kvs": [KV], "count": "1"}},
            {"response_put": {"header": {"revision": "3"}}},
        ],
    }
    result = wire.txn_result(answer)
    assert (result.succeeded, result.revision) == (False, 3)
    assert result.responses == [[KeyValue("/x/a", b"hello", 2, 2, 1, 0)], []]
    assert wire.txn_result({"header": HEADER, "succeeded": True}).succeeded


def test_lease_answers() -> None:
    assert wire.lease_id({"header": HEADER, "ID": "4111120281013961737", "TTL": "5"}) == 4111120281013961737  # fmt: skip
    assert wire.lease_ttl({"result": {"header": HEADER, "ID": "1", "TTL": "5"}}) == 5
    assert wire.lease_ttl({"result": {"header": HEADER, "ID": "1"}}) == 0  # revoked or expired


def test_watch_messages() -> None:
    created = wire.watch_message({"result": {"header": HEADER, "created": True}})
    assert created.created and not created.events and not created.canceled
    delete = {"type": "DELETE", "kv": {"key": "L3gvYQ==", "mod_revision": "3"}}
    events = wire.watch_message({"result": {"header": HEADER, "events": [{"kv": KV}, delete]}})
    assert events.events == [
        WatchEvent("put", KeyValue("/x/a", b"hello", 2, 2, 1, 0)),
        WatchEvent("delete", KeyValue("/x/a", b"", 3, 0, 0, 0)),
    ]
    compacted = {"header": HEADER, "canceled": True, "compact_revision": "3"}
    assert wire.watch_message({"result": compacted}).compact_revision == 3
    failed = {"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}}
    assert wire.watch_message(failed).error == (14, "etcdserver: no leader")
    with pytest.raises(EtcdError, match="type"):
        wire.watch_message({"result": {"events": [{"type": "EXPLODE", "kv": KV}]}})


def test_error_answers() -> None:
    answer = {"error": "etcdserver: invalid auth token", "message": "etcdserver: invalid auth token", "code": 16}  # fmt: skip
    assert wire.error(answer) == (16, "etcdserver: invalid auth token")
    assert wire.error("nonsense") == (0, "malformed error")
