"""One migration: read the module, find the backend and its pieces, plan every edit,
apply them, and list what is left for a person."""

from __future__ import annotations

import os
from pathlib import Path

import libcst as cst

from vllm.attention.types import KVCacheLayout
from vllm.migrate.analysis import (
    ClassInfo,
    ModuleInfo,
    Pieces,
    choose_backend,
    find_pieces,
    imported_base,
    is_legacy_backend,
    is_legacy_module,
    module_file,
    params,
    read_module,
    single_return,
)
from vllm.migrate.backend_class import rewrite_backend
from vllm.migrate.declarations import SOURCES_OF, Declarations, read_declarations
from vllm.migrate.impl import rewrite_impl
from vllm.migrate.imports import ImportRewriter, used_names
from vllm.migrate.layout import SPLIT_FAMILY, infer_layout
from vllm.migrate.metadata import metadata_fields, rewrite_builder, rewrite_metadata
from vllm.migrate.plan import Apply, Plan, expression
from vllm.migrate.report import (
    MARKER,
    MARKER_CONTINUED,
    ManualStep,
    MigrationError,
    MigrationResult,
)
from vllm.migrate.source import Target, parse_source, read_source
from vllm.migrate.writes import WriteFinding, find_writes

FORWARD_CACHE_ARG = 5
"""``kv_cache`` in ``forward(self, layer, query, key, value, kv_cache, attn_metadata, ...)``."""
UPDATE_CACHE_ARG = 4
"""``kv_cache`` in ``do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)``."""


def migrate(target: Target) -> MigrationResult:
    """The migrated module of ``target`` (nothing is written)."""
    text = read_source(target.path)
    return migrate_source(target.path, text, target.class_name)


def migrate_source(path: Path, text: str, class_name: str | None = None) -> MigrationResult:
    info = read_module(path, parse_source(path, text))
    backend = choose_backend(info, class_name)
    base = imported_base(info, backend)
    if base is not None:
        return _migrate_derived(info, backend, *base)
    _refuse_local_bases(info, backend)
    pieces = find_pieces(info, backend)
    _refuse_mla(info, pieces)
    flagged = _is_flagged(info, pieces)
    found = infer_layout(info, backend)
    layout = found.layout
    forward = pieces.impl.methods.get("forward")
    forward_writes = _writes_of(info, forward, FORWARD_CACHE_ARG, None)
    if flagged:
        update = pieces.impl.methods["do_kv_cache_update"]
        update_writes = _writes_of(info, update, UPDATE_CACHE_ARG, UPDATE_CACHE_ARG + 1)
        _require_write(info, pieces.impl, update, update_writes)
        _check_kinds(info, pieces, update_writes, layout)
    else:
        if forward is None:
            raise MigrationError(f"{info.path}: {pieces.impl.name} has no forward()")
        _require_write(info, pieces.impl, forward, forward_writes)
        _check_kinds(info, pieces, forward_writes, layout)
    decl = read_declarations(info, pieces, layout)

    plan = Plan(info)
    meta = pieces.metadata.name
    info.metadata_class = meta
    info.metadata_fields = metadata_fields(pieces.metadata)
    rewrite_metadata(plan, pieces.metadata, legacy=True)
    rewrite_builder(plan, pieces.builder, meta)
    rewrite_impl(plan, pieces.impl, meta, decl, forward_writes, flagged)
    rewrite_backend(plan, pieces, decl, found.note)
    _legacy_helpers(plan)
    for other in info.classes.values():
        if other is not backend and is_legacy_backend(info, other):
            plan.mark(other.node, f"{other.name} is another legacy backend of this module, "
                      "left as it was", f"migrate {other.name} in a module of its own")
    if found.note:
        plan.notes.append(found.note)

    return _result(plan, backend, decl, flagged, layout)


