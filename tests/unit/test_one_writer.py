"""Only the node store's writer assigns node state: a static check of the whole package.

Every attribute assignment (``=``, ``+=``, annotated, tuple targets, ``setattr``) whose
attribute is a field of ``Node`` or ``Boot`` and whose object is a node or a boot — by
name (``node``, ``boot``, ``*_node``), by annotation, by where it came from (``Node(...)``,
``store.nodes[...]``, ``by_mac(...)``...) or as ``<anything>.boot`` — must be inside the
store's writer methods."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

import layerpy
from layerpy.model import Boot, Node

SRC = Path(layerpy.__file__).parent
FIELDS = {f.name for f in fields(Node)} | {f.name for f in fields(Boot)}
WRITERS = {"nodes/store.py": {"apply", "apply_change", "_node_effect", "_observe"}}
NODE_NAME = re.compile(r"(^|_)(node|boot)$")
NODE_CALLS = {"Node", "Boot", "get", "by_mac", "by_ip", "at"}  # .get only on .nodes


def _called(value: ast.expr) -> bool:
    """Whether an expression yields a node or a boot by where it comes from."""
    if isinstance(value, ast.Subscript):
        return isinstance(value.value, ast.Attribute) and value.value.attr == "nodes"
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    if name == "get":
        return isinstance(func, ast.Attribute) and getattr(func.value, "attr", "") == "nodes"
    return name in NODE_CALLS


def _typed(annotation: ast.expr | None) -> bool:
    return annotation is not None and bool(re.search(r"\b(Node|Boot)\b", ast.unparse(annotation)))


class Writes(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[tuple[int, str, str]] = []  # line, function, assignment
        self.function = ""
        self.names: set[str] = set()  # the function's names known to be nodes or boots

    def visit_FunctionDef(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer = self.function, self.names
        self.function = fn.name
        every = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        self.names = {a.arg for a in every if _typed(a.annotation)}
        for inner in ast.walk(fn):  # where names get their value (order does not matter)
            if isinstance(inner, ast.Assign) and _called(inner.value):
                self.names |= {t.id for t in inner.targets if isinstance(t, ast.Name)}
            elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                if _typed(inner.annotation) or (inner.value and _called(inner.value)):
                    self.names.add(inner.target.id)
            elif isinstance(inner, ast.For) and isinstance(inner.target, ast.Name):
                self.names |= {inner.target.id} if "nodes" in ast.unparse(inner.iter) else set()
        self.generic_visit(fn)
        self.function, self.names = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def _node(self, value: ast.expr) -> bool:
        if isinstance(value, ast.Attribute) and value.attr == "boot":
            return True
        if isinstance(value, ast.Name):
            return value.id in self.names or bool(NODE_NAME.search(value.id))
        return _called(value)

    def _target(self, target: ast.expr, statement: ast.stmt) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for element in target.elts:
                self._target(element, statement)
        elif (
            isinstance(target, ast.Attribute) and target.attr in FIELDS and self._node(target.value)
        ):
            self.found.append((statement.lineno, self.function, ast.unparse(statement)))

    def visit_Assign(self, statement: ast.Assign) -> None:
        for target in statement.targets:
            self._target(target, statement)
        self.generic_visit(statement)

    def visit_AugAssign(self, statement: ast.AugAssign | ast.AnnAssign) -> None:
        self._target(statement.target, statement)
        self.generic_visit(statement)

    visit_AnnAssign = visit_AugAssign

    def visit_Expr(self, statement: ast.Expr) -> None:
        call = statement.value
        setattr_ = isinstance(call, ast.Call) and getattr(call.func, "id", "") == "setattr"
        if setattr_ and call.args and self._node(call.args[0]):
            self.found.append((statement.lineno, self.function, ast.unparse(statement)))
        self.generic_visit(statement)


def writes(source: str) -> list[tuple[int, str, str]]:
    visitor = Writes()
    visitor.visit(ast.parse(source))
    return visitor.found


def test_only_the_store_writer_assigns_node_fields() -> None:
    outside = []
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        allowed = WRITERS.get(name, set())
        outside += [f"{name}:{line} in {fn}(): {text}"
                    for line, fn, text in writes(path.read_text()) if fn not in allowed]  # fmt: skip
    assert not outside, "node fields assigned outside NodeStore.apply:\n" + "\n".join(outside)


def test_the_check_sees_writes_and_not_other_objects() -> None:
    """What it must catch, and what it must leave alone (e.g. an unknown machine's claim)."""
    caught = """
def a(self, name, now):
    node = self.store.nodes[name]
    node.last_report = now
def b(n: Node):
    n.boots += 1
def c(self, mac):
    found = self.nodes.get(mac)
    found.mac, other = mac, 1
def d(target):
    target.boot.boot_id = "b"
def e(node, value):
    setattr(node, "run_state", value)
def f(self):
    for each in self.nodes.values():
        each.ip = None
"""
    assert [fn for _, fn, _ in writes(caught)] == ["a", "b", "c", "d", "e", "f"]
    left = """
def g(self, machine, mac):
    machine.claim = mac
    self.config = None
    lease.mac = mac
    record = {}
    record["run_state"] = 1
"""
    assert writes(left) == []
