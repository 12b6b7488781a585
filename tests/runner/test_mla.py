"""MLA backends serve the DeepSeek-style model: greedy tokens equal a dense,
cache-free float64 recomputation of the same weights (written here, independently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.runner.conftest import FLOAT32_MARGIN
from vllm.attention.errors import PluginLoadError
from vllm.attention.registry import get_backend, list_backends
from vllm.runner import EngineConfig, LLMEngine, SamplingParams
from vllm.runner.model import DecoderModel

PROMPTS = [[5, 6, 7, 8, 9, 10], [3] * 20, [4]]
N_NEW = 6
HALF_MARGIN = 0.05


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_pairs(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of ``x`` ``[T, H, R]`` by ``pos * theta^(-2i/R)``."""
    r = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    ang = pos.double().unsqueeze(1) * inv
    cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def dense_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """Last-position logits of ``ids`` with expanded (non-absorbed) MLA, no cache,
    in float64 on CPU (the weights may live on CUDA)."""
    cfg = model.config
    mla = cfg.mla
    assert mla is not None
    L, P, R, V = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    eps = cfg.rms_norm_eps

    def w(t: torch.Tensor) -> torch.Tensor:  # on CPU whatever device served the weights
        return t.detach().to("cpu", torch.float64)

    T = len(ids)
    pos = torch.arange(T)
    h = w(model.embed_tokens.weight)[torch.tensor(ids)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in model.decoder_layers():
        a = layer.self_attn
        n = cfg.num_attention_heads
        x = _rms(h, w(layer.input_layernorm.weight), eps)
        if a.q_proj is not None:
            q = (x @ w(a.q_proj.weight).T).view(T, n, P + R)
        else:
            qa = _rms(x @ w(a.q_a_proj.weight).T, w(a.q_a_layernorm.weight), eps)
            q = (qa @ w(a.q_b_proj.weight).T).view(T, n, P + R)
        lat = x @ w(a.kv_a_proj_with_mqa.weight).T
        kv_c = _rms(lat[:, :L], w(a.kv_a_layernorm.weight), eps)
        k_pe = _rope_pairs(lat[:, None, L:], pos, cfg.rope.theta)
        q = torch.cat((q[..., :P], _rope_pairs(q[..., P:], pos, cfg.rope.theta)), -1)
        wkv = w(a.kv_b_proj.weight).view(n, P + V, L)
        k = torch.cat((torch.einsum("tl,npl->tnp", kv_c, wkv[:, :P]), k_pe.expand(T, n, R)), -1)
        v = torch.einsum("tl,nvl->tnv", kv_c, wkv[:, P:])
        s = torch.einsum("qnd,knd->nqk", q, k) * (P + R) ** -0.5
        p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
        o = torch.einsum("nqk,knv->qnv", p, v).reshape(T, n * V)
        h = h + o @ w(a.o_proj.weight).T
        x = _rms(h, w(layer.post_attention_layernorm.weight), eps)
        m = layer.mlp
        g = F.silu(x @ w(m.gate_proj.weight).T) * (x @ w(m.up_proj.weight).T)
        h = h + g @ w(m.down_proj.weight).T
    return _rms(h[-1], w(model.norm.weight), eps) @ w(model.lm_head.weight).T


def dense_greedy(model: DecoderModel, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids = list(prompt)
    margins = []
    for _ in range(n):
        logits = dense_logits(model, ids)
        top = logits.topk(2).values
        margins.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt):], margins


MLA_BACKENDS = [n for n in list_backends() if n.endswith("MLA") or "MLA_" in n]


@pytest.mark.parametrize("name", MLA_BACKENDS)
def test_mla_backend_serves_dense_equal_tokens(name: str) -> None:
    try:
        backend = get_backend(name)
    except PluginLoadError as exc:
        pytest.skip(f"{name} does not load: {exc}")
    engine = LLMEngine.create(
        "random-mla", backend=name,
        engine_config=EngineConfig(max_model_len=64, max_num_batched_tokens=8),
    )
    assert backend.is_mla and engine.config.is_mla
    got = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))]
    for prompt, tokens in zip(PROMPTS, got):
        want, margins = dense_greedy(engine.model, prompt, N_NEW)
        if engine.model.dtype == torch.float32:
            assert min(margins) > FLOAT32_MARGIN, f"reference near-tie: {margins}"
        else:
            k = next((i for i, m in enumerate(margins) if m < HALF_MARGIN), len(margins))
            want, tokens = want[:k], tokens[:k]
        assert tokens == want, f"{name} ({engine.model.dtype}) prompt {prompt}"


def test_mla_without_model_follows_the_backend() -> None:
    engine = LLMEngine.create(None, backend="TRITON_MLA",
                              engine_config=EngineConfig(max_model_len=32))
    assert engine.config.architecture == "deepseek_mla"


def test_deepseek_config_with_q_lora_and_no_weights(tmp_path: Path) -> None:
    """A DeepSeek-V2-style config.json (q_lora_rank set) with no weights: seeded
    random weights, served by an MLA backend, equal to the dense reference."""
    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "q_lora_rank": 48,
        "kv_lora_rank": 512, "qk_nope_head_dim": 16, "qk_rope_head_dim": 64,
        "v_head_dim": 16, "rope_theta": 10000.0, "eos_token_id": 1, "dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine.create(tmp_path, backend="TRITON_MLA",
                              engine_config=EngineConfig(max_model_len=64))
    assert engine.config.mla is not None and engine.config.mla.q_lora_rank == 48
    prompt = [5, 6, 7, 8]
    got = engine.generate([prompt], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]
    want, margins = dense_greedy(engine.model, prompt, N_NEW)
    assert engine.model.dtype == torch.float32 and min(margins) > FLOAT32_MARGIN, margins
    assert got.token_ids == want
