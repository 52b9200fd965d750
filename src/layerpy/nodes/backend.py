"""Where the node store keeps what must survive a restart: one interface, two backends.

Records are JSON-able dicts, one per (kind, key). ``LocalJournal`` keeps them in the state
directory in the files and formats of earlier releases (an upgraded state directory keeps
working); the etcd backend (``layerpy.cluster.backend``) keeps the same records in etcd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from layerpy import digests
from layerpy.journal import Journal
from layerpy.nodes.files import StateFiles

log = logging.getLogger("layerpy.nodes")

TOKENS = "tokens"  # key: node name; {"sha256", "boot_id", "boots"}
BINDINGS = "bindings"  # key: node name; {"mac"}
LEASES = "leases"  # key: IPv4 address; the discovery pool's lease record (boot.py)
OVERRIDES = "overrides"  # key: node name; operators' overrides of desired state
OBSERVED = "observed"  # key: node name; published observed fields (kept by etcd only)
ASSIGNED = "assigned"  # key: node name; {"image", "digest"} its agent is told to run (lifecycle)
CLIENTS = "clients"  # key: MAC; {"address"} of its pool lease (etcd only: one address a MAC)

Record = dict[str, Any]
Changed = Callable[[str, str, Record | None], None]
Write = tuple[str, str, Record, Record | None]  # kind, key, record, the record it replaces


class Unreachable(Exception):
    """The store every instance shares did not answer or refused (the message says which)."""


class Backend(Protocol):
    instance: str | None  # this instance's name in a cluster; None: a single server

    def load(self, kind: str) -> dict[str, Record]:
        """Every record of a kind, at start (synchronous)."""
        ...

    def get(self, kind: str, key: str) -> Record | None:
        """The record of a key as this instance knows it now."""
        ...

    def put(self, kind: str, key: str, record: Record) -> None:
        """Write one record (local: journalled at once; etcd: in order, batched)."""
        ...

    def delete(self, kind: str, key: str) -> None: ...

    def amend(self, kind: str, key: str, record: Record) -> None:
        """A put that must not revert a newer record another instance wrote meanwhile (a
        boot id learned under a token another instance may have replaced): it lands only
        if the key is still as this instance last saw it, else the newer one is read back
        and reaches ``on_change`` (one server: a put)."""
        ...

    async def create(self, kind: str, key: str, record: Record) -> bool:
        """Write only if no record of that key exists; False: someone has it."""
        ...

    async def replace(self, kind: str, key: str, record: Record, expected: Record | None) -> bool:
        """Compare-and-swap against the record last seen (None: absent)."""
        ...

    async def replace_all(self, writes: Sequence[Write]) -> bool:
        """``replace`` of several keys in one transaction: all of them, or none."""
        ...

    async def flush(self) -> None:
        """Every put so far is durable."""
        ...

    async def written(self, kind: str, key: str) -> None:
        """The last put or delete of this key is durable (an answer that hands it to
        another instance may go out)."""
        ...

    async def fresh(self, kind: str, key: str) -> None:
        """Read this key again where every instance writes it; a change reaches
        ``on_change`` (one server: there is nowhere else to read). Raises Unreachable."""
        ...

    def on_change(self, callback: Changed) -> None:
        """Records changed by another instance (local: never called)."""
        ...

    async def close(self) -> None: ...


# kind -> (journal file, the field of a line that holds the key)
JOURNALS = {TOKENS: ("boots.jsonl", "node"), LEASES: ("leases.jsonl", "address"),
            OVERRIDES: ("overrides.jsonl", "node"),
            ASSIGNED: ("assigned.jsonl", "node")}  # fmt: skip
BINDINGS_FILE = "bindings.json"  # {node: mac}, rewritten whole (a binding changes rarely)
OLD_TOKENS = "boots.json"  # releases before the journal: the whole table; read once


class LocalJournal:
    """The state directory of one server: a Journal per kind (one line per put, the key as
    a field of the line), bindings as one small JSON file. ``load`` returns a record
    without its key field; ``put`` adds it."""

    instance = None  # one server: nobody else writes its records

    def __init__(self, state_dir: Path) -> None:
        self.files = StateFiles(state_dir)
        self._live: dict[str, dict[str, Record]] = {}
        self._journals = {
            kind: Journal(state_dir / name, key=field) for kind, (name, field) in JOURNALS.items()
        }

    def load(self, kind: str) -> dict[str, Record]:
        if kind == BINDINGS:
            macs = self.files.read(BINDINGS_FILE)
            live = {node: {"mac": mac} for node, mac in macs.items() if isinstance(mac, str)}
        elif kind in self._journals:
            journal = self._journals[kind]
            field = journal.key
            records = journal.replay()
            live = {r[field]: {k: v for k, v in r.items() if k != field} for r in records}
            if kind == TOKENS:
                live = self._upgraded_tokens(live)
        else:
            live = {}  # OBSERVED: a single server rebuilds it from the network
        self._live[kind] = live
        return {key: dict(record) for key, record in live.items()}

    def get(self, kind: str, key: str) -> Record | None:
        return self._live.get(kind, {}).get(key)

    def put(self, kind: str, key: str, record: Record) -> None:
        """Raises OSError when a journal cannot be written (the answer that depends on the
        record must then not be sent as if it were kept). A kind it keeps no file of
        (OBSERVED) is not even held in memory."""
        if kind != BINDINGS and kind not in self._journals:
            return
        live = self._live.setdefault(kind, {})
        live[key] = dict(record)
        if kind == BINDINGS:
            self._write_bindings()
        elif kind in self._journals:
            journal = self._journals[kind]
            journal.append([{journal.key: key, **record}])
            if journal.crowded(len(live)):
                journal.compact(list(live.items()))

    def amend(self, kind: str, key: str, record: Record) -> None:
        """One server: no one else writes its records."""
        self.put(kind, key, record)

    def delete(self, kind: str, key: str) -> None:
        live = self._live.setdefault(kind, {})
        if live.pop(key, None) is None:
            return
        if kind == BINDINGS:
            self._write_bindings()
        elif kind in self._journals:
            self._rewrite(kind)

    async def create(self, kind: str, key: str, record: Record) -> bool:
        if key in self._live.setdefault(kind, {}):
            return False
        self.put(kind, key, record)
        return True

    async def replace(self, kind: str, key: str, record: Record, expected: Record | None) -> bool:
        return await self.replace_all([(kind, key, record, expected)])

    async def replace_all(self, writes: Sequence[Write]) -> bool:
        if any(self.get(kind, key) != expected for kind, key, _, expected in writes):
            return False
        for kind, key, record, _ in writes:
            self.put(kind, key, record)
        return True

    async def flush(self) -> None:
        """Every put is written before it returns."""

    async def written(self, kind: str, key: str) -> None:
        """Every put is written before it returns."""

    async def fresh(self, kind: str, key: str) -> None:
        """One server: its records change nowhere else."""

    def on_change(self, callback: Changed) -> None:
        """One server: nobody else changes its records."""

    async def close(self) -> None:
        for journal in self._journals.values():
            journal.close()

    def _write_bindings(self) -> None:
        macs = {node: record["mac"] for node, record in self._live[BINDINGS].items()}
        self.files.write(BINDINGS_FILE, macs)

    def _rewrite(self, kind: str) -> None:
        journal = self._journals[kind]
        journal.rewrite([{journal.key: k, **r} for k, r in self._live[kind].items()])

    def _upgraded_tokens(self, live: dict[str, Record]) -> dict[str, Record]:
        """Tokens of an older release: ``boots.json`` (the whole table) or tokens in clear
        (``token``). They are hashed as read and the journal rewritten at once with digests
        only, so a node booted before the upgrade goes on reporting."""
        old = self.files.read(OLD_TOKENS) if not live else {}
        live |= {name: r for name, r in old.items() if isinstance(r, dict)}
        in_clear = False
        for record in live.values():
            token = record.pop("token", None)
            in_clear = in_clear or token is not None
            if not isinstance(record.get("sha256"), str) and isinstance(token, str):
                record["sha256"] = digests.digest(token)
        if old or in_clear:
            self._live[TOKENS] = live
            try:
                self._rewrite(TOKENS)
                if old:
                    (self.files.directory / OLD_TOKENS).unlink()
            except OSError as error:
                log.error("cannot rewrite %s with digests only: %s", JOURNALS[TOKENS][0],
                          error.strerror)  # fmt: skip
        return live
