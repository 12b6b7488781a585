"""The impl: built from an ``AttentionLayerSpec``, ``forward`` in the new signature and
without the cache write, ``do_kv_cache_update`` gone, the layer read through
``layer.kv_quant`` and ``self.spec``."""

from __future__ import annotations

from typing import Final

import libcst as cst

from vllm.migrate.analysis import (
    ClassInfo,
    dotted,
    function_body,
    is_docstring,
    name_loads,
    names_in,
    params,
    target_names,
    unset_self_reads,
)
from vllm.migrate.declarations import Declarations
from vllm.migrate.metadata import binding, body_with, set_base, with_signature
from vllm.migrate.plan import Plan, expression, statements_from
from vllm.migrate.writes import WriteFinding

SPEC_BY_POSITION: Final = (
    ("num_heads", "spec.num_heads"), ("head_size", "spec.head_size"), ("scale", "spec.scale"),
    ("num_kv_heads", "spec.num_kv_heads"), ("alibi_slopes", "None"),
    ("sliding_window", "spec.sliding_window"), ("kv_cache_dtype", "spec.kv_cache_dtype"),
    ("logits_soft_cap", "spec.logits_soft_cap"), ("attn_type", "spec.attn_type"),
    ("kv_sharing_target_layer_name", "spec.kv_sharing_target_layer_name"),
)
"""Upstream's impl arguments in the order the adapter passes them, and what each is in
the layer's ``AttentionLayerSpec`` (ALiBi slopes are always None here)."""

LAYER_READS: Final = {
    "_k_scale": "{l}.kv_quant.k_scale",
    "_v_scale": "{l}.kv_quant.v_scale",
    "_k_scale_cpu": "{l}.kv_quant.k_scale.cpu()",
    "_v_scale_cpu": "{l}.kv_quant.v_scale.cpu()",
    "_k_scale_float": "float({l}.kv_quant.k_scale)",
    "_v_scale_float": "float({l}.kv_quant.v_scale)",
    "_q_scale_float": "1.0",
    "_q_scale": "{l}.kv_quant.k_scale.new_ones(())",
    "_prob_scale": "{l}.kv_quant.k_scale.new_ones(())",
    "num_heads": "self.spec.num_heads",
    "head_size": "self.spec.head_size",
    "head_size_v": "self.spec.v_head_size",
    "num_kv_heads": "self.spec.num_kv_heads",
    "sliding_window": "self.spec.sliding_window",
    "attn_type": "self.spec.attn_type",
    "kv_cache_dtype": "self.spec.kv_cache_dtype",
    "kv_sharing_target_layer_name": "self.spec.kv_sharing_target_layer_name",
}
"""What a legacy impl read from upstream's layer, as the new layer protocol (the scales
are ``[1]`` or ``[num_kv_heads]`` float32 where upstream's were 0-d; no query scale)."""
LAYER_KEPT: Final = frozenset({"layer_name", "kv_quant"})

LEGACY_IMPL_STATE: Final = frozenset({
    "dcp_world_size", "dcp_rank", "pcp_world_size", "pcp_rank", "total_cp_world_size",
    "total_cp_rank", "need_to_return_lse_for_decode",
})
"""Set by the legacy impl base before ``__init__`` (context parallelism); the new base
does not."""


