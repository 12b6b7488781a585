"""Fill a :class:`~vllm.runner.model.DecoderModel` from ``*.safetensors``, from
``pytorch_model*.bin`` or from a seeded generator. Every rank reads (or draws) the full tensor and keeps its shard,
so a random model is the same model at every tensor-parallel size."""

from __future__ import annotations

import json
import math
import pickle
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

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

BIN_INDEX = "pytorch_model.bin.index.json"
_UNREADABLE = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.gguf")
"""Weight files of formats the runner does not read (``training_args.bin`` and the
like are matched too: a directory holding only those is refused, never served at
random)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The weight files of a checkpoint directory, in the order they are read."""

    format: Literal["safetensors", "bin"]
    files: tuple[Path, ...]


def checkpoint_files(model_dir: Path) -> CheckpointFiles | None:
    """``*.safetensors`` when there are any (as Hugging Face prefers them), else
    ``pytorch_model.bin`` or the shards its ``pytorch_model.bin.index.json`` names;
    None for a directory with no weight files at all (``config.json`` only).

    Raises InvalidArgumentError for weights in another format, or an index naming a
    shard that is not there.
    """
    safetensors = sorted(model_dir.glob("*.safetensors"))
    if safetensors:
        return CheckpointFiles("safetensors", tuple(safetensors))
    index = model_dir / BIN_INDEX
    if index.is_file():
        return CheckpointFiles("bin", _bin_shards(index))
    single = model_dir / "pytorch_model.bin"
    if single.is_file():
        return CheckpointFiles("bin", (single,))
    other = sorted({p.name for pattern in _UNREADABLE for p in model_dir.glob(pattern)})
    if other:
        raise InvalidArgumentError(
            "--model", str(model_dir),
            f"weights as *.safetensors, pytorch_model.bin or {BIN_INDEX} with its shards "
            f"(found only {', '.join(other[:4])}, which the runner does not read)",
        )
    return None


def _bin_shards(index: Path) -> tuple[Path, ...]:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(str(index), f"unreadable ({exc})",
                                   "a JSON object with a weight_map") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise InvalidArgumentError(f"{index}:weight_map", type(weight_map).__name__,
                                   "an object mapping tensor names to shard file names")
    shards = tuple(index.parent / name for name in sorted(set(weight_map.values())))
    missing = [p.name for p in shards if not p.is_file()]
    if missing:
        raise InvalidArgumentError(f"{index}", f"missing shard(s) {', '.join(missing)}",
                                   "every shard its weight_map names, next to it")
    return shards


def _safetensors_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise InvalidArgumentError(
            "--model", str(file.parent),
            "a checkpoint loadable with the 'safetensors' package (pip install "
            "'vllm-kv-writer[runner]')",
        ) from exc
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _bin_tensors(file: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        # weights_only: a pickle may run code; mmap (zip files only) reads lazily
        state = torch.load(file, map_location="cpu", weights_only=True,
                           mmap=zipfile.is_zipfile(file))
    except Exception as exc:  # a corrupt file fails in many ways: name the file, keep the cause
        # torch's weights_only refusal is a page of advice around one fact: the class
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if isinstance(exc, pickle.UnpicklingError) and found:
            raise InvalidArgumentError(
                str(file), f"a pickle holding a {found.group(1)} object",
                "a state dict of tensors (torch.load(weights_only=True) loads nothing else)",
            ) from exc
        first = next(iter(str(exc).strip().splitlines()), "")
        raise InvalidArgumentError(str(file), f"unreadable ({type(exc).__name__}: {first})",
                                   "a file written by torch.save") from exc
    if not isinstance(state, dict):
        raise InvalidArgumentError(str(file), type(state).__name__,
                                   "a state dict (a dict of tensor name -> tensor)")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"{file} entry {name!r}", type(tensor).__name__,
                                       "a tensor under a string name")
        yield name, tensor


def load_checkpoint(model: DecoderModel, checkpoint: CheckpointFiles,
                    parallel: ParallelState) -> None:
    """Load every parameter from ``checkpoint``'s files; missing and unknown tensors
    are errors that name them."""
    read = _safetensors_tensors if checkpoint.format == "safetensors" else _bin_tensors
    slots = param_slots(model)
    seen: set[str] = set()
    unknown: list[str] = []
    for file in checkpoint.files:
        for name, tensor in read(file):
            slot = slots.get(name)
            if slot is None:
                if not name.endswith(_IGNORED_SUFFIXES) and not (
                        name == "lm_head.weight" and model.config.tie_word_embeddings):
                    unknown.append(name)
                continue
            _copy_into(slot, tensor, parallel, name)
            seen.add(name)
    missing = [n for n in slots if n not in seen]
    if missing or unknown:
        detail = []
        if missing:
            detail.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
        if unknown:
            detail.append(f"{len(unknown)} tensor(s) the runner does not know "
                          f"(MoE and other features are not implemented): {', '.join(unknown[:8])}")
        raise InvalidArgumentError(f"--model {checkpoint.files[0].parent}", "; ".join(detail),
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
