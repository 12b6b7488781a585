"""Vendor MLA decode kernels behind one interface, imported only when they can run.

Each kernel takes the absorbed decode batch (one query token per request) over
the ``(nb, bs, 576)`` latent cache and returns the latent output ``[B, N, 512]``.
``unavailable_reasons`` says why a kernel cannot run on a device, checking the
device before importing anything, so ``import vllm`` and CPU runs never touch the
vendor packages. These paths run only on their hardware; the GPU test suite
compares them with the float64 reference (``tests/mla/test_gpu_paths.py``).
"""

from __future__ import annotations

import abc
import functools
import importlib
from typing import TYPE_CHECKING, Any

import torch

from vllm.attention.types import KVCacheDType
from vllm.attention.writers.kernels.device import nvidia_capability

if TYPE_CHECKING:
    from vllm.attention.backends.mla.spec import MLALayerSpec
    from vllm.attention.ops.mla_attention import LatentFormat

_LATENT, _ROPE = 512, 64


@functools.cache
def _import(module: str) -> Any:
    """The module, or None when it does not import here."""
    try:
        return importlib.import_module(module)
    except Exception:  # any import failure means the vendor path cannot run
        return None


def _cuda_major(device: torch.device) -> int | None:
    """The compute capability's major on an NVIDIA GPU, else None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    cap = nvidia_capability(device)
    return None if cap is None else cap[0]


def _is_rocm(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None and torch.cuda.is_available()


@functools.cache
def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.int8, device=device)


class MLAVendorKernel(abc.ABC):
    """One vendor's MLA decode kernel: where it runs and how to call it."""

    name: str
    """The compute-path name reported by the registry and CLI."""
    module: str
    """What is imported to run it."""
    cache_dtypes: frozenset[KVCacheDType] = frozenset({"auto"})

    @abc.abstractmethod
    def device_reasons(self, device: torch.device) -> list[str]:
        """Why ``device`` cannot run the kernel (empty: it can)."""

    def unavailable_reasons(self, device: torch.device, cache_dtype: KVCacheDType) -> list[str]:
        """Device, cache format and import, in that order (the import only if the
        device qualifies)."""
        reasons = self.device_reasons(device)
        if cache_dtype not in self.cache_dtypes:
            reasons.append(f"kv_cache_dtype={cache_dtype!r}, {self.name} takes "
                           + ", ".join(sorted(self.cache_dtypes)))
        if not reasons and _import(self.module) is None:
            reasons.append(f"{self.module} is not importable")
        return reasons

    def config_reasons(self, spec: MLALayerSpec, block_size: int) -> list[str]:
        """Layer shapes the kernel cannot take (the portable path runs them instead)."""
        reasons = []
        if spec.kv_lora_rank != _LATENT or spec.qk_rope_head_dim != _ROPE:
            reasons.append(f"kv_lora_rank={spec.kv_lora_rank}, rope={spec.qk_rope_head_dim}; "
                           f"{self.name} needs 512 and 64")
        return reasons

    def requirements(self) -> list[str]:
        """Shape requirements checked per layer (listed in the CLI notes)."""
        return ["kv_lora_rank 512, rope 64, one query token per decode request"]

    @abc.abstractmethod
    def decode(self, q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, spec: MLALayerSpec,
               fmt: LatentFormat) -> torch.Tensor:
        """Absorbed decode.

        Args:
            q_lat: ``[B, N, 576]`` in the model dtype, one token per request.
            kv_cache: ``(nb, bs, 576)``.
            block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32.
        Returns:
            ``[B, N, 512]``.
        """


class FlashMLAKernel(MLAVendorKernel):
    """DeepSeek's ``flash_mla`` (Hopper / Blackwell), block size 64."""

    name = "flash_mla"
    module = "flash_mla"

    def device_reasons(self, device: torch.device) -> list[str]:
        major = _cuda_major(device)
        if major in (9, 10):
            return []
        seen = f" (sm{major}x)" if major is not None else ""
        return [f"device {device}{seen}: flash_mla needs CUDA sm90 or sm100"]

    def decode(self, q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, spec: MLALayerSpec,
               fmt: LatentFormat) -> torch.Tensor:
        fm = _import(self.module)
        lens = seq_lens.to(torch.int32)
        sched, splits = fm.get_mla_metadata(lens, q_lat.shape[1], 1)
        out, _ = fm.flash_mla_with_kvcache(
            q_lat.unsqueeze(1), kv_cache.unsqueeze(2), block_table.to(torch.int32), lens,
            spec.kv_lora_rank, sched, splits, softmax_scale=spec.scale, causal=True,
        )
        result: torch.Tensor = out[:, 0]
        return result


