"""The metadata class and its builder: ``slot_mapping`` dropped, the builder in the new
signature, built from the new :class:`~vllm.attention.CommonAttentionMetadata`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import libcst as cst

from vllm.migrate.analysis import (
    ClassInfo,
    ModuleInfo,
    class_body,
    dotted,
    function_body,
    is_docstring,
    name_loads,
    names_in,
    params,
    reads_attribute,
    unset_self_reads,
)
from vllm.migrate.plan import Plan, expression, method_from, statements_from

COMMON_RENAMED: Final = {"block_table_tensor": "block_table"}
"""Upstream's ``CommonAttentionMetadata`` fields under another name in the new one."""
COMMON_DERIVED: Final = {
    "num_computed_tokens_cpu":
        "({c}.seq_lens_cpu - ({c}.query_start_loc_cpu[1:] - {c}.query_start_loc_cpu[:-1]))",
}
COMMON_ABSENT: Final = frozenset({
    "logits_indices_padded", "num_logits_indices", "encoder_seq_lens", "encoder_seq_lens_cpu",
    "dcp_local_seq_lens", "dcp_local_seq_lens_cpu",
})
"""Upstream fields the adapter always passes as None (no such feature here)."""
COMMON_FIELDS: Final = frozenset({
    "query_start_loc", "seq_lens", "block_table", "query_start_loc_cpu", "seq_lens_cpu",
    "num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "block_size", "causal",
})
COMMON_METHODS: Final = {
    "batch_size": "{c}.num_reqs",
    "naive_query_lens": "({c}.query_start_loc[1:] - {c}.query_start_loc[:-1])",
    "compute_num_computed_tokens":
        "({c}.seq_lens - ({c}.query_start_loc[1:] - {c}.query_start_loc[:-1]))",
}
BUILDER_HOOKS: Final = frozenset({
    "build_for_cudagraph_capture", "build_for_drafting", "update_block_table",
    "reorder_batch", "use_cascade_attention", "get_cudagraph_support",
})
"""Legacy builder methods the runner of the new API never calls."""
BUILDER_HOOK_ATTRS: Final = frozenset({
    "_cudagraph_support", "cudagraph_support", "supports_update_block_table",
})


def metadata_fields(cls: ClassInfo) -> list[str]:
    """The dataclass fields declared in ``cls``'s body, in order."""
    fields = []
    for stmt in class_body(cls.node):
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name):
                ann = small.annotation.annotation
                head = dotted(ann.value) if isinstance(ann, cst.Subscript) else dotted(ann)
                if head is None or head.rpartition(".")[2] != "ClassVar":
                    fields.append(small.target.value)
    return fields


def _dataclass_decorator(info: ModuleInfo, cls: ClassInfo) -> cst.Decorator | None:
    for d in cls.node.decorators:
        target = d.decorator.func if isinstance(d.decorator, cst.Call) else d.decorator
        if info.qualified(target) in ("dataclasses.dataclass", "dataclass"):
            return d
    return None


def _mutated_fields(info: ModuleInfo, cls: ClassInfo, fields: list[str]) -> bool:
    """Whether the module assigns a field of the metadata on an object (not ``self``):
    such code needs the dataclass unfrozen."""
    names = set(fields) - {"slot_mapping"}
    found = False

    class Visitor(cst.CSTVisitor):
        def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
            return node.name.value not in BUILDER_HOOKS  # deleted with the migration

        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            nonlocal found
            t = node.target
            if isinstance(t, cst.Attribute) and t.attr.value in names and not (
                    isinstance(t.value, cst.Name) and t.value.value == "self"):
                found = True

    info.module.visit(Visitor())
    return found


