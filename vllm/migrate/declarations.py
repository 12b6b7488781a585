"""A legacy backend's capabilities as class data, read from its legacy methods.

The values are the ones the adapter gives the same class (``shim.adapter``), read from
the source where they are literal (:mod:`vllm.migrate.literal`): the ``get_supported_*``
methods and class lists, upstream's ``supports_*`` predicates (over the same probe
ranges), block sizes ``get_kv_cache_shape`` refuses, and features the impl refuses in
``__init__`` with ``raise NotImplementedError``. A value that is not literal stays a
legacy method, marked for a person to turn into class data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, TypeVar

import libcst as cst

from vllm.attention.backend import SizeSpec, exactly
from vllm.attention.types import KV_CACHE_DTYPES, UNQUANTISED_SPELLINGS, AttentionType, KVCacheLayout
from vllm.attention.writers import writer_for_layout
from vllm.migrate.analysis import ClassInfo, ModuleInfo, Pieces, function_body, params
from vllm.migrate.literal import (
    NOT_LITERAL,
    Evaluator,
    MultipleOfSize,
    Raised,
    TorchDType,
)

FLOAT_DTYPES: Final = ("float32", "float16", "bfloat16")
UPSTREAM_DEFAULT_DTYPES: Final = ("float16", "bfloat16")
"""The legacy base class's ``supported_dtypes`` (upstream's default)."""
UPSTREAM_DEFAULT_CACHE_DTYPES: Final = ("auto", "float16", "bfloat16")
SPELLINGS: Final = KV_CACHE_DTYPES + tuple(UNQUANTISED_SPELLINGS)

HEAD_LIMIT: Final = 512
BLOCK_LIMIT: Final = 1024
"""The ranges the adapter probes ``supports_head_size`` / ``supports_block_size`` over."""

CONSUMED: Final = frozenset({
    "get_name", "get_kv_cache_shape", "get_kv_cache_stride_order", "get_supported_dtypes",
    "supports_dtype", "supported_dtypes", "get_supported_kv_cache_dtypes",
    "supports_kv_cache_dtype", "supported_kv_cache_dtypes", "get_supported_head_sizes",
    "supports_head_size", "get_supported_block_sizes", "get_supported_kernel_block_sizes",
    "supports_block_size", "supports_attn_type", "forward_includes_kv_cache_update",
    "accept_output_buffer", "kv_cache_layout", "get_impl_cls", "get_builder_cls",
    "get_metadata_cls",
})
"""Legacy methods and class attributes the migrated declarations replace."""

DECLARATION_OF: Final = {
    "get_name": "name", "get_supported_dtypes": "supported_dtypes",
    "supports_dtype": "supported_dtypes", "supported_dtypes": "supported_dtypes",
    "get_supported_kv_cache_dtypes": "supported_kv_cache_dtypes",
    "supports_kv_cache_dtype": "supported_kv_cache_dtypes",
    "supported_kv_cache_dtypes": "supported_kv_cache_dtypes",
    "get_supported_head_sizes": "head_sizes", "supports_head_size": "head_sizes",
    "get_supported_block_sizes": "block_sizes", "supports_block_size": "block_sizes",
    "get_supported_kernel_block_sizes": "block_sizes", "get_kv_cache_shape": "block_sizes",
    "supports_attn_type": "attention_types",
}
"""Each legacy method or class list and the declaration it is read into."""

SOURCES_OF: Final = {
    declaration: frozenset(s for s, d in DECLARATION_OF.items() if d == declaration)
    for declaration in dict.fromkeys(DECLARATION_OF.values())
}
"""Each declaration and the legacy methods or class lists it is read from."""

T = TypeVar("T")

IMPL_DEFAULTS: Final[dict[str, object]] = {
    "num_heads": 8, "head_size": 64, "scale": 0.125, "num_kv_heads": 2, "alibi_slopes": None,
    "sliding_window": None, "kv_cache_dtype": "auto", "logits_soft_cap": None,
    "attn_type": "decoder", "kv_sharing_target_layer_name": None,
}
"""The impl arguments the adapter probes a refusal with (a plain decoder layer)."""


@dataclass
class Declarations:
    """Class data for the migrated backend; None where the legacy value is not literal."""

    name: str | None
    layout: KVCacheLayout
    supported_dtypes: tuple[str, ...] | None = None
    supported_kv_cache_dtypes: tuple[str, ...] | None = None
    block_sizes: SizeSpec | None = None
    head_sizes: SizeSpec | None = None
    attention_types: tuple[AttentionType, ...] | None = None
    supports_sliding_window: bool | None = True
    supports_logits_soft_cap: bool | None = True
    unresolved: dict[str, str] = field(default_factory=dict)
    """Legacy method or attribute -> the declaration it should become (not literal)."""
    refusals_folded: list[cst.If] = field(default_factory=list)
    """``if ...: raise NotImplementedError`` of the impl's ``__init__`` now declared."""
    refusals_left: list[cst.If] = field(default_factory=list)
    """Refusals whose condition is not literal, left in the impl."""