def rewrite_impl(plan: Plan, cls: ClassInfo, meta: str, decl: Declarations,
                 finding: WriteFinding | None, flagged: bool, *, derived: bool = False) -> None:
    """``derived``: ``cls`` subclasses an impl of another legacy module (migrated on its
    own), so its base stays."""
    if not derived:
        plan.need("vllm.attention", "AttentionImpl")
        set_base(plan, cls, f"AttentionImpl[{plan.info.ref(meta, cls.node, annotation=False)}]",
                 legacy_base="AttentionImpl")
    init = cls.methods.get("__init__")
    if init is not None:
        _rewrite_init(plan, cls, init, decl)
    forward = cls.methods.get("forward")
    if forward is None:
        plan.mark(cls.node, f"{cls.name} has no forward()",
                  "add forward(layer, query, key, value, kv_cache, attn_metadata, output)")
    else:
        _rewrite_forward(plan, forward, plan.info.ref(meta, cls.node, annotation=True),
                         finding)
    update = cls.methods.get("do_kv_cache_update")
    if update is not None and flagged:
        plan.remove.add(update)
    for name, fn in cls.methods.items():
        layer = _layer_param(fn)
        if layer is not None and fn not in plan.remove:
            _rewrite_layer_reads(plan, fn, layer)
            if name != "forward":
                _layer_annotation(plan, fn, layer)
    _legacy_state(plan, cls)
    process = cls.methods.get("process_weights_after_loading")
    if process is not None and any(not is_docstring(s) and plan.code(s) != "pass"
                                   for s in function_body(process)):
        plan.mark(process, "the new API never calls process_weights_after_loading()",
                  "do this work in __init__ (or on the first forward)")


def _layer_param(fn: cst.FunctionDef) -> str | None:
    ps = [p.name.value for p in params(fn)]
    if fn.name.value == "forward" and len(ps) > 1:
        return ps[1]
    return "layer" if "layer" in ps else None


def _rewrite_init(plan: Plan, cls: ClassInfo, init: cst.FunctionDef, decl: Declarations) -> None:
    info = plan.info
    ps = params(init)[1:]
    positional = [p for p in ps if p not in init.params.kwonly_params]
    supers = [s for s in function_body(init) if plan.code(s).startswith("super().__init__(")]
    used = set().union(*(names_in(s) for s in function_body(init) if s not in supers))
    assigned = _assigned_names(init)
    bindings: list[str] = []
    inline: dict[str, str] = {}
    by_name = dict(SPEC_BY_POSITION)
    for i, p in enumerate(ps):
        name = p.name.value
        if name not in used:
            continue
        value = SPEC_BY_POSITION[i][1] if p in positional and i < len(SPEC_BY_POSITION) \
            else by_name.get(name)
        if value is None and p.default is not None:
            value = info.module.code_for_node(p.default)
        if value is None:
            plan.mark(init, f"__init__ takes {name}, which the layer's AttentionLayerSpec "
                      "does not carry", f"give {name} a value in __init__")
            continue
        if value.startswith("spec.") and name not in assigned:
            inline[name] = value
            continue
        bindings.append(binding(info.module, p, value))
    # a nested def or lambda binds its own names
    nested = (cst.FunctionDef, cst.Lambda)
    for node in name_loads(init.body, inline, skip=lambda n: isinstance(n, nested)):
        plan.replace(node, expression(inline[node.value]))
    for star, kind, empty in ((init.params.star_arg, "tuple[object, ...]", "()"),
                              (init.params.star_kwarg, "dict[str, object]", "{}")):
        if isinstance(star, cst.Param) and star.name.value in used:
            bindings.append(f"        {star.name.value}: {kind} = {empty}\n")
    call = statements_from("super().__init__(spec)\n")[0]
    for stmt in supers:  # the base's __init__ runs where it ran, now given the spec
        plan.edit(stmt, lambda updated: call.with_changes(leading_lines=updated.leading_lines))
    plan.remove.update(decl.refusals_folded)
    for stmt in decl.refusals_left:
        plan.mark(stmt, "the impl refuses a configuration in __init__, which the new API "
                  "reads from the backend's declarations",
                  "declare the refusal as class data (supports_*, attention_types, "
                  "supported_kv_cache_dtypes) or in unsupported_reasons(), then delete it")
    plan.need("vllm.attention", "AttentionLayerSpec")
    first = ("" if supers else "        super().__init__(spec)\n") + "".join(bindings)

    def edit(updated: cst.FunctionDef) -> cst.FunctionDef:
        new = with_signature(updated, ["self", "spec: AttentionLayerSpec"], "None")
        return body_with(new, statements_from(first)) if first else new

    plan.edit(init, edit)