def _migrate_derived(info: ModuleInfo, backend: ClassInfo, base_info: ModuleInfo,
                     base: ClassInfo) -> MigrationResult:
    """A backend that subclasses a legacy backend of another module of the project (a
    plugin deriving from it): that module is migrated on its own; here the subclass
    keeps its bases, declares what it overrides, and its impl gets the new signatures."""
    base_pieces = find_pieces(base_info, base)
    flagged = _is_flagged(base_info, base_pieces)
    layout = infer_layout(base_info, base).layout
    impl = _local_piece(info, backend, "get_impl_cls")
    for method in ("get_builder_cls", "get_metadata_cls"):
        if _local_piece(info, backend, method) is not None:
            raise MigrationError(
                f"{info.path}: {backend.name}.{method}() returns a class of this module while "
                f"its base {base.name} is migrated on its own: the command migrates a derived "
                "backend that keeps its base's metadata and builder")
    pieces = Pieces(backend, impl or base_pieces.impl, base_pieces.builder, base_pieces.metadata)
    full = read_declarations(info, pieces, layout)
    sources = set(backend.methods) | set(backend.attrs)
    decl = Declarations(name=None, layout=layout)
    for declaration, legacy in SOURCES_OF.items():
        if sources & legacy:
            setattr(decl, declaration, getattr(full, declaration))
    decl.unresolved = {k: v for k, v in full.unresolved.items() if k in sources}
    if impl is not None:
        decl.supports_sliding_window = full.supports_sliding_window
        decl.supports_logits_soft_cap = full.supports_logits_soft_cap
        decl.refusals_folded, decl.refusals_left = full.refusals_folded, full.refusals_left
    plan = Plan(info)
    if impl is not None:
        forward = impl.methods.get("forward")
        finding = _writes_of(info, forward, FORWARD_CACHE_ARG, None)
        meta = _annotation(info, forward, 6) or base_pieces.metadata.name
        rewrite_impl(plan, impl, meta, decl, finding, flagged, derived=True)
    rewrite_backend(plan, pieces, decl, None, derived=True)
    _legacy_helpers(plan)
    names = {base.name, base_pieces.impl.name, base_pieces.metadata.name,
             base_pieces.builder.name}
    module = base_info.path
    shown = os.path.relpath(module)
    if shown.startswith(".."):
        shown = str(module)
    for imported in info.imports.values():
        if imported.qualified.rpartition(".")[2] in names and imported.module and \
                module_file(info, imported.module) == module:
            plan.mark(imported.statement, f"{imported.module} is a legacy backend module",
                      f"migrate it too (vllm-attn migrate {shown}) and import "
                      f"{', '.join(sorted(n for n in names if n in info.imports))} from the "
                      "migrated module")
    return _result(plan, backend, decl, flagged, layout,
                   f"{backend.name} keeps its base {base.name} ({base_info.path}), which is "
                   "migrated on its own")


def _local_piece(info: ModuleInfo, backend: ClassInfo, method: str) -> ClassInfo | None:
    fn = backend.methods.get(method)
    value = single_return(fn) if fn is not None else None
    if isinstance(value, cst.Name):
        return info.classes.get(value.value)
    return None


def _annotation(info: ModuleInfo, fn: cst.FunctionDef | None, index: int) -> str | None:
    if fn is None:
        return None
    ps = params(fn)
    ann = ps[index].annotation if len(ps) > index else None
    return info.module.code_for_node(ann.annotation).strip() if ann is not None else None


def _result(plan: Plan, backend: ClassInfo, decl: Declarations, flagged: bool,
            layout: KVCacheLayout, *notes: str) -> MigrationResult:
    """``plan`` applied: the migrated module, its manual steps read from its markers."""
    module = plan.info.module.visit(Apply(plan))
    code = module.visit(ImportRewriter(used_names(module), plan.imports)).code
    return MigrationResult(
        source=plan.info.path, class_name=backend.name,
        backend_name=decl.name or backend.name, generation="flagged" if flagged else "fused",
        layout=layout.name, code=code, manual_steps=manual_steps(code),
        notes=[*plan.notes, *notes])


