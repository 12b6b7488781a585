"""``vllm-attn generate``: serve prompts through the paged-KV runner.

Results go to stdout (text, or one JSON object with ``--output json``); the
progress bar, the legacy-backend warning and the closing report go to stderr.
Under ``torchrun`` every rank serves its shard and rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

import torch

from vllm.attention.errors import AttentionError, InvalidArgumentError
from vllm.runner.engine import RANDOM_MODELS, EngineConfig, LLMEngine
from vllm.runner.parallel import init_tensor_parallel, shutdown_tensor_parallel
from vllm.runner.request import RequestOutput, SamplingParams


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidArgumentError("--prompt-token-ids", text,
                                   "comma-separated non-negative ints, e.g. 1,15,27") from None
    if not ids or min(ids) < 0:
        raise InvalidArgumentError("--prompt-token-ids", text,
                                   "at least one non-negative int, comma-separated")
    return ids


class ProgressBar:
    """A one-line bar on ``stream`` that fills as tokens are generated (out of the most
    the requests can produce): redrawn in place on a terminal, drawn once at the end
    otherwise (so logs hold one line, not hundreds)."""

    def __init__(self, max_tokens: int, stream: TextIO, enabled: bool) -> None:
        self.max_tokens = max_tokens
        self.stream = stream
        self.enabled = enabled
        self.live = enabled and stream.isatty()
        self.start = time.perf_counter()
        self._last = 0.0
        self._line = ""

    def update(self, done: int, total: int, tokens: int) -> None:
        """After a step: ``done`` of ``total`` requests finished, ``tokens`` generated."""
        if not self.enabled:
            return
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        width = 24
        # requests stopping early (EOS) leave tokens unused: full once all are done
        share = 1.0 if done == total else tokens / max(self.max_tokens, 1)
        fill = min(int(width * share), width)
        self._line = (f"generate [{'#' * fill}{'.' * (width - fill)}] "
                      f"{tokens}/{self.max_tokens} tokens, {done}/{total} requests, "
                      f"{tokens / elapsed:.1f} tok/s")
        now = time.perf_counter()
        if self.live and (now - self._last > 0.1 or done == total):
            self.stream.write("\r" + self._line)
            self.stream.flush()
            self._last = now

    def close(self) -> None:
        if self.enabled and self._line:
            self.stream.write(("\r" + self._line + "\n") if self.live else self._line + "\n")
            self.stream.flush()


BUILT_IN_PROMPT = "Hello, my name is"


def _prompts(args: argparse.Namespace, engine: LLMEngine) -> list[list[int]]:
    if args.prompt_token_ids:
        return [_token_ids(t) for t in args.prompt_token_ids]
    texts: list[str] = args.prompt or [BUILT_IN_PROMPT]
    if engine.tokenizer is None:
        flag = "--prompt" if args.prompt else "the built-in prompt"
        raise InvalidArgumentError(
            flag, texts[0], f"--prompt-token-ids: {engine.no_tokenizer or 'no tokenizer'}")
    return [engine.tokenizer.encode(t) for t in texts]


def _max_new_tokens(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> int:
    return sum(max(min(max_tokens, engine.max_model_len - len(p)), 0) for p in prompts)


def _text_line(engine: LLMEngine, output: RequestOutput) -> str:
    """One line a request: its prompt and what was generated, quoted (so control
    characters and newlines of the text stay visible and on the line)."""
    if output.text is None or engine.tokenizer is None:
        return (f"Prompt token ids: {output.prompt_token_ids}, "
                f"Generated token ids: {output.token_ids}")
    prompt = engine.tokenizer.decode(output.prompt_token_ids)
    return f"Prompt: {prompt!r}, Generated text: {output.text!r}"


def _json_result(engine: LLMEngine, outputs: list[RequestOutput]) -> dict[str, Any]:
    return {
        "backend": engine.choice.backend.name,
        "dtype": engine.describe()["dtype"],
        "outputs": [{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids,
                     "text": o.text} for o in outputs],
        "tokens_per_s": round(engine.stats.tokens_per_s, 3),
    }


def _report(engine: LLMEngine, stream: TextIO) -> None:
    s = engine.stats
    d = engine.describe()
    graphs = f", {s.num_graph_steps} via CUDA graphs" if engine.graphs is not None else ""
    for note in engine.notes:
        stream.write(f"note: {note}\n")
    stream.write(
        f"backend {d['backend']} ({d['migration']}), {d['architecture']}, {d['dtype']}, "
        f"block_size {d['block_size']}, {d['device']}, tp {d['tensor_parallel_size']}: "
        f"{s.num_steps} steps{graphs}, {s.num_preemptions} preemptions\n"
    )
    deps = engine.deprecations
    if deps:
        stream.write(f"deprecations: {len(deps)} adapted legacy backend(s): "
                     + "; ".join(deps) + "\n")
    stream.write(f"{s.num_generated_tokens} tokens in {s.elapsed_s:.2f} s: "
                 f"{s.tokens_per_s:.1f} tokens/s\n")
    stream.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    """The ``generate`` subcommand; returns the exit code (0 ok, 2 bad arguments)."""
    try:
        return _generate(args)
    except AttentionError as exc:
        sys.stderr.write(f"vllm-attn generate: error: {exc}\n")
        return 2


def _generate(args: argparse.Namespace) -> int:
    parallel, device = init_tensor_parallel(args.device)
    engine: LLMEngine | None = None
    try:
        engine = LLMEngine.create(
            args.model, backend=args.backend, dtype=args.dtype, device=device,
            engine_config=EngineConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                enforce_eager=args.enforce_eager, seed=args.seed,
            ),
            kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
            strict_backends=args.strict_backends, parallel=parallel,
        )
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        prompts = _prompts(args, engine)
        show = parallel.is_driver
        bar = ProgressBar(_max_new_tokens(engine, prompts, args.max_tokens), sys.stderr,
                          enabled=show and not args.no_progress)
        outputs = engine.generate(prompts, params, on_step=bar.update)
        bar.close()
        if show:
            if args.output == "json":
                sys.stdout.write(json.dumps(_json_result(engine, outputs)) + "\n")
            else:
                for o in outputs:
                    sys.stdout.write(_text_line(engine, o) + "\n")
            sys.stdout.flush()
            _report(engine, sys.stderr)
        return 0
    finally:
        if engine is not None:
            engine.close()  # graphs holding NCCL work first: else the destroy below hangs
        shutdown_tensor_parallel(parallel)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a positive int") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"got {value}, expected a positive int")
    return value


_Parser = TypeVar("_Parser", bound=argparse.ArgumentParser)


def add_generate_parser(sub: argparse._SubParsersAction[_Parser], *,
                        device_type: Callable[[str], torch.device]) -> None:
    """Add ``generate`` to ``vllm-attn``'s subcommands; ``device_type`` parses
    ``--device`` (an absent device is a usage error)."""
    p = sub.add_parser(
        "generate", help="serve prompts through the paged-KV runner",
        description=(__doc__ or "").replace("``", ""),  # RST markup, not shell text
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face checkpoint directory (config.json + *.safetensors), or "
                        f"{' / '.join(RANDOM_MODELS)} (default: the seeded random Llama; "
                        "random-mla when --backend is an MLA backend)")
    p.add_argument("--backend", default=None, metavar="NAME|module:Class",
                   help="a registered backend or an out-of-tree module:Class "
                        "(default: the first that can serve the model here)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", metavar="TEXT",
                     help=f"a text prompt (repeat for several; default: {BUILT_IN_PROMPT!r})")
    src.add_argument("--prompt-token-ids", action="append", metavar="IDS",
                     help="comma-separated token ids (repeat for several prompts)")
    p.add_argument("--max-tokens", type=_positive, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: the checkpoint dtype on CUDA, float32 on CPU")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--block-size", type=_positive, default=None,
                   help="default: from the backend's declared block sizes")
    p.add_argument("--device", type=device_type,
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=_positive, default=16)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=512,
                   help="per-step token budget (longer prompts are chunked)")
    p.add_argument("--max-model-len", type=_positive, default=None)
    p.add_argument("--num-kv-blocks", type=_positive, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--strict-backends", action="store_true",
                   help="refuse adapted legacy backends instead of warning")
    p.add_argument("--output", default="text", choices=["text", "json"])
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_generate)