def probe_sizes(admits: Callable[[int], bool], limit: int) -> SizeSpec:
    """As the adapter reads a predicate: ``multiple_of`` when the admitted sizes in
    ``1..limit`` are the multiples of their smallest in a range, else the exact set."""
    sizes = [n for n in range(1, limit + 1) if admits(n)]
    if not sizes:
        return exactly()
    low, high = sizes[0], sizes[-1]
    step = math.gcd(*sizes)
    if sizes == list(range(low, high + 1, step)) and low % step == 0 and len(sizes) > 2:
        return SizeSpec(multiple_of=step, min=low, max=None if high == limit else high)
    return exactly(*sizes)


class _Reader:
    def __init__(self, info: ModuleInfo, pieces: Pieces, layout: KVCacheLayout) -> None:
        self.info = info
        self.backend = pieces.backend
        self.impl = pieces.impl
        self.layout = layout
        self.methods = info.methods_of(pieces.backend)
        self.attrs: dict[str, cst.BaseExpression] = {}
        for cls in reversed(info.local_mro(pieces.backend)):
            self.attrs.update(cls.attrs)
        self.eval = Evaluator(info, self.attrs)
        self.upstream_base = any(
            b.endswith(".AttentionBackend") for c in info.local_mro(pieces.backend)
            for b in c.bases if b not in info.classes)
        self.unresolved: dict[str, str] = {}

    def method(self, name: str, *args: object) -> object:
        fn = self.methods.get(name)
        if fn is None:
            return None
        value = self.eval.call(fn, *args)
        if value is NOT_LITERAL or isinstance(value, Raised):
            return NOT_LITERAL
        return value

    def attr(self, name: str) -> object:
        node = self.attrs.get(name)
        return None if node is None else self.eval.expr(node, {})

    def give_up(self, source: str) -> None:
        self.unresolved[source] = DECLARATION_OF.get(source, source)

    def _admitted(self, predicate: str, candidates: Iterable[T],
                  arg: Callable[[T], object] | None = None) -> list[T] | None:
        """The candidates the legacy ``predicate`` admits (called with ``arg`` of each,
        else the candidate itself); None when an answer is not literal."""
        found = []
        for c in candidates:
            ok = self.method(predicate, c if arg is None else arg(c))
            if not isinstance(ok, bool):
                self.give_up(predicate)
                return None
            if ok:
                found.append(c)
        return found

    def _listed(self, name: str, kind: type[T], default: Iterable[T]) -> list[T] | None:
        """The legacy ``get_<name>()``'s list, else the class list ``<name>``, else
        ``default``; None where the one there is not a literal list of ``kind``."""
        for source in (f"get_{name}", name):
            value = self.method(source) if source.startswith("get_") else self.attr(source)
            if value is None:
                continue
            if isinstance(value, (list, tuple, frozenset)) and all(
                    isinstance(v, kind) for v in value):
                return [v for v in value if isinstance(v, kind)]
            self.give_up(source)
            return None
        return list(default)

    # -- each declaration ---------------------------------------------------------------
    def name(self) -> str | None:
        value = self.method("get_name")
        if isinstance(value, str) and value:
            return value
        self.give_up("get_name")
        return None

    def dtypes(self) -> tuple[str, ...] | None:
        listed = self._dtype_list()
        if listed is None:
            return None
        if not listed and self.upstream_base:  # upstream: an empty list admits every dtype
            return FLOAT_DTYPES
        return tuple(d for d in FLOAT_DTYPES if d in listed)

    def _dtype_list(self) -> list[str] | None:
        if "supports_dtype" in self.methods:
            return self._admitted("supports_dtype", FLOAT_DTYPES, TorchDType)
        default = UPSTREAM_DEFAULT_DTYPES if self.upstream_base else FLOAT_DTYPES
        listed = self._listed("supported_dtypes", TorchDType, map(TorchDType, default))
        return None if listed is None else [d.name for d in listed]

    def cache_dtypes(self) -> tuple[str, ...] | None:
        spelled = self._cache_dtype_list()
        if spelled is None:
            return None
        writable = set(getattr(writer_for_layout(self.layout), "cache_dtypes", ("auto",)))
        found = ["auto"]
        for s in spelled:
            if s in KV_CACHE_DTYPES and s != "auto" and s in writable and s not in found:
                found.append(s)
        return tuple(found)

    def _cache_dtype_list(self) -> list[str] | None:
        if "supports_kv_cache_dtype" in self.backend.methods:
            return self._admitted("supports_kv_cache_dtype", SPELLINGS)
        default = UPSTREAM_DEFAULT_CACHE_DTYPES if self.upstream_base else ("auto",)
        listed = self._listed("supported_kv_cache_dtypes", str, default)
        if listed == [] and self.upstream_base:  # upstream: an empty list admits every one
            return list(SPELLINGS)
        return listed

    def head_sizes(self) -> SizeSpec | None:
        if "supports_head_size" in self.backend.methods or (
                "supports_head_size" in self.methods and not self.upstream_base):
            return self._probe("supports_head_size", HEAD_LIMIT)
        value = self.method("get_supported_head_sizes")
        if value is None:
            return SizeSpec()
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            return exactly(*(int(v) for v in value)) if value else SizeSpec()
        self.give_up("get_supported_head_sizes")
        return None

    def _probe(self, method: str, limit: int,
               also: Callable[[int], bool | None] | None = None) -> SizeSpec | None:
        """The sizes the legacy predicate ``method`` (and ``also``) admits."""

        def admits(n: int) -> bool | None:
            ok = self.method(method, n)
            more = True if also is None else also(n)
            if not isinstance(ok, bool) or more is None:
                return None
            return ok and more

        return self._probe_fn(admits, method, limit)

    def _shape_accepts(self, n: int) -> bool | None:
        fn = self.methods.get("get_kv_cache_shape")
        if fn is None:
            return True
        value = self.eval.call(fn, 7, n, 3, 8)
        if isinstance(value, Raised):
            return value.exception != "ValueError"
        return None if value is NOT_LITERAL else True

    def block_sizes(self) -> SizeSpec | None:
        if "supports_block_size" in self.backend.methods:
            return self._probe("supports_block_size", BLOCK_LIMIT, self._shape_accepts)
        exact = self.method("get_supported_block_sizes")
        if exact is not None and not (isinstance(exact, (list, tuple))
                                      and all(isinstance(v, int) for v in exact)):
            self.give_up("get_supported_block_sizes")
            return None
        if not self.upstream_base:
            if exact:
                return exactly(*(int(v) for v in exact))
            return self._probe_fn(self._shape_accepts, "get_kv_cache_shape")
        kernel = self.method("get_supported_kernel_block_sizes")
        if kernel is None:
            kernel = [MultipleOfSize(1)]
        if not (isinstance(kernel, (list, tuple)) and all(
                isinstance(k, (int, MultipleOfSize)) for k in kernel)):
            self.give_up("get_supported_kernel_block_sizes")
            return None
        sizes = list(kernel)

        def admits(n: int) -> bool | None:
            if exact and n not in exact:
                return False
            if sizes and not any(n % s.base == 0 if isinstance(s, MultipleOfSize) else n == s
                                 for s in sizes):
                return False
            return self._shape_accepts(n)

        return self._probe_fn(admits, "get_kv_cache_shape")

    def _probe_fn(self, admits: Callable[[int], bool | None], source: str,
                  limit: int = BLOCK_LIMIT) -> SizeSpec | None:
        """The sizes ``admits`` admits; None, giving ``source`` up, where it does not
        know (None) for one of them."""
        unknown = False

        def known(n: int) -> bool:
            nonlocal unknown
            ok = admits(n)
            if ok is None:
                unknown = True
                return False
            return ok

        spec = probe_sizes(known, limit)
        if unknown:
            self.give_up(source)
            return None
        return spec

    def attention_types(self) -> tuple[AttentionType, ...] | None:
        if "supports_attn_type" not in self.methods:
            return (AttentionType.DECODER,)
        # upstream's ENCODER reads this step's K/V and no cache (ENCODER_ONLY here); this
        # package's ENCODER attends over the paged cache
        types = [t for t in AttentionType if t is not AttentionType.ENCODER]
        found = self._admitted("supports_attn_type", types, lambda t: t.value)
        return None if found is None else tuple(found)


