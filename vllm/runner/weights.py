"""Fill a :class:`~vllm.runner.model.DecoderModel` from ``*.safetensors`` or from a
seeded generator. Every rank reads (or draws) the full tensor and keeps its shard,
so a random model is the same model at every tensor-parallel size."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm.attention.errors import InvalidArgumentError
from vllm.runner.layers import RMSNorm, ShardedLinear
from vllm.runner.model import DecoderModel
from vllm.runner.parallel import ParallelState


@dataclass(frozen=True)
class ParamSlot:
    """One checkpoint tensor: where it goes and how it is split over ranks."""

    param: torch.Tensor
    full_shape: tuple[int, ...]
    shard_dim: int | None
    kind: str
    """``linear``, ``bias``, ``norm`` or ``embedding`` (for random initialisation)."""


def checkpoint_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def param_slots(model: DecoderModel) -> dict[str, ParamSlot]:
    """Checkpoint name -> slot, in a fixed order (the random draw follows it)."""
    slots: dict[str, ParamSlot] = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, ShardedLinear):
            slots[checkpoint_name(prefix + "weight")] = ParamSlot(
                module.weight, module.full_shape, module.weight_shard_dim, "linear")
            if module.bias is not None:
                slots[checkpoint_name(prefix + "bias")] = ParamSlot(
                    module.bias, (module.full_shape[0],), module.bias_shard_dim, "bias")
        elif isinstance(module, RMSNorm):
            slots[checkpoint_name(prefix + "weight")] = ParamSlot(
                module.weight, tuple(module.weight.shape), None, "norm")
        elif isinstance(module, torch.nn.Embedding):
            slots[checkpoint_name(prefix + "weight")] = ParamSlot(
                module.weight, tuple(module.weight.shape), None, "embedding")
    if model.config.tie_word_embeddings:
        slots.pop("lm_head.weight", None)
    return slots


def _narrow(full: torch.Tensor, slot: ParamSlot, parallel: ParallelState, name: str) -> torch.Tensor:
    if slot.shard_dim is None:
        return full
    start, size = parallel.shard(full.shape[slot.shard_dim], f"{name} dim {slot.shard_dim}")
    return full.narrow(slot.shard_dim, start, size)


def _copy_into(slot: ParamSlot, full: torch.Tensor, parallel: ParallelState, name: str) -> None:
    if tuple(full.shape) != slot.full_shape:
        raise InvalidArgumentError(f"checkpoint tensor {name}", tuple(full.shape),
                                   f"shape {slot.full_shape} (from config.json)")
    with torch.no_grad():
        slot.param.copy_(_narrow(full, slot, parallel, name).to(slot.param.dtype))


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_safetensors(model: DecoderModel, model_dir: Path, parallel: ParallelState) -> None:
    """Load every parameter from ``model_dir/*.safetensors``; missing and unknown
    tensors are errors that name them."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise InvalidArgumentError(
            "--model", str(model_dir),
            "a checkpoint loadable with the 'safetensors' package (pip install "
            "'vllm-kv-writer[runner]')",
        ) from exc
    files = sorted(model_dir.glob("*.safetensors"))
    slots = param_slots(model)
    seen: set[str] = set()
    unknown: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                slot = slots.get(name)
                if slot is None:
                    if not name.endswith(_IGNORED_SUFFIXES) and not (
                            name == "lm_head.weight" and model.config.tie_word_embeddings):
                        unknown.append(name)
                    continue
                _copy_into(slot, f.get_tensor(name), parallel, name)
                seen.add(name)
    missing = [n for n in slots if n not in seen]
    if missing or unknown:
        detail = []
        if missing:
            detail.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
        if unknown:
            detail.append(f"{len(unknown)} tensor(s) the runner does not know "
                          f"(MoE and other features are not implemented): {', '.join(unknown[:8])}")
        raise InvalidArgumentError(f"--model {model_dir}", "; ".join(detail),
                                   "a checkpoint matching config.json's architecture")


def init_random(model: DecoderModel, parallel: ParallelState, seed: int) -> None:
    """Seeded weights: linears ``N(0, 1/fan_in)``, embeddings ``N(0, 1)``, norms 1,
    biases 0. Drawn in full on the CPU in checkpoint-name order, then sharded."""
    gen = torch.Generator().manual_seed(seed)
    for name, slot in param_slots(model).items():
        if slot.kind == "linear":
            full = torch.randn(slot.full_shape, generator=gen) / math.sqrt(slot.full_shape[1])
        elif slot.kind == "embedding":
            full = torch.randn(slot.full_shape, generator=gen)
        elif slot.kind == "norm":
            full = torch.ones(slot.full_shape)
        else:
            full = torch.zeros(slot.full_shape)
        _copy_into(slot, full, parallel, name)
