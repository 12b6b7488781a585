"""OOT_LEGACY: an out-of-tree paged-attention backend in its pre-split form."""
