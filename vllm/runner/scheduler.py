"""Continuous batching with chunked prefill under a per-step token budget.

Each step, running requests are served first (a decode token, or their next
prefill chunk), then waiting requests are admitted while the budget, the
sequence limit and the free blocks allow; a prompt longer than what is left of
the budget is split into chunks. When a running request cannot get a block, the
most recently admitted request is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already produced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vllm.attention.errors import InvalidArgumentError
from vllm.runner.kv_cache import KVCacheManager
from vllm.runner.request import FinishReason, Request


@dataclass(frozen=True)
class ScheduledChunk:
    """``num_new_tokens`` tokens of ``request`` from position ``start``."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk ends at the request's last known token."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return bool(self.chunks) and all(c.num_new_tokens == 1 for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, chunked_prefill: bool = True) -> None:
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if value <= 0:
                raise InvalidArgumentError(name, value, "a positive int")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        n = len(request.prompt_token_ids)
        if n == 0:
            raise InvalidArgumentError(f"prompt {request.req_id}", "[]", "at least one token")
        limit = min(self.max_model_len, self.kv.capacity_tokens())
        if n >= limit:
            raise InvalidArgumentError(
                f"prompt {request.req_id} length", n,
                f"< {limit} (max_model_len={self.max_model_len}, "
                f"KV cache holds {self.kv.capacity_tokens()} tokens)",
            )
        if not self.chunked_prefill and n > self.max_num_batched_tokens:
            raise InvalidArgumentError(
                f"prompt {request.req_id} length", n,
                f"<= max_num_batched_tokens={self.max_num_batched_tokens} without chunked prefill",
            )
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim.req_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim.req_id)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.req_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
        if out.preempted:
            return out  # no admissions in a step that had to preempt
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens - req.num_computed_tokens
            if n > budget and not self.chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate(req.req_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return out

    def update(self, out: SchedulerOutput, sampled: dict[int, int],
               eos_token_ids: frozenset[int]) -> list[Request]:
        """Advance the scheduled requests; returns those that finished this step."""
        finished: list[Request] = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start + chunk.num_new_tokens
            token = sampled.get(req.req_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            if token in eos_token_ids and not req.params.ignore_eos:
                req.finish_reason = FinishReason.STOP
            elif (len(req.output_token_ids) >= req.params.max_tokens
                  or req.num_tokens >= self.max_model_len):
                req.finish_reason = FinishReason.LENGTH
            if req.finished:
                self.running.remove(req)
                self.kv.free(req.req_id)
                finished.append(req)
        return finished