def rewrite_metadata(plan: Plan, cls: ClassInfo, legacy: bool) -> None:
    """``cls`` as a dataclass subclassing the new ``AttentionMetadata``, without
    ``slot_mapping``; ``legacy``: it subclasses the legacy ``AttentionMetadata``."""
    info = plan.info
    plan.need("vllm.attention", "AttentionMetadata")
    body = class_body(cls.node)
    for i, stmt in enumerate(body):
        if cls.attr_lines.get("slot_mapping") is stmt:
            plan.remove.add(stmt)
            if i + 1 < len(body) and is_docstring(body[i + 1]):
                plan.remove.add(body[i + 1])  # the field's docstring
    fields = metadata_fields(cls)
    decorator = _dataclass_decorator(info, cls)
    if decorator is None:
        plan.mark(cls.node, f"{cls.name} is not a dataclass",
                  f"make {cls.name} a frozen dataclass subclassing AttentionMetadata "
                  "without slot_mapping")
    else:
        frozen = not _mutated_fields(info, cls, fields)
        call = decorator.decorator if isinstance(decorator.decorator, cst.Call) else None
        target = decorator.decorator if call is None else call.func
        kept = [a for a in (() if call is None else call.args)
                if a.keyword is None or a.keyword.value not in ("frozen", "kw_only")]
        extra = "".join(f", {info.module.code_for_node(a).strip().rstrip(',')}" for a in kept)
        text = f"{info.module.code_for_node(target)}({'frozen=True, ' if frozen else ''}" \
               f"kw_only=True{extra})"
        plan.replace(decorator, decorator.with_changes(decorator=expression(text)))
        if not frozen:
            plan.notes.append(f"{cls.name} stays an unfrozen dataclass: the module assigns its "
                              "fields after construction")
    set_base(plan, cls, "AttentionMetadata", legacy_base="AttentionMetadata")
    _rewrite_constructor_calls(plan, cls, fields)


def set_base(plan: Plan, cls: ClassInfo, new_base: str, legacy_base: str) -> None:
    """Replace ``cls``'s legacy ``legacy_base`` base (or add ``new_base`` first)."""
    info = plan.info
    args = list(cls.node.bases)
    replaced = False
    for i, arg in enumerate(args):
        value = arg.value.value if isinstance(arg.value, cst.Subscript) else arg.value
        q = info.qualified(value)
        if q is not None and q.endswith("." + legacy_base) and info.is_legacy_name(
                value, legacy_base):
            args[i] = arg.with_changes(value=expression(new_base))
            replaced = True
    if not replaced:
        args.insert(0, cst.Arg(value=expression(new_base),
                               comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                               if args else cst.MaybeSentinel.DEFAULT))
    node = cls.node

    def edit(updated: cst.ClassDef) -> cst.ClassDef:
        return updated.with_changes(bases=args, lpar=cst.LeftParen(), rpar=cst.RightParen()) \
            if not isinstance(node.lpar, cst.LeftParen) else updated.with_changes(bases=args)

    plan.edit(node, edit)


