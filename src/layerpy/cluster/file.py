"""The node file a cluster's instances share through etcd: published by the first, joined
by the others when their rest is the same, changed by `layerpy reload` in two phases and
applied by every instance whole, or by none (docs/ha.md).

Keys, under the cluster's prefix:
  file                  the file in force: JSON {"revision", "text", "by"}
  file/proposed         a reload under way: JSON {"text", "by", "base"}, on a lease of its
                        own, so that a proposer's death clears it (with its verdicts)
  file/verdict/<name>   each live instance's verdict on it: JSON {"proposal", "ok",
                        "problems"}, on the proposal's lease
  instances/<name>      the live instances (kept by the membership, not here)

A reload: the proposing instance checks the text itself, publishes it as the proposal (only
if none is under way and the file is still the one it read), and waits for a verdict from
every live instance; each checks it (parses, validates, and would apply it with its own
settings and local files). All accept: the proposer commits it as the next revision in one
transaction (the file's mod_revision compared, so of two reloads one wins), and every
instance applies it. One refuses, or a live one stays silent: it is committed nowhere, and
the proposer says who and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from layerpy.cluster.etcd import (
    Compacted,
    Compare,
    Etcd,
    EtcdError,
    EtcdUnavailable,
    KeyValue,
    Op,
)
from layerpy.config import ReloadRefused
from layerpy.config.shared import rest_differs
from layerpy.logs import Outage
from layerpy.text import printable

log = logging.getLogger("layerpy.cluster.file")

T = TypeVar("T")

ANSWER_WITHIN = 20.0  # seconds the proposer waits for every live instance's verdict
GRACE = 10  # seconds a proposal outlives that wait, for the commit (its lease's TTL adds it)
RETRY = 1.0  # seconds between tries while etcd cannot be reached
SHOWN = 20  # problems of one instance's verdict shown


@dataclass(frozen=True)
class Committed:
    """A revision of the cluster's node file."""

    revision: int
    text: str
    by: str  # the instance that published it


class FileRefused(Exception):
    """This instance's node file differs from the cluster's outside its own settings: it
    does not start. The message names the key and says what to do."""


