"""``head_matmul``: MLA's per-head products (absorption and output projection).

The Triton kernel under the CPU interpreter (small shapes, float16 and float32) and on
a GPU (DeepSeek-V3's shapes, bf16), against float64; ``out=`` writes its rows and
nothing else; the path choice and the errors.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.mla.conftest import HAVE_TRITON
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.ops import head_matmul as hm

if HAVE_TRITON and not torch.cuda.is_available():
    # before anything imports triton (see tests/mla/test_triton_interpreter.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

CUDA = torch.cuda.is_available()


def _operands(t: int, n: int, k: int, c: int, dtype: torch.dtype, device: str,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` a strided slice (as ``q[..., :P]`` is), ``w`` scaled to keep sums O(1)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(t, n, k + 5, generator=g)[..., :k]
    w = torch.randn(n, k, c, generator=g) * k ** -0.5
    return a.to(dtype).to(device), w.to(dtype).to(device)


def _check_close(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    """Within one rounding of the result's dtype plus float32 accumulation error:
    ``|got - ref| <= eps |ref| + K 2^-23 (|a| @ |w|)``, ``ref`` in float64."""
    ref = torch.einsum("tnk,nkc->tnc", a.double(), w.double())
    scale = torch.einsum("tnk,nkc->tnc", a.double().abs(), w.double().abs())
    eps = torch.finfo(got.dtype).eps
    bound = eps * ref.abs() + a.shape[2] * 2.0 ** -23 * scale
    excess = (got.double() - ref).abs() - bound
    assert excess.max().item() <= 0, f"max excess over the bound {excess.max().item():.3e}"


def _out_in_rows(t: int, n: int, c: int, dtype: torch.dtype, device: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[t, n, c]`` view into the middle rows of a larger tensor full of sentinels
    (as a layer's output rows are); returns (view, whole)."""
    whole = torch.full((t + 3, n, c + 4), 7.5, dtype=dtype, device=device)
    return whole[1:t + 1, :, 2:c + 2], whole


def _untouched(whole: torch.Tensor, t: int, c: int) -> bool:
    keep = torch.ones(whole.shape, dtype=torch.bool, device=whole.device)
    keep[1:t + 1, :, 2:c + 2] = False
    return bool((whole[keep] == 7.5).all())


INTERP_CASES = [  # t, n, k, c, dtype
    (5, 3, 128, 64, torch.float16),   # K and C multiples of the tiles
    (19, 2, 80, 40, torch.float16),   # neither: masked K and C
    (33, 2, 96, 48, torch.float32),   # two row tiles
    (1, 4, 64, 24, torch.float32),
    (6, 2, 64, 32, torch.bfloat16),   # on float32 copies under the interpreter
]


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("t, n, k, c, dtype", INTERP_CASES)
def test_triton_kernel_under_the_interpreter(t: int, n: int, k: int, c: int,
                                             dtype: torch.dtype) -> None:
    a, w = _operands(t, n, k, c, dtype, "cpu", seed=t * 7 + k)
    _check_close(hm.head_matmul(a, w, path="triton"), a, w)
    out, whole = _out_in_rows(t, n, c, dtype, "cpu")
    got = hm.head_matmul(a, w, out, path="triton")
    assert got.data_ptr() == out.data_ptr()
    _check_close(out, a, w)
    assert _untouched(whole, t, c)


@pytest.mark.usefixtures("triton_interpreter")
def test_tiles_other_than_the_default_give_the_same_products() -> None:
    a, w = _operands(21, 2, 128, 96, torch.float16, "cpu", seed=3)
    for cfg in (hm.HeadMatmulConfig(16, 32, 32), hm.HeadMatmulConfig(32, 64, 128)):
        _check_close(hm.head_matmul(a, w, path="triton", config=cfg), a, w)


def test_bmm_path_on_cpu_and_its_out_rows() -> None:
    a, w = _operands(9, 3, 32, 16, torch.float32, "cpu", seed=1)
    assert hm.head_matmul_path(a, w) == "bmm"
    _check_close(hm.head_matmul(a, w), a, w)
    out, whole = _out_in_rows(9, 3, 16, torch.float32, "cpu")
    hm.head_matmul(a, w, out)
    _check_close(out, a, w)
    assert _untouched(whole, 9, 16)


