"""Greedy and temperature / top-p sampling, one generator per request."""

from __future__ import annotations

import torch

from vllm.runner.request import Request


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of largest probabilities whose mass reaches
    ``top_p`` (``probs``: ``[V]`` float32, sums to 1). Not renormalised."""
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of strictly larger tokens
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, order, sorted_p)


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """One token per row of ``logits`` (float32 ``[n, vocab]``), row ``i`` for ``requests[i]``."""
    greedy = torch.argmax(logits, dim=-1).tolist()
    tokens: list[int] = []
    for i, req in enumerate(requests):
        p = req.params
        if p.greedy:
            tokens.append(int(greedy[i]))
            continue
        probs = top_p_filter(torch.softmax(logits[i] / p.temperature, dim=-1), p.top_p)
        tokens.append(int(torch.multinomial(probs, 1, generator=req.generator).item()))
    return tokens