def _assigned_names(fn: cst.FunctionDef) -> set[str]:
    found: set[str] = set()

    class Visitor(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.For)):
                found.update(n.value for n in target_names(node.target))
            return True

    fn.body.visit(Visitor())
    return found


def _rewrite_forward(plan: Plan, fn: cst.FunctionDef, meta: str,
                     finding: WriteFinding | None) -> None:
    info = plan.info
    ps = params(fn)[1:]
    names = [p.name.value for p in ps]
    if len(ps) < 6:
        plan.mark(fn, "forward() takes fewer arguments than (layer, query, key, value, "
                  "kv_cache, attn_metadata)", "write forward(self, layer, query, key, value, "
                  "kv_cache, attn_metadata, output) -> torch.Tensor")
        return
    used = names_in(fn.body)
    added_output = len(ps) == 6
    out = "output" if "output" not in used else "output_buffer"
    kept = names[:7] if not added_output else [*names[:6], out]
    bindings: list[str] = []
    for p in ps[7:]:
        name = p.name.value
        if name not in used:
            continue
        if p.default is None:
            plan.mark(fn, f"forward() takes {name}, which the new forward() is not given",
                      f"compute {name} inside forward()")
            continue
        bindings.append(binding(info.module, p, info.module.code_for_node(p.default)))
    types = ["AttentionLayerProtocol", "torch.Tensor", "torch.Tensor | None",
             "torch.Tensor | None", "torch.Tensor", meta, "torch.Tensor"]
    args = ["self", *(f"{n}: {t}" for n, t in zip(kept, types))]
    plan.need("vllm.attention.backend", "AttentionLayerProtocol")
    plan.need("torch")
    if finding is not None:
        plan.remove.update(finding.removed)
        for write in finding.other_writes:
            plan.mark(write.statement, "writes the cache, but not from the slot mapping",
                      "move this write into a KVCacheWriter or delete it: forward() must "
                      "not write kv_cache")
        for stmt in finding.slot_reads_left:
            plan.mark(stmt, "still reads the slot mapping",
                      "compute without it: the slot mapping reaches only the writer")
    if added_output:
        _return_into(plan, fn, out)
    # where the legacy type already admits None, the legacy code handles None (or mypy
    # reports it there): the new API's None is nothing new to it
    unchecked = [p.name.value for p in ps[2:4]
                 if p.annotation is None or not admits_none(p.annotation.annotation)]
    if unchecked:
        _key_value_uses(plan, fn, unchecked, finding.removed if finding else set())

    def edit(updated: cst.FunctionDef) -> cst.FunctionDef:
        new = with_signature(updated, args, "torch.Tensor")
        return body_with(new, statements_from("".join(bindings))) if bindings else new

    plan.edit(fn, edit)


def admits_none(annotation: cst.BaseExpression) -> bool:
    """Whether a type annotation admits None: ``X | None``, ``Optional[X]``,
    ``Union[X, None]`` or ``None`` itself (a string annotation too)."""
    if isinstance(annotation, cst.SimpleString):
        value = annotation.evaluated_value
        try:
            return isinstance(value, str) and admits_none(cst.parse_expression(value))
        except cst.ParserSyntaxError:
            return False
    if isinstance(annotation, cst.Name):
        return annotation.value == "None"
    if isinstance(annotation, cst.BinaryOperation) and isinstance(annotation.operator,
                                                                  cst.BitOr):
        return admits_none(annotation.left) or admits_none(annotation.right)
    if isinstance(annotation, cst.Subscript):
        generic = dotted(annotation.value) or ""
        if generic.rsplit(".", 1)[-1] == "Optional":
            return True
        if generic.rsplit(".", 1)[-1] == "Union":
            return any(isinstance(el.slice, cst.Index) and admits_none(el.slice.value)
                       for el in annotation.slice)
    return False