def test_unsupported_reasons_name_what_is_missing() -> None:
    a, w = _operands(4, 2, 16, 8, torch.float32, "cpu", seed=2)
    reasons = hm.unsupported_reasons(a, w)
    assert any("device cpu" in r for r in reasons)
    assert any("float16 or bfloat16" in r for r in reasons)
    a.requires_grad_(True)
    assert any("autograd" in r for r in hm.unsupported_reasons(a, w))


def test_autograd_flows_through_the_bmm_path() -> None:
    a, w = _operands(3, 2, 8, 4, torch.float32, "cpu", seed=4)
    a.requires_grad_(True)
    out = torch.zeros(3, 2, 4)
    hm.head_matmul(a, w, out).sum().backward()
    assert a.grad is not None
    torch.testing.assert_close(a.grad, w.sum(2).unsqueeze(0).expand(3, 2, 8))


@pytest.mark.parametrize("bad, argument", [
    (lambda a, w: (a[0], w, None), "a.shape"),
    (lambda a, w: (a, w[:, :-1], None), "w.shape"),
    (lambda a, w: (a, w[:1], None), "w.shape"),
    (lambda a, w: (a, w, torch.empty(4, 2, 9)), "out.shape"),
    (lambda a, w: (a, w, torch.empty(4, 2, 8, dtype=torch.float64)), "out"),
])
def test_bad_operands_name_the_argument(bad, argument: str) -> None:  # type: ignore[no-untyped-def]
    a, w = _operands(4, 2, 16, 8, torch.float32, "cpu", seed=5)
    with pytest.raises(InvalidArgumentError) as info:
        hm.head_matmul(*bad(a, w))
    assert info.value.argument == argument


def test_forcing_triton_where_it_cannot_run_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a, w = _operands(4, 2, 16, 8, torch.float32, "cpu", seed=6)
    with pytest.raises(InvalidArgumentError, match="device cpu"):
        hm.head_matmul(a, w, path="triton")
    with pytest.raises(InvalidArgumentError, match="'triton', 'bmm' or None"):
        hm.head_matmul(a, w, path="cublas")  # type: ignore[arg-type]


def _sm90() -> bool:
    return CUDA and torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an NVIDIA sm_90+ GPU (the Triton path's "
                                        "devices)")
@pytest.mark.parametrize("t", [1, 64, 65, 200])
@pytest.mark.parametrize("op", ["absorb", "project"])
@pytest.mark.parametrize("n", [128, 64, 16])
def test_deepseek_shapes_on_the_gpu(op: str, t: int, n: int) -> None:
    k, c = (128, 512) if op == "absorb" else (512, 128)
    a, w = _operands(t, n, k, c, torch.bfloat16, "cuda", seed=t + n)
    default = "triton" if t <= hm.TRITON_MAX_TOKENS and n >= hm.TRITON_MIN_HEADS else "bmm"
    assert hm.head_matmul_path(a, w) == default
    for path in ("triton", "bmm"):  # each path at every shape, default or not
        _check_close(hm.head_matmul(a, w, path=path), a, w)
        out, whole = _out_in_rows(t, n, c, torch.bfloat16, "cuda")
        hm.head_matmul(a, w, out, path=path)
        _check_close(out, a, w)
        assert _untouched(whole, t, c)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an NVIDIA sm_90+ GPU (the Triton path's "
                                        "devices)")
def test_the_layer_takes_the_triton_products_at_deepseek_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.attention.backends.mla.spec import MLAProjection

    launches: list[bool] = []
    kernel = hm._kernel

    def counted(interpret: bool) -> object:
        launches.append(interpret)
        return kernel(interpret)

    monkeypatch.setattr(hm, "_kernel", counted)
    a, w = _operands(64, 128, 128, 512, torch.bfloat16, "cuda", seed=9)
    proj = MLAProjection(w_uk=w, w_uv=w.transpose(1, 2).contiguous())
    _check_close(proj.absorb_query(a), a, w)
    o = torch.randn(64, 128, 512, device="cuda").to(torch.bfloat16)
    out, whole = _out_in_rows(64, 128, 128, torch.bfloat16, "cuda")
    proj.project_output(o, out=out)
    _check_close(out, o, proj.w_uv)
    assert _untouched(whole, 64, 128)
    assert launches == [False, False]