class FlashInferTrtllmMLAKernel(MLAVendorKernel):
    """FlashInfer's trtllm-gen MLA decode (Blackwell), block size 32 or 64."""

    name = "flashinfer.trtllm_mla"
    module = "flashinfer.decode"

    def device_reasons(self, device: torch.device) -> list[str]:
        if _cuda_major(device) == 10:
            return []
        return [f"device {device}: trtllm-gen MLA needs CUDA sm100"]

    def config_reasons(self, spec: MLALayerSpec, block_size: int) -> list[str]:
        reasons = super().config_reasons(spec, block_size)
        if spec.qk_nope_head_dim not in (128, 192):
            reasons.append(f"qk_nope_head_dim={spec.qk_nope_head_dim}, needs 128 or 192")
        if block_size not in (32, 64):
            reasons.append(f"block_size={block_size}, needs 32 or 64")
        return reasons

    def requirements(self) -> list[str]:
        return super().requirements() + ["qk_nope_head_dim 128 or 192"]

    def decode(self, q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, spec: MLALayerSpec,
               fmt: LatentFormat) -> torch.Tensor:
        fi = _import(self.module)
        # the kernel reads block-table rows in groups of 128 / block_size pages
        group = max(1, 128 // kv_cache.shape[1])
        pad = (-block_table.shape[1]) % group
        table = torch.nn.functional.pad(block_table.to(torch.int32), (0, pad))
        out = fi.trtllm_batch_decode_with_kv_cache_mla(
            query=q_lat.unsqueeze(1), kv_cache=kv_cache.unsqueeze(1),
            workspace_buffer=_workspace(q_lat.device, 128 << 20),
            qk_nope_head_dim=spec.qk_nope_head_dim, kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.qk_rope_head_dim, block_tables=table,
            seq_lens=seq_lens.to(torch.int32), max_seq_len=max_seq_len,
            bmm1_scale=spec.scale, bmm2_scale=1.0,
        )
        result: torch.Tensor = out.view(q_lat.shape[0], q_lat.shape[1], spec.kv_lora_rank)
        return result


class CutlassMLAKernel(MLAVendorKernel):
    """The CUTLASS SM100 MLA decode kernel (as packaged in ``sgl_kernel``), 128 heads."""

    name = "cutlass_mla"
    module = "sgl_kernel"

    def device_reasons(self, device: torch.device) -> list[str]:
        if _cuda_major(device) == 10:
            return []
        return [f"device {device}: CUTLASS MLA needs CUDA sm100"]

    def config_reasons(self, spec: MLALayerSpec, block_size: int) -> list[str]:
        reasons = super().config_reasons(spec, block_size)
        if spec.num_heads != 128:
            reasons.append(f"num_heads={spec.num_heads}, the kernel is built for 128")
        return reasons

    def requirements(self) -> list[str]:
        return super().requirements() + ["128 query heads"]

    def decode(self, q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, spec: MLALayerSpec,
               fmt: LatentFormat) -> torch.Tensor:
        sk = _import(self.module)
        b = q_lat.shape[0]
        size = int(sk.cutlass_mla_get_workspace_size(max_seq_len, b, num_kv_splits=1))
        group = max(1, 128 // kv_cache.shape[1])
        table = torch.nn.functional.pad(block_table.to(torch.int32),
                                        (0, (-block_table.shape[1]) % group))
        out: torch.Tensor = sk.cutlass_mla_decode(
            q_lat[..., :_LATENT].contiguous(), q_lat[..., _LATENT:].contiguous(), kv_cache,
            seq_lens.to(torch.int32), table,
            torch.empty(size, dtype=torch.uint8, device=q_lat.device), spec.scale, 1,
        )
        return out[..., :_LATENT]


class FlashAttnMLAKernel(MLAVendorKernel):
    """FlashAttention-3's paged kernel with ``qv`` (Hopper): scores are
    ``q_pe . k_pe + ql_nope . kv_c`` and the values are ``kv_c``."""

    name = "flash_attn_3.qv"
    module = "flash_attn_interface"

    def device_reasons(self, device: torch.device) -> list[str]:
        if _cuda_major(device) == 9:
            return []
        return [f"device {device}: FlashAttention-3 MLA needs CUDA sm90"]

    def decode(self, q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, spec: MLALayerSpec,
               fmt: LatentFormat) -> torch.Tensor:
        fa = _import(self.module)
        L = spec.kv_lora_rank
        out = fa.flash_attn_with_kvcache(
            q=q_lat[..., L:].unsqueeze(1), k_cache=kv_cache[..., L:].unsqueeze(2),
            v_cache=kv_cache[..., :L].unsqueeze(2), qv=q_lat[..., :L].unsqueeze(1),
            cache_seqlens=seq_lens.to(torch.int32), page_table=block_table.to(torch.int32),
            softmax_scale=spec.scale, causal=True,
        )
        o = out[0] if isinstance(out, tuple) else out
        result: torch.Tensor = o[:, 0]
        return result


class AiterMLAKernel(MLAVendorKernel):
    """AMD aiter's ``mla_decode_fwd`` (ROCm); every token is a page of one, so any
    block size works."""

    name = "aiter.mla"
    module = "aiter.mla"
    cache_dtypes = frozenset({"auto"})

    def device_reasons(self, device: torch.device) -> list[str]:
        if _is_rocm(device):
            return []
        return [f"device {device}: aiter needs a ROCm GPU"]

    def decode(self, q_lat: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, spec: MLALayerSpec,
               fmt: LatentFormat) -> torch.Tensor:
        am = _import(self.module)
        b, n, _ = q_lat.shape
        nb, bs, d = kv_cache.shape
        dev = q_lat.device
        lens = seq_lens.to(torch.int64)
        kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
        req = torch.repeat_interleave(torch.arange(b, device=dev), lens)
        pos = torch.arange(int(kv_indptr[-1].item()), device=dev) - kv_indptr[req].to(torch.int64)
        slots = block_table.to(torch.int64)[req, pos // bs] * bs + pos % bs
        out = torch.empty(b, n, spec.kv_lora_rank, dtype=q_lat.dtype, device=dev)
        am.mla_decode_fwd(
            q_lat, kv_cache.view(nb * bs, 1, 1, d), out,
            torch.arange(b + 1, dtype=torch.int32, device=dev), kv_indptr,
            slots.to(torch.int32), torch.ones(b, dtype=torch.int32, device=dev), 1, spec.scale,
        )
        return out
