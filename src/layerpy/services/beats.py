"""Datagram heartbeats, the server's side (``layerpy.proto.beat``): a beat that verifies and
changes nothing costs a dictionary look-up, an HMAC and the store's quiet heartbeat.

A full report over HTTP gets a beat key for the node's boot in its answer (`offer`), and
this table notes what the node was told (the answer's inputs) and what the server then
held of it (its facts). A beat is taken (`judge`) while both are still so; otherwise the
reply asks for a full report, which carries the whole contract. Keys live in memory only:
after a restart, or at another instance, the first beat goes unanswered and the agent
reports over HTTP, getting a fresh key. Nothing is logged per beat: outcomes are counted.
"""

from __future__ import annotations

import logging
import operator
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from layerpy.host import cannot_listen
from layerpy.model import Node, RunState
from layerpy.proto import beat
from layerpy.proto.agent import BeatOffer
from layerpy.services.datagrams import Datagrams, deep_buffers

log = logging.getLogger("layerpy.beats")


def facts(node: Node) -> tuple[object, ...]:
    """What the server holds of a node that a full report sets or another writer may change
    (a power change forgets the image, the lost detector the run state, a new boot the
    token): a beat stands for an unchanged report only while these are as it left them."""
    boot = node.boot
    return (
        node.run_state, node.busy, node.image_state, node.image_digest, node.image_error,
        node.files_revision, node.files_error, node.ip, node.mac, node.hostname, node.problem,
        node.secure_boot, node.heard_by, boot, boot and boot.token_digest, boot and boot.boot_id,
    )  # fmt: skip


@dataclass(slots=True)
class Held:
    """A node's beat key for its boot, the newest beat taken, and what stood at its last
    full report."""

    key: bytes
    boot: str | None  # the token digest the key was made under
    seq: int
    basis: tuple[object, ...]
    facts: tuple[object, ...]


class Beats:
    """The beat table; its one writer. Sans-I/O: `judge` takes a datagram, returns the
    reply to send (or None), and records the beat in the node store."""

    def __init__(
        self,
        port: int,
        nodes: dict[str, Node],
        basis: Callable[[str], tuple[object, ...]],
        heard: Callable[[str, int, float], None],
        count: Callable[[str], None],
    ) -> None:
        """`basis(name)`: what the node's answer is made of (compared by equality, cheap);
        `heard(name, seq, uptime)`: the store's record of an unchanged heartbeat;
        `count(outcome)`: one of OUTCOMES."""
        self.port = port
        self.nodes = nodes
        self.basis = basis
        self.heard = heard
        self.count = count
        self.held: dict[str, Held] = {}

    def offer(self, name: str, seq: int) -> BeatOffer | None:
        """After a full report of `name` (seq `seq`) was accepted: the offer for its answer."""
        node = self.nodes.get(name)
        if not self.port or node is None or node.boot is None:
            return None
        digest = node.boot.token_digest
        held = self.held.get(name)
        if held is None or held.boot != digest:
            key = os.urandom(beat.KEY_SIZE)
            held = self.held[name] = Held(key, digest, seq, (), ())
        held.seq = max(held.seq, seq)
        held.basis, held.facts = self.basis(name), facts(node)
        return BeatOffer(self.port, held.key.hex())

    def judge(self, data: bytes) -> bytes | None:
        """The reply to a datagram, or None (dropped and counted)."""
        got = beat.read_beat(data)
        if got is None:
            self.count("malformed")
            return None
        held = self.held.get(got.node)
        if held is None:
            self.count("unknown")
            return None
        if not beat.verified(held.key, got):
            self.count("forged")
            return None
        if got.seq <= held.seq:
            self.count("replayed")
            return None
        held.seq = got.seq
        node = self.nodes.get(got.node)
        if node is None:  # a reload removed it
            del self.held[got.node]
            self.count("unknown")
            return None
        basis = self.basis(got.node)
        if node.run_state != RunState.READY or facts(node) != held.facts or basis != held.basis:
            self.count("report")
            return beat.reply(held.key, got.seq, beat.Verdict.REPORT)
        if not all(map(operator.is_, basis, held.basis)):
            held.basis = basis  # equal, made anew by a reload: compared by identity from now on
        self.heard(got.node, got.seq, got.uptime)
        self.count("ok")
        return beat.reply(held.key, got.seq, beat.Verdict.OK)


OUTCOMES = ("ok", "report", "malformed", "unknown", "forged", "replayed", "dropped")
BEAT_TAKEN = ("ok", "report")  # the others are failures: dropped, unanswered


class BeatListener:
    """The UDP socket beats arrive on (the boot HTTP listener's address)."""

    def __init__(self, beats: Beats, address: str) -> None:
        self.beats = beats
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setblocking(False)
            deep_buffers(sock)  # 10 000 beats a second: a 20 ms pause would overflow the default
            sock.bind((address, beats.port))
        except OSError as error:
            sock.close()
            raise cannot_listen("heartbeat", error, beats.port, address=address) from None
        self.datagrams = Datagrams(sock)
        self.datagrams.listen(self._received)
        log.info("heartbeats by datagram on %s udp %d", address, beats.port)

    def _received(self, data: bytes, sender: tuple[str, int]) -> None:
        answer = self.beats.judge(data)
        if answer is not None and not self.datagrams.send(answer, sender):
            self.beats.count("dropped")

    def close(self) -> None:
        self.datagrams.close()
