"""Tensor parallel on torch.distributed: TP=2 gives TP=1's tokens (gloo on CPU; NCCL
on two GPUs, marked ``gpu`` and skipped with the reason on fewer).

Two processes are spawned with the environment ``torchrun`` would give them and
run the real CLI entry point, so the torchrun path (process group from the
environment, rank 0 printing) is what is tested.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.runner.conftest import MAX_NEW, PROMPTS, HFCheckpoint
from vllm.cli import main
from vllm.runner import EngineConfig, LLMEngine, SamplingParams

MLA_PROMPTS = [[5, 6, 7, 8, 9, 10], [3] * 20, [4]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _args(model: str, backend: str, prompts: list[list[int]], device: str = "cpu",
          dtype: str = "auto") -> list[str]:
    args = ["generate", "--model", model, "--backend", backend, "--device", device,
            "--dtype", dtype,
            "--max-tokens", str(MAX_NEW), "--max-model-len", "64", "--max-num-batched-tokens",
            "8", "--output", "json", "--no-progress"]
    for p in prompts:
        args += ["--prompt-token-ids", ",".join(map(str, p))]
    return args


def _rank_main(rank: int, port: int, out_dir: str, runs: list[list[str]]) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # one host: NCCL's bootstrap over loopback too (on 2 x H200 its second process group
    # of a run once picked the VM's other interface and the connect was refused)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    for i, argv in enumerate(runs):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        Path(out_dir, f"run{i}-rank{rank}.json").write_text(json.dumps(
            {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}))


def test_tp2_gloo_equals_tp1(hf_llama: HFCheckpoint, tmp_path: Path) -> None:
    runs = [_args(str(hf_llama.path), "TORCH_REF", PROMPTS),
            _args("random-mla", "TRITON_MLA", MLA_PROMPTS)]
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path), runs), nprocs=2, join=True)
    cfg = EngineConfig(max_model_len=64, max_num_batched_tokens=8)
    single = [
        LLMEngine.create(hf_llama.path, backend="TORCH_REF", engine_config=cfg)
        .generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW)),
        LLMEngine.create("random-mla", backend="TRITON_MLA",
                         engine_config=cfg)
        .generate(MLA_PROMPTS, SamplingParams(max_tokens=MAX_NEW)),
    ]
    for i, outs in enumerate(single):
        rank0 = json.loads((tmp_path / f"run{i}-rank0.json").read_text())
        rank1 = json.loads((tmp_path / f"run{i}-rank1.json").read_text())
        assert rank0["code"] == 0 and rank1["code"] == 0
        assert rank1["stdout"] == "" and rank1["stderr"] == ""  # only rank 0 prints
        assert ", tp 2:" in rank0["stderr"]
        got = [o["token_ids"] for o in json.loads(rank0["stdout"])["outputs"]]
        assert got == [o.token_ids for o in outs], runs[i]
    assert [o.token_ids for o in single[0]] == hf_llama.expected(PROMPTS)


def test_tp_shards_heads_and_rejects_indivisible() -> None:
    from vllm.attention.errors import InvalidArgumentError
    from vllm.runner.parallel import ParallelState

    p = ParallelState(rank=1, world_size=2)
    assert p.shard(4, "num_attention_heads") == (2, 2)
    with pytest.raises(InvalidArgumentError, match="num_key_value_heads: got 3, expected a "
                                                   "multiple of the tensor-parallel size 2"):
        p.shard(3, "num_key_value_heads")


@pytest.mark.gpu
def test_tp2_nccl_equals_tp1(hf_llama: HFCheckpoint, tmp_path: Path) -> None:
    """The same on two GPUs: each rank on ``cuda:LOCAL_RANK``, NCCL collectives, the
    Triton kernels; float32, so the tokens must equal one GPU's and transformers'."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    runs = [_args(str(hf_llama.path), "TRITON_ATTN", PROMPTS, "cuda", "float32"),
            _args("random-mla", "TRITON_MLA", MLA_PROMPTS, "cuda", "float32")]
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path), runs), nprocs=2, join=True)
    cfg = EngineConfig(max_model_len=64, max_num_batched_tokens=8)
    single = [
        LLMEngine.create(hf_llama.path, backend="TRITON_ATTN", dtype="float32", device="cuda",
                         engine_config=cfg).generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW)),
        LLMEngine.create("random-mla", backend="TRITON_MLA", dtype="float32", device="cuda",
                         engine_config=cfg).generate(MLA_PROMPTS,
                                                     SamplingParams(max_tokens=MAX_NEW)),
    ]
    for i, outs in enumerate(single):
        rank0 = json.loads((tmp_path / f"run{i}-rank0.json").read_text())
        rank1 = json.loads((tmp_path / f"run{i}-rank1.json").read_text())
        assert rank0["code"] == 0 and rank1["code"] == 0, (rank0["stderr"], rank1["stderr"])
        assert ", tp 2:" in rank0["stderr"]
        got = [o["token_ids"] for o in json.loads(rank0["stdout"])["outputs"]]
        assert got == [o.token_ids for o in outs], runs[i]
    assert [o.token_ids for o in single[0]] == hf_llama.expected(PROMPTS)
