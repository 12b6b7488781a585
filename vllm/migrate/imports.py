"""Import statements: legacy-surface names to the new API, and the ones the migrated
module needs. Runs after the other rewrites, on the names the module still uses."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import libcst as cst

from vllm.migrate.analysis import alias_local, dotted, is_docstring, is_legacy_module, module_name
from vllm.migrate.report import ManualStep

NEW_API: Final[Mapping[str, tuple[str, str]]] = {
    "AttentionBackend": ("vllm.attention", "AttentionBackend"),
    "AttentionImpl": ("vllm.attention", "AttentionImpl"),
    "AttentionMetadata": ("vllm.attention", "AttentionMetadata"),
    "AttentionMetadataBuilder": ("vllm.attention", "AttentionMetadataBuilder"),
    "CommonAttentionMetadata": ("vllm.attention", "CommonAttentionMetadata"),
    "AttentionType": ("vllm.attention", "AttentionType"),
    "AttentionLayer": ("vllm.attention.backend", "AttentionLayerProtocol"),
}
"""Legacy-surface names and the new-API name each becomes (the module the migrated code
imports it from, and its name there)."""

NEW_API_MODULES: Final = frozenset({"vllm.attention", "vllm.attention.backend"})


def used_names(module: cst.Module) -> set[str]:
    """Names the module reads outside its import statements."""
    found: set[str] = set()

    class Visitor(cst.CSTVisitor):
        def visit_Import(self, node: cst.Import) -> bool:
            return False

        def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
            return False

        def visit_Name(self, node: cst.Name) -> None:
            found.add(node.value)

        def visit_Attribute(self, node: cst.Attribute) -> bool:
            node.value.visit(self)
            return False

        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            value = node.evaluated_value  # string annotations name classes too
            if isinstance(value, str) and value.replace(".", "").replace("_", "").isalnum():
                found.add(value.split(".")[0])

    module.visit(Visitor())
    return found


@dataclass
class ImportPlan:
    defined: dict[str, str] = field(default_factory=dict)
    """Legacy helpers the migrated module defines itself: name -> its definition."""
    needed: dict[str, set[str]] = field(default_factory=dict)
    """Module -> names the migrated code uses from it (added where missing)."""
    steps: list[ManualStep] = field(default_factory=list)

    def need(self, module: str, *names: str) -> None:
        self.needed.setdefault(module, set()).update(names)


_NO_CONFIG = ("the new API passes no configuration object: take what you read from it "
              "from the AttentionLayerSpec or the CommonAttentionMetadata")
_NO_DCP = "the new API has no decode context parallelism: drop that path"
LEGACY_ADVICE: Final[Mapping[str, str]] = {
    "VllmConfig": _NO_CONFIG, "get_current_vllm_config": _NO_CONFIG,
    "get_layers_from_vllm_config": _NO_CONFIG,
    "CacheDType": "use vllm.attention.KVCacheDType",
    "get_dcp_group": _NO_DCP, "get_dcp_local_seq_lens": _NO_DCP,
    "init_logger": "use logging.getLogger (upstream's logger adds the *_once methods)",
    "Attention": "use vllm.attention.layer.Attention",
    "vllm_is_batch_invariant": "read your own setting",
    "DeviceCapability": "compare torch.cuda.get_device_capability(device) in "
                        "device_unsupported_reasons()",
    "AttentionCGSupport": "the new builder declares no CUDA-graph support level: drop it",
    "MultipleOf": "declare block_sizes as a SizeSpec",
    "register_backend": "register with vllm.attention.registry.register_backend(cls), "
                        "under cls.name",
    "AttentionBackendEnum": "the new registry takes the backend's own name",
}
"""What to use instead of a legacy-surface name without a new-API counterpart."""


def _advice(local: str, name: str, module: str) -> tuple[str, str, str]:
    return local, module, LEGACY_ADVICE.get(name or local, "")


def _grouped(kept: list[tuple[str, str, str]]) -> str:
    """``a, b (module): advice; c (module)``: names with the same advice together."""
    groups: dict[tuple[str, str], list[str]] = {}
    for local, module, advice in kept:
        groups.setdefault((module, advice), []).append(local)
    return "; ".join(f"{', '.join(names)} ({module})" + (f": {advice}" if advice else "")
                     for (module, advice), names in groups.items())


class ImportRewriter(cst.CSTTransformer):
    """Drops legacy imports the module no longer uses, moves the ones with a new-API
    counterpart there, marks the rest, and adds the imports in ``plan.needed``."""

    def __init__(self, used: set[str], plan: ImportPlan) -> None:
        super().__init__()
        self.used = used
        self.plan = plan
        self.depth = 0

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self.depth += 1

    def leave_IndentedBlock(self, original: cst.IndentedBlock,
                            updated: cst.IndentedBlock) -> cst.IndentedBlock:
        self.depth -= 1
        return updated

    def leave_SimpleStatementLine(
        self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine | cst.RemovalSentinel:
        if self.depth or not any(isinstance(s, (cst.Import, cst.ImportFrom))
                                 for s in updated.body):
            return updated
        body: list[cst.BaseSmallStatement] = []
        kept_legacy: list[tuple[str, str, str]] = []
        for small in updated.body:
            new: cst.BaseSmallStatement | None = small
            if isinstance(small, cst.ImportFrom):
                new = self._import_from(small, kept_legacy)
            elif isinstance(small, cst.Import):
                new = self._import(small, kept_legacy)
            if new is not None:
                body.append(new)
        if not body:
            return cst.RemoveFromParent()
        result = updated.with_changes(body=body)
        if kept_legacy:
            step = ManualStep(
                "still imported from the legacy surface, which shim's removal takes away",
                "replace " + _grouped(kept_legacy))
            self.plan.steps.append(step)
            result = result.with_changes(leading_lines=[
                *result.leading_lines,
                *(cst.EmptyLine(comment=cst.Comment(line)) for line in step.comment)])
        return result

    def _import_from(self, small: cst.ImportFrom, kept_legacy: list[tuple[str, str, str]]
                     ) -> cst.BaseSmallStatement | None:
        """``small`` with its legacy names dropped, moved to the new API or kept (noted in
        ``kept_legacy``), and the names the migrated code needs from its module added;
        None when no name is left."""
        if isinstance(small.names, cst.ImportStar):
            return small
        module = module_name(small.module, len(small.relative))
        names = [alias for alias in small.names if self._keeps(module, alias, kept_legacy)]
        wanted = self.plan.needed.pop(module, set()) if not is_legacy_module(module) \
            and not small.relative else set()
        missing = wanted - {dotted(a.name) for a in names}
        names.extend(cst.ImportAlias(name=cst.Name(extra)) for extra in sorted(missing))
        if len(names) == len(small.names) and not missing:
            return small  # nothing dropped or added: as it was written
        if not names:
            return None
        if missing and all(a.asname is None for a in names):
            return _from_import(module, [dotted(a.name) or "" for a in names]).body[0]
        last = names[-1].with_changes(comma=small.names[-1].comma)
        return small.with_changes(names=[*names[:-1], last])

    def _keeps(self, module: str, alias: cst.ImportAlias,
               kept_legacy: list[tuple[str, str, str]]) -> bool:
        """Whether ``from module import alias`` stays: a legacy name the module still uses
        stays (noted in ``kept_legacy``) unless the new API has it, which is then needed
        from there instead."""
        local = alias_local(alias)
        name = dotted(alias.name) or ""
        if module in ("typing", "typing_extensions") and local not in self.used:
            return False  # made unused by the rewrite (a legacy signature's Any)
        if module in NEW_API_MODULES:
            self.plan.needed.get(module, set()).discard(name)
        if not (is_legacy_module(module) or is_legacy_module(f"{module}.{name}")):
            return True
        if local not in self.used or (local in self.plan.defined and alias.asname is None):
            return False
        new = NEW_API.get(name)
        if new is not None and alias.asname is None:
            self.plan.need(*new)
            return False
        kept_legacy.append(_advice(local, name, module))
        return True

    def _import(self, small: cst.Import, kept_legacy: list[tuple[str, str, str]]
                ) -> cst.Import | None:
        """``small`` without the legacy modules the module no longer uses (those it
        still uses noted in ``kept_legacy``); None when none is left."""
        names = []
        for alias in small.names:
            local = alias_local(alias)
            full = dotted(alias.name) or ""
            if is_legacy_module(full):
                if local not in self.used:
                    continue
                kept_legacy.append(_advice(local, "", full))
            names.append(alias)
        if len(names) == len(small.names):
            return small
        if not names:
            return None
        last = names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return small.with_changes(names=[*names[:-1], last])

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        body: list[cst.BaseStatement] = list(updated.body)
        existing = _existing_from_imports(body)
        additions: list[cst.SimpleStatementLine] = []
        for module in sorted(self.plan.needed, key=_import_order):
            names = self.plan.needed[module]
            at = existing.get(module)
            if at is not None:
                body[at] = _merge(body[at], names)  # type: ignore[arg-type]
                continue
            if names:
                additions.append(_from_import(module, names))
            elif not _imports_module(body, module):
                stmt = cst.parse_statement(f"import {module}\n")
                assert isinstance(stmt, cst.SimpleStatementLine)
                additions.append(stmt)
        if self.plan.defined:
            at = _insert_at(body, "~")  # after every import
            two = [cst.EmptyLine(indent=False), cst.EmptyLine(indent=False)]
            if at < len(body):
                after = body[at]
                lines = list(after.leading_lines)  # type: ignore[attr-defined]
                while lines and lines[0].comment is None:
                    lines.pop(0)
                body[at] = after.with_changes(leading_lines=[*two, *lines])
            for code in reversed(sorted(self.plan.defined.values())):
                definition = cst.parse_statement(code)
                body.insert(at, definition.with_changes(leading_lines=two))
        for stmt in additions:
            index = _insert_at(body, _statement_module(stmt))
            ends_group = index > 0 and _same_group(_statement_module(body[index - 1]),
                                                   _statement_module(stmt))
            if index < len(body) and _statement_module(body[index]) and not ends_group:
                displaced = body[index]  # the new import takes its place and blank lines
                assert isinstance(displaced, cst.SimpleStatementLine)
                lines = list(displaced.leading_lines)
                blank = 0
                while blank < len(lines) and lines[blank].comment is None:
                    blank += 1
                stmt = stmt.with_changes(leading_lines=lines[:blank])
                body[index] = displaced.with_changes(leading_lines=lines[blank:])
            body.insert(index, stmt)
        return updated.with_changes(body=body)


def _imports_module(body: list[cst.BaseStatement], module: str) -> bool:
    for stmt in body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Import) and any(
                        dotted(a.name) == module and a.asname is None for a in small.names):
                    return True
    return False


def _import_order(module: str) -> tuple[int, str]:
    return (0 if module in ("dataclasses", "typing") else 1 if module == "torch" else 2, module)


def _existing_from_imports(body: list[cst.BaseStatement]) -> dict[str, int]:
    found: dict[str, int] = {}
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and \
                isinstance(stmt.body[0], cst.ImportFrom) and not stmt.body[0].relative and \
                not isinstance(stmt.body[0].names, cst.ImportStar):
            found.setdefault(module_name(stmt.body[0].module), i)
    return found


def _from_import(module: str, names: Iterable[str]) -> cst.SimpleStatementLine:
    ordered = sorted(set(names))
    line = f"from {module} import {', '.join(ordered)}"
    if len(line) > 99:
        inner = "".join(f"    {n},\n" for n in ordered)
        line = f"from {module} import (\n{inner})"
    stmt = cst.parse_statement(line + "\n")
    assert isinstance(stmt, cst.SimpleStatementLine)
    return stmt


def _merge(stmt: cst.SimpleStatementLine, names: set[str]) -> cst.SimpleStatementLine:
    node = stmt.body[0]
    assert isinstance(node, cst.ImportFrom) and not isinstance(node.names, cst.ImportStar)
    have = {dotted(a.name) for a in node.names if a.asname is None}
    missing = sorted(names - {h for h in have if h})
    if not missing:
        return stmt
    current = [dotted(a.name) or "" for a in node.names]
    if any(a.asname is not None for a in node.names):
        return stmt.with_changes(body=[node, *[
            _from_import(module_name(node.module), missing).body[0]]])
    merged = _from_import(module_name(node.module), [*current, *missing])
    return merged.with_changes(leading_lines=stmt.leading_lines)


def _statement_module(stmt: cst.BaseStatement) -> str:
    if isinstance(stmt, cst.SimpleStatementLine) and stmt.body:
        small = stmt.body[0]
        if isinstance(small, cst.ImportFrom):
            return module_name(small.module, len(small.relative))
        if isinstance(small, cst.Import):
            return dotted(small.names[0].name) or ""
    return ""


def _is_import_line(stmt: cst.BaseStatement) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)


def _only_imports(stmt: cst.BaseStatement) -> bool:
    """An ``if``/``try`` at module level whose bodies only import (optional kernels)."""
    if not isinstance(stmt, (cst.If, cst.Try)):
        return False
    blocks: list[cst.BaseSuite] = [stmt.body]
    if isinstance(stmt, cst.If) and isinstance(stmt.orelse, cst.Else):
        blocks.append(stmt.orelse.body)
    if isinstance(stmt, cst.Try):
        blocks.extend(h.body for h in stmt.handlers)
    return all(isinstance(b, cst.IndentedBlock) and all(
        _is_import_line(s) or (isinstance(s, cst.SimpleStatementLine) and all(
            isinstance(x, cst.Pass) for x in s.body)) for s in b.body) for b in blocks)


def _same_group(a: str, b: str) -> bool:
    """Whether two imports sort into one group (standard library, or one package)."""
    if not a or not b:
        return False
    if _is_stdlib(a) or _is_stdlib(b):
        return _is_stdlib(a) and _is_stdlib(b) and "__future__" not in (a, b)
    return a.split(".")[0] == b.split(".")[0]


def _is_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top == "__future__"


def _insert_at(body: list[cst.BaseStatement], module: str) -> int:
    """Where an import of ``module`` goes in the module's leading imports: among its
    group (standard library, else its top-level package) in sorted order, else after
    them. ``"~"``: after the whole import region."""
    imports: list[tuple[int, str]] = []
    end = 0
    for i, stmt in enumerate(body):
        if _is_import_line(stmt):
            imports.append((i, _statement_module(stmt)))
        elif not (_only_imports(stmt) or (i == 0 and is_docstring(stmt))):
            break
        end = i + 1
    if module == "~" or not imports:
        return end
    if _is_stdlib(module):
        group = [(i, m) for i, m in imports if _is_stdlib(m) and m != "__future__"]
        if not group:
            first_other = next((i for i, m in imports if not _is_stdlib(m)), None)
            return first_other if first_other is not None else end
    else:
        top = module.split(".")[0]
        group = [(i, m) for i, m in imports if m.split(".")[0] == top]
        if not group:
            return max(i for i, _ in imports) + 1
    before = [i for i, m in group if m < module]
    return before[-1] + 1 if before else group[0][0]
