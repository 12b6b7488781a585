"""The engine: model + KV caches + scheduler + sampler, one step at a time.

Per step: the scheduler picks chunks; the engine builds, once per KV-cache group,
the :class:`~vllm.attention.backend.CommonAttentionMetadata`, the backend's
metadata (``builder.build``) and the int64 slot mapping (``-1`` for padded rows),
puts them in the ForwardContext keyed by layer name, runs the model (eagerly, or
decode through piecewise CUDA graphs), samples on rank 0 and broadcasts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm.attention.backend import (
    AttentionMetadata,
    CommonAttentionMetadata,
    allocate_kv_cache,
    num_blocks_of,
)
from vllm.attention.errors import InvalidArgumentError
from vllm.attention.types import cache_storage_dtype, parse_kv_cache_dtype
from vllm.forward_context import KVConnector, set_forward_context
from vllm.runner.attention_block import cache_head_size
from vllm.runner.backend_choice import BackendChoice, choose_backend, resolve_backend_name
from vllm.runner.config import ModelConfig, load_config, random_llama_config, random_mla_config
from vllm.runner.connector import RegisteredKVCache, RegistersKVCaches
from vllm.runner.cuda_graph import PiecewiseCUDAGraphs, default_capture_sizes
from vllm.runner.kv_cache import BlockAllocator, KVCacheGroup, KVCacheManager, KVCacheSpec
from vllm.runner.model import DecoderModel
from vllm.runner.parallel import ParallelState
from vllm.runner.request import Request, RequestOutput, SamplingParams
from vllm.runner.sampler import sample
from vllm.runner.scheduler import Scheduler, SchedulerOutput
from vllm.runner.tokenizer import TextTokenizer, load_tokenizer
from vllm.runner.weights import CheckpointFiles, checkpoint_files, init_random, load_checkpoint

SPARSE_TOPK = 2048
"""Positions the sparse-MLA stand-in indexer selects per token (DeepSeek-V3.2's top-k)."""

RANDOM_MODELS = ("random", "random-mla")
"""``--model`` keywords: the seeded random Llama, or the DeepSeek-style MLA model."""


@dataclass(frozen=True)
class EngineConfig:
    """Serving limits. ``None`` fields are derived (see ``docs/runner.md``)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    """The per-step token budget; prompts longer than what is left are chunked."""
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    chunked_prefill: bool = True
    enforce_eager: bool = False
    """No CUDA graphs (they are only ever used on CUDA)."""
    cuda_graph_sizes: tuple[int, ...] | None = None
    pad_tokens_to_multiple: int = 1
    """Pad every eager step to a multiple of this many tokens (slots ``-1``)."""
    seed: int = 0
    """Seeds sampling of requests that bring no seed of their own."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "pad_tokens_to_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(name, value, "a positive int")
        for name in ("max_model_len", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise InvalidArgumentError(name, value, "None or a positive int")


@dataclass
class RunStats:
    """What one :meth:`LLMEngine.generate` call did."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_graph_steps: int = 0
    num_preemptions: int = 0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of stepping (model build excluded)."""
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class _StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    num_tokens: int
    padded_tokens: int
    attn_metadata: dict[str, AttentionMetadata]
    slot_mappings: dict[str, torch.Tensor]
    """Built here, handed to the ForwardContext; no metadata holds it."""
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Request] = field(default_factory=list)
    graph: bool = False


def _resolve_model(model: str | Path | None, mla_backend: bool = False
                   ) -> tuple[ModelConfig, Path | None, CheckpointFiles | None]:
    """(config, checkpoint dir or None, its weight files or None)."""
    if model is None and mla_backend:
        return random_mla_config(), None, None
    if model is None or str(model) == "random":
        return random_llama_config(), None, None
    if str(model) == "random-mla":
        return random_mla_config(), None, None
    path = Path(model)
    if not path.is_dir():
        raise InvalidArgumentError(
            "--model", str(model),
            "a checkpoint directory (config.json + *.safetensors or pytorch_model*.bin) "
            "or one of " + ", ".join(RANDOM_MODELS),
        )
    config = load_config(path)
    return config, path, checkpoint_files(path)


class LLMEngine:
    """Serves token ids; build it with :meth:`create`."""

    def __init__(self, model: DecoderModel, choice: BackendChoice, *, config: ModelConfig,
                 engine_config: EngineConfig, parallel: ParallelState, device: torch.device,
                 kv_connector: KVConnector | None = None,
                 tokenizer: TextTokenizer | None = None, notes: Sequence[str] = (),
                 no_tokenizer: str | None = None) -> None:
        self.model = model
        self.choice = choice
        self.config = config
        self.engine_config = engine_config
        self.parallel = parallel
        self.device = device
        self.kv_connector = kv_connector
        self.tokenizer = tokenizer
        self.no_tokenizer = no_tokenizer
        """Why :attr:`tokenizer` is None (for the error a text prompt gets)."""
        self.notes = list(notes) + ([choice.note] if choice.note else [])
        self.max_model_len = min(engine_config.max_model_len or 4096,
                                 config.max_position_embeddings)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.kv = KVCacheManager(self._allocate_caches())
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=engine_config.max_num_batched_tokens,
            max_model_len=self.max_model_len, chunked_prefill=engine_config.chunked_prefill,
        )
        self.graphs: PiecewiseCUDAGraphs | None = None
        if device.type == "cuda" and not engine_config.enforce_eager:
            sizes = engine_config.cuda_graph_sizes or tuple(
                default_capture_sizes(engine_config.max_num_seqs))
            self.graphs = PiecewiseCUDAGraphs(model, sizes)
            self.graphs.capture()
        self._next_id = 0
        self.stats = RunStats()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, model: str | Path | None = None, *, backend: str | None = None,
               dtype: str = "auto", device: str | torch.device = "cpu",
               engine_config: EngineConfig | None = None, kv_cache_dtype: str = "auto",
               block_size: int | None = None, strict_backends: bool = False,
               parallel: ParallelState | None = None, model_seed: int = 0,
               kv_connector: KVConnector | None = None) -> LLMEngine:
        """Load (or draw) the model, choose the backend, allocate caches.

        ``model``: a checkpoint directory (``config.json`` plus ``*.safetensors`` or
        ``pytorch_model*.bin``; a directory with no weight files at all has them
        drawn from ``model_seed``, one in a format not read here is an error), ``"random"`` for the
        small random Llama, ``"random-mla"`` for the MLA one; ``None`` is the
        random MLA model for an MLA ``backend``, else the random Llama.
        """
        par = parallel or ParallelState()
        dev = torch.device(device)
        ecfg = engine_config or EngineConfig()
        kv_dtype = parse_kv_cache_dtype(kv_cache_dtype, argument="kv_cache_dtype")
        named = resolve_backend_name(backend) if backend is not None else None
        config, path, weights = _resolve_model(
            model, mla_backend=named is not None and named.backend.is_mla)
        choice = choose_backend(named, config, dtype=dtype, device=dev, block_size=block_size,
                                kv_cache_dtype=kv_dtype, strict=strict_backends,
                                show_warnings=par.is_driver)
        notes: list[str] = []
        with torch.inference_mode(False), torch.no_grad():
            net = DecoderModel(config, backend=choice.backend, kv_cache_dtype=kv_dtype,
                               parallel=par, dtype=choice.dtype, device=dev)
            if weights is not None:
                load_checkpoint(net, weights, par)
            else:
                init_random(net, par, model_seed)
                if path is not None:
                    notes.append(f"{path} holds config.json and no weight files: weights "
                                 f"drawn from seed {model_seed}")
            net.finalize()
        net.eval()
        tokenizer, no_tokenizer = load_tokenizer(path)
        if path is None:
            notes.append(f"the seeded random {config.architecture} model: its weights are "
                         "random, so its text is noise; --model DIR serves a checkpoint")
        return cls(net, choice, config=config, engine_config=ecfg, parallel=par, device=dev,
                   kv_connector=kv_connector, tokenizer=tokenizer, notes=notes,
                   no_tokenizer=no_tokenizer)

    def _cache_bytes_per_block(self) -> int:
        total = 0
        for layer in self.model.attention_layers():
            spec = layer.spec
            shape = layer.backend.get_kv_cache_shape(
                1, self.choice.block_size, spec.num_kv_heads,
                cache_head_size(layer.backend, spec.head_size, spec.v_head_size),
                spec.kv_cache_dtype)
            dtype = cache_storage_dtype(spec.kv_cache_dtype, self.model.dtype)
            total += math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        return max(total, 1)

    def _num_blocks(self) -> int:
        ecfg, bs = self.engine_config, self.choice.block_size
        if ecfg.num_kv_blocks is not None:
            return ecfg.num_kv_blocks
        wanted = ecfg.max_num_seqs * -(-self.max_model_len // bs)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            wanted = min(wanted, max(int(0.5 * free) // self._cache_bytes_per_block(), 1))
        # every rank must agree on the block count, or their schedules diverge
        if not self.parallel.all_equal(wanted):
            raise InvalidArgumentError("num_kv_blocks", wanted,
                                       "the same value on every rank (pass num_kv_blocks)")
        return wanted

    def _allocate_caches(self) -> list[KVCacheGroup]:
        num_blocks = self._num_blocks()
        bs = self.choice.block_size
        groups: dict[KVCacheSpec, KVCacheGroup] = {}
        registered: dict[str, RegisteredKVCache] = {}
        for layer in self.model.attention_layers():
            spec = layer.spec
            head_size = cache_head_size(layer.backend, spec.head_size, spec.v_head_size)
            key = KVCacheSpec(layer.backend, bs, spec.num_kv_heads, head_size,
                              spec.kv_cache_dtype)
            group = groups.get(key)
            if group is None:
                builder = layer.backend.get_builder_cls()(spec, self.device)
                group = KVCacheGroup(len(groups), key, [], builder, BlockAllocator(num_blocks))
                groups[key] = group
            group.layer_names.append(layer.layer_name)
            cache = allocate_kv_cache(  # the usable blocks and the null block
                layer.backend, num_blocks=num_blocks + 1, block_size=bs,
                num_kv_heads=spec.num_kv_heads, head_size=head_size,
                cache_dtype=spec.kv_cache_dtype, model_dtype=self.model.dtype,
                device=self.device,
            )
            cache.zero_()
            layer.bind_kv_cache(cache, bs)
            probe = layer.backend.get_kv_cache_shape(7919, 16, 1, 8)
            registered[layer.layer_name] = RegisteredKVCache(
                cache, bs, probe.index(7919) if 7919 in probe else 0, layer.backend.name)
            if num_blocks_of(layer.backend, cache) != num_blocks + 1:
                raise InvalidArgumentError(f"{layer.layer_name} kv_cache", tuple(cache.shape),
                                           f"{num_blocks + 1} blocks")
        if isinstance(self.kv_connector, RegistersKVCaches):
            self.kv_connector.register_kv_caches(registered)
        return list(groups.values())

    # -- requests -----------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Request:
        ids = [int(t) for t in prompt_token_ids]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InvalidArgumentError("prompt token ids", bad[:5],
                                       f"ids in [0, {self.config.vocab_size})")
        req = Request(self._next_id, ids, params)
        self._next_id += 1
        if not params.greedy:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed if params.seed is not None
                                      else self.engine_config.seed + req.req_id)
        self.scheduler.add(req)
        return req

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step -----------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if not out.chunks:
            if out.preempted:
                return []
            raise InvalidArgumentError(
                "KV cache", f"{self.kv.groups[0].allocator.num_free} free blocks",
                "room for at least one waiting request (raise num_kv_blocks)",
            )
        with torch.inference_mode():
            batch = self._prepare(out)
            with set_forward_context(attn_metadata=batch.attn_metadata,
                                     slot_mapping=batch.slot_mappings,
                                     num_tokens=batch.padded_tokens,
                                     kv_connector=self.kv_connector):
                if batch.graph and self.graphs is not None:
                    hidden = self.graphs.run(batch.input_ids, batch.positions)
                else:
                    hidden = self.model(batch.input_ids, batch.positions)
            tokens = self._sample(hidden, batch)
        self.stats.num_steps += 1
        self.stats.num_graph_steps += int(batch.graph)
        self.stats.num_generated_tokens += len(tokens)
        sampled = {r.req_id: t for r, t in zip(batch.sample_requests, tokens)}
        return self.scheduler.update(out, sampled, self.eos_token_ids)

    def _padded(self, n: int, decode_only: bool) -> tuple[int, bool]:
        if decode_only and self.graphs is not None:
            size = self.graphs.size_for(n)
            if size is not None:
                return size, True
        m = self.engine_config.pad_tokens_to_multiple
        return -(-n // m) * m, False

    def _prepare(self, out: SchedulerOutput) -> _StepBatch:
        ids: list[int] = []
        pos: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for c in out.chunks:
            stop = c.start + c.num_new_tokens
            ids.extend(c.request.token_ids(c.start, stop))
            pos.extend(range(c.start, stop))
            qsl.append(qsl[-1] + c.num_new_tokens)
            seq_lens.append(stop)
            if c.samples:
                sample_rows.append(qsl[-1] - 1)
                sample_reqs.append(c.request)
        n = len(ids)
        padded, graph = self._padded(n, out.is_decode_only)
        pad = padded - n
        dev = self.device
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        qsl_dev, seq_dev = qsl_cpu.to(dev), seq_cpu.to(dev)
        req_ids = [c.request.req_id for c in out.chunks]
        attn_metadata: dict[str, AttentionMetadata] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for group in self.kv.groups:
            table, _ = self.kv.block_table(group, req_ids, dev)
            common = CommonAttentionMetadata(
                query_start_loc=qsl_dev, seq_lens=seq_dev, block_table=table,
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu, num_reqs=len(out.chunks),
                num_actual_tokens=n, max_query_len=max(c.num_new_tokens for c in out.chunks),
                max_seq_len=max(seq_lens), block_size=group.block_size, causal=True,
            )
            meta = group.builder.build(common)  # once per group, shared by its layers
            if group.spec.backend.is_sparse:
                meta = self._attach_topk(meta, pos, seq_lens, out)
            slots: list[int] = []
            for c in out.chunks:
                slots.extend(group.slots(c.request.req_id, c.start, c.start + c.num_new_tokens))
            slot_t = torch.tensor(slots + [-1] * pad, dtype=torch.int64).to(dev)
            for name in group.layer_names:
                attn_metadata[name] = meta
                slot_mapping[name] = slot_t
        return _StepBatch(
            input_ids=torch.tensor(ids + [0] * pad, dtype=torch.int64).to(dev),
            positions=torch.tensor(pos + [0] * pad, dtype=torch.int64).to(dev),
            num_tokens=n, padded_tokens=padded, attn_metadata=attn_metadata,
            slot_mappings=slot_mapping, sample_rows=sample_rows, sample_requests=sample_reqs,
            graph=graph,
        )

    def _attach_topk(self, meta: AttentionMetadata, positions: list[int], seq_lens: list[int],
                     out: SchedulerOutput) -> AttentionMetadata:
        """Sparse MLA needs an indexer's top-k positions per token. The runner's
        stand-in selects each token's last ``SPARSE_TOPK`` positions (all of them
        for shorter sequences, which makes sparse attention exactly dense)."""
        from vllm.attention.backends.mla.common import MLASparseMetadata

        if not isinstance(meta, MLASparseMetadata):
            raise InvalidArgumentError("sparse backend metadata", type(meta).__name__,
                                       "MLASparseMetadata")
        k = min(SPARSE_TOPK, max(seq_lens))
        pos = torch.tensor(positions, dtype=torch.int64).unsqueeze(1)
        idx = pos - k + 1 + torch.arange(k, dtype=torch.int64).unsqueeze(0)
        idx = idx.masked_fill(idx < 0, -1).to(torch.int32).to(self.device)
        return meta.with_topk_indices(idx)

    def _sample(self, hidden: torch.Tensor, batch: _StepBatch) -> list[int]:
        if not batch.sample_rows:
            return []
        rows = torch.tensor(batch.sample_rows, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        if self.parallel.is_driver:
            tokens = sample(logits, batch.sample_requests)
        else:
            tokens = [0] * len(batch.sample_rows)
        if self.parallel.world_size > 1:
            t = torch.tensor(tokens, dtype=torch.int64, device=self._collective_device())
            tokens = [int(x) for x in self.parallel.broadcast(t).tolist()]
        return tokens

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # -- whole runs ---------------------------------------------------------------------
    def close(self) -> None:
        """Release the captured CUDA graphs (see :meth:`PiecewiseCUDAGraphs.release`); the
        engine runs eagerly afterwards. Call before tearing down tensor parallelism."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 *, on_step: Callable[[int, int, int], None] | None = None) -> list[RequestOutput]:
        """Serve every prompt to completion; outputs in prompt order.

        ``on_step(finished, total, generated_tokens)`` is called after each step.
        """
        plist = ([params] * len(prompts) if isinstance(params, SamplingParams)
                 else list(params))
        if len(plist) != len(prompts):
            raise InvalidArgumentError("params", len(plist),
                                       f"one SamplingParams or {len(prompts)} of them")
        self.stats = RunStats()
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        self.stats.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        done = 0
        start = time.perf_counter()
        while self.has_unfinished:
            done += len(self.step())
            if on_step is not None:
                on_step(done, len(reqs), self.stats.num_generated_tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.elapsed_s = time.perf_counter() - start
        self.stats.num_preemptions = sum(r.num_preemptions for r in reqs)
        return [self._output(r) for r in reqs]

    def _output(self, req: Request) -> RequestOutput:
        if req.finish_reason is None:
            raise InvalidArgumentError(f"request {req.req_id}", "unfinished", "a finished request")
        text = (self.tokenizer.decode(req.output_token_ids)
                if self.tokenizer is not None else None)
        return RequestOutput(list(req.prompt_token_ids), list(req.output_token_ids),
                             req.finish_reason, text)

    @property
    def deprecations(self) -> list[str]:
        return list(self.choice.deprecations)

    def describe(self) -> dict[str, Any]:
        """What serves (for logs and the CLI's report)."""
        return {
            "backend": self.choice.backend.name,
            "migration": self.choice.backend.migration,
            "block_size": self.choice.block_size,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.device),
            "tensor_parallel_size": self.parallel.world_size,
            "architecture": self.config.architecture,
            "cuda_graphs": self.graphs.sizes if self.graphs is not None else [],
        }