def manual_steps(code: str) -> list[ManualStep]:
    """The marker comments of a migrated module, in order, with their lines."""
    found: list[tuple[int, str]] = []
    continued = False
    for number, line in enumerate(code.splitlines(), start=1):
        text = line.strip()
        if text.startswith(MARKER):
            found.append((number, text[len(MARKER):].strip()))
            continued = True
        elif continued and text.startswith(MARKER_CONTINUED):
            found[-1] = (found[-1][0], f"{found[-1][1]} {text[len(MARKER_CONTINUED):].strip()}")
        else:
            continued = False
    steps = []
    for number, text in found:
        reason, _, todo = text.partition("; ")
        steps.append(ManualStep(reason, todo or reason, number))
    return steps


def _refuse_local_bases(info: ModuleInfo, backend: ClassInfo) -> None:
    bases = [b for b in backend.bases if b in info.classes]
    if bases:
        raise MigrationError(
            f"{info.path}: {backend.name} subclasses {', '.join(bases)}, a class of this "
            f"module: the command migrates a backend that stands alone; copy what "
            f"{backend.name} inherits into it (or migrate {bases[0]} first)")


def _refuse_mla(info: ModuleInfo, pieces: Pieces) -> None:
    mla = any(b.endswith("MLAAttentionImpl") for b in pieces.impl.bases) or any(
        m in pieces.impl.methods for m in ("forward_mha", "forward_mqa"))
    is_mla = pieces.backend.methods.get("is_mla")
    if mla or (is_mla is not None and "True" in info.module.code_for_node(is_mla)):
        raise MigrationError(
            f"{info.path}: {pieces.backend.name} is a legacy MLA backend (forward_mha / "
            "forward_mqa): the command migrates standard attention backends; move it onto "
            "vllm.attention.backends.mla's bases by hand (docs/mla.md, migration_guide.md)")


def _is_flagged(info: ModuleInfo, pieces: Pieces) -> bool:
    """The generation, with the adapter's consistency checks."""
    flag = None
    for cls in info.local_mro(pieces.backend):
        if "forward_includes_kv_cache_update" in cls.attrs:
            flag = info.module.code_for_node(cls.attrs["forward_includes_kv_cache_update"])
            break
    has_update = "do_kv_cache_update" in pieces.impl.methods
    name = pieces.backend.name
    if flag not in (None, "True", "False"):
        raise MigrationError(
            f"{info.path}: {name}.forward_includes_kv_cache_update = {flag}: expected True or "
            "False (a literal)")
    if flag == "False" and not has_update:
        raise MigrationError(
            f"{info.path}: {name} sets forward_includes_kv_cache_update = False but "
            f"{pieces.impl.name} has no do_kv_cache_update(): no cache write to migrate; add "
            "it, or remove the flag if forward() writes the cache")
    if flag != "False" and has_update:
        raise MigrationError(
            f"{info.path}: {pieces.impl.name} defines do_kv_cache_update() but "
            f"{name}.forward_includes_kv_cache_update is not False, so the legacy code "
            "writes twice; set the flag (or delete do_kv_cache_update) first")
    return flag == "False"


def _writes_of(info: ModuleInfo, fn: cst.FunctionDef | None, cache_arg: int,
               slot_arg: int | None) -> WriteFinding | None:
    if fn is None:
        return None
    ps = params(fn)
    if len(ps) <= cache_arg:
        return None
    slot = ps[slot_arg].name.value if slot_arg is not None and len(ps) > slot_arg else None
    return find_writes(info, fn, ps[cache_arg].name.value, slot)