def _refusal_ifs(fn: cst.FunctionDef) -> list[cst.If]:
    """``if <test>: raise ...`` statements at the top of ``fn``'s body (no else)."""
    found = []
    for stmt in function_body(fn):
        if not isinstance(stmt, cst.If) or stmt.orelse is not None:
            continue
        body = list(stmt.body.body)
        if len(body) == 1 and isinstance(body[0], cst.SimpleStatementLine) and \
                len(body[0].body) == 1 and isinstance(body[0].body[0], cst.Raise):
            exc = body[0].body[0].exc
            target = exc.func if isinstance(exc, cst.Call) else exc
            if isinstance(target, cst.Name) and target.value in ("NotImplementedError",
                                                                  "ValueError"):
                found.append(stmt)
    return found


def _self_from_params(init: cst.FunctionDef, names: list[str]) -> dict[str, str]:
    """``self.x = <param>`` assignments of ``__init__``: ``"self.x"`` -> the parameter."""
    found: dict[str, str] = {}
    for stmt in function_body(init):
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(
                        small.value, cst.Name) and small.value.value in names:
                    target = small.targets[0].target
                    if isinstance(target, cst.Attribute) and isinstance(target.value, cst.Name) \
                            and target.value.value == "self":
                        found[f"self.{target.attr.value}"] = small.value.value
    return found


