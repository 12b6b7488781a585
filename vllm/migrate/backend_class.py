"""The backend class: a subclass of ``AttentionBackend[Metadata]`` with its declarations
as class data, classmethods naming its pieces, and the writer of its layout."""

from __future__ import annotations

import textwrap
from typing import Final

import libcst as cst

from vllm.attention.types import AttentionType
from vllm.migrate.analysis import (
    ClassInfo,
    ModuleInfo,
    Pieces,
    class_body,
    is_docstring,
    reads_attribute,
    single_return,
)
from vllm.migrate.declarations import CONSUMED, Declarations, size_spec_code, sorted_dtypes
from vllm.migrate.literal import NOT_LITERAL, Evaluator
from vllm.migrate.metadata import set_base
from vllm.migrate.plan import Plan, statements_from
from vllm.migrate.report import MARKER_WIDTH

DEFAULT_HOOKS: Final = {
    "is_mla": False, "is_sparse": False, "is_ssm": False, "supports_sink": False,
    "supports_alibi_sqrt": False, "supports_mm_prefix": False,
    "supports_per_head_quant_scales": False, "supports_non_causal": False,
    "supports_batch_invariance": False, "supports_kv_connector": True,
    "get_min_compute_capability": None, "get_max_compute_capability": None,
    "supports_combination": None, "get_required_kv_cache_layout": None,
}
"""Legacy backend hooks and the value that means "nothing special" (deleted when the
class answers that); any other answer is a manual step."""

PIECE_METHODS: Final = ("get_impl_cls", "get_builder_cls", "get_metadata_cls")
"""The classmethods naming the backend's pieces (kept, in the new signature)."""

HOOK_ADVICE: Final = {
    "get_min_compute_capability": "return the reason from device_unsupported_reasons()",
    "get_max_compute_capability": "return the reason from device_unsupported_reasons()",
    "supports_compute_capability": "return the reason from device_unsupported_reasons()",
    "supports_combination": "return its reasons from unsupported_reasons()",
    "validate_configuration": "return its reasons from unsupported_reasons()",
    "get_required_kv_cache_layout": "declare the layout as kv_cache_layout",
    "get_preferred_block_size": "declare block_sizes (the first admitted size is preferred)",
}


def _declare(name: str, kind: str, value: str) -> str:
    """``name: ClassVar[kind] = value`` in a class body, its call's arguments on a line
    of their own when it is too long."""
    one = f"    {name}: ClassVar[{kind}] = {value}\n"
    if len(one) <= 100 or not value.endswith(")") or "(" not in value:
        return one
    head, _, inner = value[:-1].partition("(")
    if len(inner) > 88 and inner.startswith("{") and inner.endswith("}"):
        items = "".join(f"        {item},\n" for item in inner[1:-1].split(", "))
        return f"    {name}: ClassVar[{kind}] = {head}({{\n{items}    }})\n"
    return f"    {name}: ClassVar[{kind}] = {head}(\n        {inner}\n    )\n"


def _declaration_lines(d: Declarations, *, layout: bool = True) -> str:
    lines = []
    if d.name is not None:
        lines.append(_declare("name", "str", f'"{d.name}"'))
    if layout:
        lines.append(_declare("kv_cache_layout", "KVCacheLayout",
                              f"KVCacheLayout.{d.layout.name}"))
    if d.supported_dtypes is not None:
        dtypes = ", ".join(f"torch.{n}" for n in sorted_dtypes(d.supported_dtypes))
        lines.append(_declare("supported_dtypes", "frozenset[torch.dtype]",
                              f"frozenset({{{dtypes}}})"))
    if d.supported_kv_cache_dtypes is not None:
        caches = ", ".join(f'"{c}"' for c in d.supported_kv_cache_dtypes)
        lines.append(_declare("supported_kv_cache_dtypes", "frozenset[KVCacheDType]",
                              f"frozenset({{{caches}}})"))
    if d.block_sizes is not None:
        lines.append(_declare("block_sizes", "SizeSpec", size_spec_code(d.block_sizes)))
    if d.head_sizes is not None:
        lines.append(_declare("head_sizes", "SizeSpec", size_spec_code(d.head_sizes)))
    if d.attention_types is not None and d.attention_types != (AttentionType.DECODER,):
        types = ", ".join(f"AttentionType.{t.name}" for t in d.attention_types)
        lines.append(_declare("attention_types", "frozenset[AttentionType]",
                              f"frozenset({{{types}}})"))
    if d.supports_sliding_window is False:
        lines.append(_declare("supports_sliding_window", "bool", "False"))
    if d.supports_logits_soft_cap is False:
        lines.append(_declare("supports_logits_soft_cap", "bool", "False"))
    return "".join(lines)


def _piece_methods(info: ModuleInfo, p: Pieces, only: frozenset[str] | None = None) -> str:
    """The classmethods naming the pieces (``only``: those a derived backend overrides)
    and, for a backend of its own, the writer of its layout."""
    pieces = (("get_impl_cls", p.impl.name), ("get_builder_cls", p.builder.name),
              ("get_metadata_cls", p.metadata.name))

    def returns(name: str) -> str:
        ref = info.ref(name, p.backend.node, annotation=True)
        return f"type[{name}]" if ref == name else f'"type[{name}]"'

    text = "".join(
        "    @classmethod\n"
        f"    def {method}(cls) -> {returns(name)}:\n"
        f"        return {name}\n\n"
        for method, name in pieces if only is None or method in only)
    if only is not None:
        return text
    return text + (
        "    @classmethod\n"
        '    def get_kv_cache_writer(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheWriter:\n'
        "        if cache_dtype not in cls.supported_kv_cache_dtypes:\n"
        '            allowed = ", ".join(sorted(cls.supported_kv_cache_dtypes))\n'
        "            raise InvalidArgumentError(\n"
        '                "cache_dtype", cache_dtype, f"one of {allowed} for {cls.name}"\n'
        "            )\n"
        "        return writer_for_layout(cls.kv_cache_layout)\n"
    )


