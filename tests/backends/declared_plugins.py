"""Plugin backends as an out-of-tree author might write them, for ``vllm-attn check
module:Class``: declarations in the obvious spellings (normalised when the class is
created) and declarations that have no unambiguous meaning (that backend's FAIL)."""

from __future__ import annotations

from vllm.attention.backends.torch_ref import TorchRefBackend


class PlainlySpelled(TorchRefBackend):  # type: ignore[misc]
    """A list of sizes, a layout's value and dtype names: all unambiguous."""

    name = "PLAINLY_SPELLED"
    kv_cache_layout = "split_nhd"
    head_sizes = [64, 128]
    block_sizes = (16, 32)
    supported_dtypes = ["float32"]
    supported_kv_cache_dtypes = ["auto", "fp8_e4m3"]


class BadlyDeclared(TorchRefBackend):  # type: ignore[misc]
    """A head size as a string and a layout that does not exist."""

    name = "BADLY_DECLARED"
    kv_cache_layout = "split_nhdd"
    head_sizes = [64, "128"]
