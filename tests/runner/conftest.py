"""Tiny Hugging Face checkpoints built on the spot (nothing is downloaded).

Torch runs single-threaded in this package: these models are so small that thread
start-up and contention on a shared 2-core machine cost 100x the arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import torch_threads
from vllm.runner import LLMEngine

MAX_NEW = 10
FLOAT32_MARGIN = 1e-3
"""Logit margin below which two float32 implementations may rightly pick different
tokens (their rounding differs by ~1e-5 here); the references stay well above it."""
PROMPTS: list[list[int]] = [[5, 17, 33, 9], list(range(3, 40)), [100], [7, 7, 8, 120, 64, 3, 2]]
"""Different lengths: the 37-token one spans three 16-slot blocks."""


@dataclass(frozen=True)
class HFCheckpoint:
    path: Path
    reference: dict[tuple[int, ...], list[int]]
    """Prompt -> Hugging Face greedy continuation of ``MAX_NEW`` tokens."""
    margins: dict[tuple[int, ...], list[float]]
    """Prompt -> top-1 minus top-2 logit of HF at each generated token."""

    @property
    def min_margin(self) -> float:
        return min(min(m) for m in self.margins.values())

    def expected(self, prompts: list[list[int]]) -> list[list[int]]:
        """The reference continuations, for float32 comparisons: only sound while no
        step is a near-tie, which another BLAS or CPU could rightly resolve the other
        way (fails saying so, rather than on some machines)."""
        low = [(p, m) for p in prompts for m in self.margins[tuple(p)] if m < FLOAT32_MARGIN]
        assert not low, f"reference near-ties (top-1 minus top-2 logit): {low}"
        return [self.reference[tuple(p)] for p in prompts]

    def unambiguous(self, prompts: list[list[int]], margin: float) -> list[list[int]]:
        """Each reference continuation up to its first step whose top-1 margin is
        below ``margin``: past a near-tie, a 16-bit model may rightly pick either."""
        out = []
        for p in prompts:
            ms = self.margins[tuple(p)]
            k = next((i for i, m in enumerate(ms) if m < margin), len(ms))
            out.append(self.reference[tuple(p)][:k])
        return out


def build_checkpoint(path: Path, *, with_tokenizer: bool = True, **overrides: object) -> HFCheckpoint:
    from transformers import LlamaConfig, LlamaForCausalLM

    kw: dict[str, object] = dict(
        vocab_size=128, hidden_size=64, head_dim=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    model.save_pretrained(str(path))
    if with_tokenizer:
        _save_word_tokenizer(path, int(kw["vocab_size"]))  # type: ignore[call-overload]
    reference: dict[tuple[int, ...], list[int]] = {}
    margins: dict[tuple[int, ...], list[float]] = {}
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)
            reference[tuple(prompt)] = out.sequences[0, len(prompt):].tolist()
            margins[tuple(prompt)] = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    return HFCheckpoint(path, reference, margins)


def _save_word_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="package", autouse=True)
def single_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="package")
def hf_llama(single_thread: None, tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoint:
    """A 2-layer GQA Llama (4 heads, 2 KV heads, head_dim 64) and its HF greedy outputs."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def spy_step_tokens(engine: LLMEngine) -> list[int]:
    """The number of tokens of every step ``engine`` schedules from now on (a list that
    fills as it runs; this engine only)."""
    steps: list[int] = []
    real = engine.scheduler.schedule

    def spy():  # type: ignore[no-untyped-def]
        out = real()
        steps.append(out.num_tokens)
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    return steps
