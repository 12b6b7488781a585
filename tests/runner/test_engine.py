"""Engine internals: per-group metadata and slot mappings, sampling, stopping, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runner.conftest import MAX_NEW, PROMPTS, HFCheckpoint
from vllm.attention.errors import InvalidArgumentError, UnsupportedBackendError
from vllm.runner import CPUMirrorConnector, EngineConfig, FinishReason, LLMEngine, SamplingParams
from vllm.runner.cuda_graph import default_capture_sizes
from vllm.runner.sampler import top_p_filter

SMALL = EngineConfig(max_model_len=128, max_num_batched_tokens=16)


def test_metadata_built_once_per_group_and_slot_mapping_shared(hf_llama: HFCheckpoint) -> None:
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=SMALL)
    assert len(engine.kv.groups) == 1
    group = engine.kv.groups[0]
    assert group.layer_names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    builds = []
    real_build = group.builder.build

    def counting_build(common):  # type: ignore[no-untyped-def]
        builds.append(common.num_actual_tokens)
        return real_build(common)

    group.builder.build = counting_build  # type: ignore[method-assign]
    writes: list[tuple[str, int]] = []

    class Spy:
        def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
            assert slot_mapping.dtype == torch.int64
            writes.append((layer_name, id(slot_mapping)))

    engine.kv_connector = Spy()
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=3))
    assert len(builds) == engine.stats.num_steps  # once per step, not per layer
    per_step = [writes[i:i + 2] for i in range(0, len(writes), 2)]
    assert len(per_step) == engine.stats.num_steps
    for (n0, id0), (n1, id1) in per_step:
        assert (n0, n1) == tuple(group.layer_names) and id0 == id1  # one tensor per group


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(hf_llama: HFCheckpoint) -> None:
    def run(params: SamplingParams) -> list[list[int]]:
        engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=SMALL)
        return [o.token_ids for o in engine.generate(PROMPTS, params)]

    hot = SamplingParams(max_tokens=MAX_NEW, temperature=1.5, top_p=0.9, seed=7)
    first = run(hot)
    assert first == run(hot)
    assert first != hf_llama.expected(PROMPTS)
    assert run(SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=1e-6)) == \
        hf_llama.expected(PROMPTS)


def test_top_p_filter_keeps_the_smallest_sufficient_set() -> None:
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    assert top_p_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert top_p_filter(probs, 0.6).tolist() == pytest.approx([0.0, 0.5, 0.3, 0.0])
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_stop_on_eos_and_ignore_eos(hf_llama: HFCheckpoint) -> None:
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=SMALL)
    ref = hf_llama.expected(PROMPTS[:1])[0]
    engine.eos_token_ids = frozenset({ref[2]})
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_NEW))[0]
    assert out.token_ids == ref[:3] and out.finish_reason is FinishReason.STOP
    out = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.token_ids == ref and out.finish_reason is FinishReason.LENGTH


def test_clear_errors(hf_llama: HFCheckpoint, tmp_path: Path) -> None:
    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=SMALL)
    with pytest.raises(InvalidArgumentError, match=r"prompt token ids.*\[500\].*\[0, 128\)"):
        engine.add_request([1, 500], SamplingParams())
    with pytest.raises(InvalidArgumentError, match="prompt 0 length: got 200"):
        engine.add_request([3] * 200, SamplingParams())
    with pytest.raises(InvalidArgumentError, match="temperature: got -1"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidArgumentError, match="top_p: got 0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(UnsupportedBackendError, match="FLASHMLA cannot serve.*use_mla=False"):
        LLMEngine.create(hf_llama.path, backend="FLASHMLA")
    with pytest.raises(InvalidArgumentError, match="--model: got .*nowhere.*random-mla"):
        LLMEngine.create(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(InvalidArgumentError, match="architectures.*LlamaForCausalLM"):
        LLMEngine.create(tmp_path)


def test_config_without_weights_draws_seeded_ones(hf_llama: HFCheckpoint, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((hf_llama.path / "config.json").read_text())
    a = LLMEngine.create(tmp_path, backend="TORCH_REF", engine_config=SMALL)
    b = LLMEngine.create(tmp_path, backend="TORCH_REF", engine_config=SMALL)
    assert any("no weight files: weights drawn from seed 0" in n for n in a.notes)
    params = SamplingParams(max_tokens=4)
    assert [o.token_ids for o in a.generate(PROMPTS, params)] == \
        [o.token_ids for o in b.generate(PROMPTS, params)]


@pytest.mark.parametrize("backend", ["TORCH_REF", "ROCM_ATTN"])
def test_cpu_mirror_connector_holds_every_written_block(backend: str,
                                                        hf_llama: HFCheckpoint) -> None:
    """ROCM_ATTN's cache is (2, nb, ...): blocks are on axis 1, not 0."""
    mirror = CPUMirrorConnector()
    engine = LLMEngine.create(hf_llama.path, backend=backend, engine_config=SMALL,
                              kv_connector=mirror)
    engine.generate(PROMPTS, SamplingParams(max_tokens=4))
    layers = engine.model.attention_layers()
    assert mirror.num_calls == engine.stats.num_steps * len(layers)
    for layer in layers:
        written = mirror.written_blocks[layer.layer_name]
        assert written, layer.layer_name
        axis = 1 if backend == "ROCM_ATTN" else 0
        ids = torch.tensor(sorted(written))
        cache = layer.kv_cache
        got = mirror.mirrors[layer.layer_name]
        assert got.device.type == "cpu" and got.data_ptr() != cache.data_ptr()
        assert torch.equal(got.index_select(axis, ids), cache.index_select(axis, ids).cpu())
        untouched = [b for b in range(cache.shape[axis]) if b not in written]
        assert not got.index_select(axis, torch.tensor(untouched)).any()


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(16) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def test_null_block_is_never_allocated_and_stays_zero(hf_llama: HFCheckpoint) -> None:
    """vLLM's null block: block 0 is not handed to a request, and block-table padding
    points at zeros (a legacy backend may read it)."""
    from vllm.attention.conformance import null_block
    from vllm.runner.kv_cache import NULL_BLOCK

    engine = LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=SMALL)
    group = engine.kv.groups[0]
    seen: list[list[int]] = []

    class Spy:
        def on_kv_written(self, layer_name: str, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
            seen.append((slot_mapping[slot_mapping >= 0] // group.block_size).tolist())

    engine.kv_connector = Spy()
    engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    assert seen and all(NULL_BLOCK not in blocks for blocks in seen)
    for layer in engine.model.attention_layers():
        assert int(null_block(layer.backend, layer.kv_cache).count_nonzero()) == 0
    assert group.allocator.num_free == group.allocator.num_blocks  # all returned, none lost
