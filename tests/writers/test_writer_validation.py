"""Every writer checks every argument before it writes: a bad call raises an error
from ``vllm.attention.errors`` naming the argument, the value seen and what is
allowed, and leaves the cache byte-identical. Plus the writer registry and API."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from vllm.attention import (
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheLayout,
    KVCacheWriter,
    KVQuant,
    MLAKVCacheWriter,
)
from vllm.attention.writers import (
    MLA_LAYOUTS,
    AiterShuffledKVCacheWriter,
    DiffKVCacheWriter,
    FP8DsMLACacheWriter,
    LegacyPagedKVCacheWriter,
    MLALatentCacheWriter,
    PerTokenHeadKVCacheWriter,
    SplitKVCacheWriter,
    mla_writer_for,
    mla_writer_for_layout,
    reference_write,
    writer_for_layout,
)
from vllm.attention.writers.kernels import triton_importable

L = KVCacheLayout
T, H, D, NB, BS = 4, 2, 16, 2, 16


def q(dtype: str = "auto", k: torch.Tensor | None = None) -> KVQuant:
    ks = torch.ones(1) if k is None else k
    return KVQuant(dtype, ks, torch.ones(ks.shape))  # type: ignore[arg-type]


def rows(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


SLOTS = torch.tensor([0, 5, -1, 17])


@dataclass(frozen=True)
class Bad:
    """One rejected call: the writer's write arguments and the argument named."""

    name: str
    writer: Callable[[], object]
    args: Callable[[], tuple[object, ...]]
    argument: str
    error: type[Exception] = InvalidArgumentError