class SharedFile(Generic[T]):
    """One instance's side of the shared node file.

    ``check(text)`` says whether this instance could run the cluster's file ``text`` (with
    its own settings): it raises ReloadRefused if not, and changes nothing.
    ``apply(committed)`` applies a committed file whole (it may still raise ReloadRefused,
    logged: the instance then stays on the revision it runs).
    """

    def __init__(
        self,
        etcd: Etcd,
        name: str,
        prefix: str,
        own_text: str,
        *,
        check: Callable[[str], Awaitable[object]],
        apply: Callable[[Committed], Awaitable[T]],
        answer_within: float = ANSWER_WITHIN,
    ) -> None:
        self.etcd, self.name, self.own_text = etcd, name, own_text
        self._check, self._apply = check, apply
        self.answer_within = answer_within
        self._file = f"{prefix}/file"
        self._proposed = f"{prefix}/file/proposed"
        self._verdicts = f"{prefix}/file/verdict/"
        self._instances = f"{prefix}/instances/"
        self.revision = 0  # of the file this instance runs; 0 before start
        self._seen = 0  # the etcd revision the run loop has followed up to
        self._applying = asyncio.Lock()  # one apply at a time, each revision once

    async def start(self) -> Committed:
        """The file in force: this instance's own, published as revision 1 if the cluster
        has none yet (one transaction: of two first instances one publishes, the other
        joins), else the cluster's, if its rest is this file's. Raises FileRefused if not."""
        kv = await self.etcd.get(self._file)
        if kv is None:
            first = _encode({"revision": 1, "text": self.own_text, "by": self.name})
            result = await self.etcd.txn(
                [Compare.version(self._file, "==", 0)],
                [Op.put(self._file, first)],
                [Op.get(self._file)],
            )
            if result.succeeded:
                log.info("published this node file as the cluster's, revision 1")
                self.revision = 1
                return Committed(1, self.own_text, self.name)
            kv = result.responses[0][0]
        try:
            committed = _committed(kv)
        except ValueError as error:
            raise FileRefused(f"{error}: put a node file there with layerpy reload") from None
        if why := rest_differs(self.own_text, committed.text, committed.revision):
            raise FileRefused(
                f"{why}. Outside its own settings ([server], [api], [cluster]) an "
                "instance's node file must be the cluster's: to change the cluster's, edit "
                "it on a running instance and run `layerpy reload` there; to join, copy the "
                f"cluster's here and keep this instance's own settings (`etcdctl get "
                f'{self._file} --print-value-only` prints it, as JSON: its "text")'
            )
        log.info("joined the cluster's node file, revision %d (by %s)", committed.revision,
                 committed.by)  # fmt: skip
        self.revision = committed.revision
        return committed

    async def run(self) -> None:
        """Forever: a verdict on every other instance's proposal, and every committed
        revision applied in order. Survives etcd's absence (it waits and resumes)."""
        reread = True  # first: a proposal made before this instance followed is judged too
        outage = Outage(log, "following the cluster's node file")
        while True:
            try:
                if reread:
                    await self._catch_up()
                    reread = False
                    outage.ok()
                watch = self.etcd.watch(self._file, self._seen + 1)
                async with contextlib.aclosing(watch):
                    async for events in watch:
                        for event in events:
                            await self._follow(event.kind, event.kv)
                        self._seen = events[-1].kv.mod_revision
            except Compacted:
                log.warning("etcd's history of the node file was compacted; reading it again")
                reread = True
            except (EtcdError, EtcdUnavailable) as error:
                outage.failed(str(error))
                await asyncio.sleep(RETRY)

    async def propose(self, text: str) -> T:
        """``layerpy reload``: ``text`` (this instance's node file, read again) checked by
        every live instance, then committed and applied here; what ``apply`` returned.
        Raises ReloadRefused (nothing committed) naming who refused and why."""
        await self._check(text)  # refused here: nothing is published
        try:
            return await self._propose(text)
        except (EtcdError, EtcdUnavailable) as error:
            raise ReloadRefused([f"etcd: {printable(error, 500)}"]) from None

    async def _propose(self, text: str) -> T:
        found = await self.etcd.get(self._file)
        if found is None:
            raise ReloadRefused(["the cluster has no node file yet (no instance has started)"])
        try:
            current = _committed(found)
        except ValueError as error:
            raise ReloadRefused([str(error)]) from None
        base = found.mod_revision
        lease = await self.etcd.grant(math.ceil(self.answer_within) + GRACE)
        try:
            live = await self._live()
            proposal = _encode({"text": text, "by": self.name, "base": current.revision})
            result = await self.etcd.txn(
                [Compare.version(self._proposed, "==", 0),
                 Compare.mod_revision(self._file, "==", base)],
                [Op.put(self._proposed, proposal, lease)],
                [Op.get(self._proposed)],
            )  # fmt: skip
            if not result.succeeded:
                raise ReloadRefused([_why_not(result.responses[0])])
            created = result.revision
            await self.etcd.put(self._verdicts + self.name, _verdict(created, []), lease=lease)
            await self._wait_for_verdicts(created, live - {self.name})
            return await self._commit(text, current.revision, base, created)
        finally:
            with contextlib.suppress(EtcdError, EtcdUnavailable):
                await self.etcd.revoke(lease)  # the proposal and its verdicts go with it

    async def _commit(self, text: str, revision: int, base: int, created: int) -> T:
        """The next revision, if the file is still the one the proposal was made on and the
        proposal still ours; applied here before the run loop sees it (it skips it then)."""
        committed = Committed(revision + 1, text, self.name)
        value = _encode({"revision": committed.revision, "text": text, "by": self.name})
        async with self._applying:
            result = await self.etcd.txn(
                [Compare.mod_revision(self._file, "==", base),
                 Compare.create_revision(self._proposed, "==", created)],
                [Op.put(self._file, value), Op.delete(self._proposed)],
            )  # fmt: skip
            if not result.succeeded:
                raise ReloadRefused([
                    "the proposal expired or the cluster's file changed meanwhile: run "
                    "layerpy reload again"
                ])  # fmt: skip
            log.info("committed the node file as revision %d", committed.revision)
            try:
                return await self._applied(committed)
            except ReloadRefused as refused:  # it changed here since its check: rare, but say so
                raise ReloadRefused([
                    f"committed as revision {committed.revision} for the cluster, but this "
                    "instance could not apply it (it runs the one before):", *refused.problems,
                ]) from None  # fmt: skip

    async def _wait_for_verdicts(self, proposal: int, others: set[str]) -> None:
        """Until every other live instance accepted; ReloadRefused at the first refusal,
        or when one still live has not answered in time."""
        if not others:
            return
        answered: set[str] = set()
        watch = self.etcd.watch(self._verdicts, proposal + 1)
        try:
            async with asyncio.timeout(self.answer_within):
                async with contextlib.aclosing(watch):
                    async for events in watch:
                        for event in events:
                            verdict = _verdict_of(event.kind, event.kv, proposal)
                            if verdict is None:
                                continue
                            who, problems = verdict
                            if problems:
                                raise ReloadRefused([f"{who} refused it: {problem}"
                                                     for problem in problems[:SHOWN]])  # fmt: skip
                            answered.add(who)
                        if not others - answered:
                            break
        except TimeoutError:
            silent = sorted((await self._live()) & (others - answered))
            if silent:
                raise ReloadRefused([
                    f"no verdict from {', '.join(silent)} within {self.answer_within:g} s "
                    "(alive in etcd but silent: see its log), so nothing changed anywhere"
                ]) from None  # fmt: skip
            # the silent ones have died meanwhile: a dead instance checks the file at its start

    async def _follow(self, kind: str, kv: KeyValue) -> None:
        if kind != "put":
            return
        if kv.key == self._file:
            try:
                committed = _committed(kv)
            except ValueError as error:
                log.error("the cluster's node file in etcd is unreadable: %s", error)
                return
            async with self._applying:
                if committed.revision > self.revision:
                    with contextlib.suppress(ReloadRefused):  # logged by _applied
                        await self._applied(committed)
        elif kv.key == self._proposed:
            await self._judge(kv)

    async def _judge(self, kv: KeyValue) -> None:
        """This instance's verdict on another's proposal, on the proposal's lease (it goes
        with the proposal)."""
        try:
            proposal = json.loads(kv.value)
            text, by = proposal["text"], proposal["by"]
            if not isinstance(text, str) or not isinstance(by, str):
                raise TypeError
        except (ValueError, TypeError, KeyError):
            log.error("a proposed node file in etcd is unreadable (not JSON with its text)")
            return
        if by == self.name:
            return  # the proposer's own verdict is its own check, before it proposed
        try:
            await self._check(text)
            problems: list[str] = []
        except ReloadRefused as refused:
            problems = refused.problems or ["refused"]
            log.warning("refused the node file %s proposed: %s", printable(by, 64),
                        "; ".join(problems))  # fmt: skip
        try:
            await self.etcd.put(
                self._verdicts + self.name, _verdict(kv.create_revision, problems), lease=kv.lease
            )
        except EtcdError as error:  # the proposal's lease went: nobody waits for it any more
            log.info("no verdict given on the proposal of %s: %s", printable(by, 64), error)

    async def _applied(self, committed: Committed) -> T:
        """Apply a committed revision (the caller holds the lock)."""
        try:
            result = await self._apply(committed)
        except ReloadRefused as refused:
            log.error(
                "revision %d of the cluster's node file (by %s) cannot be applied here, this "
                "instance stays on revision %d: %s", committed.revision, committed.by,
                self.revision, "; ".join(refused.problems),
            )  # fmt: skip
            raise
        self.revision = committed.revision
        log.info("applied revision %d of the cluster's node file (by %s)", committed.revision,
                 committed.by)  # fmt: skip
        return result

    async def _catch_up(self) -> None:
        """The file as it is now, applied if newer, and a verdict on a proposal under way
        (at the start of the run loop, and after a compaction)."""
        kvs, self._seen = await self.etcd.range(self._file)
        for kv in kvs:
            if kv.key in (self._file, self._proposed):
                await self._follow("put", kv)

    async def _live(self) -> set[str]:
        kvs, _ = await self.etcd.range(self._instances)
        return {kv.key.removeprefix(self._instances) for kv in kvs}


