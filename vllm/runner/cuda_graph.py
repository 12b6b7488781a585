"""Piecewise CUDA graphs for decode steps.

Everything between two attention calls (norms, projections, RoPE, MLP, the
tensor-parallel all-reduces) is captured once per padded batch size; each
layer's attention call (the cache write, the KV-connector hook and compute)
runs eagerly between the replays, with the step's real metadata and slot
mapping from the ForwardContext. So any backend can be served under graphs:
its metadata may hold host values and its writer may synchronise, and padded
rows are skipped through ``-1`` slots. ``docs/runner.md`` gives the trade-off
against whole-step capture.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.runner.attention_block import AttnInputs
from vllm.runner.model import DecoderModel

T = TypeVar("T")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to ``max_num_seqs`` (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


@dataclass
class _Captured:
    graphs: list[torch.cuda.CUDAGraph]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_inputs: list[AttnInputs]
    attn_outputs: list[torch.Tensor]
    hidden: torch.Tensor


class PiecewiseCUDAGraphs:
    """Per batch size, ``num_layers + 1`` graphs that share one memory pool."""

    def __init__(self, model: DecoderModel, sizes: Sequence[int]) -> None:
        if model.device.type != "cuda":
            raise InvalidArgumentError("device", str(model.device), "cuda for CUDA graphs")
        if not sizes or min(sizes) <= 0:
            raise InvalidArgumentError("cuda_graph_sizes", list(sizes), "positive batch sizes")
        self.model = model
        self.sizes = sorted(set(sizes))
        self._captured: dict[int, _Captured] = {}
        self.num_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def release(self) -> None:
        """Free every captured graph (after the work in flight). Under tensor parallelism
        this must precede ``destroy_process_group``: on 2 x H200 with NCCL 2.28 the
        destroy waited forever while graphs that captured NCCL all-reduces were alive."""
        if self._captured:
            torch.cuda.synchronize(self.model.device)
            for c in self._captured.values():
                for g in c.graphs:
                    g.reset()
            self._captured.clear()

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds ``num_tokens`` (None: too many)."""
        return next((s for s in self.sizes if s >= num_tokens), None)

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller ones reuse its pool
                self._captured[size] = self._capture_size(size, pool)
        torch.cuda.synchronize()

    @staticmethod
    def _graph(fn: Callable[[], T], pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up: lazy initialisation must not happen during capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    def _capture_size(self, size: int, pool: Any) -> _Captured:
        model, dev = self.model, self.model.device
        layers = model.decoder_layers()
        ids = torch.zeros(size, dtype=torch.int64, device=dev)
        pos = torch.zeros(size, dtype=torch.int64, device=dev)
        outs = [torch.zeros(layer.self_attn.output_shape(size), dtype=model.dtype, device=dev)
                for layer in layers]
        graphs: list[torch.cuda.CUDAGraph] = []
        inputs: list[AttnInputs] = []
        residual: torch.Tensor | None = None
        for i, layer in enumerate(layers):
            def piece(i: int = i, prev: torch.Tensor | None = residual,
                      layer: Any = layer) -> tuple[torch.Tensor, AttnInputs]:
                if prev is None:
                    h = model.embed(ids)
                else:
                    h = layers[i - 1].post_attention(outs[i - 1], prev)
                return h, layer.pre_attention(h, pos)

            graph, (residual, attn_in) = self._graph(piece, pool)
            graphs.append(graph)
            inputs.append(attn_in)
        last_residual = residual
        if last_residual is None:
            raise InvalidArgumentError("num_hidden_layers", 0, "at least one layer")

        def last() -> torch.Tensor:
            return model.final_norm(layers[-1].post_attention(outs[-1], last_residual))

        graph, hidden = self._graph(last, pool)
        graphs.append(graph)
        return _Captured(graphs, ids, pos, inputs, outs, hidden)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Replay for a batch padded to a captured size; needs the ForwardContext.

        ``input_ids``/``positions``: int64 ``[size]``. Returns normed hidden ``[size, H]``
        (a static buffer: read it before the next replay).
        """
        size = int(input_ids.shape[0])
        c = self._captured.get(size)
        if c is None:
            raise InvalidArgumentError("num_tokens", size, f"a captured size {self.sizes}")
        c.input_ids.copy_(input_ids)
        c.positions.copy_(positions)
        c.graphs[0].replay()
        for i, layer in enumerate(self.model.decoder_layers()):
            out = layer.self_attn.attend(c.attn_inputs[i], c.attn_outputs[i])
            if out.data_ptr() != c.attn_outputs[i].data_ptr():
                c.attn_outputs[i].copy_(out.view_as(c.attn_outputs[i]))
            c.graphs[i + 1].replay()
        self.num_replays += 1
        return c.hidden
