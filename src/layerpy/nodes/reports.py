"""Admission of agent reports: who may report (its boot token, its protocol), what a report
may change (not which machine a node is), and the node it makes the agent (a discovered or
moved machine is handed over to its node, with a token of its own)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

from layerpy.model import Busy, ImageState, Node, Phase, RunState
from layerpy.nodes import identity, tokens
from layerpy.nodes.discovery import DISCOVERY
from layerpy.nodes.effects import Effect, Event, Machine, Mark, NewBoot, Observe, Store, Token
from layerpy.proto.agent import ContractError, Identity, ProtocolMismatch, Report
from layerpy.proto.agent import Event as AgentEvent

log = logging.getLogger("layerpy.nodes")

ALIVE = (RunState.INIT, RunState.READY)
# a node of a secure_boot group whose firmware says Secure Boot is off: shown as its problem
SECURE_BOOT_OFF = (
    "Secure Boot is off, but the node file has secure_boot = true for it: its firmware ran "
    "the signed path unchecked (turn Secure Boot on in its firmware setup)"
)


class ReportRejected(Exception):
    def __init__(self, status: int, reason: str, token_of: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.token_of = token_of  # the node whose boot token the report did not hold


@dataclass(frozen=True)
class Ack:
    """An accepted report: the node the agent is now, and the identity to hand it when
    the machine turned out to be another node (a discovered or moved machine)."""

    node: str
    identity: Identity | None = None


Outcome = tuple[list[Effect], Ack | ReportRejected]


def admit(store: Store, payload: Any) -> Outcome:
    """An agent report (parsed JSON): what it changes, and the answer or why it is refused
    (a refused report may still change something: a wrong protocol is shown on its node)."""
    try:
        report = Report.from_json(payload)
    except ProtocolMismatch as mismatch:
        return wrong_protocol(store, mismatch), ReportRejected(400, str(mismatch))
    except ContractError as error:
        return [], ReportRejected(400, str(error))
    if report.node == DISCOVERY:
        return _discovery(store, report)
    node = store.nodes.get(report.node)
    if node is None:
        return [], ReportRejected(404, f"no node named {report.node!r} in the node file")
    if not tokens.holds(node, report.token):
        return [], ReportRejected(403, f"wrong boot token for {node.name}", node.name)
    bound = store.mac_of(node)
    if bound is not None and report.mac != bound:  # a node may not change its MAC
        return _lied(node, f"reports MAC {report.mac}, but {node.name} is {bound}"), Ack(node.name)
    located, effects = identity.lldp_node(store, report)
    if located is not None and located is not node:  # the machine moved to another port
        return _hand_over(effects, located)
    return [*effects, *_accepted(store, node, report)], Ack(node.name)


def _accepted(store: Store, node: Node, report: Report) -> list[Effect]:
    """A report of the node's own agent: its boot, its facts, its run state."""
    boot = node.boot
    assert boot is not None  # it holds the boot's token
    effects: list[Effect] = []
    state, resumed = node.run_state, boot.resumed and not boot.phases
    if boot.boot_id and report.boot_id != boot.boot_id:
        log.info("%s: agent reports a new boot id without a network boot", node.name)
        effects.append(NewBoot(node.name))
        state, resumed = RunState.BOOTING, False
    if boot.boot_id != report.boot_id:
        effects.append(Token(node.name, boot.token_digest, report.boot_id))
    effects += facts(node, report, store.clock())
    if (resumed or state in (*ALIVE, RunState.LOST)) and report.event != AgentEvent.HELLO:
        return [
            *effects,
            Mark(node.name, Phase.READY),
            Observe(node.name, {"run_state": RunState.READY}),
        ]
    return [
        *effects,
        Mark(node.name, Phase.AGENT_HELLO),
        Observe(node.name, {"run_state": RunState.INIT}),
    ]