def _referenced_elsewhere(plan: Plan, cls: ClassInfo, attr: str) -> bool:
    """Whether the module reads ``<x>.attr`` outside ``cls``'s method of that name."""
    method = cls.methods.get(attr)
    return reads_attribute(plan.info.module, attr, lambda node: node is method)


def rewrite_backend(plan: Plan, pieces: Pieces, decl: Declarations, layout_note: str | None,
                    *, derived: bool = False) -> None:
    """``derived``: the backend subclasses a legacy backend of another module (migrated
    on its own): its base stays, and it declares only what it overrides."""
    info = plan.info
    cls = pieces.backend
    meta = pieces.metadata.name
    plan.need("typing", "ClassVar")
    if not derived:
        plan.need("torch")
        plan.need("vllm.attention", "AttentionBackend", "KVCacheLayout", "KVCacheDType",
                  "KVCacheWriter", "InvalidArgumentError")
        plan.need("vllm.attention.writers", "writer_for_layout")
    if decl.supported_dtypes is not None:
        plan.need("torch")
    if decl.supported_kv_cache_dtypes is not None:
        plan.need("vllm.attention", "KVCacheDType")
    if decl.block_sizes is not None or decl.head_sizes is not None:
        plan.need("vllm.attention", "SizeSpec")
    if decl.attention_types is not None and decl.attention_types != (AttentionType.DECODER,):
        plan.need("vllm.attention", "AttentionType")
    if not derived:
        set_base(plan, cls, f"AttentionBackend[{info.ref(meta, cls.node, annotation=False)}]",
                 legacy_base="AttentionBackend")

    body = class_body(cls.node)
    anchor = next((s for s in body if isinstance(s, cst.FunctionDef)
                   and s.name.value in PIECE_METHODS), None)
    for stmt in body:
        name = stmt.name.value if isinstance(stmt, cst.FunctionDef) else next(
            (n for n, line in cls.attr_lines.items() if line is stmt), None)
        if name is None:
            continue
        if name in decl.unresolved:
            plan.mark(stmt, f"{name} is not literal, so {decl.unresolved[name]} was not "
                      "derived from it", f"declare {decl.unresolved[name]} as class data and "
                      f"delete {name}")
            continue
        if name in CONSUMED:
            if stmt is not anchor and (name in PIECE_METHODS
                                       or not _referenced_elsewhere(plan, cls, name)):
                plan.remove.add(stmt)  # the anchor is where the new piece methods go
            continue
        if isinstance(stmt, cst.FunctionDef) and name in DEFAULT_HOOKS:
            value = single_return(stmt)
            answer = Evaluator(info, cls.attrs).expr(value, {}) if value is not None \
                else NOT_LITERAL
            if answer is not NOT_LITERAL and answer == DEFAULT_HOOKS[name]:
                plan.remove.add(stmt)
                continue
        if name in HOOK_ADVICE or name in DEFAULT_HOOKS:
            plan.mark(stmt, f"{name}() is a legacy hook the new API never calls",
                      HOOK_ADVICE.get(name, f"express what {name}() says as a declaration "
                                            "or delete it"))
    declarations = _declaration_lines(decl, layout=not derived)
    if layout_note:
        note = textwrap.wrap(layout_note, width=MARKER_WIDTH)
        declarations = "".join(f"    # {line}\n" for line in note) + declarations
    new_decl = statements_from(declarations)
    overridden = frozenset(m for m in PIECE_METHODS if m in cls.methods)
    new_methods = statements_from(_piece_methods(info, pieces,
                                                 overridden if derived else None)) \
        if overridden or not derived else []
    if decl.name is None:
        plan.mark(cls.node, "get_name() is not literal, so name was not derived from it",
                  "declare name as class data")

    def edit(updated: cst.ClassDef) -> cst.ClassDef:
        block = updated.body
        assert isinstance(block, cst.IndentedBlock)
        stmts = list(block.body)
        doc = stmts[:1] if stmts and is_docstring(stmts[0]) else []
        rest = stmts[len(doc):]
        at = next((i for i, s in enumerate(rest) if isinstance(s, cst.FunctionDef)
                   and anchor is not None and s.name.value == anchor.name.value), None)
        methods = [_blank_before(m) for m in new_methods]
        if not methods:
            pass
        elif at is None:
            rest = [*rest, *methods]
        else:
            anchor_now = rest[at]
            assert isinstance(anchor_now, cst.FunctionDef)
            comments = anchor_now.leading_lines
            methods[0] = methods[0].with_changes(leading_lines=comments)
            rest = [*rest[:at], *methods, *rest[at + 1:]]
        if rest:
            rest[0] = _blank_before(rest[0])
        return updated.with_changes(body=block.with_changes(body=[*doc, *new_decl, *rest]))

    plan.edit(cls.node, edit)


def _blank_before(stmt: cst.BaseStatement) -> cst.BaseStatement:
    if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and not any(
            line.comment is None for line in stmt.leading_lines[:1]):
        return stmt.with_changes(leading_lines=[cst.EmptyLine(indent=False), *stmt.leading_lines])
    return stmt
