"""TREE_ATTN: the draft-tree mask travels in its metadata. No tree means causal (the
conformance kit's batches); a static ``draft_tree`` applies to requests whose query
length is the tree size and that have context; per-step ``tree_masks`` win."""

from __future__ import annotations

import pytest
import torch

from tests.backends.grid import DEVICES, dense, rel_err
from tests.helpers import fill_random_bytes
from vllm.attention import allocate_kv_cache
from vllm.attention.backends.tree_attn import TreeAttentionBackend, TreeAttentionMetadataBuilder
from vllm.attention.batch import make_paged_batch
from vllm.attention.errors import InvalidArgumentError, UnsupportedBackendError
from vllm.attention.layer import Attention
from vllm.forward_context import set_forward_context

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
PARENTS = [-1, 0, 0, 1, 1, 2]


def _ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    m = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        p = parents[i]
        while p >= 0:
            m[i, p] = True
            p = parents[p]
    return m


def _run(device: str, builder_kwargs: dict[str, object], build_kwargs: dict[str, object],
         masks: list[torch.Tensor | None]) -> str | None:
    """Run a mixed tree/causal batch; returns the compute path that ran."""
    g = torch.Generator().manual_seed(11)
    dev = torch.device(device)
    qlens, clens = [6, 9, 6, 1], [21, 0, 0, 40]  # tree, prefill, tree-sized prefill, decode
    bs, h, kvh, d = 16, 8, 2, 64
    batch = make_paged_batch(qlens, clens, block_size=bs, generator=g, device=dev)
    layer = Attention(num_heads=h, num_kv_heads=kvh, head_size=d, scale=d ** -0.5,
                      backend=TreeAttentionBackend, layer_name="t", logits_soft_cap=8.0).to(dev)
    cache = allocate_kv_cache(TreeAttentionBackend, num_blocks=batch.num_blocks, block_size=bs,
                              num_kv_heads=kvh, head_size=d, model_dtype=torch.float32,
                              device=dev)
    fill_random_bytes(cache, 2)
    layer.bind_kv_cache(cache, bs)
    total = [c + q for c, q in zip(clens, qlens)]
    ks = [torch.randn(t, kvh, d, generator=g) for t in total]
    vs = [torch.randn(t, kvh, d, generator=g) for t in total]
    qs = [torch.randn(q, h, d, generator=g) for q in qlens]
    k_ctx = torch.cat([k[:c] for k, c in zip(ks, clens)]).to(dev)
    v_ctx = torch.cat([v[:c] for v, c in zip(vs, clens)]).to(dev)
    layer.kv_cache_writer.write(k_ctx, v_ctx, cache, batch.context_slots, layer.kv_quant)
    builder = TreeAttentionMetadataBuilder(layer.spec, dev, **builder_kwargs)  # type: ignore[arg-type]
    meta = builder.build(batch.common, **build_kwargs)  # type: ignore[arg-type]
    with set_forward_context(attn_metadata={"t": meta}, slot_mapping={"t": batch.new_slots}):
        out = layer(torch.cat(qs).to(dev), torch.cat([k[c:] for k, c in zip(ks, clens)]).to(dev),
                    torch.cat([v[c:] for v, c in zip(vs, clens)]).to(dev))
    at = 0
    for q, k, v, c, m in zip(qs, ks, vs, clens, masks):
        n = q.shape[0]
        if m is None:
            ref = dense(q, k, v, scale=d ** -0.5, causal=True, cap=8.0)
        else:
            visible = torch.cat([torch.ones(n, c, dtype=torch.bool), m], dim=1)
            ref = dense(q, k, v, scale=d ** -0.5, causal=False, cap=8.0, visible=visible)
        assert rel_err(out[at: at + n], ref) < 1e-4
        at += n
    path: str | None = getattr(layer.impl, "last_compute_path")
    return path


@pytest.mark.parametrize("device", DEVICES)
def test_no_tree_is_causal(device: str) -> None:
    _run(device, {}, {}, [None, None, None, None])


@pytest.mark.parametrize("device", DEVICES)
def test_static_draft_tree(device: str) -> None:
    tree = _ancestors(PARENTS)
    # the tree-sized prefill (no context) stays causal; the decode (1 token) too
    _run(device, {"draft_tree": PARENTS}, {}, [tree, None, None, None])


@pytest.mark.parametrize("device", DEVICES)
def test_per_step_masks_win(device: str) -> None:
    chain = torch.ones(6, 6, dtype=torch.bool).tril()
    star = torch.eye(6, dtype=torch.bool)
    star[:, 0] = True
    _run(device, {"draft_tree": PARENTS}, {"tree_masks": [star, None, chain, None]},
         [star, None, chain, None])


def test_metadata_carries_the_mask_only_when_a_tree_is_present() -> None:
    batch = make_paged_batch([6, 1], [3, 9], block_size=16)
    spec = Attention(num_heads=4, head_size=64, scale=0.1, backend=TreeAttentionBackend,
                     layer_name="x").spec
    assert TreeAttentionMetadataBuilder(spec, torch.device("cpu")).build(batch.common).tree_mask is None
    meta = TreeAttentionMetadataBuilder(spec, torch.device("cpu"), draft_tree=PARENTS).build(batch.common)
    assert meta.tree_mask is not None and tuple(meta.tree_mask.shape) == (7, 6)
    assert torch.equal(meta.tree_mask[:6], _ancestors(PARENTS))


def test_bad_tree_is_a_clear_error() -> None:
    spec = Attention(num_heads=4, head_size=64, scale=0.1, backend=TreeAttentionBackend,
                     layer_name="x").spec
    with pytest.raises(InvalidArgumentError, match=r"parents\[2\]: got 5"):
        TreeAttentionMetadataBuilder(spec, torch.device("cpu"), draft_tree=[-1, 0, 5])
    with pytest.raises(UnsupportedBackendError, match="sliding_window=8, TREE_ATTN supports only None"):
        Attention(num_heads=4, head_size=64, scale=0.1, backend=TreeAttentionBackend,
                  layer_name="x", sliding_window=8)
