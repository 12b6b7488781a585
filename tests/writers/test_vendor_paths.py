"""The writers' NVIDIA-only paths are never taken on an AMD GPU, and what ROCm runs
instead stores the reference's bytes.

ROCm builds of torch call AMD GPUs ``cuda`` and an MI300 reports capability 9.4, so
these tests pretend to be such a build (``torch.version.hip`` set, capability (9, 4))
and ask the writers' one device decision
(``vllm.attention.writers.kernels.device.gpu_of``) what it sees; every launcher asks it.
The compiled gfx942 code itself is checked by ``test_triton_compile.py``.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.writers.oracle import KV_LAYOUTS, Case, L, check, prepare, write
from vllm.attention import KVQuant
from vllm.attention.rope import RoPE, rotate_reference
from vllm.attention.writers import SplitKVCacheWriter, reference_write
from vllm.attention.writers.kernels import device

ROOT = Path(__file__).resolve().parents[2]
PTX_FLAGS = ("HW_CVT", "FAST_DIV", "HW_NAN", "FAST_RCP", "PACKED_WIDEN")


def _pretend(monkeypatch: pytest.MonkeyPatch, hip: str | None,
             capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(device, "_capability", lambda index: capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ROCm build of torch on an MI300, with every NVIDIA path asked for by name."""
    _pretend(monkeypatch, "6.3.42131", (9, 4))
    monkeypatch.setenv("VLLM_KV_FAST_DIV", "1")
    monkeypatch.setenv("VLLM_KV_HW_NAN", "1")


