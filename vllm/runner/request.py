"""Requests, their sampling options and what the engine hands back."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from vllm.attention.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0``: greedy. Otherwise softmax(logits / temperature) restricted
    to the smallest top-probability set whose mass reaches ``top_p``."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    """Seeds this request's sampling generator (None: the engine's seed + request id)."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens <= 0:
            raise InvalidArgumentError("max_tokens", self.max_tokens, "a positive int")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError("temperature", self.temperature, "a finite float >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError("top_p", self.top_p, "a float in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class FinishReason(enum.Enum):
    STOP = "stop"
    """An EOS token was sampled."""
    LENGTH = "length"
    """``max_tokens`` or the model's context length was reached."""


@dataclass
class Request:
    """One prompt being served. ``num_computed_tokens`` of its tokens (prompt, then
    outputs) are in the KV cache; a preempted request starts over at 0."""

    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens ``start..stop-1`` of prompt + outputs."""
        p = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:min(stop, p)]
                + self.output_token_ids[max(start - p, 0):max(stop - p, 0)])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, in the engine's answer order (the prompts' order)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None