def _require_write(info: ModuleInfo, impl: ClassInfo, fn: cst.FunctionDef,
                   finding: WriteFinding | None) -> None:
    if finding is not None and finding.writes:
        return
    where = f"{info.path}: {impl.name}.{fn.name.value}()"
    others = "; ".join(w.what for w in finding.other_writes) if finding else ""
    also = f" (it writes the cache, but not from the slot mapping: {others})" if others else ""
    raise MigrationError(
        f"{where}: found no cache write from the slot mapping{also}. The command moves "
        "writes it recognises: reshape_and_cache_flash, reshape_and_cache, "
        "concat_and_cache_mla, index_put_/index_copy_ or an indexed assignment into the "
        "kv_cache argument (or a view of it) at slot-mapping indices. Migrate this backend "
        "by hand (migration_guide.md)")


def _check_kinds(info: ModuleInfo, pieces: Pieces, finding: WriteFinding | None,
                 layout: KVCacheLayout) -> None:
    for write in finding.writes if finding else ():
        ok = (write.kind == "index" or (write.kind == "split" and layout in SPLIT_FAMILY)
              or (write.kind == "legacy_paged" and layout is KVCacheLayout.LEGACY_PAGED))
        if write.kind == "mla":
            raise MigrationError(
                f"{info.path}: {pieces.impl.name} writes with concat_and_cache_mla, an MLA "
                "write: the command migrates standard attention backends; move it onto "
                "vllm.attention.backends.mla's bases by hand (docs/mla.md)")
        if not ok:
            raise MigrationError(
                f"{info.path}: {pieces.impl.name} writes with {write.what.split('(')[0]}, "
                f"which writes the {write.kind} layout, but {pieces.backend.name}."
                f"get_kv_cache_shape implies {layout.name}: the command cannot tell which "
                "writer is right; make them agree (or declare kv_cache_layout)")


LOCAL_HELPERS = {
    "cdiv": 'def cdiv(a: int, b: int) -> int:\n    """``ceil(a / b)`` for ints."""\n'
            "    return -(a // -b)\n",
    "round_up": 'def round_up(x: int, y: int) -> int:\n    """``x`` rounded up to a multiple '
                'of ``y``."""\n    return -(x // -y) * y\n',
}
"""Small legacy helpers the migrated module defines itself (the legacy surface's code)."""
STANDARD_LOG_METHODS = frozenset({"debug", "info", "warning", "error", "exception", "critical",
                                  "log", "isEnabledFor", "setLevel"})


def _legacy_helpers(plan: Plan) -> None:
    """Legacy helpers with an exact spelling outside the legacy surface: upstream's
    ``is_quantized_kv_cache`` on the spec's cache dtype, ``cdiv`` / ``round_up``, and
    ``init_logger`` where only the standard logging methods are called."""
    info = plan.info
    quantized: list[cst.Call] = []
    loggers: list[tuple[cst.Call, str]] = []
    log_calls: dict[str, set[str]] = {}

    class Visitor(cst.CSTVisitor):
        def visit_Assign(self, node: cst.Assign) -> None:
            value = node.value
            if isinstance(value, cst.Call) and info.is_legacy_name(value.func, "init_logger") \
                    and len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name):
                loggers.append((value, node.targets[0].target.value))

        def visit_Call(self, node: cst.Call) -> None:
            if info.is_legacy_name(node.func, "is_quantized_kv_cache") and \
                    len(node.args) == 1 and node.args[0].keyword is None:
                quantized.append(node)

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if isinstance(node.value, cst.Name):
                log_calls.setdefault(node.value.value, set()).add(node.attr.value)

    info.module.visit(Visitor())
    for call in quantized:
        # the spec's cache dtype is a KVCacheDType: quantised means anything but auto
        plan.edit(call, lambda updated: expression(
            f'({info.module.code_for_node(updated.args[0].value)} != "auto")'))
    for call, name in loggers:
        if log_calls.get(name, set()) <= STANDARD_LOG_METHODS:
            plan.replace(call.func, expression("logging.getLogger"))
            plan.need("logging")
    for name, code in LOCAL_HELPERS.items():
        imported = info.imports.get(name)
        if imported is not None and is_legacy_module(imported.module):
            plan.imports.defined[name] = code
