"""The cached eager launcher: one full validation per call signature, and a bad call
after cached good ones still raises the same error before writing anything.

Also the direct launch itself, on CPU: a :class:`BoundLaunch` bound to a stand-in for
Triton's CUDA launcher passes exactly the arguments Triton's own launch would (tensors
as their pointers), for new tensors of the same signature, and refuses (returns False)
where its assumptions do not hold.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.helpers import raw
from vllm.attention import InvalidArgumentError, InvalidTypeError, KVCacheWriteError, KVQuant
from vllm.attention.layouts import split_kv_views
from vllm.attention.rope import RoPE
from vllm.attention.types import KVCacheLayout
from vllm.attention.writers import kernels as tw
from vllm.attention.writers import MLALatentCacheWriter, SplitKVCacheWriter
from vllm.attention.writers import launch_cache as launch_cache_mod
from vllm.attention.writers import split as split_mod
from vllm.attention.writers.launch_cache import MAX_SIGNATURES, write_signature

L = KVCacheLayout
H, D, BS, NB = 2, 8, 4, 6


def _args(t: int = 3, dtype: torch.dtype = torch.float32, cache_dtype: str = "auto",
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KVQuant]:
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(t, H, D, generator=g).to(dtype)
    value = torch.randn(t, H, D, generator=g).to(dtype)
    storage = dtype if cache_dtype == "auto" else torch.float8_e4m3fn
    cache = torch.zeros(NB, 2, BS, H, D, dtype=storage)
    slots = torch.randperm(NB * BS, generator=g)[:t]
    return key, value, cache, slots, KVQuant(cache_dtype, torch.ones(1), torch.ones(1))  # type: ignore[arg-type]


def _count_calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Count the calls of ``module.<name>`` (still calling it)."""
    calls = [0]
    real = getattr(module, name)

    def counting(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def count_validations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _count_calls(monkeypatch, split_mod, "validate_kv_views")


def test_repeat_signature_validates_once(count_validations: list[int]) -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    for seed in range(4):  # new tensors each step, same signature
        key, value, cache, slots, quant = _args(seed=seed)
        w.write(key, value, cache, slots, quant)
        assert torch.equal(cache[slots // BS, 0, slots % BS], key)
    assert count_validations[0] == 1 and len(w._runners) == 1


def test_new_signature_is_validated(count_validations: list[int]) -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    w.write(*_args(t=3))
    w.write(*_args(t=4))  # another token count
    w.write(*_args(t=3, dtype=torch.bfloat16))
    w.write(*_args(t=3), path="torch")  # an explicit path is part of the signature
    assert count_validations[0] == 4 and len(w._runners) == 4


def test_table_is_bounded() -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    for t in range(1, MAX_SIGNATURES + 3):
        key, value, cache, slots, quant = _args(t=min(t, NB * BS))
        w.write(key[:1].expand(t, H, D), value[:1].expand(t, H, D), cache,
                torch.full((t,), -1), quant)
    assert 0 < len(w._runners) <= MAX_SIGNATURES


def _bad_calls() -> list[tuple[str, Callable[..., tuple[Any, ...]], type[Exception], str]]:
    def key_dtype(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k.to(torch.float16), v, c, s, q

    def key_heads(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k[:, :1], v, c, s, q

    def key_rows(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k[:2], v, c, s, q

    def slots_int32(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c, s.to(torch.int32), q

    def slots_2d(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c, s[None], q

    def value_meta(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v.to("meta"), c, s, q

    def cache_dtype(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c.to(torch.bfloat16), s, q

    def cache_expanded(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c[:1].expand(NB, 2, BS, H, D), s, q

    def quant_not_allowed(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c, s, KVQuant("int8_per_token_head", q.k_scale, q.v_scale)

    def quant_fp8_on_bf16_cache(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c, s, KVQuant("fp8_e4m3", q.k_scale, q.v_scale)

    def key_list(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k.tolist(), v, c, s, q

    def key_parameter(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return torch.nn.Parameter(k[:, :1], requires_grad=False), v, c, s, q

    def quant_dict(k: Any, v: Any, c: Any, s: Any, q: Any) -> tuple[Any, ...]:
        return k, v, c, s, {"kv_cache_dtype": "auto"}

    return [
        ("key-dtype", key_dtype, KVCacheWriteError, "value.dtype"),
        ("key-heads", key_heads, KVCacheWriteError, "key.shape"),
        ("key-rows", key_rows, KVCacheWriteError, "key.shape"),
        ("slots-int32", slots_int32, KVCacheWriteError, "slot_mapping.dtype"),
        ("slots-2d", slots_2d, KVCacheWriteError, "slot_mapping.shape"),
        ("value-device", value_meta, KVCacheWriteError, "value.device"),
        ("cache-dtype", cache_dtype, KVCacheWriteError, "kv_cache.dtype"),
        ("cache-expanded", cache_expanded, KVCacheWriteError, "kv_cache.stride"),
        ("quant-format", quant_not_allowed, KVCacheWriteError, "quant.kv_cache_dtype"),
        ("quant-fp8-on-fp32-cache", quant_fp8_on_bf16_cache, KVCacheWriteError,
         "kv_cache.dtype"),
        ("key-list", key_list, InvalidTypeError, "key"),
        ("key-parameter", key_parameter, KVCacheWriteError, "key.shape"),
        ("quant-dict", quant_dict, InvalidTypeError, "quant"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("path", ["torch", None])
@pytest.mark.parametrize(("name", "make", "error", "argument"), BAD, ids=[b[0] for b in BAD])
def test_bad_call_after_cached_good_ones_raises_before_writing(
        name: str, make: Callable[..., tuple[Any, ...]], error: type[Exception], argument: str,
        path: str | None) -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    key, value, cache, slots, quant = _args()
    for _ in range(2):
        w.write(key, value, cache, slots, quant, path=path)  # type: ignore[arg-type]
    assert len(w._runners) == 1
    bad = make(key, value, cache, slots, quant)
    before = raw(cache).clone()
    for _ in range(2):  # and again: a failed signature is never stored
        with pytest.raises(error) as info:
            w.write(*bad, path=path)
        assert getattr(info.value, "argument", None) == argument
    assert torch.equal(raw(cache), before)
    assert len(w._runners) == 1


def test_bad_rope_call_after_cached_good_one_raises() -> None:
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    key, value, cache, slots, quant = _args()
    rope = RoPE.build(D, 16)
    positions = torch.tensor([1, 2, 3])
    w.write_with_rope(None, key, value, cache, slots, quant, positions, rope)
    w.write_with_rope(None, key, value, cache, slots, quant, positions, rope)
    assert len(w._runners) == 1
    before = raw(cache).clone()
    with pytest.raises(InvalidArgumentError) as dtype:
        w.write_with_rope(None, key, value, cache, slots, quant, positions.to(torch.int32), rope)
    with pytest.raises(InvalidArgumentError) as wide:
        w.write_with_rope(None, key, value, cache, slots, quant, positions, RoPE.build(2 * D, 16))
    assert (dtype.value.argument, wide.value.argument) == ("positions.dtype", "rope.rotary_dim")
    assert torch.equal(raw(cache), before)


def test_mla_writer_caches_and_still_rejects() -> None:
    w = MLALatentCacheWriter()
    cache = torch.zeros(2, 4, 12)
    slots = torch.tensor([0, 5])
    quant = KVQuant.unscaled()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        kv_c, k_pe = torch.randn(2, 8, generator=g), torch.randn(2, 1, 4, generator=g)
        w.write(kv_c, k_pe, cache, slots, quant)
        assert torch.equal(cache.view(-1, 12)[slots], torch.cat([kv_c, k_pe[:, 0]], -1))
    assert len(w._runners) == 1
    with pytest.raises(KVCacheWriteError) as info:
        w.write(kv_c, k_pe[:, :, :3], cache, slots, quant)
    assert info.value.argument == "kv_cache.shape"


@pytest.fixture
def count_signatures(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _count_calls(monkeypatch, launch_cache_mod, "signature_of")


def test_repeat_call_is_recalled_without_a_signature(count_signatures: list[int],
                                                     count_validations: list[int]) -> None:
    """New per-step tensors with the same cache and KVQuant objects match the last call
    (no signature built); another cache object of the same metadata builds the signature
    and finds it (no validation); each write lands."""
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    _, _, cache, _, quant = _args()
    for seed in range(4):
        key, value, _, slots, _ = _args(seed=seed)
        w.write(key, value, cache, slots, quant)
        assert torch.equal(cache[slots // BS, 0, slots % BS], key)
    assert count_signatures[0] == 1 and count_validations[0] == 1
    other = cache.clone()
    w.write(key, value, other, slots, quant)
    w.write(key, value, other, slots, KVQuant.unscaled())  # another KVQuant object
    w.write(key, value, other, slots, quant, path="torch")  # another path
    assert count_signatures[0] == 4 and count_validations[0] == 2


def test_in_place_metadata_change_of_the_cache_is_seen(count_signatures: list[int]) -> None:
    """The same cache tensor given other strides (``as_strided_``) or another shape
    (``unsqueeze_``) in place is not recalled: the new strides are checked and written
    through, the new shape is rejected before anything is written."""
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    key, value, cache, slots, quant = _args()
    w.write(key, value, cache, slots, quant)
    w.write(key, value, cache, slots, quant)
    assert count_signatures[0] == 1
    storage = torch.zeros(H, NB, 2, BS, D)  # heads outermost: other strides, same shape
    cache.set_(storage.untyped_storage(), 0, cache.shape, storage.permute(1, 2, 3, 0, 4).stride())
    w.write(key, value, cache, slots, quant)
    assert count_signatures[0] == 2
    assert torch.equal(cache[slots // BS, 0, slots % BS], key)
    assert torch.equal(cache[slots // BS, 1, slots % BS], value)
    before = raw(cache).clone()
    cache.unsqueeze_(0)
    with pytest.raises(InvalidArgumentError) as info:
        w.write(key, value, cache, slots, quant)
    assert info.value.argument == "kv_cache.shape" and count_signatures[0] == 3
    assert torch.equal(raw(cache), before)


def test_writer_keeps_no_freed_cache_alive() -> None:
    """The recalled call holds its cache, KVQuant and RoPE table weakly."""
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    key, value, cache, slots, quant = _args()
    rope = RoPE.build(D, 16)
    w.write(key, value, cache, slots, quant)
    w.write_with_rope(None, key, value, cache, slots, quant, torch.tensor([1, 2, 3]), rope)
    refs = [weakref.ref(x) for x in (cache, quant, rope)]
    del cache, quant, rope
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_write_and_rope_recall_apart_and_clear_forgets(count_signatures: list[int],
                                                       count_validations: list[int]) -> None:
    """``write`` and ``write_with_rope`` interleaved each recall their own last call;
    ``clear_launch_cache`` forgets the recalled calls too (the next call is checked)."""
    w = SplitKVCacheWriter(L.SPLIT_NHD)
    key, value, cache, slots, quant = _args()
    rope, positions = RoPE.build(D, 16), torch.tensor([1, 2, 3])
    for _ in range(3):
        w.write(key, value, cache, slots, quant)
        w.write_with_rope(None, key, value, cache, slots, quant, positions, rope)
    assert count_signatures[0] == 2 and count_validations[0] == 2
    w.clear_launch_cache()
    w.write(key, value, cache, slots, quant)
    assert count_signatures[0] == 3 and count_validations[0] == 3


def test_signature_covers_what_validation_reads() -> None:
    key, value, cache, slots, quant = _args(cache_dtype="fp8_e4m3")
    base = write_signature(key, value, cache, slots, quant, None)
    per_head = KVQuant("fp8_e4m3", torch.ones(H), torch.ones(H))
    assert write_signature(key, value, cache, slots, per_head, None) != base
    assert write_signature(key, value, cache.transpose(2, 3), slots, quant, None) != base
    assert write_signature(key.to("meta"), value, cache, slots, quant, None) != base
    assert write_signature(key, value, cache, slots, quant, "torch") != base
    assert write_signature(key, value, cache, slots, quant, None) == base
    assert write_signature(torch.nn.Parameter(key), value, cache, slots, quant, None) is None


# -- the direct launch, against Triton's own argument list ------------------------------------


class _Launcher:
    """Stands in for Triton 3.x's CudaLauncher: records what its C launch would get."""

    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = False

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def launch(self, *args: Any) -> None:
        self.calls.append(args)


class _Compiled:
    def __init__(self) -> None:
        self.run = _Launcher()
        self.function = 0xF00
        self.packed_metadata = (4, 1, 0)


def _triton_args(launch: tw.Launch) -> list[object]:
    """What ``fn[grid](*args, **constexprs)`` hands the launcher after the header."""
    fn = getattr(tw.load_kernels(interpret=False), launch.kernel)
    names = list(fn.arg_names)
    return ([a.data_ptr() if isinstance(a, torch.Tensor) else a for a in launch.args]
            + [launch.constexprs[n] for n in names[len(launch.args):]])


def _split_launch(live: tuple[torch.Tensor, ...], mode: int) -> tw.Launch:
    k, v = split_kv_views(live[2], L.SPLIT_HND)
    return tw.scatter_kv_launch(live[0], live[1], tw.ScatterTarget.token_major(k),
                                tw.ScatterTarget.token_major(v), live[3], mode, live[4],
                                live[5])


def _live(seed: int, fp8: bool) -> tuple[torch.Tensor, ...]:
    key, value, cache, slots, _ = _args(dtype=torch.bfloat16,
                                        cache_dtype="fp8_e4m3" if fp8 else "auto", seed=seed)
    return key, value, cache, slots, torch.ones(H), torch.ones(H)


triton_kernels = pytest.mark.skipif(not tw.triton_importable(),
                                    reason="triton is not importable: no kernels to bind")


def _bind(launch: tw.Launch, live: tuple[torch.Tensor, ...], compiled: _Compiled,
          device: list[int]) -> tw.BoundLaunch | None:
    fn = getattr(tw.load_kernels(interpret=False), launch.kernel)
    return tw.BoundLaunch.bind(compiled, launch, live, arg_names=list(fn.arg_names), device=0,
                               get_device=lambda: device[0], get_stream=lambda d: 0x5E)


@triton_kernels
@pytest.mark.parametrize("mode", [0, 1], ids=["auto", "fp8_e4m3"])
def test_bound_launch_passes_tritons_arguments_for_new_tensors(mode: int) -> None:
    first = _live(0, mode == 1)
    compiled, device = _Compiled(), [0]
    bound = _bind(_split_launch(first, mode), first, compiled, device)
    assert bound is not None
    for seed in (1, 2):
        live = _live(seed, mode == 1)
        assert bound(live)
        header, args = compiled.run.calls[-1][:13], list(compiled.run.calls[-1][13:])
        assert header == (3, 1, 1, 0x5E, 0xF00, False, False, None, None, (4, 1, 0), None,
                          None, None)
        assert args == _triton_args(_split_launch(live, mode))


@triton_kernels
def test_bound_rope_launch_passes_tritons_arguments() -> None:
    g = torch.Generator().manual_seed(0)

    def live(seed: int) -> tuple[torch.Tensor, ...]:
        base = _live(seed, True)
        q = torch.randn(4, 4, D, generator=g).to(torch.bfloat16)
        return (*base, q, torch.tensor([1, 2, 3, 0]), RoPE.build(D, 8).cos_sin_cache)

    def launch(x: tuple[torch.Tensor, ...]) -> tw.Launch:
        k, v = split_kv_views(x[2], L.SPLIT_NHD)
        return tw.rope_kv_launch(x[6], x[0], x[1], tw.ScatterTarget.token_major(k),
                                 tw.ScatterTarget.token_major(v), x[3], x[7], x[8], True, 1,
                                 x[4], x[5])

    first = live(0)
    compiled = _Compiled()
    bound = _bind(launch(first), first, compiled, [0])
    assert bound is not None
    second = live(1)
    assert bound(second)
    assert list(compiled.run.calls[-1][13:]) == _triton_args(launch(second))


@triton_kernels
def test_bound_launch_refuses_where_its_assumptions_break() -> None:
    first = _live(0, False)
    compiled, device = _Compiled(), [0]
    bound = _bind(_split_launch(first, 0), first, compiled, device)
    assert bound is not None
    key = torch.empty(first[0].numel() + 1, dtype=torch.bfloat16)[1:].view(first[0].shape)
    assert not bound((key, *first[1:]))  # a 2-byte-aligned key: compiled for 16
    device[0] = 1
    assert not bound(first)  # another device is current
    assert compiled.run.calls == []
    launcher = _Compiled()
    launcher.run.global_scratch_size = 128
    assert _bind(_split_launch(first, 0), first, launcher, [0]) is None
    fn = tw.load_kernels(interpret=False).scatter_kv_kernel
    assert tw.BoundLaunch.bind(_Compiled(), _split_launch(first, 0), first,
                               arg_names=list(fn.arg_names), device=0, get_device=lambda: 0,
                               get_stream=lambda d: 0,
                               knobs=SimpleNamespace(launch_enter_hook=print,
                                                     launch_exit_hook=None)) is None
    assert tw.BoundLaunch.bind(object(), _split_launch(first, 0), first,
                               arg_names=list(fn.arg_names), device=0, get_device=lambda: 0,
                               get_stream=lambda d: 0) is None


@triton_kernels
def test_bound_launch_accepts_empty_hook_chains_and_yields_to_a_profiler() -> None:
    """Triton 3.4+ keeps empty ``knobs.HookChain`` objects as launch hooks (older versions
    kept None): empty chains bind; a hook added later (a profiler) or a replaced hook
    sends every call back to Triton's own launch, which calls it."""
    from triton.knobs import HookChain

    first = _live(0, False)
    fn = getattr(tw.load_kernels(interpret=False), _split_launch(first, 0).kernel)
    enter, exit_ = HookChain(), HookChain(reversed=True)
    knobs = SimpleNamespace(launch_enter_hook=enter, launch_exit_hook=exit_)
    compiled = _Compiled()
    bound = tw.BoundLaunch.bind(compiled, _split_launch(first, 0), first,
                                arg_names=list(fn.arg_names), device=0, get_device=lambda: 0,
                                get_stream=lambda d: 0, knobs=knobs)
    assert bound is not None
    assert bound(first) and len(compiled.run.calls) == 1
    assert compiled.run.calls[0][10:13] == (None, None, None)  # no metadata, no hooks
    enter.add(print)
    assert not bound(first)
    enter.remove(print)
    assert bound(first)
    exit_.add(print)
    assert not bound(first)
    exit_.remove(print)
    assert bound(first)
    knobs.launch_exit_hook = None  # replaced (here by None): not the object bound against
    assert not bound(first)
    knobs.launch_exit_hook = exit_
    knobs.launch_enter_hook = HookChain()  # replaced by another (empty) chain
    assert not bound(first)
    assert len(compiled.run.calls) == 3
    busy = HookChain()
    busy.add(print)
    assert tw.BoundLaunch.bind(_Compiled(), _split_launch(first, 0), first,
                               arg_names=list(fn.arg_names), device=0, get_device=lambda: 0,
                               get_stream=lambda d: 0,
                               knobs=SimpleNamespace(launch_enter_hook=busy,
                                                     launch_exit_hook=None)) is None
    assert tw.hooks_quiet(None) and tw.hooks_quiet(HookChain())
    assert not tw.hooks_quiet(busy) and not tw.hooks_quiet(print)


def test_cached_launch_falls_back_when_the_launcher_rejects_its_arguments() -> None:
    launches: list[int] = []

    class FakeLaunch:
        def launch(self) -> None:
            launches.append(1)

    cached = tw.CachedLaunch(lambda live: FakeLaunch())  # type: ignore[arg-type, return-value]

    def rejecting(live: object) -> bool:
        raise TypeError("function takes exactly 40 arguments")

    cached._bound = rejecting
    cached._tried = True
    cached((torch.zeros(1),) * 6)
    assert launches == [1] and not cached.bound
