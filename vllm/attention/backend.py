"""Backends as class-level data, impls that only compute, and their metadata.

A backend is never instantiated: it is a bundle of typed declarations plus
classmethods. ``unsupported_reasons`` derives every "why not" from those
declarations, and selection, the CLI table and the test grid all read them.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Final,
    Generic,
    Literal,
    Protocol,
    TypeGuard,
    TypeVar,
)

import torch

from vllm.attention.errors import InvalidArgumentError, UnsupportedBackendError
from vllm.attention.layouts import empty_in_stride_order, kv_cache_shape, kv_cache_stride_order
from vllm.attention.types import (
    KV_CACHE_DTYPES,
    AttentionType,
    KVCacheDType,
    KVCacheLayout,
    KVQuant,
    cache_storage_dtype,
    declared_spelling,
    parse_kv_cache_dtype,
)

if TYPE_CHECKING:
    from vllm.attention.writer import KVCacheWriter, MLAKVCacheWriter


class AttentionMetadata:
    """Base of every backend's metadata. Subclasses are dataclasses of what compute
    needs; none of them carries ``slot_mapping`` (that lives in the ForwardContext)."""


M = TypeVar("M", bound=AttentionMetadata)
_Item = TypeVar("_Item")
M_co = TypeVar("M_co", bound=AttentionMetadata, covariant=True)


@dataclass(frozen=True, kw_only=True)
class CommonAttentionMetadata:
    """What the runner knows about a batch, in backend-neutral form.

    Requests are laid out query-major: request ``i``'s new tokens are rows
    ``query_start_loc[i]:query_start_loc[i+1]`` of the step's tokens, and are its
    last ``query_len`` positions of ``seq_lens[i]`` (context + new tokens).
    """

    query_start_loc: torch.Tensor
    """``[num_reqs + 1]`` int32, on the compute device."""
    seq_lens: torch.Tensor
    """``[num_reqs]`` int32, on the compute device."""
    block_table: torch.Tensor
    """``[num_reqs, max_blocks_per_req]`` int32, on the compute device."""
    query_start_loc_cpu: torch.Tensor
    """``query_start_loc`` on the host (no device sync to read it)."""
    seq_lens_cpu: torch.Tensor
    """``seq_lens`` on the host."""
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    causal: bool = True


def common_fields(common: CommonAttentionMetadata) -> dict[str, Any]:
    """The batch description as constructor keywords: every metadata class built
    from it (paged, MLA, legacy) takes these and adds its own."""
    return {f.name: getattr(common, f.name) for f in dataclasses.fields(CommonAttentionMetadata)}


@dataclass(frozen=True, kw_only=True)
class PagedAttentionMetadata(CommonAttentionMetadata, AttentionMetadata):
    """Metadata of the backends whose compute needs only the paged batch description
    (the fields of :class:`CommonAttentionMetadata`; still no ``slot_mapping``)."""

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        return cls(**common_fields(common))


@dataclass(frozen=True, kw_only=True)
class AttentionLayerSpec:
    """The constructor arguments of an impl: one layer's attention shape and options."""

    num_heads: int
    head_size: int
    num_kv_heads: int
    scale: float
    head_size_v: int | None = None
    """Value head size when it differs from ``head_size`` (DiffKV); None means equal."""
    sliding_window: int | None = None
    """A query at position p sees keys at positions > p - sliding_window."""
    logits_soft_cap: float | None = None
    attn_type: AttentionType = AttentionType.DECODER
    kv_cache_dtype: KVCacheDType = "auto"
    kv_sharing_target_layer_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_size", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(name, value, "a positive int")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                "num_heads", self.num_heads,
                f"a multiple of num_kv_heads={self.num_kv_heads}",
            )
        scale: object = self.scale
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not math.isfinite(scale) or scale <= 0):
            raise InvalidArgumentError("scale", self.scale, "a positive finite float")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise InvalidArgumentError("sliding_window", self.sliding_window, "None or > 0")
        if self.logits_soft_cap is not None and self.logits_soft_cap <= 0:
            raise InvalidArgumentError("logits_soft_cap", self.logits_soft_cap, "None or > 0")
        parse_kv_cache_dtype(self.kv_cache_dtype)

    @property
    def v_head_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v


class AttentionLayerProtocol(Protocol):
    """What an impl may read from the layer that calls it."""

    @property
    def layer_name(self) -> str: ...

    @property
    def kv_quant(self) -> KVQuant: ...


