"""Every registered backend, plus the two adapted legacy examples, serving on CUDA
(the serving tests carry the ``gpu`` marker and skip without CUDA).

* standard backends: the tiny HF Llama, greedy tokens equal ``transformers``
  (computed on CPU in float32), eager, under CUDA graphs, and with chunked prefill
  (a 5-token budget); float32 where the backend takes it, else bfloat16 compared up
  to the reference's first near-tie; where a vendor kernel imports (flashinfer,
  flash-attn), the case fails unless that kernel ran;
* MLA backends: the random DeepSeek-style model, greedy tokens equal the float64
  dense recomputation of ``test_mla.py``;
* the adapted legacy examples (``module:Class``): equal ``transformers`` in float32.

A backend the runner's own capability check refuses on CUDA is skipped with its
``unsupported_reasons``; one whose vendor kernel is missing still runs its portable
path. Each case builds its own engine (nothing is shared between cases) and names
the compute path(s) that ran in its assertion message. With ``VLLM_GPU_REPORT_DIR``
set, every case appends one JSON line to ``gpu_every_backend.jsonl`` there, and the
module's end writes ``gpu_every_backend.txt`` (one line per case).

The helpers take the device, so ``test_helpers_on_cpu`` runs the same code on CPU.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from shim import LegacyBackendWarning
from tests.runner.conftest import MAX_NEW, PROMPTS, HFCheckpoint, spy_step_tokens
from tests.runner.test_mla import N_NEW, dense_greedy
from tests.runner.test_mla import PROMPTS as MLA_PROMPTS
from vllm.attention.errors import PluginLoadError
from vllm.attention.registry import get_backend, list_backends
from vllm.runner import EngineConfig, LLMEngine, SamplingParams
from vllm.runner.backend_choice import (
    AnyBackend,
    _reasons,
    pick_block_size,
    resolve_backend_name,
    resolve_dtype,
)
from vllm.runner.config import ModelConfig, load_config, random_mla_config

GREEDY = SamplingParams(max_tokens=MAX_NEW)
HALF_MARGIN = 0.05
"""Logit margin a 16-bit run of the tiny model is trusted to resolve (as test_hf_equality)."""
FUSED = "tests.legacy_backends.fused:FusedLegacyBackend"
FLAGGED = "tests.legacy_backends.flagged:FlaggedLegacyBackend"
REPORT_ENV = "VLLM_GPU_REPORT_DIR"
REPORT_JSONL = "gpu_every_backend.jsonl"


def _variant(name: str) -> EngineConfig:
    """A fresh config per case (EngineConfig is frozen; nothing is shared anyway)."""
    if name == "eager":
        return EngineConfig(max_model_len=128, max_num_batched_tokens=64, enforce_eager=True)
    if name == "graphs":  # the default engine config: CUDA graphs for decode on CUDA
        return EngineConfig(max_model_len=128)
    if name == "chunked":  # the 37-token prompt in 8 chunks; graphs stay on
        return EngineConfig(max_model_len=128, max_num_batched_tokens=5)
    raise ValueError(name)


VARIANTS = ("eager", "graphs", "chunked")
CHUNK_BUDGET = 5


def _load(name: str) -> AnyBackend | str:
    try:
        return get_backend(name)
    except PluginLoadError as exc:
        return f"{name} does not load: {exc}"


def _is_mla(name: str) -> bool:
    b = _load(name)
    return not isinstance(b, str) and b.is_mla


STANDARD = [n for n in list_backends() if not _is_mla(n)]
"""Non-MLA registered backends (a plugin that fails to load lands here and skips)."""
MLA = [n for n in list_backends() if _is_mla(n)]


# -- report ----------------------------------------------------------------------------
@dataclass
class Row:
    """What one case did; written as one JSON line when ``VLLM_GPU_REPORT_DIR`` is set."""

    backend: str
    kind: str
    variant: str
    device: str
    dtype: str = ""
    declared_path: str = ""
    paths: str = ""
    cuda_graphs: str = ""
    compared_tokens: int = 0
    result: str = ""


def _report_dir() -> Path | None:
    d = os.environ.get(REPORT_ENV)
    return Path(d) if d else None


@contextmanager
def _reported(row: Row) -> Iterator[Row]:
    """Fill ``row.result`` from how the block ends (pass, skip or failure) and write it."""
    try:
        yield row
        row.result = "pass"
    except pytest.skip.Exception as exc:
        row.result = f"skip: {exc.msg}"
        raise
    except BaseException as exc:
        row.result = f"FAIL: {type(exc).__name__}: {str(exc)[:800]}"
        raise
    finally:
        d = _report_dir()
        if d is not None:
            d.mkdir(parents=True, exist_ok=True)
            with open(d / REPORT_JSONL, "a") as f:
                f.write(json.dumps(row.__dict__) + "\n")


@pytest.fixture(scope="module", autouse=True)
def report_file() -> Iterator[None]:
    """Start the JSON-lines report afresh; at the module's end, a one-line-per-case text."""
    d = _report_dir()
    if d is not None and (d / REPORT_JSONL).exists():
        (d / REPORT_JSONL).unlink()
    yield
    if d is None or not (d / REPORT_JSONL).exists():
        return
    rows = [json.loads(line) for line in (d / REPORT_JSONL).read_text().splitlines() if line]
    lines = [f"{r['backend']:<28} {r['kind']:<8} {r['variant']:<8} {r['device']:<5} "
             f"{r['dtype']:<9} path={r['paths'] or '-':<24} graphs={r['cuda_graphs'] or '-':<14} "
             + " ".join(r["result"].split())[:300] for r in rows]
    counts = {k: sum(r["result"].startswith(k) for r in rows) for k in ("pass", "skip", "FAIL")}
    lines.append(f"# {len(rows)} cases: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    (d / "gpu_every_backend.txt").write_text("\n".join(lines) + "\n")


# -- shared steps ------------------------------------------------------------------------
def _dtype_for(backend: AnyBackend) -> str:
    """float32 when the backend takes it, else bfloat16."""
    return "float32" if torch.float32 in backend.supported_dtypes else "bfloat16"


def _why_not(backend: AnyBackend, config: ModelConfig, dtype: str,
             device: torch.device) -> str | None:
    """The runner's own capability check (``backend_choice``): why ``backend`` cannot
    serve ``config`` on ``device`` in ``dtype`` (None: it can)."""
    dt = resolve_dtype(dtype, config, backend, device)
    reasons = _reasons(backend, config, dt, pick_block_size(backend), "auto", device)
    if not reasons:
        return None
    notes = backend.compute_path_notes(device)
    return (f"{backend.name} cannot run on {device.type} ({dtype}): " + "; ".join(reasons)
            + (f" [paths: {'; '.join(notes)}]" if notes else ""))


def _admit(row: Row, name: str, config: ModelConfig, device: torch.device) -> AnyBackend:
    """Load ``name``, record its dtype and declared path in ``row``, and skip (with the
    reason) where it does not load or the runner cannot serve ``config`` with it."""
    backend = _load(name)
    if isinstance(backend, str):
        pytest.skip(backend)
    row.dtype = _dtype_for(backend)
    row.declared_path = str(backend.compute_path(device))
    why = _why_not(backend, config, row.dtype, device)
    if why is not None:
        pytest.skip(why)
    return backend


def _path_recorder(engine: LLMEngine, seen: list[str]) -> Callable[[int, int, int], None]:
    """An ``on_step`` callback appending the compute path(s) each layer's impl says it
    ran (standard: ``last_compute_path``; MLA: ``last_path``); legacy impls say none."""
    def on_step(done: int, total: int, generated: int) -> None:
        for layer in engine.model.attention_layers():
            impl: Any = layer.impl
            path = getattr(impl, "last_compute_path", None) or getattr(impl, "last_path", None)
            for part in str(path).split("+") if path is not None else ():
                if part not in seen:  # MLA joins decode and prefill paths with "+"
                    seen.append(part)
    return on_step


def _serve(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
           row: Row) -> list[list[int]]:
    seen: list[str] = []
    outs = engine.generate(prompts, params, on_step=_path_recorder(engine, seen))
    assert [o.prompt_token_ids for o in outs] == prompts
    row.paths = "+".join(seen) if seen else "not recorded"
    row.cuda_graphs = (f"{engine.describe()['cuda_graphs']} steps={engine.stats.num_graph_steps}"
                       if engine.graphs is not None else "")
    return [o.token_ids for o in outs]


def _compare_hf(got: list[list[int]], hf: HFCheckpoint, dtype: str, what: str) -> int:
    """Equal in float32; in 16 bits equal up to the reference's first near-tie.
    Returns how many tokens were compared."""
    if dtype == "float32":
        want = hf.expected(PROMPTS)
        assert got == want, (f"{what} diverged from transformers (float32): got {got}, "
                             f"want {want} (reference min margin {hf.min_margin:.3g})")
        return sum(map(len, want))
    want = hf.unambiguous(PROMPTS, HALF_MARGIN)
    assert sum(map(len, want)) >= len(PROMPTS) * MAX_NEW // 2, "reference too ambiguous"
    cut = [g[:len(w)] for g, w in zip(got, want)]
    assert cut == want, (f"{what} diverged from transformers before any reference logit "
                         f"margin fell below {HALF_MARGIN}: got {cut}, want {want}")
    return sum(map(len, want))


# -- the three kinds, each for any device --------------------------------------------------
def check_standard(name: str, hf: HFCheckpoint, device: torch.device, variant: str) -> Row:
    """Serve the tiny Llama through ``name`` on ``device`` and compare with HF."""
    row = Row(name, "standard", variant, device.type)
    with _reported(row):
        backend = _admit(row, name, load_config(hf.path), device)
        engine = LLMEngine.create(hf.path, backend=name, dtype=row.dtype, device=device,
                                  engine_config=_variant(variant))
        steps = spy_step_tokens(engine)
        got = _serve(engine, PROMPTS, GREEDY, row)
        what = (f"{name} [{variant}] on {device.type} ({row.dtype}, path ran: {row.paths}, "
                f"declared: {row.declared_path}; {engine.describe()})")
        row.compared_tokens = _compare_hf(got, hf, row.dtype, what)
        vendor = {k.name for k in getattr(backend, "vendor_kernels", ())}
        if row.declared_path in vendor:  # a vendor kernel imports here: it served the tokens
            assert row.declared_path in row.paths.split("+"), f"{what}: the vendor path never ran"
        if variant == "chunked":
            assert max(steps) <= CHUNK_BUDGET, f"{what}: a step of {max(steps)} tokens"
        uses_graphs = device.type == "cuda" and variant != "eager"
        assert (engine.graphs is not None) == uses_graphs, what
        if variant == "graphs" and uses_graphs:
            assert engine.stats.num_graph_steps > 0, f"{what}: no decode step replayed a graph"
        if variant == "eager":
            assert engine.stats.num_graph_steps == 0, what
    return row


def check_mla(name: str, device: torch.device) -> Row:
    """Serve ``random-mla`` through ``name`` on ``device``; compare with the float64
    dense recomputation (computed on CPU from the served weights)."""
    row = Row(name, "mla", "default", device.type)
    with _reported(row):
        _admit(row, name, random_mla_config(), device)
        engine = LLMEngine.create(
            "random-mla", backend=name, dtype=row.dtype, device=device,
            engine_config=EngineConfig(max_model_len=64, max_num_batched_tokens=8),
        )
        assert engine.config.is_mla
        params = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
        got = _serve(engine, MLA_PROMPTS, params, row)
        what = (f"{name} on {device.type} ({row.dtype}, path ran: {row.paths}, "
                f"declared: {row.declared_path}; {engine.describe()})")
        compared: list[tuple[list[int], list[int]]] = []
        for prompt, tokens in zip(MLA_PROMPTS, got):
            want, margins = dense_greedy(engine.model, prompt, N_NEW)
            if row.dtype != "float32":
                k = next((i for i, m in enumerate(margins) if m < HALF_MARGIN), len(margins))
                want, tokens = want[:k], tokens[:k]
            compared.append((tokens, want))
        row.compared_tokens = sum(len(w) for _, w in compared)
        assert row.compared_tokens >= len(MLA_PROMPTS) * N_NEW // 3, "reference too ambiguous"
        assert all(t == w for t, w in compared), (
            f"{what} diverged from the float64 dense recomputation: "
            f"got {[t for t, _ in compared]}, want {[w for _, w in compared]}")
    return row


def check_legacy(target: str, hf: HFCheckpoint, device: torch.device, variant: str) -> Row:
    """Serve the tiny Llama through an adapted legacy ``module:Class`` in float32."""
    row = Row(target.rsplit(":", 1)[-1], "legacy", variant, device.type, dtype="float32")
    with _reported(row), warnings.catch_warnings():
        # the shim warns once per class per process; which test sees it is test_cli's concern
        warnings.simplefilter("ignore", LegacyBackendWarning)
        backend = resolve_backend_name(target).backend
        assert backend.migration == "adapted"
        row.backend = backend.name
        row.declared_path = str(backend.compute_path(device))
        why = _why_not(backend, load_config(hf.path), "float32", device)
        if why is not None:
            pytest.skip(why)
        engine = LLMEngine.create(hf.path, backend=target, dtype="float32", device=device,
                                  engine_config=_variant(variant))
        got = _serve(engine, PROMPTS, GREEDY, row)
        what = f"{target} [{variant}] on {device.type} (float32; {engine.describe()})"
        row.compared_tokens = _compare_hf(got, hf, "float32", what)
        assert engine.deprecations, what
    return row


@pytest.fixture
def isolated_legacy_warnings() -> Iterator[None]:
    """Forget which legacy backends warned, before and after (other modules count them)."""
    from shim.warnings import _reset_for_tests

    _reset_for_tests()
    yield
    _reset_for_tests()


# -- on CUDA (gpu marker) ------------------------------------------------------------------
CUDA = torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", STANDARD)
def test_standard_backend_on_cuda_equals_hf(name: str, variant: str,
                                            hf_llama: HFCheckpoint) -> None:
    check_standard(name, hf_llama, CUDA, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("name", MLA)
def test_mla_backend_on_cuda_equals_dense(name: str) -> None:
    check_mla(name, CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["eager", "graphs"])
@pytest.mark.parametrize("target", [FUSED, FLAGGED])
@pytest.mark.usefixtures("isolated_legacy_warnings")
def test_legacy_backend_on_cuda_equals_hf(target: str, variant: str,
                                          hf_llama: HFCheckpoint) -> None:
    check_legacy(target, hf_llama, CUDA, variant)


def test_every_registered_backend_has_a_gpu_case() -> None:
    assert sorted(STANDARD + MLA) == sorted(list_backends())


# -- the same helpers on CPU (not gpu-marked: they run in CI) --------------------------------
CPU = torch.device("cpu")


@pytest.mark.parametrize("case", [
    "standard:TORCH_REF:eager", "standard:TRITON_ATTN:eager", "standard:TRITON_ATTN:chunked",
    "mla:TRITON_MLA:default", "legacy:FUSED:eager",
])
@pytest.mark.usefixtures("isolated_legacy_warnings")
def test_helpers_on_cpu(case: str, hf_llama: HFCheckpoint) -> None:
    kind, name, variant = case.split(":")
    if kind == "standard":
        row = check_standard(name, hf_llama, CPU, variant)
        # TORCH_REF's impl is not a StandardImpl: it records no path
        assert row.dtype == "float32" and row.declared_path == "torch"
        assert row.paths == ("not recorded" if name == "TORCH_REF" else "torch")
        assert row.compared_tokens == sum(map(len, hf_llama.expected(PROMPTS)))
    elif kind == "mla":
        row = check_mla(name, CPU)
        assert row.dtype == "float32" and row.paths.startswith("torch")
        assert row.compared_tokens == len(MLA_PROMPTS) * N_NEW
    else:
        row = check_legacy(FUSED, hf_llama, CPU, variant)
        assert row.backend == "EXAMPLE_LEGACY_FUSED" and row.paths == "not recorded"
        assert row.declared_path == "torch"
    assert row.result == "pass" and row.declared_path