def _decide_as_gpu0(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """Make every device decision of the launchers (which see CPU tensors here) the one
    :func:`device.gpu_of` makes for ``cuda:0`` under the pretended build; returns the
    devices asked about, so a test can tell the launchers asked."""
    real = device.gpu_of
    asked: list[torch.device] = []

    def gpu_of(dev: torch.device) -> device.GPU | None:
        asked.append(dev)
        return real(torch.device("cuda", 0))

    monkeypatch.setattr(device, "gpu_of", gpu_of)
    return asked


def test_rocm_gpu_takes_no_nvidia_path(rocm: None) -> None:
    for dev in (torch.device("cuda", 0), torch.device("cuda")):
        assert device.gpu_of(dev) == device.GPU("amd", (9, 4))
        assert not device.nvidia_gpu(dev)
        assert not device.hardware_fp8(dev)
        assert not device.fast_division(dev)
        assert not device.hardware_fp8_nan(dev)
        assert not device.direct_launch(dev)
        for mode in (1, 2):
            assert not any(device.fp8_consts(mode, dev).values()), mode


@pytest.mark.parametrize(("capability", "fp8", "nan"), [
    ((8, 0), False, False), ((8, 6), False, False), ((8, 9), True, False),
    ((9, 0), True, True), ((10, 0), True, False)])
def test_nvidia_gpu_takes_its_paths_by_capability(monkeypatch: pytest.MonkeyPatch,
                                                  capability: tuple[int, int], fp8: bool,
                                                  nan: bool) -> None:
    _pretend(monkeypatch, None, capability)
    monkeypatch.delenv("VLLM_KV_FAST_DIV", raising=False)
    monkeypatch.delenv("VLLM_KV_HW_NAN", raising=False)
    dev = torch.device("cuda", 0)
    assert device.gpu_of(dev) == device.GPU("nvidia", capability)
    assert device.nvidia_gpu(dev) and device.direct_launch(dev)
    assert device.hardware_fp8(dev) == fp8
    assert device.fast_division(dev) == fp8  # its PTX needs sm_86; it runs beside HW_CVT
    assert device.hardware_fp8_nan(dev) == nan
    assert device.fp8_consts(1, dev) == {"HW_CVT": fp8, "FAST_DIV": fp8, "HW_NAN": nan,
                                         "FAST_RCP": fp8}
    assert not any(device.fp8_consts(0, dev).values())  # unquantised writes use none


def test_cpu_tensors_take_no_hardware_path() -> None:
    cpu = torch.device("cpu")
    assert device.gpu_of(cpu) is None
    assert not device.nvidia_gpu(cpu) and not device.direct_launch(cpu)
    assert not any(device.fp8_consts(1, cpu).values())


@pytest.fixture
def compile_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``tools/triton_compile_check.py`` as a module (it imports Triton; ``tools/`` on the
    path only while the test runs)."""
    pytest.importorskip("triton", reason="triton is not installed: the compile check needs it")
    monkeypatch.syspath_prepend(ROOT / "tools")
    import triton_compile_check

    return triton_compile_check


@pytest.mark.parametrize("vendor", ["amd", "nvidia"])
def test_every_writer_launch_chooses_by_vendor(vendor: str, compile_check: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every writer launch of the compile check, built as on an MI300 under ROCm: no
    NVIDIA-only constexpr set, whatever the environment asks for. Built as on an H200,
    the fp8 launches do set them (the check can tell)."""
    if vendor == "amd":
        _pretend(monkeypatch, "6.3.42131", (9, 4))
    else:
        _pretend(monkeypatch, None, (9, 0))
    asked = _decide_as_gpu0(monkeypatch)
    chosen: dict[str, list[str]] = {}
    for env in compile_check.WRITER_ENVS + ({"VLLM_KV_FAST_DIV": "1", "VLLM_KV_HW_NAN": "1"},):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for name, launch in compile_check.writer_launches():
            flags = [k for k in PTX_FLAGS if launch.constexprs.get(k)]
            if flags:
                chosen[name] = flags
        for k in env:
            monkeypatch.delenv(k)
    assert asked, "the launchers never asked for the device's paths"
    if vendor == "amd":
        assert chosen == {}
    else:
        assert {"tiled-fp8_e4m3-T4096", "rope-fp8_e5m2-neox", "tiled-mla-fp8"} <= set(chosen)
        assert set().union(*chosen.values()) == set(PTX_FLAGS)


def _interpreted_cases() -> list[Case]:
    out = [Case(layout, dt, cd, 16, "scale_per_head")
           for layout in KV_LAYOUTS
           for dt, cd in (("bf16", "fp8_e4m3"), ("fp16", "fp8_e5m2"))]
    out += [Case(L.MLA_LATENT, "bf16", "fp8_e4m3", 16),
            Case(L.PER_TOKEN_HEAD_QUANT, "bf16", "fp8_per_token_head", 16, "scale_none"),
            Case(L.MLA_FP8_DS, "bf16", "fp8_ds_mla", 64, "scale_none")]
    return out


INTERPRETED = _interpreted_cases()
TILED = (L.SPLIT_NHD, L.SPLIT_HND, L.SPLIT_KV_FIRST, L.SPLIT_BLOCK_INTERLEAVED,
         L.DIFFKV_PACKED, L.MLA_LATENT)


@pytest.fixture
def interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot run here")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the interpreter does not run CUDA tensors' kernels")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("case", INTERPRETED, ids=[c.id for c in INTERPRETED])
def test_rocm_launches_store_the_reference_bytes(case: Case, rocm: None, interpreter: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The launches as built for an MI300, run by the interpreter on fresh random inputs:
    every written row is the oracle's, nothing else changes, and the bytes equal the
    torch reference writer's."""
    asked = _decide_as_gpu0(monkeypatch)
    seed = zlib.crc32(case.id.encode())
    got = prepare(case, "cpu", seed=seed, num_tokens=5)
    write(got, "triton")
    if case.layout in TILED:  # the others' kernels have no hardware path to choose
        assert asked, "the launchers never asked for the device's paths"
    check(got)
    want = prepare(case, "cpu", seed=seed, num_tokens=5)
    write(want, "torch")
    assert torch.equal(got.storage.view(torch.uint8), want.storage.view(torch.uint8))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_rocm_fused_rope_stores_the_reference_bytes(cache_dtype: str, rocm: None,
                                                    interpreter: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused RoPE write as built for an MI300 (the rotated keys rounded by the plain
    code, not the hardware conversion): rotate-then-write's bytes, the query rotated."""
    asked = _decide_as_gpu0(monkeypatch)
    g = torch.Generator().manual_seed(zlib.crc32(cache_dtype.encode()))
    t, h, d = 5, 2, 32
    key = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    value = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
    query = torch.randn(t, 4, d, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 64, (t,), generator=g)
    slots = torch.tensor([7, -1, 0, 30, 12])
    rope = RoPE.build(d, 64, style="neox")
    quant = KVQuant(cache_dtype, torch.rand(h, generator=g) + 0.25,  # type: ignore[arg-type]
                    torch.rand(h, generator=g) + 0.25)
    storage = torch.float8_e4m3fn if cache_dtype == "fp8_e4m3" else torch.float8_e5m2
    raw = torch.randint(0, 256, (4 * 2 * 16 * h * d,), generator=g, dtype=torch.uint8)
    want = raw.view(storage).view(4, 2, 16, h, d)
    got = want.clone()
    reference_write(L.SPLIT_NHD, rotate_reference(key, positions, rope), value, want, slots,
                    quant)
    q = query.clone()
    SplitKVCacheWriter(L.SPLIT_NHD).write_with_rope(q, key, value, got, slots, quant,
                                                    positions, rope, path="triton")
    assert asked, "the launchers never asked for the device's paths"
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(q.view(torch.int16),
                       rotate_reference(query, positions, rope).view(torch.int16))
