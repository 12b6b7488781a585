"""DeepSeek-style multi-head latent attention around :class:`~vllm.attention.layer.MLAAttention`.

Parameter names follow DeepSeek-V2/V3 checkpoints. The latent ``kv_c`` and the
shared rope key ``k_pe`` are replicated on every rank (the latent cache is not
split by head); query heads, ``kv_b_proj`` rows and ``o_proj`` columns are
sharded. ``kv_b_proj`` is never applied as a matmul here: the MLA impl absorbs
it (``MLAProjection``), see ``docs/mla.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.attention.backend import AttentionBackend
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.layer import MLAAttention
from vllm.attention.types import parse_kv_cache_dtype
from vllm.runner.attention_block import AttentionBlock, AttentionLayer, AttnInputs
from vllm.runner.config import ModelConfig
from vllm.runner.layers import RMSNorm, Rotary, ShardedLinear, Shard
from vllm.runner.parallel import ParallelState


class DeepseekMLAAttention(AttentionBlock):
    def __init__(self, config: ModelConfig, *, layer_name: str, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise InvalidArgumentError("config.mla", None, "the MLA dimensions")
        self.mla = mla
        self.layer_name = layer_name
        self.num_heads = parallel.shard(config.num_attention_heads, "num_attention_heads")[1]
        n, h = config.num_attention_heads, config.hidden_size

        def linear(n_in: int, n_out: int, shard: Shard) -> ShardedLinear:
            return ShardedLinear(n_in, n_out, bias=False, shard=shard, parallel=parallel,
                                 dtype=dtype, device=device, what="num_attention_heads")

        if mla.q_lora_rank is None:
            self.q_proj: ShardedLinear | None = linear(h, n * mla.qk_head_dim, "column")
        else:
            self.q_proj = None
            self.q_a_proj = linear(h, mla.q_lora_rank, "none")
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, dtype=dtype,
                                         device=device)
            self.q_b_proj = linear(mla.q_lora_rank, n * mla.qk_head_dim, "column")
        self.kv_a_proj_with_mqa = linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, "none")
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, dtype=dtype,
                                      device=device)
        self.kv_b_proj = linear(mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim),
                                "column")
        self.o_proj = linear(n * mla.v_head_dim, h, "row")
        self.rotary = Rotary(config.rope, mla.qk_rope_head_dim, config.max_position_embeddings,
                             device=device)
        self._attn: MLAAttention | None = None

    def finalize(self, backend: type[AttentionBackend[Any]], kv_cache_dtype: str) -> None:
        from vllm.attention.backends.mla.common import MLALayerSpec, MLAProjection

        mla = self.mla
        projection = MLAProjection.from_kv_b_proj(
            self.kv_b_proj.weight, num_heads=self.num_heads,
            qk_nope_head_dim=mla.qk_nope_head_dim, v_head_dim=mla.v_head_dim,
        )
        spec = MLALayerSpec.create(
            num_heads=self.num_heads, kv_lora_rank=mla.kv_lora_rank,
            qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
            v_head_dim=mla.v_head_dim, projection=projection,
            kv_cache_dtype=parse_kv_cache_dtype(kv_cache_dtype),
        )
        self._attn = MLAAttention(spec=spec, backend=backend, layer_name=self.layer_name)

    @property
    def layer(self) -> AttentionLayer:
        if self._attn is None:
            raise InvalidArgumentError(f"{self.layer_name}", "not finalized",
                                       "DecoderModel.finalize() after loading the weights")
        return self._attn

    def project(self, h: torch.Tensor, positions: torch.Tensor) -> AttnInputs:
        mla, t = self.mla, h.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        q = q.view(t, self.num_heads, mla.qk_head_dim)
        q_pe = self.rotary(q[..., mla.qk_nope_head_dim:], positions)
        q = torch.cat((q[..., :mla.qk_nope_head_dim], q_pe), dim=-1)
        latent = self.kv_a_proj_with_mqa(h)
        kv_c_normed = self.kv_a_layernorm(latent[:, :mla.kv_lora_rank].contiguous())
        k_pe = self.rotary(latent[:, mla.kv_lora_rank:].unsqueeze(1), positions).squeeze(1)
        return q, kv_c_normed, k_pe

    def attend(self, inputs: AttnInputs, output: torch.Tensor) -> torch.Tensor:
        q, kv_c_normed, k_pe = inputs
        layer = self.layer
        if not isinstance(layer, MLAAttention):
            raise InvalidArgumentError(self.layer_name, type(layer).__name__, "an MLAAttention")
        out: torch.Tensor = layer(q, kv_c_normed, k_pe, output)
        return out

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_heads * self.mla.v_head_dim)

    def finish(self, attn_out: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(attn_out.flatten(1))
        return out
