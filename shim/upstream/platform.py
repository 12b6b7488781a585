"""``vllm.platforms``: the device capability type and a ``current_platform`` that
answers what a backend asks of it, from torch."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["DeviceCapability", "Platform", "current_platform"]


class DeviceCapability(NamedTuple):
    """A compute capability; compares as a ``(major, minor)`` tuple."""

    major: int
    minor: int

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"

    def to_int(self) -> int:
        """``major * 10 + minor`` (``9.0`` -> 90), as upstream spells capabilities."""
        return self.major * 10 + self.minor


class Platform:
    """What a legacy backend may ask the platform: the device type and capability."""

    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is None

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and torch.version.hip is not None

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_cpu(self) -> bool:
        return not torch.cuda.is_available()

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(device_id)
        return DeviceCapability(major, minor)

    def has_device_capability(self, capability: tuple[int, int] | int,
                              device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, int):
            return current.to_int() >= capability
        return current >= capability

    def is_device_capability(self, capability: tuple[int, int] | int,
                             device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, int):
            return current.to_int() == capability
        return current == capability

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


@functools.cache
def _platform() -> Platform:
    return Platform()


current_platform: Platform = _platform()
