"""The decoder the runner serves: Llama (GQA) or DeepSeek-style (MLA) attention,
RMSNorm, RoPE and a SwiGLU MLP, with parameter names of the Hugging Face checkpoints.

The forward pass is split at every attention call so a CUDA graph can capture
what lies between (``vllm.runner.cuda_graph``): ``embed`` -> per layer
``pre_attention`` / ``attend`` / ``post_attention`` -> ``final_norm``. Attention
reads the per-step metadata and slot mapping from the ForwardContext.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vllm.attention.backend import AttentionBackend
from vllm.attention.layer import Attention
from vllm.runner.attention_block import AttentionBlock, AttentionLayer, AttnInputs
from vllm.runner.config import ModelConfig
from vllm.runner.layers import RMSNorm, Rotary, ShardedLinear, SwiGLU
from vllm.runner.mla import DeepseekMLAAttention
from vllm.runner.parallel import ParallelState


class LlamaAttention(AttentionBlock):
    def __init__(self, config: ModelConfig, *, layer_name: str,
                 backend: type[AttentionBackend[Any]], kv_cache_dtype: str,
                 parallel: ParallelState, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        d = config.head_dim
        self.num_heads = parallel.shard(config.num_attention_heads, "num_attention_heads")[1]
        self.num_kv_heads = parallel.shard(config.num_key_value_heads, "num_key_value_heads")[1]
        self.head_dim = d

        def linear(n_in: int, n_out: int, shard: str, what: str) -> ShardedLinear:
            return ShardedLinear(n_in, n_out, bias=config.attention_bias,
                                 shard="column" if shard == "column" else "row",
                                 parallel=parallel, dtype=dtype, device=device, what=what)

        h = config.hidden_size
        self.q_proj = linear(h, config.num_attention_heads * d, "column", "num_attention_heads")
        self.k_proj = linear(h, config.num_key_value_heads * d, "column", "num_key_value_heads")
        self.v_proj = linear(h, config.num_key_value_heads * d, "column", "num_key_value_heads")
        self.o_proj = linear(config.num_attention_heads * d, h, "row", "num_attention_heads")
        self.rotary = Rotary(config.rope, d, config.max_position_embeddings, device=device)
        self.attn = Attention(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                              head_size=d, scale=d ** -0.5, backend=backend,
                              layer_name=layer_name, kv_cache_dtype=kv_cache_dtype)

    @property
    def layer(self) -> AttentionLayer:
        return self.attn

    def project(self, h: torch.Tensor, positions: torch.Tensor) -> AttnInputs:
        t = h.shape[0]
        q = self.q_proj(h).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(t, self.num_kv_heads, self.head_dim)
        return self.rotary(q, positions), self.rotary(k, positions), v

    def attend(self, inputs: AttnInputs, output: torch.Tensor) -> torch.Tensor:
        q, k, v = inputs
        out: torch.Tensor = self.attn(q, k, v, output=output)
        return out

    def output_shape(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens, self.num_heads, self.head_dim)

    def finish(self, attn_out: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.o_proj(attn_out.flatten(1))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attn: AttentionBlock, *, parallel: ParallelState,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps, dtype=dtype,
                                                device=device)
        self.mlp = SwiGLU(h, config.intermediate_size, bias=config.mlp_bias, parallel=parallel,
                          dtype=dtype, device=device)

    def pre_attention(self, h: torch.Tensor, positions: torch.Tensor) -> AttnInputs:
        return self.self_attn.project(self.input_layernorm(h), positions)

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        h = residual + self.self_attn.finish(attn_out)
        mlp_out: torch.Tensor = self.mlp(self.post_attention_layernorm(h))
        return h + mlp_out


class DecoderModel(nn.Module):
    """``model.*`` and ``lm_head`` of a causal LM; see the module docstring for the split."""

    def __init__(self, config: ModelConfig, *, backend: type[AttentionBackend[Any]],
                 kv_cache_dtype: str, parallel: ParallelState, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.parallel = parallel
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.embed_tokens.weight.requires_grad_(False)
        layers = []
        for i in range(config.num_hidden_layers):
            name = f"model.layers.{i}.self_attn.attn"
            attn: AttentionBlock
            if config.mla is not None:
                attn = DeepseekMLAAttention(config, layer_name=name, parallel=parallel,
                                            dtype=dtype, device=device)
            else:
                attn = LlamaAttention(config, layer_name=name, backend=backend,
                                      kv_cache_dtype=kv_cache_dtype, parallel=parallel,
                                      dtype=dtype, device=device)
            layers.append(DecoderLayer(config, attn, parallel=parallel, dtype=dtype,
                                       device=device))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = ShardedLinear(config.hidden_size, config.vocab_size, bias=False,
                                     shard="none", parallel=parallel, dtype=dtype,
                                     device=device, what="vocab_size")
        self._backend = backend
        self._kv_cache_dtype = kv_cache_dtype

    # -- after loading ------------------------------------------------------------------
    def finalize(self) -> None:
        """Tie embeddings if the config says so and build layers that need weights."""
        if self.config.tie_word_embeddings:
            tied = self.embed_tokens.weight
            if isinstance(tied, nn.Parameter):
                self.lm_head.weight = tied
        for layer in self.decoder_layers():
            layer.self_attn.finalize(self._backend, self._kv_cache_dtype)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def attention_layers(self) -> list[AttentionLayer]:
        return [layer.self_attn.layer for layer in self.decoder_layers()]

    # -- the forward pass, in pieces ------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.embed_tokens(input_ids)
        return h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(h)
        return out

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` (already normed) -> float32 ``[n, vocab_size]``."""
        logits: torch.Tensor = self.lm_head(h)
        return logits.float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Eager pass: ``input_ids``/``positions`` int64 ``[T]`` -> normed hidden ``[T, hidden]``.

        Needs a ForwardContext with every attention layer's metadata and slot mapping.
        """
        h = self.embed(input_ids)
        for layer in self.decoder_layers():
            inputs = layer.pre_attention(h, positions)
            out = torch.empty(layer.self_attn.output_shape(h.shape[0]), dtype=h.dtype,
                              device=h.device)
            out = layer.self_attn.attend(inputs, out)
            h = layer.post_attention(out, h)
        return self.final_norm(h)
