"""Finding the cache write in a legacy ``forward()`` or ``do_kv_cache_update()``.

A statement writes the cache when it assigns into (or calls an in-place method of) the
``kv_cache`` argument or a view of it, or calls one of the legacy write ops. It is the
*slot write* the migration moves to the writer when its indices or values come from
the slot mapping (``attn_metadata.slot_mapping``, the ``slot_mapping`` argument, or
names computed from them). Statements that only served the write (the slot mapping read,
``keep = slots >= 0``, a ``for`` loop over the slots, an ``if`` around the write) go with
it. Everything else stays; a remaining cache write or slot-mapping read is reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final

import libcst as cst

from vllm.migrate.analysis import ModuleInfo, dotted, suite_body, target_names

WRITE_OPS: Final = {
    "reshape_and_cache_flash": "split",
    "reshape_and_cache": "legacy_paged",
    "concat_and_cache_mla": "mla",
}
"""Legacy write ops (``vllm._custom_ops``, ``torch.ops._C_cache_ops``, ``shim.legacy``)
and the layout family each writes."""

INDEX_WRITES: Final = frozenset({"index_put_", "index_copy_", "scatter_", "put_", "copy_",
                                 "masked_scatter_", "index_add_"})
"""In-place tensor methods that write given indices (or a view) of the cache."""

_METADATA_ATTRS: Final = frozenset({"shape", "dtype", "device", "ndim", "size", "stride",
                                    "numel", "dim", "element_size", "is_contiguous"})
_PURE_CALLS: Final = frozenset({"int", "len", "min", "max", "divmod", "range", "enumerate",
                                "zip", "tuple", "list", "float", "bool"})


@dataclass
class Write:
    """One cache write found."""

    statement: cst.CSTNode
    kind: str
    """``split`` / ``legacy_paged`` / ``mla`` for a write op, ``index`` for an indexed
    assignment or in-place method."""
    what: str
    """The call or assignment, for messages."""


@dataclass
class WriteFinding:
    """The write of one function and what goes with it."""

    writes: list[Write] = field(default_factory=list)
    """Slot writes: removed."""
    removed: set[cst.CSTNode] = field(default_factory=set)
    """Statements removed (the writes and what only served them)."""
    other_writes: list[Write] = field(default_factory=list)
    """Writes into the cache not tied to the slot mapping: left, marked."""
    slot_reads_left: list[cst.CSTNode] = field(default_factory=list)
    """Statements left that still read the slot mapping: marked."""


def _units(block: cst.BaseSuite) -> Iterator[cst.BaseStatement]:
    """Every statement of ``block``, nested ones included (not inside nested defs)."""
    for stmt in suite_body(block):
        yield stmt
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue
        for suite in _suites(stmt):
            yield from _units(suite)


def _suites(stmt: cst.BaseStatement) -> list[cst.BaseSuite]:
    suites: list[cst.BaseSuite] = []
    if isinstance(stmt, cst.If):
        suites.append(stmt.body)
        orelse = stmt.orelse
        while isinstance(orelse, cst.If):
            suites.append(orelse.body)
            orelse = orelse.orelse
        if isinstance(orelse, cst.Else):
            suites.append(orelse.body)
    elif isinstance(stmt, (cst.For, cst.While)):
        suites.append(stmt.body)
        if stmt.orelse is not None:
            suites.append(stmt.orelse.body)
    elif isinstance(stmt, cst.With):
        suites.append(stmt.body)
    elif isinstance(stmt, cst.Try):
        suites.append(stmt.body)
        suites.extend(h.body for h in stmt.handlers)
        if stmt.orelse is not None:
            suites.append(stmt.orelse.body)
        if stmt.finalbody is not None:
            suites.append(stmt.finalbody.body)
    return suites


def _children(stmt: cst.BaseStatement) -> list[cst.BaseStatement]:
    """The statements directly inside a compound statement."""
    out: list[cst.BaseStatement] = []
    for suite in _suites(stmt):
        if isinstance(suite, cst.IndentedBlock):
            out.extend(suite.body)
    return out


def _headers(stmt: cst.BaseStatement) -> list[cst.CSTNode]:
    """The expressions of a compound statement outside its bodies."""
    if isinstance(stmt, cst.If):
        heads: list[cst.CSTNode] = [stmt.test]
        orelse = stmt.orelse
        while isinstance(orelse, cst.If):
            heads.append(orelse.test)
            orelse = orelse.orelse
        return heads
    if isinstance(stmt, cst.For):
        return [stmt.target, stmt.iter]
    if isinstance(stmt, cst.While):
        return [stmt.test]
    if isinstance(stmt, cst.With):
        return list(stmt.items)
    return []


class _Names(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()
        self.slot_attr = False
        self.calls: list[cst.Call] = []

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if node.attr.value == "slot_mapping":
            self.slot_attr = True
        node.value.visit(self)
        return False

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False


def _scan(node: cst.CSTNode) -> _Names:
    v = _Names()
    node.visit(v)
    return v


def _root(expr: cst.BaseExpression) -> str | None:
    """The name a subscript / attribute / method-call chain starts from, unless the chain
    reads tensor metadata (``x.shape[0]`` is not a view of ``x``)."""
    while True:
        if isinstance(expr, cst.Name):
            return expr.value
        if isinstance(expr, cst.Subscript):
            expr = expr.value
        elif isinstance(expr, cst.Attribute):
            if expr.attr.value in _METADATA_ATTRS:
                return None
            expr = expr.value
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            if expr.func.attr.value in _METADATA_ATTRS:
                return None
            expr = expr.func.value
        else:
            return None


class _Analysis:
    def __init__(self, info: ModuleInfo, fn: cst.FunctionDef, cache: str,
                 slot_param: str | None) -> None:
        self.info = info
        self.fn = fn
        self.units = list(_units(fn.body))
        self.aliases = {cache}
        self.tainted = {slot_param} if slot_param else set()

    # -- what names mean ----------------------------------------------------------------
    def cache_view(self, expr: cst.BaseExpression) -> bool:
        root = _root(expr)
        if root in self.aliases:
            return True
        if isinstance(expr, cst.Call):  # torch.unbind(kv_cache, 1), split_kv_cache(kv_cache)
            return any(isinstance(a.value, cst.Name) and a.value.value in self.aliases
                       for a in expr.args)
        return False

    def taints(self, node: cst.CSTNode) -> bool:
        scan = _scan(node)
        return scan.slot_attr or bool(scan.names & self.tainted)

    def _bind(self, target: cst.BaseExpression, value: cst.BaseExpression | None,
              tainted: bool) -> bool:
        changed = False
        if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)) \
                and len(target.elements) == len(value.elements):
            for t, v in zip(target.elements, value.elements):
                changed |= self._bind(t.value, v.value, self.taints(v.value))
            return changed
        names = [n.value for n in target_names(target)]
        view = value is not None and self.cache_view(value)
        for n in names:
            if view and n not in self.aliases:
                self.aliases.add(n)
                changed = True
            if tainted and n not in self.tainted:
                self.tainted.add(n)
                changed = True
        return changed

    def propagate(self) -> None:
        changed = True
        while changed:
            changed = False
            for unit in self.units:
                if isinstance(unit, cst.SimpleStatementLine):
                    for small in unit.body:
                        if isinstance(small, cst.Assign):
                            for t in small.targets:
                                changed |= self._bind(t.target, small.value,
                                                      self.taints(small.value))
                        elif isinstance(small, cst.AnnAssign) and small.value is not None:
                            changed |= self._bind(small.target, small.value,
                                                  self.taints(small.value))
                elif isinstance(unit, cst.For):
                    changed |= self._bind(unit.target, None, self.taints(unit.iter))

    # -- which statements write ---------------------------------------------------------
    def classify(self, line: cst.SimpleStatementLine) -> tuple[str, Write] | None:
        """``("slot", write)``, ``("other", write)`` or None for a line that does not write."""
        found: tuple[str, Write] | None = None
        for small in line.body:
            result = self._classify_small(line, small)
            if result is not None and (found is None or result[0] == "other"):
                found = result
        return found

    def _classify_small(self, line: cst.SimpleStatementLine,
                        small: cst.BaseSmallStatement) -> tuple[str, Write] | None:
        code = self.info.module.code_for_node(small).strip()
        if isinstance(small, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
            targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign)
                       else [small.target])
            for target in targets:
                if isinstance(target, cst.Subscript) and self.cache_view(target.value):
                    slot = self.taints(target) or (
                        small.value is not None and self.taints(small.value))
                    return ("slot" if slot else "other"), Write(line, "index", code)
            return None
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            call = small.value
            func = call.func
            last = func.attr.value if isinstance(func, cst.Attribute) else (
                func.value if isinstance(func, cst.Name) else "")
            if last in WRITE_OPS:
                slot = any(self.taints(a.value) for a in call.args)
                return ("slot" if slot else "other"), Write(line, WRITE_OPS[last], code)
            receiver_view = isinstance(func, cst.Attribute) and self.cache_view(func.value)
            first_view = bool(call.args) and self.cache_view(call.args[0].value)
            inplace = last.endswith("_") and not last.endswith("__")
            if inplace and (receiver_view or (last in INDEX_WRITES and first_view)):
                slot = last in INDEX_WRITES and (
                    any(self.taints(a.value) for a in call.args) or self.taints(func))
                return ("slot" if slot else "other"), Write(line, "index", code)
        return None

    # -- what goes with the write -------------------------------------------------------
    def run(self) -> WriteFinding:
        self.propagate()
        finding = WriteFinding()
        for unit in self.units:
            if isinstance(unit, cst.SimpleStatementLine):
                result = self.classify(unit)
                if result is None:
                    continue
                kind, write = result
                if kind == "slot":
                    finding.writes.append(write)
                    finding.removed.add(unit)
                else:
                    finding.other_writes.append(write)
        if not finding.writes:
            return finding
        changed = True
        while changed:
            changed = False
            for unit in self.units:
                if unit not in finding.removed and self._serves_only(unit, finding.removed):
                    finding.removed.add(unit)
                    changed = True
        # nested statements of a removed compound statement are removed with it
        for removed in list(finding.removed):
            finding.removed.update(_units_in(removed))
        for unit in self.units:
            if unit in finding.removed:
                continue
            heads = [unit] if isinstance(unit, cst.SimpleStatementLine) else _headers(unit)
            if any(self.taints(h) for h in heads):
                finding.slot_reads_left.append(unit)
        return finding

    def _reads_outside(self, names: set[str], removed: set[cst.CSTNode],
                       skip: cst.CSTNode) -> bool:
        for unit in self.units:
            if unit is skip or unit in removed or _inside(unit, removed):
                continue
            parts = [unit] if isinstance(unit, cst.SimpleStatementLine) else _headers(unit)
            for part in parts:
                if _reads(part) & names:
                    return True
        return False

    def _serves_only(self, unit: cst.BaseStatement, removed: set[cst.CSTNode]) -> bool:
        if isinstance(unit, cst.SimpleStatementLine):
            defs: set[str] = set()
            for small in unit.body:
                if isinstance(small, cst.Assign):
                    for t in small.targets:
                        if not all(isinstance(n, cst.Name) for n in _flat(t.target)):
                            return False
                        defs |= {n.value for n in target_names(t.target)}
                elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                    defs.add(small.target.value)
                else:
                    return False
            if not defs or self._reads_outside(defs, removed, unit):
                return False
            used_by_write = any(_reads(r) & defs for r in removed
                                if isinstance(r, cst.SimpleStatementLine))
            return used_by_write and (self.taints(unit) or self._pure(unit))
        if isinstance(unit, (cst.If, cst.For, cst.While)):
            children = _children(unit)
            if not children or not all(c in removed or _control_only(c) for c in children):
                return False
            if not any(c in removed for c in children):
                return False
            heads = _headers(unit)
            if isinstance(unit, cst.For):
                defs = {n.value for n in target_names(unit.target)}
                if self._reads_outside(defs, removed | {unit}, unit):
                    return False
            return all(self.taints(h) or self._pure(h) for h in heads)
        return False

    def _pure(self, node: cst.CSTNode) -> bool:
        for call in _scan(node).calls:
            name = dotted(call.func) or ""
            last = name.rpartition(".")[2]
            if isinstance(call.func, cst.Name) and last in _PURE_CALLS:
                continue
            if isinstance(call.func, cst.Attribute) and not last.endswith("_"):
                continue
            return False
        return True


def _flat(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(target, (cst.Tuple, cst.List)):
        return [x for el in target.elements for x in _flat(el.value)]
    return [target]


def _reads(node: cst.CSTNode) -> set[str]:
    """Names read by a statement or expression (names only assigned are not reads)."""
    if isinstance(node, cst.SimpleStatementLine):
        names: set[str] = set()
        for small in node.body:
            if isinstance(small, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
                targets = ([t.target for t in small.targets] if isinstance(small, cst.Assign)
                           else [small.target])
                for t in targets:
                    for el in _flat(t):
                        if not isinstance(el, cst.Name):
                            names |= _scan(el).names
                if isinstance(small, cst.AugAssign):
                    names |= _scan(small.target).names
                if small.value is not None:
                    names |= _scan(small.value).names
            else:
                names |= _scan(small).names
        return names
    return _scan(node).names


def _control_only(stmt: cst.BaseStatement) -> bool:
    if isinstance(stmt, cst.SimpleStatementLine):
        return all(isinstance(s, (cst.Continue, cst.Break, cst.Pass)) for s in stmt.body)
    if isinstance(stmt, cst.If):
        return all(_control_only(c) for c in _children(stmt))
    return False


def _units_in(stmt: cst.CSTNode) -> list[cst.BaseStatement]:
    if not isinstance(stmt, (cst.If, cst.For, cst.While, cst.With, cst.Try)):
        return []
    out: list[cst.BaseStatement] = []
    for suite in _suites(stmt):
        out.extend(_units(suite))
    return out


def _inside(unit: cst.BaseStatement, removed: set[cst.CSTNode]) -> bool:
    return any(unit in _units_in(r) for r in removed if isinstance(r, cst.BaseCompoundStatement))


def find_writes(info: ModuleInfo, fn: cst.FunctionDef, cache: str,
                slot_param: str | None = None) -> WriteFinding:
    """The cache writes of ``fn`` whose cache argument is named ``cache``; ``slot_param``
    names a slot-mapping argument (``do_kv_cache_update``)."""
    return _Analysis(info, fn, cache, slot_param).run()
