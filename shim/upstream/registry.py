"""``vllm.v1.attention.backends.registry``: upstream's ``@register_backend`` decorator,
registering into this package's registry (:mod:`vllm.attention.registry`).

``@register_backend(AttentionBackendEnum.CUSTOM)`` registers the class as ``CUSTOM``;
naming another member overrides that backend, as upstream's decorator does. The class
is checked and adapted when first asked for and warns when first used, pointing at the
decorator.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

from shim.warnings import caller_location
from vllm.attention.errors import InvalidArgumentError

__all__ = ["AttentionBackendEnum", "register_backend"]


class AttentionBackendEnum(enum.Enum):
    """Upstream's backend names; a member's value is the path upstream would import."""

    FLASH_ATTN = "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    FLASHINFER = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    FLEX_ATTENTION = "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"
    TREE_ATTN = "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend"
    ROCM_ATTN = "vllm.v1.attention.backends.rocm_attn.RocmAttentionBackend"
    TORCH_SDPA = "vllm.v1.attention.backends.cpu_attn.TorchSDPABackend"
    CUSTOM = ""

    def get_path(self) -> str:
        return self.value


T = TypeVar("T", bound=type)


def register_backend(backend: AttentionBackendEnum, class_path: str | None = None,
                     is_mamba: bool = False) -> Callable[[T], T]:
    """Register a backend under ``backend``'s name: as a decorator, the decorated class;
    given ``class_path`` (``"pkg.module.Class"``), that class, imported when first asked
    for. Returns the decorator (with ``class_path``, one that does nothing)."""
    from vllm.attention import registry

    if not isinstance(backend, AttentionBackendEnum):
        raise InvalidArgumentError("backend", backend, "an AttentionBackendEnum member")
    if is_mamba:
        raise InvalidArgumentError("is_mamba", is_mamba, "False: there are no Mamba layers here")
    if class_path is not None:
        module, _, attr = class_path.rpartition(".")
        registry.register_target(backend.name, f"{module}:{attr}")
        return lambda cls: cls
    site = caller_location()

    def decorator(cls: T) -> T:
        # recorded now, checked when first asked for: the impl the class names is often
        # defined below it, so it does not exist yet (upstream's decorator is lazy too)
        registry.register_deferred(cls, name=backend.name, registered_at=site)
        return cls

    return decorator
