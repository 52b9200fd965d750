"""The node lifecycle as data: the variables of a node's state and the mutations between
them. The engine runs this table; ``layerpy plan`` and ``explain`` read it, and
docs/lifecycle.md shows it (``markdown_table``; a test keeps the two equal)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from layerpy.config import NodeConfig
from layerpy.engine import ANY, Mutation, Variable
from layerpy.model import Busy, ImageState, PowerState, RunState

P, R, I = PowerState, RunState, ImageState  # noqa: E741 (the table reads better short)

VARIABLES = (
    Variable("power", tuple(PowerState)),
    Variable("run", tuple(RunState)),
    Variable("busy", tuple(Busy)),
    # as the agent reports it; "stale" is active with another digest than the file wants
    Variable("image", tuple(ImageState)),
)
_DONT_CARE = dict.fromkeys(v.name for v in VARIABLES)  # a cfg that wants nothing

FORGOTTEN_ON_POWER = ("run", "busy", "image")
BOOT_TIMEOUT = 120.0
NOT_BUSY = {"busy": frozenset({Busy.BUSY})}


def mutations(boot_timeout: float = BOOT_TIMEOUT) -> tuple[Mutation, ...]:
    """What can change, when, how long it may take, and what a timeout means."""
    return (
        Mutation("power.on", {"power": (P.OFF, P.ON)}, action="power_on",
                 timeout=30, fail_to={"power": P.ERROR}),
        Mutation("power.off", {"power": (P.ON, P.OFF)}, action="power_off", excludes=NOT_BUSY,
                 forgets=FORGOTTEN_ON_POWER, timeout=30, fail_to={"power": P.ERROR}),
        Mutation("power.cycle", {"power": (P.HANG, P.ON)}, action="power_cycle",
                 forgets=FORGOTTEN_ON_POWER, timeout=30, fail_to={"power": P.ERROR}),
        Mutation("power.off_hung", {"power": (P.HANG, P.OFF)}, action="power_off",
                 forgets=FORGOTTEN_ON_POWER, timeout=30, fail_to={"power": P.ERROR}),
        Mutation("power.retry", {"power": (P.ERROR, P.UNKNOWN)}, action="power_status",
                 timeout=30, fail_to={"power": P.ERROR}, cost=5),
        Mutation("boot.wait", {"run": (ANY, R.READY)}, requires={"power": P.ON},
                 timeout=boot_timeout, fail_to={"power": P.HANG}, cost=2,
                 doc="waits for the boot"),
        Mutation("boot.recover", {"run": (R.LOST, R.READY)}, requires={"power": P.ON},
                 timeout=10, fail_to={"power": P.HANG}, doc="waits for reports to resume"),
        # the agent switches without a reboot once told; a busy node is drained first
        Mutation("image.activate", {"image": (ANY, I.ACTIVE)}, action="image_assign",
                 requires={"run": R.READY}, excludes=NOT_BUSY,
                 timeout=300, fail_to={"image": I.ERROR}),
    )  # fmt: skip


def desired(node: NodeConfig, override: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """cfg for a node, every variable named (None: don't care): the file's power (or a
    run-time override), a powered node ready and running its image. Without a BMC,
    power is not layerpy's to want."""
    wanted: dict[str, str | None] = dict(_DONT_CARE)
    if (override or {}).get("image", node.image):
        wanted["image"] = ImageState.ACTIVE
    if node.bmc is None:
        return wanted
    if (override or {}).get("power", node.power) == PowerState.OFF:
        return {**wanted, "power": PowerState.OFF, "image": None}
    return {**wanted, "power": PowerState.ON, "run": RunState.READY}


def markdown_table(table: Iterable[Mutation], actions: Mapping[str, str]) -> str:
    """The table as docs/lifecycle.md shows it; ``actions`` maps an action to what it does."""
    rows = [
        "| mutation | change | guard | action | timeout → falls to |",
        "|---|---|---|---|---|",
    ]
    for m in table:
        change = "; ".join(f"{var} {frm} → {to}" for var, (frm, to) in m.changes.items())
        guards = [f"{var} {_either(values)}" for var, values in m.requires.items()]
        guards += [f"not {_either(values)}" for values in m.excludes.values()]
        if m.forgets:
            guards.append(f"forgets {', '.join(m.forgets)}")
        does = actions[m.action] if m.action else f"({m.doc})"
        falls = " ".join(f"{var}={value}" for var, value in m.fail_to.items())
        timeout = f"{m.timeout:g} s → {falls}" if m.timeout else ""
        rows.append(f"| `{m.name}` | {change} | {'; '.join(guards)} | {does} | {timeout} |")
    return "\n".join(rows)


def _either(values: Iterable[str]) -> str:
    return "\\|".join(sorted(values))  # a bar inside a Markdown table cell