def split_cache(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(NB, 2, BS, H, D).to(dtype)


def split_args(**over: object) -> Callable[[], tuple[object, ...]]:
    def make() -> tuple[object, ...]:
        a: dict[str, object] = {"key": rows(T, H, D), "value": rows(T, H, D),
                                "kv_cache": split_cache(), "slot_mapping": SLOTS, "quant": q()}
        a.update({k: (v() if callable(v) else v) for k, v in over.items()})
        return (a["key"], a["value"], a["kv_cache"], a["slot_mapping"], a["quant"])
    return make


def nhd() -> SplitKVCacheWriter:
    return SplitKVCacheWriter(L.SPLIT_NHD)


def mla_args(**over: object) -> Callable[[], tuple[object, ...]]:
    def make() -> tuple[object, ...]:
        a: dict[str, object] = {"kv_c": rows(T, 32), "pe": rows(T, 8),
                                "kv_cache": torch.zeros(NB, BS, 40).to(torch.bfloat16),
                                "slot_mapping": SLOTS, "quant": q()}
        a.update({k: (v() if callable(v) else v) for k, v in over.items()})
        return (a["kv_c"], a["pe"], a["kv_cache"], a["slot_mapping"], a["quant"])
    return make


def ds_args(**over: object) -> Callable[[], tuple[object, ...]]:
    def make() -> tuple[object, ...]:
        a: dict[str, object] = {"kv_c": rows(T, 512), "pe": rows(T, 64),
                                "kv_cache": torch.zeros(NB, BS, 656, dtype=torch.uint8),
                                "slot_mapping": SLOTS, "quant": q("fp8_ds_mla")}
        a.update({k: (v() if callable(v) else v) for k, v in over.items()})
        return (a["kv_c"], a["pe"], a["kv_cache"], a["slot_mapping"], a["quant"])
    return make


def ptq_cache() -> torch.Tensor:
    return torch.zeros(NB, 2, BS, H, D + 4, dtype=torch.uint8)


BAD = [
    Bad("key-not-tensor", nhd, split_args(key=lambda: [1.0]), "key", InvalidTypeError),
    Bad("key-int", nhd, split_args(key=lambda: torch.zeros(T, H, D, dtype=torch.int32)),
        "key.dtype"),
    Bad("key-heads", nhd, split_args(key=lambda: rows(T, H + 1, D)), "key.shape"),
    Bad("key-few-rows", nhd, split_args(key=lambda: rows(T - 1, H, D)), "key.shape"),
    Bad("value-dtype", nhd, split_args(value=lambda: rows(T, H, D, dtype=torch.float16)),
        "value.dtype"),
    Bad("slots-int32", nhd, split_args(slot_mapping=lambda: SLOTS.to(torch.int32)),
        "slot_mapping.dtype"),
    Bad("slots-2d", nhd, split_args(slot_mapping=lambda: SLOTS.view(2, 2)),
        "slot_mapping.shape"),
    Bad("quant-type", nhd, split_args(quant="auto"), "quant", InvalidTypeError),
    Bad("quant-dtype", nhd, split_args(quant=lambda: q("int8_per_token_head")),
        "quant.kv_cache_dtype"),
    Bad("cache-dtype", nhd, split_args(quant=lambda: q("fp8_e4m3")), "kv_cache.dtype"),
    Bad("cache-dtype-e5m2", nhd,
        split_args(quant=lambda: q("fp8_e5m2"), kv_cache=lambda: split_cache(torch.float8_e4m3fn)),
        "kv_cache.dtype"),
    Bad("scale-shape", nhd,
        split_args(quant=lambda: q("fp8", torch.ones(3)),
                   kv_cache=lambda: split_cache(torch.float8_e4m3fn)), "quant.k_scale.shape"),
    Bad("cache-not-tensor", nhd, split_args(kv_cache=None), "kv_cache", InvalidTypeError),
    Bad("cache-4d", nhd, split_args(kv_cache=lambda: torch.zeros(NB, 2, BS, H * D)),
        "kv_cache.shape"),
    Bad("legacy-x", LegacyPagedKVCacheWriter,
        split_args(key=lambda: rows(T, H, 4), value=lambda: rows(T, H, 4),
                   kv_cache=lambda: torch.zeros(2, NB, BS * H * 4).to(torch.bfloat16)),
        "head_size"),
    Bad("legacy-width", LegacyPagedKVCacheWriter,
        split_args(kv_cache=lambda: torch.zeros(2, NB, BS * H * D + 8).to(torch.bfloat16)),
        "kv_cache.shape"),
    Bad("legacy-kv-axis", LegacyPagedKVCacheWriter,
        split_args(kv_cache=lambda: torch.zeros(3, NB, BS * H * D).to(torch.bfloat16)),
        "kv_cache.shape"),
    Bad("aiter-block", AiterShuffledKVCacheWriter,
        split_args(kv_cache=lambda: torch.zeros(2, NB, 4, H, D).to(torch.bfloat16)),
        "block_size"),
    Bad("aiter-strided", AiterShuffledKVCacheWriter,
        split_args(kv_cache=lambda: torch.zeros(2, NB, BS, H, 2 * D).to(torch.bfloat16)[..., :D]),
        "kv_cache.stride"),
    Bad("diffkv-value", DiffKVCacheWriter,
        split_args(kv_cache=lambda: torch.zeros(NB, BS, H, D + 8).to(torch.bfloat16)),
        "value.shape"),
    Bad("ptq-cache-dtype", PerTokenHeadKVCacheWriter,
        split_args(kv_cache=lambda: ptq_cache().to(torch.bfloat16),
                   quant=lambda: q("int8_per_token_head")), "kv_cache.dtype"),
    Bad("ptq-quant", PerTokenHeadKVCacheWriter,
        split_args(kv_cache=ptq_cache, quant=lambda: q("fp8")), "quant.kv_cache_dtype"),
    Bad("ptq-width", PerTokenHeadKVCacheWriter,
        split_args(kv_cache=lambda: torch.zeros(NB, 2, BS, H, 3, dtype=torch.uint8),
                   quant=lambda: q("int8_per_token_head")), "kv_cache.shape"),
    Bad("mla-kv-c-3d", MLALatentCacheWriter, mla_args(kv_c=lambda: rows(T, 1, 32)),
        "kv_c_normed.shape"),
    Bad("mla-pe-2-heads", MLALatentCacheWriter, mla_args(pe=lambda: rows(T, 2, 8)), "k_pe.shape"),
    Bad("mla-width", MLALatentCacheWriter, mla_args(pe=lambda: rows(T, 16)), "kv_cache.shape"),
    Bad("mla-pe-dtype", MLALatentCacheWriter,
        mla_args(pe=lambda: rows(T, 8, dtype=torch.float32)), "k_pe.dtype"),
    Bad("mla-pe-rows", MLALatentCacheWriter, mla_args(pe=lambda: rows(T - 2, 8)), "k_pe.shape"),
    Bad("mla-scale", MLALatentCacheWriter,
        mla_args(quant=lambda: q("fp8", torch.ones(2)),
                 kv_cache=lambda: torch.zeros(NB, BS, 40, dtype=torch.float8_e4m3fn)),
        "quant.k_scale.shape"),
    Bad("mla-ds-dtype", MLALatentCacheWriter, mla_args(quant=lambda: q("fp8_ds_mla")),
        "quant.kv_cache_dtype"),
    Bad("ds-latent", FP8DsMLACacheWriter, ds_args(kv_c=lambda: rows(T, 256)),
        "kv_c_normed.shape"),
    Bad("ds-rope", FP8DsMLACacheWriter, ds_args(pe=lambda: rows(T, 32)), "k_pe.shape"),
    Bad("ds-cache-width", FP8DsMLACacheWriter,
        ds_args(kv_cache=lambda: torch.zeros(NB, BS, 576, dtype=torch.uint8)), "kv_cache.shape"),
    Bad("ds-cache-dtype", FP8DsMLACacheWriter,
        ds_args(kv_cache=lambda: torch.zeros(NB, BS, 656).to(torch.bfloat16)), "kv_cache.dtype"),
    Bad("ds-quant", FP8DsMLACacheWriter, ds_args(quant=lambda: q("auto")),
        "quant.kv_cache_dtype"),
]


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_bad_argument_is_named_and_nothing_is_written(bad: Bad) -> None:
    writer = bad.writer()
    args = bad.args()
    cache = args[2]
    before = cache.clone() if isinstance(cache, torch.Tensor) else None
    with pytest.raises(bad.error) as info:
        writer.write(*args)  # type: ignore[attr-defined]
    err = info.value
    assert getattr(err, "argument", None) == bad.argument, str(err)
    assert "got" in str(err) and "expected" in str(err), str(err)
    if before is not None and isinstance(cache, torch.Tensor):
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


def test_bad_path_is_named() -> None:
    key, value, cache, slots, quant = split_args()()
    with pytest.raises(InvalidArgumentError, match="path"):
        nhd().write(key, value, cache, slots, quant, path="cuda")  # type: ignore[arg-type]


NON_MLA = [x for x in KVCacheLayout if x not in MLA_LAYOUTS]


@pytest.mark.parametrize("layout", NON_MLA, ids=[x.value for x in NON_MLA])
def test_writer_for_every_non_mla_layout(layout: KVCacheLayout) -> None:
    writer = writer_for_layout(layout)
    assert isinstance(writer, KVCacheWriter)
    assert writer.layout is layout  # type: ignore[attr-defined]
    assert writer.path(torch.device("cpu")) == "torch"  # type: ignore[attr-defined]


@pytest.mark.parametrize("layout", MLA_LAYOUTS, ids=[x.value for x in MLA_LAYOUTS])
def test_mla_writers(layout: KVCacheLayout) -> None:
    writer = mla_writer_for_layout(layout)
    assert isinstance(writer, MLAKVCacheWriter)
    assert writer.layout is layout  # type: ignore[attr-defined]
    with pytest.raises(InvalidArgumentError, match="layout"):
        writer_for_layout(layout)


def test_mla_writer_for_cache_dtypes() -> None:
    assert isinstance(mla_writer_for("fp8_ds_mla"), FP8DsMLACacheWriter)
    for dt in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert isinstance(mla_writer_for(dt), MLALatentCacheWriter)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="cache_dtype"):
        mla_writer_for("int8_per_token_head")


