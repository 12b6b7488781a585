"""Compatibility adapter: runs legacy attention backends (which write the KV
cache inside ``forward`` or through ``do_kv_cache_update``) as new-style ones,
with a :class:`LegacyBackendWarning` pointing at ``migration_guide.md``."""

from shim.adapter import LegacyBackendRuntimeError, adapt_legacy_backend
from shim.declarations import LegacyGeneration, is_legacy_backend, legacy_generation
from shim.legacy import LegacyCommonAttentionMetadata
from shim.warnings import LegacyBackendWarning

__all__ = [
    "LegacyBackendRuntimeError",
    "LegacyBackendWarning",
    "LegacyCommonAttentionMetadata",
    "LegacyGeneration",
    "adapt_legacy_backend",
    "is_legacy_backend",
    "legacy_generation",
]