class AttentionMetadataBuilder(abc.ABC, Generic[M_co]):
    """Turns the runner's :class:`CommonAttentionMetadata` into a backend's metadata."""

    def __init__(self, spec: AttentionLayerSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    @abc.abstractmethod
    def build(self, common: CommonAttentionMetadata) -> M_co:
        """Metadata for one step; called once per KV-cache group, not per layer."""


class PagedMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    def build(self, common: CommonAttentionMetadata) -> PagedAttentionMetadata:
        return PagedAttentionMetadata.from_common(common)


class AttentionImpl(abc.ABC, Generic[M]):
    """Computes attention over the cache. Never writes ``kv_cache``."""

    def __init__(self, spec: AttentionLayerSpec) -> None:
        self.spec = spec

    @abc.abstractmethod
    def forward(
        self,
        layer: AttentionLayerProtocol,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: M,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of this step's queries.

        Args:
            query: ``[num_tokens, num_heads, head_size]``.
            key, value: this step's ``[num_tokens, num_kv_heads, head_size(_v)]``
                (already in ``kv_cache`` unless the layer has no cache); may be None
                for cross-attention after its first step.
            kv_cache: the backend's logical cache tensor (read only).
            output: ``[num_tokens, num_heads, head_size_v]``, filled and returned.
        """


@dataclass(frozen=True)
class SizeSpec:
    """Allowed integer sizes: an explicit set, or multiples in a range."""

    values: frozenset[int] | None = None
    multiple_of: int = 1
    min: int = 1
    max: int | None = None

    def admits(self, n: int) -> bool:
        if self.values is not None:
            return n in self.values
        return n >= self.min and n % self.multiple_of == 0 and (
            self.max is None or n <= self.max
        )

    def describe(self) -> str:
        if self.values is not None:
            return ", ".join(str(v) for v in sorted(self.values))
        parts = ["any" if self.multiple_of == 1 else f"a multiple of {self.multiple_of}"]
        if self.max is not None:
            parts.append(f"up to {self.max}")
        if self.min > max(1, self.multiple_of):
            parts.append(f"from {self.min}")
        return " ".join(parts)

    def examples(self, candidates: tuple[int, ...] = (1, 16, 32, 64, 128)) -> tuple[int, ...]:
        """Admitted sizes for test grids: the explicit set, else the admitted candidates."""
        if self.values is not None:
            return tuple(sorted(self.values))
        return tuple(c for c in candidates if self.admits(c))


def exactly(*sizes: int) -> SizeSpec:
    return SizeSpec(values=frozenset(sizes))


def multiple_of(n: int, *, max: int | None = None) -> SizeSpec:
    return SizeSpec(multiple_of=n, min=n, max=max)


_FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


DEFAULT_TOLERANCES: Final[Mapping[torch.dtype, float]] = MappingProxyType({
    torch.float32: 1e-4,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
})
"""Relative Frobenius error ‖out − ref‖ / ‖ref‖ against float64, by model dtype."""


ComputePath = str
"""A short name of the compute path that runs (``"torch"``, ``"triton"``, ``"flash_attn.cute"``)."""


# -- declarations: checked and normalised when a backend class is created ---------------


class _Rejected(Exception):
    """A declaration's value has no unambiguous meaning; ``allowed`` says what would."""

    def __init__(self, allowed: str) -> None:
        super().__init__(allowed)
        self.allowed = allowed


_COLLECTIONS = (list, tuple, set, frozenset, range)


def _members(value: object) -> tuple[object, ...]:
    """A collection's items, or a lone value as a one-item tuple."""
    return tuple(value) if isinstance(value, _COLLECTIONS) else (value,)


def _is_size(n: object) -> TypeGuard[int]:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


_SIZES_ALLOWED = ("a SizeSpec (exactly(64, 128), multiple_of(16), SizeSpec(...)) or positive "
                  "ints: one, or a list, tuple, set or range of them")


def _size_spec(value: object) -> SizeSpec:
    if isinstance(value, SizeSpec):
        v = value
        values: object = v.values  # a dataclass does not check its field types
        ok = (_is_size(v.multiple_of) and _is_size(v.min)
              and (v.max is None or (_is_size(v.max) and v.max >= v.min))
              and (values is None or (isinstance(values, frozenset) and bool(values)
                                      and all(_is_size(n) for n in values))))
        if ok:
            return value
        raise _Rejected(f"a SizeSpec that admits a size: positive values, multiple_of and "
                        f"min, max >= min; {_SIZES_ALLOWED}")
    sizes = _members(value)
    ints = [n for n in sizes if _is_size(n)]
    if sizes and len(ints) == len(sizes):
        return exactly(*ints)
    raise _Rejected(_SIZES_ALLOWED)


def _layout(value: object) -> KVCacheLayout:
    if isinstance(value, KVCacheLayout):
        return value
    if isinstance(value, str):
        for member in KVCacheLayout:
            if value.lower() == member.value:
                return member
    raise _Rejected("a KVCacheLayout, or the value or name of one: "
                    + ", ".join(m.value for m in KVCacheLayout))


_DTYPE_BY_NAME = {name: d for d, name in _DTYPE_NAMES.items()}


def _set_of(value: object, parse: Callable[[object], _Item | None],
            allowed: str) -> frozenset[_Item]:
    """``value`` (one member, or a set, list or tuple of them) as the frozenset of what
    ``parse`` makes of each member; rejected, naming ``allowed``, when it is empty or any
    member parses to None. A frozenset that is already right is returned as itself."""
    found: set[_Item] = set()
    for item in _members(value):
        parsed = parse(item)
        if parsed is None:
            found.clear()
            break
        found.add(parsed)
    if not found:
        raise _Rejected(allowed + ", alone or in a set, list or tuple")
    if isinstance(value, frozenset) and found == set(value):
        return value
    return frozenset(found)


def _model_dtype(item: object) -> torch.dtype | None:
    if isinstance(item, str):
        item = _DTYPE_BY_NAME.get(item.removeprefix("torch."), item)
    return item if isinstance(item, torch.dtype) and item in _FLOAT_DTYPES else None


def _model_dtypes(value: object) -> frozenset[torch.dtype]:
    return _set_of(value, _model_dtype, "one or more of torch.float32, torch.float16, "
                                        "torch.bfloat16 (or their names)")


def _cache_dtypes(value: object) -> frozenset[KVCacheDType]:
    return _set_of(value, lambda item: next((d for d in KV_CACHE_DTYPES if item == d), None),
                   "one or more of " + ", ".join(KV_CACHE_DTYPES))


def _attention_type(item: object) -> AttentionType | None:
    if isinstance(item, str):
        item = next((t for t in AttentionType if item.lower() == t.value), item)
    return item if isinstance(item, AttentionType) else None


def _attention_types(value: object) -> frozenset[AttentionType]:
    return _set_of(value, _attention_type, "one or more AttentionType members (or their "
                   "values: " + ", ".join(t.value for t in AttentionType) + ")")


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise _Rejected("True or False")


def _name(value: object) -> str:
    if isinstance(value, str) and value and value == value.strip():
        return value
    raise _Rejected("a non-empty str without surrounding spaces, such as 'MY_BACKEND'")


def _migration(value: object) -> Literal["migrated", "adapted"]:
    if value == "migrated":
        return "migrated"
    if value == "adapted":
        return "adapted"
    raise _Rejected("'migrated' or 'adapted' (set by the shim for the classes it adapts)")


def _vendor_package(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise _Rejected("None or the import name of a package, such as 'flash_attn'")


def _tolerances(value: object) -> Mapping[torch.dtype, float]:
    allowed = ("a mapping of model dtype (torch.float32, torch.float16, torch.bfloat16) to a "
               "positive finite float")
    if not isinstance(value, Mapping):
        raise _Rejected(allowed)
    found: dict[torch.dtype, float] = {}
    for dtype, tol in value.items():
        dt = _DTYPE_BY_NAME.get(dtype.removeprefix("torch."), dtype) if isinstance(
            dtype, str) else dtype
        if not (isinstance(dt, torch.dtype) and dt in _FLOAT_DTYPES
                and isinstance(tol, (int, float)) and not isinstance(tol, bool)
                and math.isfinite(tol) and tol > 0):
            raise _Rejected(allowed)
        found[dt] = float(tol)
    if isinstance(value, MappingProxyType) and dict(value) == found:
        return value
    return MappingProxyType(found)


_NORMALISERS: Final[Mapping[str, Callable[[object], object]]] = MappingProxyType({
    "name": _name,
    "kv_cache_layout": _layout,
    "supported_dtypes": _model_dtypes,
    "supported_kv_cache_dtypes": _cache_dtypes,
    "block_sizes": _size_spec,
    "head_sizes": _size_spec,
    "attention_types": _attention_types,
    "supports_sliding_window": _flag,
    "supports_logits_soft_cap": _flag,
    "is_mla": _flag,
    "is_sparse": _flag,
    "migration": _migration,
    "vendor_package": _vendor_package,
    "tolerances": _tolerances,
})
"""Every declaration of :class:`AttentionBackend`, with the function that checks it and
turns an unambiguous spelling into the declared type (``docs/writing_a_backend.md``)."""

DECLARATIONS: Final[tuple[str, ...]] = tuple(_NORMALISERS)
"""The names of :class:`AttentionBackend`'s declarations, in the order it declares them."""

REQUIRED_DECLARATIONS: Final[tuple[str, ...]] = ("name", "kv_cache_layout")
"""Declarations without a default: every concrete backend sets them."""


def _normalise_declarations(cls: type) -> dict[str, str]:
    """Replace each declaration of ``cls`` by its normal form; the rejected ones, each
    with a ``"<declaration>: got <value>, expected <allowed>"`` line."""
    problems: dict[str, str] = {}
    for declaration, normalise in _NORMALISERS.items():
        if not hasattr(cls, declaration):
            continue  # a missing one is missing_declarations()'s to report
        value = getattr(cls, declaration)
        try:
            normal = normalise(value)
        except _Rejected as rejected:
            problems[declaration] = f"{declaration}: got {value!r}, expected {rejected.allowed}"
            continue
        if normal is not value:
            setattr(cls, declaration, normal)
    return problems


class AttentionBackend(abc.ABC, Generic[M]):
    """Class-level declarations and classmethods; never instantiated.

    Subclass as ``class MyBackend(AttentionBackend[MyMetadata])``: the impl,
    builder and metadata classmethods are then typed against ``MyMetadata``, so
    mypy reports a backend whose pieces disagree.
    """

    name: ClassVar[str]
    kv_cache_layout: ClassVar[KVCacheLayout]
    supported_dtypes: ClassVar[frozenset[torch.dtype]] = _FLOAT_DTYPES
    supported_kv_cache_dtypes: ClassVar[frozenset[KVCacheDType]] = frozenset({"auto"})
    block_sizes: ClassVar[SizeSpec] = multiple_of(16)
    head_sizes: ClassVar[SizeSpec] = multiple_of(8, max=256)
    attention_types: ClassVar[frozenset[AttentionType]] = frozenset({AttentionType.DECODER})
    supports_sliding_window: ClassVar[bool] = True
    supports_logits_soft_cap: ClassVar[bool] = True
    is_mla: ClassVar[bool] = False
    is_sparse: ClassVar[bool] = False
    migration: ClassVar[Literal["migrated", "adapted"]] = "migrated"
    vendor_package: ClassVar[str | None] = None
    """Import name of the vendor kernel package, if the backend has one."""
    tolerances: ClassVar[Mapping[torch.dtype, float]] = DEFAULT_TOLERANCES
    """Compute tolerance per supported model dtype (the kit and tests read it). A
    subclass that does not declare its own gets the defaults for its dtypes."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        # Never raises for a bad declaration: importing a plugin must not break the
        # registry or the CLI; declaration_problems() reports it as that backend's.
        super().__init_subclass__(**kwargs)
        _normalise_declarations(cls)
        if "tolerances" not in vars(cls) and isinstance(cls.supported_dtypes, frozenset):
            cls.tolerances = MappingProxyType(
                {d: DEFAULT_TOLERANCES[d] for d in cls.supported_dtypes if d in DEFAULT_TOLERANCES}
            )

    def __new__(cls) -> AttentionBackend[M]:
        raise TypeError(f"{cls.__name__} is a backend declaration; it is never instantiated")

    # -- the pieces ---------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl[M]]: ...

    @classmethod
    @abc.abstractmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder[M]]: ...

    @classmethod
    @abc.abstractmethod
    def get_metadata_cls(cls) -> type[M]: ...

    @classmethod
    @abc.abstractmethod
    def get_kv_cache_writer(
        cls, cache_dtype: KVCacheDType = "auto"
    ) -> KVCacheWriter | MLAKVCacheWriter: ...

    # -- the cache ----------------------------------------------------------------
    @classmethod
    def kv_cache_layout_for(cls, cache_dtype: KVCacheDType = "auto") -> KVCacheLayout:
        """The layout of a cache in ``cache_dtype``: ``kv_cache_layout`` unless a cache
        format brings its own (TRITON_ATTN's per-token-head formats)."""
        return cls.kv_cache_layout

    @classmethod
    def get_kv_cache_shape(
        cls,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype: KVCacheDType = "auto",
    ) -> tuple[int, ...]:
        """The logical cache shape (``docs/layouts.md``)."""
        return kv_cache_shape(
            cls.kv_cache_layout_for(cache_dtype), num_blocks, block_size, num_kv_heads,
            head_size,
        )

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        """Permutation of logical axes from the outermost physical axis inwards."""
        return kv_cache_stride_order(cls.kv_cache_layout)

    # -- compute path -------------------------------------------------------------
    @classmethod
    def compute_path(cls, device: torch.device) -> ComputePath:
        """The compute path that runs on ``device`` (vendor kernel or portable)."""
        return "torch"

    @classmethod
    def compute_path_notes(cls, device: torch.device) -> list[str]:
        """Why a faster path does not run on ``device`` (empty when the best one does)."""
        return []

    # -- capabilities -------------------------------------------------------------
    @classmethod
    def unsupported_reasons(
        cls,
        *,
        dtype: torch.dtype,
        head_size: int,
        block_size: int,
        kv_cache_dtype: str = "auto",
        attn_type: AttentionType = AttentionType.DECODER,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        use_mla: bool = False,
        use_sparse: bool = False,
        device: torch.device | None = None,
    ) -> list[str]:
        """Every reason this backend cannot run the configuration; empty if it can."""
        problems = cls.declaration_problems()
        if problems:
            who = getattr(cls, "name", cls.__qualname__)
            return [f"{who} is declared wrongly: {p}" for p in problems]
        n = cls.name
        reasons: list[str] = []
        if dtype not in cls.supported_dtypes:
            allowed = ", ".join(sorted(dtype_name(d) for d in cls.supported_dtypes))
            reasons.append(f"dtype={dtype_name(dtype)}, {n} needs one of {allowed}")
        if not cls.head_sizes.admits(head_size):
            reasons.append(f"head_size={head_size}, {n} needs {cls.head_sizes.describe()}")
        if not cls.block_sizes.admits(block_size):
            reasons.append(f"block_size={block_size}, {n} needs {cls.block_sizes.describe()}")
        if cls.cache_dtype_spelling(kv_cache_dtype, dtype) is None:
            allowed = ", ".join(sorted(cls.supported_kv_cache_dtypes))
            reasons.append(f"kv_cache_dtype={kv_cache_dtype!r}, {n} needs one of {allowed} "
                           "(or another spelling of one: fp8 = fp8_e4m3; bfloat16 / float16 "
                           "= auto for a model of that dtype)")
        if attn_type not in cls.attention_types:
            allowed = ", ".join(sorted(t.value for t in cls.attention_types))
            reasons.append(f"attn_type={attn_type.value}, {n} supports {allowed}")
        if sliding_window is not None and not cls.supports_sliding_window:
            reasons.append(f"sliding_window={sliding_window}, {n} supports only None")
        if logits_soft_cap is not None and not cls.supports_logits_soft_cap:
            reasons.append(f"logits_soft_cap={logits_soft_cap}, {n} supports only None")
        if use_mla != cls.is_mla:
            reasons.append(f"use_mla={use_mla}, {n} is {'an' if cls.is_mla else 'not an'} MLA backend")
        if use_sparse and not cls.is_sparse:
            reasons.append(f"use_sparse=True, {n} is not a sparse backend")
        if device is not None:
            reasons.extend(cls.device_unsupported_reasons(device))
        return reasons

    @classmethod
    def cache_dtype_spelling(cls, kv_cache_dtype: str,
                             model_dtype: torch.dtype | None = None) -> KVCacheDType | None:
        """``kv_cache_dtype`` as this backend declares it (``fp8_e4m3`` is ``fp8`` where
        ``fp8`` is declared; ``bfloat16`` / ``float16`` are ``auto`` for a model of that
        dtype), or None when the backend stores no such format."""
        try:
            parsed = parse_kv_cache_dtype(kv_cache_dtype, model_dtype=model_dtype)
        except InvalidArgumentError:
            return None
        return declared_spelling(parsed, cls.supported_kv_cache_dtypes)

    @classmethod
    def device_unsupported_reasons(cls, device: torch.device) -> list[str]:
        """Reasons no path of this backend runs on ``device`` (empty: one does)."""
        return []

    @classmethod
    def supports(cls, **config: object) -> bool:
        return not cls.unsupported_reasons(**config)  # type: ignore[arg-type]

    @classmethod
    def missing_declarations(cls) -> list[str]:
        """Names of required declarations or classmethods this class lacks."""
        missing = [a for a in REQUIRED_DECLARATIONS if not hasattr(cls, a)]
        if inspect.isabstract(cls):
            missing.extend(sorted(getattr(cls, "__abstractmethods__", ())))
        return missing

    @classmethod
    def declaration_problems(cls) -> list[str]:
        """Everything that keeps this class from being registered or checked, one line
        each (``"head_sizes: got ..., expected ..."``); empty when it is complete.

        The declarations are checked as they are now (also after a late assignment),
        and unambiguous spellings are replaced by their declared type on the class.
        """
        problems = [
            f"{m}: not declared, expected "
            + ("a KVCacheLayout" if m == "kv_cache_layout" else "a non-empty str")
            if m in REQUIRED_DECLARATIONS else f"{m}: not defined (an abstract classmethod)"
            for m in cls.missing_declarations()
        ]
        rejected = _normalise_declarations(cls)
        problems.extend(rejected.values())
        if "tolerances" not in rejected and "supported_dtypes" not in rejected:
            tolerances, dtypes = cls.tolerances, cls.supported_dtypes
            lacking = sorted(dtype_name(d) for d in dtypes - set(tolerances))
            if lacking:
                problems.append(
                    f"tolerances: got {dict(tolerances)!r}, expected a tolerance for every "
                    f"supported dtype (missing {', '.join(lacking)})")
        return problems


def check_supported(
    backend: type[AttentionBackend[M]],
    *,
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
    device: torch.device | None = None,
) -> None:
    """Raise :class:`UnsupportedBackendError` naming ``backend`` and every reason."""
    reasons = backend.unsupported_reasons(
        dtype=dtype, head_size=head_size, block_size=block_size,
        kv_cache_dtype=kv_cache_dtype, use_mla=backend.is_mla, device=device,
    )
    if reasons:
        raise UnsupportedBackendError(f"{backend.name} cannot run this: " + "; ".join(reasons))


def allocate_kv_cache(
    backend: type[AttentionBackend[M]],
    *,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype: str = "auto",
    model_dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """The backend's cache: logical shape, physical stride order, storage dtype.

    Contents are uninitialised. MLA backends take ``num_kv_heads=1`` and
    ``head_size=kv_lora_rank + rope_dim``.
    """
    if num_blocks <= 0:
        raise InvalidArgumentError("num_blocks", num_blocks, "a positive int")
    if num_kv_heads <= 0:
        raise InvalidArgumentError("num_kv_heads", num_kv_heads, "a positive int")
    dev = torch.device(device)
    parsed = parse_kv_cache_dtype(cache_dtype, argument="cache_dtype", model_dtype=model_dtype)
    check_supported(
        backend, dtype=model_dtype, head_size=head_size, block_size=block_size,
        kv_cache_dtype=parsed,
    )
    parsed = backend.cache_dtype_spelling(parsed) or parsed
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, parsed)
    return empty_in_stride_order(shape, backend.get_kv_cache_stride_order(),
                                 dtype=cache_storage_dtype(parsed, model_dtype), device=dev)


def num_blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


_NB_PROBE = 7919  # a prime no other axis of a probe shape can equal


def block_axis(backend: type[AttentionBackend[M]]) -> int:
    """The axis of ``num_blocks`` in ``backend``'s logical cache shape (not always 0)."""
    return backend.get_kv_cache_shape(_NB_PROBE, 16, 1, 8).index(_NB_PROBE)


def num_blocks_of(backend: type[AttentionBackend[M]], kv_cache: torch.Tensor) -> int:
    """``num_blocks`` of a cache in ``backend``'s logical shape."""
    return int(kv_cache.shape[block_axis(backend)])