def test_empty_and_all_skipped_writes_change_nothing() -> None:
    cache = split_cache()
    before = cache.clone()
    for slots in (torch.empty(0, dtype=torch.int64), torch.full((T,), -1)):
        nhd().write(rows(T, H, D), rows(T, H, D), cache, slots, q())
        reference_write(L.SPLIT_NHD, rows(T, H, D), rows(T, H, D), cache, slots, q())
    assert torch.equal(cache, before)


def test_reference_write_runs_the_checks() -> None:
    with pytest.raises(InvalidArgumentError, match="key.shape"):
        reference_write(L.LEGACY_PAGED, rows(T, H), rows(T, H, D),
                        torch.zeros(2, NB, BS * H * D), SLOTS, q())


def test_without_triton_everything_runs_the_reference() -> None:
    """``import vllm`` and every write work where Triton cannot be imported (a plain
    install: Triton is an optional extra)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        import vllm
        from vllm.attention import KVCacheLayout, KVQuant, KVCacheWriteError
        from vllm.attention.writers import writer_for_layout
        w = writer_for_layout(KVCacheLayout.SPLIT_NHD)
        assert w.path(torch.device("cuda")) == "torch"
        cache = torch.zeros(2, 2, 16, 2, 8)
        k = torch.randn(3, 2, 8)
        w.write(k, k, cache, torch.tensor([0, -1, 9]), KVQuant.unscaled("auto"))
        try:
            w.write(k, k, cache, torch.tensor([0, -1, 9]), KVQuant.unscaled("auto"), path="triton")
        except KVCacheWriteError as e:
            assert "triton is not importable" in str(e), e
        else:
            raise AssertionError("path='triton' without triton must be refused")
        assert "triton" not in {m for m in sys.modules if sys.modules[m] is not None}
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_interpreted_kernels_leave_the_environment_alone() -> None:
    import os

    pytest.importorskip("triton", reason="triton is not installed")
    from vllm.attention.writers.kernels import load_kernels

    before = os.environ.get("TRITON_INTERPRET")
    load_kernels(interpret=True)
    assert os.environ.get("TRITON_INTERPRET") == before


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=[x.value for x in KVCacheLayout])
@pytest.mark.parametrize("n", [0, 3], ids=["no_tokens", "all_skipped"])
def test_nothing_to_write_on_every_layout(layout: KVCacheLayout, n: int) -> None:
    """No token, or only skipped ones: no error, no byte changed, reads of nothing work."""
    from tests.writers.oracle import Case, prepare, write
    from vllm.attention.writers.readback import read_slots

    cd = {L.PER_TOKEN_HEAD_QUANT: "int8_per_token_head", L.MLA_FP8_DS: "fp8_ds_mla"}.get(
        layout, "fp8_e4m3")
    w = prepare(Case(layout, "bf16", cd, 16, "scale_none"), num_tokens=max(n, 1))
    w.slots = torch.full((n,), -1, dtype=torch.int64)
    paths = ["torch"]
    if n and triton_importable() and not torch.cuda.is_available():
        paths.append("triton")  # the kernels, interpreted: masked programs only
    for path in paths:
        write(w, path)
        assert torch.equal(w.storage.view(torch.uint8), w.before.view(torch.uint8)), path
    extra: dict[str, object] = {"quant": w.quant, "num_kv_heads": 2, "head_size": 32,
                                "kv_lora_rank": 64}
    none = torch.empty(0, dtype=torch.int64)
    rows = read_slots(layout, w.cache, none, **extra)  # type: ignore[call-overload]
    assert all(t.shape[0] == 0 for t in rows)
    values = read_slots(layout, w.cache, none, dequantize=True, **extra)  # type: ignore[call-overload]
    assert all(t.shape[0] == 0 and t.dtype == torch.float32 for t in values)