def _impl_refusals(info: ModuleInfo, impl: ClassInfo, decl: Declarations) -> None:
    """Fold the impl's literal refusals (sliding window, soft cap, attention types, cache
    dtypes) into the declarations, as the adapter probes them. A refusal that cannot
    trigger for anything the backend declares goes too; one that is not literal for a
    declared configuration stays, marked."""
    init = impl.methods.get("__init__")
    if init is None:
        return
    names = [p.name.value for p in params(init)[1:]]
    aliases = _self_from_params(init, names)
    ev = Evaluator(info)

    def refuses(test: cst.BaseExpression, **change: object) -> object:
        env = {n: IMPL_DEFAULTS.get(n, None) for n in names}
        env.update({k: v for k, v in change.items() if k in env})
        env.update({alias: env[param] for alias, param in aliases.items()})
        return ev.expr(test, env)

    for stmt in _refusal_ifs(init):
        base = refuses(stmt.test)
        variations: dict[str, tuple[bool, object]] = {  # name: (declared?, refuses?)
            "sliding_window": (decl.supports_sliding_window is not False,
                               refuses(stmt.test, sliding_window=21)),
            "logits_soft_cap": (decl.supports_logits_soft_cap is not False,
                                refuses(stmt.test, logits_soft_cap=7.5)),
        }
        types = {t: refuses(stmt.test, attn_type=t.value) for t in AttentionType}
        caches = {c: refuses(stmt.test, kv_cache_dtype=c) for c in KV_CACHE_DTYPES}
        declared_types = set(decl.attention_types or AttentionType)
        declared_caches = set(decl.supported_kv_cache_dtypes or KV_CACHE_DTYPES)
        relevant = [base, *(v for d, v in variations.values() if d),
                    *(v for t, v in types.items() if t in declared_types),
                    *(v for c, v in caches.items() if c in declared_caches)]
        if not all(isinstance(v, bool) for v in relevant) or base:
            decl.refusals_left.append(stmt)
            continue
        if variations["sliding_window"][1] is True:
            decl.supports_sliding_window = False
        if variations["logits_soft_cap"][1] is True:
            decl.supports_logits_soft_cap = False
        if decl.attention_types is not None:
            decl.attention_types = tuple(t for t in decl.attention_types if types[t] is not True)
        if decl.supported_kv_cache_dtypes is not None:
            decl.supported_kv_cache_dtypes = tuple(
                c for c in decl.supported_kv_cache_dtypes if caches.get(c) is not True)  # type: ignore[call-overload]
        decl.refusals_folded.append(stmt)


def read_declarations(info: ModuleInfo, pieces: Pieces, layout: KVCacheLayout) -> Declarations:
    r = _Reader(info, pieces, layout)
    decl = Declarations(
        name=r.name(), layout=layout, supported_dtypes=r.dtypes(),
        supported_kv_cache_dtypes=r.cache_dtypes(), block_sizes=r.block_sizes(),
        head_sizes=r.head_sizes(), attention_types=r.attention_types(),
    )
    decl.unresolved = r.unresolved
    _impl_refusals(info, pieces.impl, decl)
    return decl


def size_spec_code(spec: SizeSpec) -> str:
    if spec.values is not None:
        return f"SizeSpec(values=frozenset({{{', '.join(str(v) for v in sorted(spec.values))}}}))"
    args = []
    if spec.multiple_of != 1:
        args.append(f"multiple_of={spec.multiple_of}")
    if spec.min != 1:
        args.append(f"min={spec.min}")
    if spec.max is not None:
        args.append(f"max={spec.max}")
    return f"SizeSpec({', '.join(args)})"


def sorted_dtypes(names: Iterable[str]) -> list[str]:
    return [d for d in FLOAT_DTYPES if d in set(names)]
