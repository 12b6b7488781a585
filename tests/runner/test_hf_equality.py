"""Greedy tokens of the runner equal Hugging Face ``transformers`` greedy generation,
for every registered backend that can run here, with chunked prefill, padding,
several concurrent requests, preemption, and the config variants we parse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runner.conftest import (
    MAX_NEW,
    PROMPTS,
    HFCheckpoint,
    build_checkpoint,
    spy_step_tokens,
)
from vllm.attention.errors import PluginLoadError
from vllm.attention.registry import get_backend, list_backends
from vllm.runner import EngineConfig, LLMEngine, SamplingParams
from vllm.runner.backend_choice import pick_block_size, resolve_dtype
from vllm.runner.config import load_config

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=MAX_NEW)
HALF_MARGIN = 0.05
"""Logit margin a 16-bit run of the tiny model is trusted to resolve."""
SMALL = EngineConfig(max_model_len=128, max_num_batched_tokens=64)


def _why_not(name: str, ckpt: HFCheckpoint) -> str | None:
    """Why ``name`` cannot serve the tiny Llama on this CPU (None: it can)."""
    try:
        backend = get_backend(name)
    except PluginLoadError as exc:
        return f"{name} does not load: {exc}"
    config = load_config(ckpt.path)
    if backend.is_mla:
        return f"{name} is an MLA backend (served in test_mla.py)"
    if backend.migration == "adapted":
        return f"{name} is an adapted legacy backend (served in test_cli.py)"
    from vllm.runner.backend_choice import _reasons

    dtype = resolve_dtype("auto", config, backend, CPU)
    reasons = _reasons(backend, config, dtype, pick_block_size(backend), "auto", CPU)
    return f"{name} cannot run here: " + "; ".join(reasons) if reasons else None


@pytest.mark.parametrize("name", list_backends())
def test_greedy_equals_hf_for_every_backend(name: str, hf_llama: HFCheckpoint) -> None:
    why = _why_not(name, hf_llama)
    if why is not None:
        pytest.skip(why)
    engine = LLMEngine.create(hf_llama.path, backend=name, engine_config=SMALL)
    outs = engine.generate(PROMPTS, GREEDY)
    got = [o.token_ids for o in outs]
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    if engine.model.dtype == torch.float32:
        assert got == hf_llama.expected(PROMPTS), f"{name} (float32) diverged from transformers"
        return
    # A backend that runs only 16-bit: equal up to the reference's first near-tie.
    want = hf_llama.unambiguous(PROMPTS, HALF_MARGIN)
    assert sum(map(len, want)) >= len(PROMPTS) * MAX_NEW // 2, "reference too ambiguous"
    assert [g[:len(w)] for g, w in zip(got, want)] == want, (
        f"{name} ({engine.describe()['dtype']}) diverged from transformers before any "
        f"reference logit margin fell below {HALF_MARGIN}"
    )


def test_chunked_prefill_equals_hf(hf_llama: HFCheckpoint) -> None:
    """A 5-token budget: the 37-token prompt is prefilled in 8 chunks, interleaved
    with the other requests' decode steps."""
    cfg = EngineConfig(max_model_len=128, max_num_batched_tokens=5)
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=cfg)
    steps = spy_step_tokens(engine)
    got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert got == hf_llama.expected(PROMPTS)
    assert max(steps) <= 5


def test_concurrent_requests_with_queueing_and_late_arrivals(hf_llama: HFCheckpoint) -> None:
    """Two sequences at a time, a fifth request arriving mid-run."""
    cfg = EngineConfig(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2)
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=cfg)
    reqs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    late = None
    for i in range(200):
        if not engine.has_unfinished:
            break
        engine.step()
        assert len(engine.scheduler.running) <= 2
        if i == 3:
            late = engine.add_request(PROMPTS[1], GREEDY)
    assert late is not None and late.finished
    assert [r.output_token_ids for r in reqs] == hf_llama.expected(PROMPTS)
    assert late.output_token_ids == hf_llama.expected([PROMPTS[1]])[0]


def test_preemption_recomputes_and_still_equals_hf(hf_llama: HFCheckpoint) -> None:
    """Seven 4-slot blocks for requests that end up needing eleven."""
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    cfg = EngineConfig(max_model_len=64, max_num_batched_tokens=64, num_kv_blocks=7)
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=cfg,
                              block_size=4)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert engine.stats.num_preemptions > 0
    assert got == hf_llama.expected(prompts)


def test_padded_rows_get_minus_one_slots_and_change_nothing(hf_llama: HFCheckpoint) -> None:
    cfg = EngineConfig(max_model_len=128, max_num_batched_tokens=16, pad_tokens_to_multiple=8)
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=cfg)
    seen: list[torch.Tensor] = []

    class Spy:
        def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
            seen.append(slot_mapping.clone())

    engine.kv_connector = Spy()
    got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert got == hf_llama.expected(PROMPTS)
    assert all(s.shape[0] % 8 == 0 for s in seen)
    assert any(bool((s == -1).any()) for s in seen)


@pytest.mark.parametrize("variant", ["llama3_rope_tied_bias", "linear_rope_mha"])
def test_config_variants_equal_hf(variant: str, tmp_path: Path) -> None:
    overrides: dict[str, object] = (
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
             tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
        if variant == "llama3_rope_tied_bias"
        else dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, num_key_value_heads=4,
                  head_dim=16, rope_theta=500.0)
    )
    ckpt = build_checkpoint(tmp_path, with_tokenizer=False, **overrides)
    engine = LLMEngine.create(ckpt.path, backend="TORCH_REF", engine_config=SMALL)
    got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert got == ckpt.expected(PROMPTS)