def _rewrite_constructor_calls(plan: Plan, cls: ClassInfo, fields: list[str]) -> None:
    """Calls of the metadata class: positional arguments become keywords (the class is
    keyword-only now) and the ``slot_mapping`` argument goes."""
    info = plan.info
    calls: list[cst.Call] = []

    class Visitor(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            if isinstance(node.func, cst.Name) and node.func.value == cls.name:
                calls.append(node)

    info.module.visit(Visitor())
    for call in calls:
        if any(a.star == "*" for a in call.args) or sum(
                a.keyword is None and not a.star for a in call.args) > len(fields):
            plan.mark(info.statement_of(call), f"{cls.name}(...) is called with *args/**kwargs",
                      f"call {cls.name} with keywords only, without slot_mapping")
            continue
        keep: list[tuple[int, str]] = []  # index of each argument kept, with its field
        for i, arg in enumerate(call.args):
            name = arg.keyword.value if arg.keyword is not None else (
                "**" if arg.star else fields[i])
            if name != "slot_mapping":
                keep.append((i, name))
        converted = any(call.args[i].keyword is None and not call.args[i].star
                        for i, _ in keep)
        if converted or len(keep) != len(call.args):
            plan.edit(call, _call_edit(info, call, keep, converted))


def _call_edit(info: ModuleInfo, call: cst.Call, keep: list[tuple[int, str]],
               converted: bool) -> Callable[[cst.Call], cst.BaseExpression]:
    """The edit of one metadata constructor call (on its updated arguments, which other
    edits may have changed): keep ``keep``, and with ``converted``, all as keywords."""
    column = info.column(call)

    def edit(updated: cst.Call) -> cst.BaseExpression:
        args = [updated.args[i] for i, _ in keep]
        if not converted:
            if args:
                args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(args=args)
        values = [(name, info.module.code_for_node(a.value).strip())
                  for a, (_, name) in zip(args, keep)]  # ** keeps its name: "**=x" below
        return _keyword_call(info.module.code_for_node(updated.func), values, column)

    return edit


def _keyword_call(func: str, values: list[tuple[str, str]], column: int) -> cst.BaseExpression:
    """``func(field=value, ...)``: one line where it fits, else one argument a line."""
    values = [(f"**{v}", "") if f == "**" else (f, v) for f, v in values]
    one = f"{func}({', '.join(f'{f}={v}' if v else f for f, v in values)})"
    if column + len(one) <= 99 or any("\n" in v for _, v in values):
        return expression(one)
    # continuation lines are indented relative to the statement's block
    inner = "".join(f"    {f}={v},\n" if v else f"    {f},\n" for f, v in values)
    return expression(f"{func}(\n{inner})")


def rewrite_builder(plan: Plan, cls: ClassInfo, meta: str) -> None:
    info = plan.info
    plan.need("vllm.attention", "AttentionMetadataBuilder", "CommonAttentionMetadata")
    set_base(plan, cls, f"AttentionMetadataBuilder[{info.ref(meta, cls.node, annotation=False)}]",
             legacy_base="AttentionMetadataBuilder")
    init = cls.methods.get("__init__")
    if init is not None:
        _rewrite_builder_init(plan, cls, init)
    build = cls.methods.get("build")
    if build is None:
        plan.mark(cls.node, f"{cls.name} has no build()",
                  f"add build(self, common: CommonAttentionMetadata) -> {meta}")
    else:
        _rewrite_build(plan, build, info.ref(meta, cls.node, annotation=True))
    _builder_state(plan, cls)
    for name, fn in cls.methods.items():
        if name in BUILDER_HOOKS:
            if _referenced(info, name, fn):
                plan.mark(fn, f"{name}() is a legacy runner hook the new API never calls",
                          f"delete {name}() and what calls it, or fold it into build()")
            else:
                plan.remove.add(fn)
                plan.notes.append(f"{cls.name}.{name}() deleted: the new API never calls it")
    for name, line in cls.attr_lines.items():
        if name in BUILDER_HOOK_ATTRS and not _referenced(info, name, line):
            plan.remove.add(line)
            plan.notes.append(f"{cls.name}.{name} deleted: the new API never reads it")


LEGACY_BUILDER_STATE: Final = frozenset({"vllm_config", "kv_cache_spec", "layer_names"})
"""What upstream's builder base stored in ``__init__``; the new base stores spec and device."""


def _builder_state(plan: Plan, cls: ClassInfo) -> None:
    """Mark reads of ``self.vllm_config`` (and the other legacy base state) the class does
    not set itself."""
    for node, attr in unset_self_reads(cls, LEGACY_BUILDER_STATE):
        stmt = plan.info.statement_of(node)
        if stmt not in plan.remove:
            plan.mark(stmt, f"reads self.{attr}, which the legacy builder base set",
                      "read what you need from self.spec (AttentionLayerSpec) instead")


def _referenced(info: ModuleInfo, attr: str, definition: cst.CSTNode) -> bool:
    """Whether the module reads ``<x>.attr`` anywhere outside ``definition``."""

    def skip(node: cst.CSTNode) -> bool:
        # the legacy hooks go with the migration: what only they read goes too
        return node is definition or (isinstance(node, cst.FunctionDef)
                                      and node.name.value in BUILDER_HOOKS)

    return reads_attribute(info.module, attr, skip)


def _signature(name: str, args: list[str], returns: str) -> str:
    one = f"    def {name}({', '.join(args)}) -> {returns}:\n"
    if len(one) <= 100:
        return one
    inner = "".join(f"        {a},\n" for a in args)
    return f"    def {name}(\n{inner}    ) -> {returns}:\n"


def with_signature(fn: cst.FunctionDef, args: list[str], returns: str) -> cst.FunctionDef:
    """``fn`` with a new parameter list and return annotation (body, decorators and
    comments kept)."""
    sig = method_from(_signature(fn.name.value, args, returns) + "        pass\n")
    return fn.with_changes(params=sig.params, returns=sig.returns,
                           whitespace_before_params=sig.whitespace_before_params)


def _docstring_split(fn: cst.FunctionDef) -> tuple[list[cst.BaseStatement], list[cst.BaseStatement]]:
    body = function_body(fn)
    if body and is_docstring(body[0]):
        return body[:1], body[1:]
    return [], body


def binding(module: cst.Module, param: cst.Param, value: str) -> str:
    """``name: annotation = value`` for a parameter the new signature drops, as the first
    lines of a method's body give it (the annotation as ``param`` has it, if any)."""
    name = param.name.value
    if param.annotation is None:
        return f"        {name} = {value}\n"
    return f"        {name}: {module.code_for_node(param.annotation.annotation)} = {value}\n"


def body_with(fn: cst.FunctionDef, first: list[cst.BaseStatement]) -> cst.FunctionDef:
    """``fn`` with ``first`` inserted after its docstring."""
    doc, rest = _docstring_split(fn)
    block = fn.body
    if not isinstance(block, cst.IndentedBlock):
        block = cst.IndentedBlock(body=rest)
    return fn.with_changes(body=block.with_changes(body=[*doc, *first, *rest]))


def _rewrite_builder_init(plan: Plan, cls: ClassInfo, init: cst.FunctionDef) -> None:
    ps = [p.name.value for p in params(init)[1:]]
    device = ps[-1] if ps else "device"
    extra = ps[:-1]
    _, rest = _docstring_split(init)
    dropped: list[cst.BaseStatement] = []
    for stmt in rest:
        code = plan.code(stmt)
        if code in (f"self.device = {device}", f"self.{device} = {device}"):
            dropped.append(stmt)
        elif code.startswith("super().__init__("):
            dropped.append(stmt)
    if all(s in dropped for s in rest):
        plan.remove.add(init)
        plan.notes.append(f"{cls.name}.__init__ deleted: the base class stores spec and device")
        return
    plan.remove.update(dropped)
    for stmt in rest:
        if stmt in dropped:
            continue
        used = names_in(stmt) & set(extra)
        if used:
            plan.mark(stmt, f"reads {', '.join(sorted(used))}, which the new builder is not "
                      "given", "compute it from self.spec (AttentionLayerSpec) or per step "
                      "in build() from the CommonAttentionMetadata")
    plan.need("vllm.attention", "AttentionLayerSpec")

    def edit(updated: cst.FunctionDef) -> cst.FunctionDef:
        new = with_signature(updated, ["self", "spec: AttentionLayerSpec",
                                       f"{device}: torch.device"], "None")
        return body_with(new, statements_from(f"        super().__init__(spec, {device})\n"))

    plan.edit(init, edit)
    if extra:
        plan.notes.append(f"{cls.name}.__init__ takes (spec, device) instead of "
                          f"({', '.join(ps)})")


def _rewrite_build(plan: Plan, build: cst.FunctionDef, meta: str) -> None:
    info = plan.info
    ps = params(build)[1:]
    names = [p.name.value for p in ps]
    if len(ps) >= 2:
        common, others = names[1], [ps[0], *ps[2:]]
    elif ps:
        common, others = names[0], []
    else:
        common, others = "common", []
    aliases = {common}
    for stmt in function_body(build):  # c = common_attn_metadata
        if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
            small = stmt.body[0]
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(
                    small.targets[0].target, cst.Name) and isinstance(small.value, cst.Name) \
                    and small.value.value == common:
                aliases.add(small.targets[0].target.value)
    _rewrite_common_reads(plan, build, aliases)
    used = names_in(build.body)
    bindings = []
    for i, p in enumerate(others):
        name = p.name.value
        if name not in used:
            continue
        if i == 0 and len(ps) >= 2:
            default: str | None = "0"  # common_prefix_len: the adapter passes 0
        elif p.default is not None:
            default = info.module.code_for_node(p.default)
        else:
            default = "False" if name == "fast_build" else None  # as the adapter passes it
        if default is None:
            plan.mark(build, f"build() reads {name}, which the new build() is not given",
                      f"compute {name} from the CommonAttentionMetadata in build()")
            continue
        bindings.append(binding(info.module, p, default))
    returns = info.module.code_for_node(build.returns.annotation) if build.returns else meta

    def edit(updated: cst.FunctionDef) -> cst.FunctionDef:
        new = with_signature(updated, ["self", f"{common}: CommonAttentionMetadata"], returns)
        return body_with(new, statements_from("".join(bindings))) if bindings else new

    plan.edit(build, edit)


def _rewrite_common_reads(plan: Plan, fn: cst.FunctionDef, aliases: set[str]) -> None:
    """Upstream's ``CommonAttentionMetadata`` reads as the new one's."""
    info = plan.info
    found: list[tuple[cst.Call | cst.Attribute, str, str]] = []  # node, alias, attr
    methods: set[cst.CSTNode] = set()  # the ``alias.method`` of the calls found

    class Visitor(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            f = node.func
            if isinstance(f, cst.Attribute) and isinstance(f.value, cst.Name) and \
                    f.value.value in aliases and f.attr.value in COMMON_METHODS:
                found.append((node, f.value.value, f.attr.value))
                methods.add(f)

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if isinstance(node.value, cst.Name) and node.value.value in aliases:
                found.append((node, node.value.value, node.attr.value))

    fn.body.visit(Visitor())
    for node, alias, attr in found:
        if isinstance(node, cst.Call):
            plan.replace(node, expression(COMMON_METHODS[attr].format(c=alias)))
        elif node in methods:
            continue
        elif attr in COMMON_RENAMED:
            plan.replace(node, expression(f"{alias}.{COMMON_RENAMED[attr]}"))
        elif attr in COMMON_DERIVED:
            plan.replace(node, expression(COMMON_DERIVED[attr].format(c=alias)))
        elif attr in COMMON_ABSENT:
            plan.replace(node, expression("None"))
        elif attr == "slot_mapping":
            if _is_slot_argument(info, node):
                continue
            stmt = info.statement_of(node)
            local = _assigned_local(stmt, node)
            if local is not None and all(_is_slot_argument(info, n)
                                         for n in _name_loads(fn, local)):
                plan.remove.add(stmt)  # read only to hand to the metadata, which drops it
            else:
                plan.mark(stmt, "build() reads the slot mapping",
                          "drop it: the slot mapping reaches only the writer, through the "
                          "ForwardContext")
        elif attr not in COMMON_FIELDS:
            plan.mark(info.statement_of(node),
                      f"reads {alias}.{attr}, which CommonAttentionMetadata does not have",
                      f"compute {attr} from the fields of vllm.attention."
                      "CommonAttentionMetadata")


def _assigned_local(stmt: cst.CSTNode, value: cst.CSTNode) -> str | None:
    """``name`` of a ``name = <value>`` statement."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Assign) and small.value is value and len(small.targets) == 1 \
                and isinstance(small.targets[0].target, cst.Name):
            return small.targets[0].target.value
    return None


def _name_loads(fn: cst.FunctionDef, name: str) -> list[cst.Name]:
    """The reads of ``name`` in ``fn`` (not its assignments)."""
    return name_loads(fn.body, {name}, skip=lambda node: isinstance(node, cst.AssignTarget)
                      and isinstance(node.target, cst.Name))


def _is_slot_argument(info: ModuleInfo, node: cst.CSTNode) -> bool:
    """``node`` is the ``slot_mapping`` argument of a metadata constructor call (dropped)."""
    arg = info.parent(node)
    call = info.parent(arg) if arg is not None else None
    if not isinstance(arg, cst.Arg) or not isinstance(call, cst.Call):
        return False
    if not (isinstance(call.func, cst.Name) and call.func.value == info.metadata_class):
        return False
    if arg.keyword is not None:
        return arg.keyword.value == "slot_mapping"
    index = [a for a in call.args if a.keyword is None].index(arg)
    fields = info.metadata_fields
    return index < len(fields) and fields[index] == "slot_mapping"
