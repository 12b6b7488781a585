"""Decode steps through piecewise CUDA graphs (``gpu`` marker: needs CUDA).

Graph replays must give exactly the eager run's tokens, for several batch sizes
(so padded rows with ``-1`` slots occur), and match Hugging Face in float32.
"""

from __future__ import annotations

import pytest
import torch

from tests.runner.conftest import MAX_NEW, PROMPTS, HFCheckpoint
from vllm.runner import CPUMirrorConnector, EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu


def _engine(hf: HFCheckpoint, backend: str, eager: bool, dtype: str = "float32",
            **kw: object) -> LLMEngine:
    cfg = EngineConfig(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8,
                       enforce_eager=eager)
    return LLMEngine.create(hf.path, backend=backend, dtype=dtype, device="cuda",
                            engine_config=cfg, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["TORCH_REF", "TRITON_ATTN", "FLASH_ATTN"])
def test_graph_decode_equals_eager_and_hf(backend: str, hf_llama: HFCheckpoint) -> None:
    from vllm.attention.registry import get_backend

    b = get_backend(backend)
    dtype = "float32" if torch.float32 in b.supported_dtypes else "bfloat16"
    reasons = b.unsupported_reasons(dtype=getattr(torch, dtype), head_size=64, block_size=16,
                                    device=torch.device("cuda"))
    if reasons:
        pytest.skip(f"{backend}: " + "; ".join(reasons))
    graphs = _engine(hf_llama, backend, eager=False, dtype=dtype)
    eager = _engine(hf_llama, backend, eager=True, dtype=dtype)
    assert graphs.graphs is not None and graphs.graphs.sizes == [1, 2, 4, 8]
    for n in (1, 3, len(PROMPTS)):  # batch sizes 1, 3 (padded to 4), 4
        prompts = PROMPTS[:n]
        got = [o.token_ids for o in graphs.generate(prompts, SamplingParams(max_tokens=MAX_NEW))]
        want = [o.token_ids for o in eager.generate(prompts, SamplingParams(max_tokens=MAX_NEW))]
        assert got == want
        assert graphs.stats.num_graph_steps > 0 and eager.stats.num_graph_steps == 0
        if backend == "TORCH_REF":
            assert got == hf_llama.expected(prompts)
        else:  # Triton may use TF32 / 16-bit dots: equal up to the first near-tie
            want_hf = hf_llama.unambiguous(prompts, 0.05)
            assert [g[:len(w)] for g, w in zip(got, want_hf)] == want_hf


def test_graph_decode_keeps_connector_hook_eager(hf_llama: HFCheckpoint) -> None:
    mirror = CPUMirrorConnector()
    engine = _engine(hf_llama, "TORCH_REF", eager=False, kv_connector=mirror)
    engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))
    assert engine.stats.num_graph_steps > 0
    assert mirror.num_calls == engine.stats.num_steps * len(engine.model.attention_layers())


def test_close_releases_the_graphs_and_decodes_eagerly(hf_llama: HFCheckpoint) -> None:
    """``close()`` frees the captured graphs (what the CLI does before tearing down
    tensor parallelism); the engine then decodes eagerly (``stats`` are per
    ``generate`` call), with the same tokens."""
    engine = _engine(hf_llama, "TORCH_REF", eager=False)
    want = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))]
    assert engine.stats.num_graph_steps > 0
    engine.close()
    assert engine.graphs is None
    got = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW))]
    assert got == want and engine.stats.num_graph_steps == 0
    engine.close()  # a second close is a no-op