def _return_into(plan: Plan, fn: cst.FunctionDef, out: str) -> None:
    """A legacy forward without an output buffer returned its own tensor; the new one
    fills ``output`` and returns it (what the adapter does with the result)."""
    returns: list[cst.Return] = []

    class Visitor(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node is fn

        def visit_Return(self, node: cst.Return) -> None:
            returns.append(node)

    fn.visit(Visitor())
    for ret in returns:
        def edit(updated: cst.Return) -> cst.Return:
            if updated.value is None:
                return updated
            value = plan.info.module.code_for_node(updated.value)
            return updated.with_changes(
                value=expression(f"{out}.copy_(({value}).reshape({out}.shape))"))

        plan.edit(ret, edit)
    plan.notes.append(f"forward() takes the output buffer {out!r} and fills it (the legacy "
                      "forward returned its own tensor)")


def _rewrite_layer_reads(plan: Plan, fn: cst.FunctionDef, layer: str) -> None:
    info = plan.info
    reads: list[cst.Attribute] = []

    class Visitor(cst.CSTVisitor):
        def visit_Attribute(self, node: cst.Attribute) -> None:
            if isinstance(node.value, cst.Name) and node.value.value == layer:
                reads.append(node)

    fn.body.visit(Visitor())
    for node in reads:
        attr = node.attr.value
        if attr in LAYER_KEPT:
            continue
        new = LAYER_READS.get(attr)
        if new is None:
            plan.mark(info.statement_of(node), f"reads {layer}.{attr}, which the new layer "
                      "protocol does not offer",
                      f"read it from self.spec or {layer}.kv_quant, or pass it in")
            continue
        if new.startswith("torch."):
            plan.need("torch")
        plan.replace(node, expression(new.format(l=layer)))


LEGACY_LAYER_TYPES: Final = ("torch.nn.Module", "nn.Module", "AttentionLayer", "Attention")


def _layer_annotation(plan: Plan, fn: cst.FunctionDef, layer: str) -> None:
    """A helper of the impl that takes the layer as upstream's type takes the new layer
    protocol (what forward hands it now)."""
    for p in params(fn):
        if p.name.value == layer and p.annotation is not None and plan.code(
                p.annotation.annotation) in LEGACY_LAYER_TYPES:
            plan.replace(p.annotation.annotation, expression("AttentionLayerProtocol"))
            plan.need("vllm.attention.backend", "AttentionLayerProtocol")


def _key_value_uses(plan: Plan, fn: cst.FunctionDef, names: list[str],
                    removed: set[cst.CSTNode]) -> None:
    """Statements that use ``key`` / ``value`` beyond a None check: the new API passes
    None for cross-attention after its first step, where upstream's type said Tensor."""
    info = plan.info
    marked: set[cst.CSTNode] = set()
    for use in name_loads(fn.body, names, skip=_none_check):
        stmt = info.statement_of(use)
        if stmt in marked or info.within(stmt, removed):
            continue
        marked.add(stmt)
        plan.mark(stmt, f"uses {' / '.join(names)}, which the new forward() gets as None "
                  "for cross-attention after its first step",
                  f"check {' and '.join(names)} for None before this use")


def _none_check(node: cst.CSTNode) -> bool:
    """``name is None`` / ``name is not None`` (chained alike)."""
    return isinstance(node, cst.Comparison) and isinstance(node.left, cst.Name) and all(
        isinstance(c.comparator, cst.Name) and c.comparator.value == "None"
        and isinstance(c.operator, (cst.Is, cst.IsNot)) for c in node.comparisons)


def _legacy_state(plan: Plan, cls: ClassInfo) -> None:
    """Mark reads of the legacy impl base's state the class does not set itself (a base of
    another module may read it too: its own migration may drop the state, not set it)."""
    for node, attr in unset_self_reads(cls, LEGACY_IMPL_STATE):
        stmt = plan.info.statement_of(node)
        if stmt in plan.remove:
            continue
        plan.mark(stmt, f"reads self.{attr}, which the legacy impl base set",
                  f"set self.{attr} in __init__ (1, 0 or False without context parallelism)")