def facts(node: Node, report: Report, now: float) -> list[Effect]:
    """What an agent says of its node; the heartbeat itself (when, uptime, seq) is quiet."""
    image, files = report.image, report.files
    unknown = (ImageState.UNKNOWN, ImageState.STALE)
    state = image.state if image.state not in unknown else ImageState.NONE
    busy = Busy.BUSY if report.busy else Busy.FREE
    if busy != node.busy:
        log.info("%s: %s", node.name, busy)
    if (state, image.digest, image.error) != (
        node.image_state,
        node.image_digest,
        node.image_error,
    ):
        reason = f": {image.error}" if image.error else ""
        log.info("%s: image %s %s%s", node.name, state, (image.digest or "-")[:19], reason)
    if (files.revision, files.error) != (node.files_revision, node.files_error):
        reason = f": {files.error}" if files.error else ""
        log.info("%s: files revision %s%s", node.name, files.revision or "-", reason)
    try:
        ip: IPv4Address | None = IPv4Address(report.ip)
    except ValueError:
        ip = None
    if ip == node.config.ip:
        ip = node.config.ip  # the file's own: no address object per node kept besides it
    agent = {
        "agent_version": report.agent_version,
        "timeline": report.timeline,
        "persist": report.persist,
        "platform": report.platform,
    }
    # what changes with every report is kept apart, in plain numbers: a heartbeat leaves
    # no new object behind for the garbage collector to walk (docs/scale.md)
    heard: dict[str, Any] = {"last_report": now, "agent_uptime": report.uptime,
                             "agent_seq": report.seq}  # fmt: skip
    quiet = agent == node.agent
    if not quiet:
        heard["agent"] = agent
    problem = SECURE_BOOT_OFF if node.config.secure_boot and report.secure_boot is False else None
    if problem is not None and node.problem != problem:
        log.warning("%s: %s", node.name, problem)
    return [
        Observe(node.name, heard, quiet=quiet),
        Observe(
            node.name,
            {
                "ip": ip,
                "mac": report.mac,
                "hostname": report.hostname,
                "busy": busy,
                "image_state": state,
                "image_digest": image.digest,
                "image_error": image.error,
                "files_revision": files.revision,
                "files_error": files.error,
                "secure_boot": report.secure_boot,
                "problem": problem,
            },
        ),
    ]


def wrong_protocol(store: Store, mismatch: ProtocolMismatch) -> list[Effect]:
    """An agent of another release: shown on its node, if it holds that node's token."""
    node = store.nodes.get(mismatch.node or "")
    if node is None or mismatch.token is None or not tokens.holds(node, mismatch.token):
        return []
    if node.problem != str(mismatch):
        log.error("%s: %s", node.name, mismatch)
    return [Observe(node.name, {"problem": str(mismatch)})]


def _discovery(store: Store, report: Report) -> Outcome:
    """A machine booted from the pool: once its LLDP neighbour names a node's port, it
    becomes that node (its agent switches identity and address without a reboot)."""
    if store.unknown.check_token(report.mac, report.token) is None:
        return [], ReportRejected(403, f"wrong discovery token for {report.mac}")
    seen: list[Effect] = [Machine(report.mac, {})]
    node, effects = identity.lldp_node(store, report)
    if node is None:
        return [*seen, *effects], Ack(DISCOVERY)
    return _hand_over([*seen, *effects], node)


def _hand_over(effects: list[Effect], node: Node) -> Outcome:
    """Tell an agent to carry on as `node`: a new boot of that node, with its own token."""
    token, handed = tokens.hand_over(node)
    return [*effects, *handed], Ack(node.name, Identity(node.name, token))


def _lied(node: Node, what: str) -> list[Effect]:
    """A report that would change who a node is: ignored, shown on the node."""
    message = f"{what}: ignored (layerpy bind changes a node's machine)"
    events: list[Effect] = (
        [Event(node.name, "conflict", message)] if node.problem != message else []
    )
    return [*events, Observe(node.name, {"problem": message})]