def _why_not(proposed: list[KeyValue]) -> str:
    """Why a proposal was not made: another is under way, or the file changed."""
    if not proposed:
        return "the cluster's file changed meanwhile: run layerpy reload again"
    try:
        by = printable(json.loads(proposed[0].value)["by"], 64)
    except (ValueError, KeyError, TypeError):
        by = "another instance"
    return f"another reload is under way (proposed by {by}): run layerpy reload again after it"


def _committed(kv: KeyValue) -> Committed:
    try:
        value = json.loads(kv.value)
        committed = Committed(value["revision"], value["text"], value["by"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{kv.key} is not JSON with a revision, a text and a by") from None
    if not (isinstance(committed.revision, int) and isinstance(committed.text, str)
            and isinstance(committed.by, str)):  # fmt: skip
        raise ValueError(f"{kv.key} is not JSON with a revision, a text and a by")
    return committed


def _verdict(proposal: int, problems: list[str]) -> bytes:
    return _encode({"proposal": proposal, "ok": not problems, "problems": problems})


def _verdict_of(kind: str, kv: KeyValue, proposal: int) -> tuple[str, list[str]] | None:
    """Who gave a verdict on this proposal, and the problems (none: accepted)."""
    if kind != "put":
        return None
    try:
        verdict = json.loads(kv.value)
        if verdict["proposal"] != proposal:
            return None
        problems = [printable(problem, 1000) for problem in verdict["problems"]]
        ok = verdict["ok"] is True and not problems
    except (ValueError, KeyError, TypeError):
        return None
    who = printable(kv.key.rpartition("/")[2], 64)
    return who, [] if ok else problems or ["refused"]


def _encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()
