"""Text <-> token ids: the checkpoint's ``tokenizer.json`` through ``tokenizers``,
or a byte-level tokenizer for the random model (so text prompts work anywhere)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Final, Protocol

from vllm.attention.errors import InvalidArgumentError


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class HFTokenizer:
    """``tokenizer.json`` via the ``tokenizers`` package (special tokens added as the
    file's post-processor says, skipped when decoding)."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise InvalidArgumentError(
                "tokenizer", str(path), "the 'tokenizers' package installed "
                "(pip install 'vllm-kv-writer[runner]'), or --prompt-token-ids",
            ) from exc
        self._tok: Any = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text).ids]

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))


class ByteTokenizer:
    """UTF-8 bytes offset by three special ids (0 pad, 1 BOS, 2 EOS); ids past the
    bytes decode as ``<id>``."""

    PAD: Final = 0
    BOS: Final = 1
    EOS: Final = 2
    OFFSET: Final = 3

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in token_ids:
            if self.OFFSET <= i < self.OFFSET + 256:
                pending.append(i - self.OFFSET)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i >= self.OFFSET + 256:
                out.append(f"<{i}>")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def load_tokenizer(model_dir: Path | None) -> tuple[TextTokenizer | None, str | None]:
    """``(tokenizer, None)``: the checkpoint's, or the byte tokenizer for the random
    model; ``(None, why)`` when there is none to use here (token ids still work, and
    ``why`` says what is missing: the file, the package, or what went wrong reading it)."""
    if model_dir is None:
        return ByteTokenizer(), None
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        why = f"{model_dir} has no tokenizer.json"
        if (model_dir / "tokenizer.model").is_file():
            why += " (its tokenizer.model is a SentencePiece file, which the runner does not read)"
        return None, why
    if importlib.util.find_spec("tokenizers") is None:
        return None, ("reading tokenizer.json needs the 'tokenizers' package, which is not "
                      "installed (pip install 'vllm-kv-writer[runner]')")
    try:
        return HFTokenizer(path), None
    except Exception as exc:  # the Rust library's errors have no common Python class
        first = next(iter(str(exc).strip().splitlines()), type(exc).__name__)
        return None, f"{path} could not be read by the 'tokenizers' package: {first}"
