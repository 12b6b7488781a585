"""Checkpoint formats: ``pytorch_model.bin`` (one file or sharded through its index)
serves the same tokens as the safetensors checkpoint; weights in a format the runner
does not read, a missing shard or an unsafe pickle are errors, never random weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.runner.conftest import MAX_NEW, PROMPTS, HFCheckpoint
from vllm.attention.errors import InvalidArgumentError
from vllm.runner import EngineConfig, LLMEngine, SamplingParams

SMALL = EngineConfig(max_model_len=128, max_num_batched_tokens=64)
GREEDY = SamplingParams(max_tokens=MAX_NEW)


def _state_dict(ckpt: HFCheckpoint) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(ckpt.path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def _config_only(ckpt: HFCheckpoint, to: Path) -> Path:
    to.mkdir(exist_ok=True)
    shutil.copy(ckpt.path / "config.json", to / "config.json")
    return to


def _tokens(path: Path) -> list[list[int]]:
    engine = LLMEngine.create(path, backend="TORCH_REF", engine_config=SMALL)
    assert engine.notes == []  # no "weights drawn from seed" note
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def test_pytorch_model_bin_serves_the_checkpoint(hf_llama: HFCheckpoint, tmp_path: Path) -> None:
    path = _config_only(hf_llama, tmp_path / "bin")
    torch.save(_state_dict(hf_llama), path / "pytorch_model.bin")
    assert _tokens(path) == hf_llama.expected(PROMPTS)


def test_sharded_pytorch_model_bin_through_its_index(hf_llama: HFCheckpoint,
                                                     tmp_path: Path) -> None:
    path = _config_only(hf_llama, tmp_path / "sharded")
    names = sorted(_state_dict(hf_llama))
    state = _state_dict(hf_llama)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert _tokens(path) == hf_llama.expected(PROMPTS)

    (path / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(InvalidArgumentError,
                       match=r"index.json: got 'missing shard\(s\) pytorch_model-00002-of-00002"):
        LLMEngine.create(path, backend="TORCH_REF", engine_config=SMALL)


@pytest.mark.parametrize("file", ["model.pt", "training_args.bin", "consolidated.00.pth"])
def test_weights_the_runner_cannot_read_are_refused(hf_llama: HFCheckpoint, tmp_path: Path,
                                                    file: str) -> None:
    path = _config_only(hf_llama, tmp_path / "other")
    torch.save(_state_dict(hf_llama), path / file)
    with pytest.raises(InvalidArgumentError,
                       match=f"--model: got .*found only {file}, which the runner does not read"):
        LLMEngine.create(path, backend="TORCH_REF", engine_config=SMALL)


class _NotATensor:
    pass


@pytest.mark.parametrize("payload, match", [
    (_NotATensor(), "pytorch_model.bin: got 'a pickle holding a "
                    "tests.runner.test_weights._NotATensor object', expected a state dict"),
    ([torch.zeros(2)], "pytorch_model.bin: got 'list', expected a state dict"),
    (b"not a pickle", r"pytorch_model.bin: got 'unreadable \(.*expected a file written by"),
    (b"junk", r"pytorch_model.bin: got 'unreadable \(.*expected a file written by"),
])
def test_unloadable_bin_is_an_error_naming_the_file(hf_llama: HFCheckpoint, tmp_path: Path,
                                                    payload: object, match: str) -> None:
    path = _config_only(hf_llama, tmp_path / "bad")
    if isinstance(payload, bytes):
        (path / "pytorch_model.bin").write_bytes(payload)
    else:
        torch.save(payload, path / "pytorch_model.bin")
    with pytest.raises(InvalidArgumentError, match=match):
        LLMEngine.create(path, backend="TORCH_REF", engine_config=SMALL)


def test_bin_with_a_missing_tensor_names_it(hf_llama: HFCheckpoint, tmp_path: Path) -> None:
    path = _config_only(hf_llama, tmp_path / "partial")
    state = _state_dict(hf_llama)
    del state["model.norm.weight"]
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(InvalidArgumentError, match="missing 1 tensor.*model.norm.weight"):
        LLMEngine.create(path, backend="TORCH_REF", engine_config=SMALL)
