"""A small paged-KV model runner that serves tokens over any attention backend.

``LLMEngine.create(model_dir_or_random, backend=NAME)`` then ``engine.generate(...)``;
the ``vllm-attn generate`` command wraps it. See ``docs/runner.md``.
"""

from vllm.runner.connector import CPUMirrorConnector, RegisteredKVCache
from vllm.runner.engine import EngineConfig, LLMEngine, RunStats
from vllm.runner.request import FinishReason, RequestOutput, SamplingParams

__all__ = [
    "CPUMirrorConnector",
    "EngineConfig",
    "FinishReason",
    "LLMEngine",
    "RegisteredKVCache",
    "RequestOutput",
    "RunStats",
    "SamplingParams",
]
