"""Model configurations the runner serves, read from a Hugging Face ``config.json``.

Two architectures: a Llama decoder (GQA attention) and a DeepSeek-style decoder
whose attention is multi-head latent attention (MLA). Both are frozen dataclasses
so a config can be hashed, compared across ranks and printed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import torch

from vllm.attention.errors import InvalidArgumentError

Architecture = Literal["llama", "deepseek_mla"]

_LLAMA_ARCHS: Final = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})
_MLA_ARCHS: Final = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})
_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: ``theta`` and an optional frequency scaling."""

    theta: float = 10000.0
    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    interleaved: bool = False
    """Rotate pairs ``(2i, 2i+1)`` (DeepSeek) instead of halves (Llama)."""

    def inv_freq(self, dim: int) -> torch.Tensor:
        """``[dim // 2]`` float32 inverse frequencies, as Hugging Face computes them."""
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class MLAConfig:
    """The latent-attention dimensions of a DeepSeek-style layer."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """What the runner needs to build a model (the subset of ``config.json`` it reads)."""

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: torch.dtype = torch.float32
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"config.{name}", value, "a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgumentError(
                "config.num_attention_heads", self.num_attention_heads,
                f"a multiple of num_key_value_heads={self.num_key_value_heads}",
            )
        if (self.architecture == "deepseek_mla") != (self.mla is not None):
            raise InvalidArgumentError("config.mla", self.mla,
                                       "MLA dimensions exactly for the deepseek_mla architecture")

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def attn_head_size(self) -> int:
        """The cache row's head size: ``head_dim``, or ``kv_lora_rank + rope`` for MLA."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return self.head_dim

    @property
    def attn_num_kv_heads(self) -> int:
        """KV heads of the cache (1 for MLA: the latent is shared by every head)."""
        return 1 if self.mla is not None else self.num_key_value_heads


def random_llama_config(vocab_size: int = 384) -> ModelConfig:
    """The small Llama built when no checkpoint is given (fits the byte tokenizer)."""
    return ModelConfig(
        architecture="llama", vocab_size=vocab_size, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, eos_token_ids=(2,), bos_token_id=1,
        checkpoint_dtype=torch.bfloat16,
    )


def random_mla_config(vocab_size: int = 384) -> ModelConfig:
    """A small DeepSeek-style MLA model. The latent is DeepSeek's (512 + 64), the one
    size the MLA backends and their vendor kernels take."""
    return ModelConfig(
        architecture="deepseek_mla", vocab_size=vocab_size, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        eos_token_ids=(2,), bos_token_id=1, checkpoint_dtype=torch.bfloat16,
        rope=RopeConfig(interleaved=True),
        mla=MLAConfig(kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                      v_head_dim=32, q_lora_rank=None),
    )


def _int(raw: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"config.json:{key}", value, "an int")
    return value


def _float(raw: Mapping[str, object], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"config.json:{key}", value, "a number")
    return float(value)


def _rope(raw: Mapping[str, object], *, interleaved: bool) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    merged: dict[str, object] = {}
    if isinstance(scaling, Mapping):
        merged.update(scaling)
    if isinstance(params, Mapping):
        merged.update(params)
    theta = _float(merged, "rope_theta", _float(raw, "rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default"))
    interleave = raw.get("rope_interleave", interleaved)
    if kind == "default":
        return RopeConfig(theta=theta, interleaved=bool(interleave))
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=_float(merged, "factor", 1.0),
                          interleaved=bool(interleave))
    if kind == "llama3":
        return RopeConfig(
            theta=theta, kind="llama3", factor=_float(merged, "factor", 8.0),
            low_freq_factor=_float(merged, "low_freq_factor", 1.0),
            high_freq_factor=_float(merged, "high_freq_factor", 4.0),
            original_max_position_embeddings=_int(merged, "original_max_position_embeddings",
                                                  8192),
            interleaved=bool(interleave),
        )
    raise InvalidArgumentError("config.json:rope_type", kind, "one of default, linear, llama3")


def _eos(raw: Mapping[str, object]) -> tuple[int, ...]:
    value = raw.get("eos_token_id")
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise InvalidArgumentError("config.json:eos_token_id", value, "an int, a list of ints or null")


def _head_dim(raw: Mapping[str, object], hidden: int, heads: int) -> int:
    value = raw.get("head_dim")
    return value if isinstance(value, int) and value > 0 else hidden // heads


def parse_config(raw: Mapping[str, object], *, source: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a parsed ``config.json``; unknown architectures and
    features the runner does not implement are rejected by name."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise InvalidArgumentError(f"{source}:architectures", archs,
                                   f"a list naming one of {sorted(_LLAMA_ARCHS | _MLA_ARCHS)}")
    arch = str(archs[0])
    if arch not in _LLAMA_ARCHS | _MLA_ARCHS:
        raise InvalidArgumentError(f"{source}:architectures", archs,
                                   f"one of {sorted(_LLAMA_ARCHS | _MLA_ARCHS)}")
    is_mla = arch in _MLA_ARCHS
    heads = _int(raw, "num_attention_heads")
    hidden = _int(raw, "hidden_size")
    dtype_name = raw.get("dtype", raw.get("torch_dtype", "float32"))
    dtype = _DTYPES.get(str(dtype_name), torch.float32)
    if raw.get("sliding_window") is not None and arch == "MistralForCausalLM":
        raise InvalidArgumentError(f"{source}:sliding_window", raw.get("sliding_window"),
                                   "null (the runner serves full attention only)")
    mla: MLAConfig | None = None
    if is_mla:
        q_lora = raw.get("q_lora_rank")
        mla = MLAConfig(
            kv_lora_rank=_int(raw, "kv_lora_rank"),
            qk_nope_head_dim=_int(raw, "qk_nope_head_dim"),
            qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
            v_head_dim=_int(raw, "v_head_dim"),
            q_lora_rank=q_lora if isinstance(q_lora, int) else None,
        )
    bos = raw.get("bos_token_id")
    return ModelConfig(
        architecture="deepseek_mla" if is_mla else "llama",
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_int(raw, "num_key_value_heads", heads),
        head_dim=mla.qk_head_dim if mla is not None else _head_dim(raw, hidden, heads),
        max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
        rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
        rope=_rope(raw, interleaved=is_mla),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos(raw),
        bos_token_id=bos if isinstance(bos, int) else None,
        checkpoint_dtype=dtype,
        mla=mla,
    )


def load_config(model_dir: Path) -> ModelConfig:
    """Read ``model_dir/config.json``."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise InvalidArgumentError("--model", str(model_dir),
                                   "a directory holding config.json (and *.safetensors or "
                                   "pytorch_model*.bin)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(str(path), f"invalid JSON ({exc.msg} at line {exc.lineno} "
                                   f"column {exc.colno})", "a JSON object") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(str(path), f"unreadable ({exc})",
                                   "a UTF-8 JSON file") from None
    if not isinstance(raw, dict):
        raise InvalidArgumentError(str(path), type(raw).__name__, "a JSON object")
    return parse_config(raw, source=str(path))
