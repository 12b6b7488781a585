from __future__ import annotations

import torch

from shim import legacy
from shim.legacy import reshape_and_cache_flash  # E: deprecated

k = torch.zeros(1, 1, 8)
cache = torch.zeros(4, 16, 1, 8)
legacy.reshape_and_cache_flash(k, k, cache, cache, torch.tensor([0]), "auto",  # E: deprecated
                               torch.ones(1), torch.ones(1))
del reshape_and_cache_flash
