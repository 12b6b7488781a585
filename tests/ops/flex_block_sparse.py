"""What Inductor's compiled ``flex_attention`` computes, on CPU, and what its block
lists must satisfy.

Eager ``flex_attention`` (and Dynamo with ``aot_eager``) evaluates ``mask_mod`` over
every (query, key) pair and never reads the ``BlockMask``'s block lists. Inductor's
Triton kernels (``flex_attention.py.jinja``, ``flex_decode.py.jinja``) read only the
lists: for query block ``qb`` of batch entry ``z`` and head ``h`` they walk the
``kv_num_blocks`` first entries of ``kv_indices`` applying ``score_mod`` and
``mask_mod``, then the ``full_kv_num_blocks`` first entries of ``full_kv_indices``
applying ``score_mod`` only; keys past the key length are masked; every listed key row
is multiplied by its probability, zero or not (so a NaN row poisons the row's output);
a block listed twice is attended twice; nothing else is read. Both lists are found at
one offset computed from the partial lists' strides (the decode kernel in every torch
version, the forward kernel before 2.13).

:func:`block_sparse_attention` computes exactly that in float64, and
:func:`block_list_errors` checks a ``BlockMask`` against its own ``mask_mod`` at block
granularity (or the exact visibility :class:`PageTablesSeen` recorded, where a
page_table decode's block mask carries a constant one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                    torch.Tensor]


class PageTablesSeen:
    """``flex_paged``'s page_table mode tables (``_PageTables``), recorded as built,
    with the exact visibility of each block mask (its own ``mask_mod`` may be a
    constant: a single-query decode where ``lists_only``)."""

    def __init__(self, monkeypatch: Any) -> None:
        from vllm.attention.ops import flex_paged

        self.tables: list[Any] = []
        build = flex_paged._page_block_mask

        def record(*args: Any, **kwargs: Any) -> Any:
            self.tables.append(build(*args, **kwargs))
            return self.tables[-1]

        monkeypatch.setattr(flex_paged, "_page_block_mask", record)

    def exact_mask(self, block_mask: Any) -> Any:
        """``block_mask``'s exact visibility (None: not a page_table mask; its own)."""
        return next((t.exact_mask for t in self.tables if t.block_mask is block_mask), None)


@dataclass(frozen=True)
class _Lists:
    """A block mask's lists on the host, flat, with the partial lists' strides."""

    q_block: int
    kv_block: int
    num: torch.Tensor
    idx: torch.Tensor
    full_num: torch.Tensor | None
    full_idx: torch.Tensor | None
    num_shape: tuple[int, ...]
    num_strides: tuple[int, ...]
    idx_strides: tuple[int, ...]

    @staticmethod
    def of(block_mask: Any) -> _Lists:
        num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
        fnum, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices

        def flat(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().cpu().contiguous().reshape(-1)

        qb, kvb = block_mask.BLOCK_SIZE
        n, i = flat(num), flat(idx)
        assert n is not None and i is not None
        return _Lists(int(qb), int(kvb), n, i, flat(fnum), flat(fidx), tuple(num.shape),
                      num.stride(), idx.stride())

    def walk(self, z: int, h: int, qb: int, kv_len: int) -> tuple[list[int], list[int]]:
        """(partial, full) block ids the kernel walks for entry ``z``, head ``h``, query
        block ``qb``: each list's counted prefix, at most ``cdiv(kv_len, kv_block)``
        entries, read at the partial lists' offsets. Raises IndexError where that read
        leaves a list's storage (on CUDA: whatever memory lies there)."""
        cap = max(1, -(-kv_len // self.kv_block))
        zz, hh = z % self.num_shape[0], h % self.num_shape[1]
        at_num = zz * self.num_strides[0] + hh * self.num_strides[1] + qb * self.num_strides[2]
        at_idx = zz * self.idx_strides[0] + hh * self.idx_strides[1] + qb * self.idx_strides[2]
        out: list[list[int]] = []
        for num, idx in ((self.num, self.idx), (self.full_num, self.full_idx)):
            if num is None or idx is None:
                out.append([])
                continue
            if at_num >= num.numel():
                raise IndexError(f"count read at {at_num}, past the {num.numel()} stored")
            n = min(int(num[at_num]), cap)
            if n and at_idx + n > idx.numel():
                raise IndexError(f"ids read at {at_idx}..{at_idx + n}, past the "
                                 f"{idx.numel()} stored")
            out.append([int(x) for x in idx[at_idx: at_idx + n]])
        return out[0], out[1]


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any,
                           *, scale: float, score_mod: ScoreMod | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inductor's flex kernels' function, in float64 on CPU: ``q`` ``[B, Hq, Lq, D]``,
    ``k``/``v`` ``[B or 1, H, Lk, D(v)]`` (GQA: ``Hq`` a multiple of ``H``). Returns the
    output ``[B, Hq, Lq, Dv]`` and the natural-log log-sum-exp ``[B, Hq, Lq]`` (``-inf``
    and a zero row where a row sees no key, as the kernels write them)."""
    lists = _Lists.of(block_mask)
    b, hq, lq, _ = q.shape
    h, lk = k.shape[1], k.shape[2]
    g = hq // h
    qbs, kvb = lists.q_block, lists.kv_block
    out = torch.zeros(b, hq, lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, hq, lq), -math.inf, dtype=torch.float64)
    mask_mod = block_mask.mask_mod
    for z in range(b):
        zk = z % k.shape[0]
        for head in range(hq):
            kh = head // g
            for qb in range(-(-lq // qbs)):
                rows = torch.arange(qb * qbs, min((qb + 1) * qbs, lq))
                part, full = lists.walk(z, head, qb, lk)
                scores, values = [], []
                for blocks, masked in ((part, True), (full, False)):
                    for blk in blocks:
                        cols = torch.arange(blk * kvb, (blk + 1) * kvb)
                        inside = cols < lk
                        c = cols.clamp(max=lk - 1)
                        kk = torch.where(inside[:, None], k[zk, kh, c].double(), 0.0)
                        vv = torch.where(inside[:, None], v[zk, kh, c].double(), 0.0)
                        s = q[z, head, rows].double() @ kk.T * scale
                        zt, ht = torch.tensor(z), torch.tensor(head)
                        if score_mod is not None:
                            s = score_mod(s, zt, ht, rows[:, None], c[None, :])
                        keep = inside[None, :].expand_as(s)
                        if masked:
                            keep = keep & mask_mod(zt, ht, rows[:, None], c[None, :]).expand_as(s)
                        scores.append(s.masked_fill(~keep, -math.inf))
                        values.append(vv)
                if not scores:
                    continue
                s_all = torch.cat(scores, dim=1)
                v_all = torch.cat(values, dim=0)
                m = s_all.max(dim=1).values
                m_safe = torch.where(torch.isfinite(m), m, 0.0)
                p = torch.exp(s_all - m_safe[:, None])
                total = p.sum(dim=1)
                acc = p @ v_all   # a NaN row of a listed block poisons the row, as on CUDA
                seen = total > 0
                out[z, head, rows] = acc / torch.where(seen, total, 1.0)[:, None]
                lse[z, head, rows] = torch.where(seen, m_safe + torch.log(total), -math.inf)
    return out, lse


def live_rows(q: torch.Tensor, query_lens: tuple[int, ...]) -> torch.Tensor:
    """Which query rows of a compiled call's ``q`` ``[entries, Hq, q_len, D]`` are real,
    bool ``[entries, q_len]``: gather mode (one entry) packs the batch's tokens, then
    padding; page_table mode gives request ``i`` entry ``i`` and its first
    ``query_lens[i]`` rows."""
    entries, q_len = q.shape[0], q.shape[2]
    if entries == 1:
        return torch.arange(q_len)[None, :] < max(sum(query_lens), 1)
    lens = torch.zeros(entries, dtype=torch.int64)
    lens[:len(query_lens)] = torch.tensor(query_lens)
    return torch.arange(q_len)[None, :] < lens[:, None]


def dense_mask(block_mask: Any, batch: int, heads: int, q_len: int, kv_len: int,
               mask_mod: Any = None) -> torch.Tensor:
    """``mask_mod`` (default the block mask's) over every (entry, head, query, key): bool
    ``[B, H, Lq, Lk]`` on the host, evaluated on the block mask's device."""
    dev = block_mask.kv_num_blocks.device
    mm = block_mask.mask_mod if mask_mod is None else mask_mod
    qi = torch.arange(q_len, device=dev)[:, None]
    ki = torch.arange(kv_len, device=dev)[None, :]
    out = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    for z in range(batch):
        for h in range(heads):
            zt, ht = torch.tensor(z, device=dev), torch.tensor(h, device=dev)
            out[z, h] = mm(zt, ht, qi, ki).expand(q_len, kv_len).cpu()
    return out


def block_list_errors(block_mask: Any, *, q_len: int, kv_len: int, batch: int | None = None,
                      live_rows: torch.Tensor | None = None, max_errors: int = 10,
                      mask_mod: Any = None) -> list[str]:
    """What is wrong with ``block_mask`` for a call over ``q_len`` queries, ``kv_len``
    keys and ``batch`` entries (empty: nothing), against its own ``mask_mod`` (or the
    exact visibility ``mask_mod`` where the block mask carries a constant one) at block
    granularity, the lists read as the kernels read them. ``live_rows`` (bool
    ``[batch, q_len]``, default all): the query rows whose output is used; padding rows
    are free to see anything.

    * every listed full block is all True (over its live queries, in-range keys);
    * every listed partial block has at least one True;
    * every block not listed is all False, and no block is listed twice;
    * partial and full lists of one shape, int32, contiguous; counts within the lists'
      width, ids in range, query blocks covering ``q_len``, ``seq_lengths`` the call's.
    """
    errors: list[str] = []
    if tuple(block_mask.seq_lengths) != (q_len, kv_len):
        errors.append(f"seq_lengths {tuple(block_mask.seq_lengths)} != the call's "
                      f"{(q_len, kv_len)}")
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    fnum, fidx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    for name, t in (("kv_num_blocks", num), ("kv_indices", idx),
                    ("full_kv_num_blocks", fnum), ("full_kv_indices", fidx)):
        if t is None:
            continue
        if t.dtype != torch.int32:
            errors.append(f"{name} dtype {t.dtype}, the kernels read int32")
        if not t.is_contiguous():
            errors.append(f"{name} strides {t.stride()} for shape {tuple(t.shape)}: "
                          "not contiguous, as the kernels address it")
    if fnum is not None and (fnum.shape != num.shape or fidx.shape != idx.shape):
        errors.append(f"full lists {tuple(fnum.shape)} / {tuple(fidx.shape)} differ in shape "
                      f"from the partial lists {tuple(num.shape)} / {tuple(idx.shape)}: the "
                      "kernels read both at the partial lists' offsets")
    lists = _Lists.of(block_mask)
    qbs, kvb = lists.q_block, lists.kv_block
    nq = -(-q_len // qbs)
    nk = -(-kv_len // kvb)
    if num.shape[2] < nq:
        errors.append(f"{num.shape[2]} query blocks listed, the call has {nq}")
    entries = num.shape[0] if batch is None else batch
    heads = num.shape[1]
    truth = dense_mask(block_mask, num.shape[0], heads, q_len, kv_len, mask_mod)
    if truth.shape[0] < entries:
        truth = truth.expand(entries, -1, -1, -1)
    live = (torch.ones(entries, q_len, dtype=torch.bool) if live_rows is None
            else live_rows.cpu().bool())
    for z in range(entries):
        for h in range(heads):
            for qb in range(nq):
                try:
                    part, full = lists.walk(z, h, qb, kv_len)
                except IndexError as exc:
                    errors.append(f"z{z} h{h} qb{qb}: {exc}")
                    return errors
                for blk in part + full:
                    if not 0 <= blk < nk:
                        errors.append(f"z{z} h{h} qb{qb}: block {blk} outside [0, {nk})")
                seen = part + full
                if len(set(seen)) != len(seen):
                    errors.append(f"z{z} h{h} qb{qb}: a block listed twice: {sorted(seen)}")
                rows = slice(qb * qbs, min((qb + 1) * qbs, q_len))
                tile = truth[z, h, rows][live[z, rows]]                  # [live rows, kv_len]
                padded = torch.zeros(tile.shape[0], nk * kvb, dtype=torch.bool)
                padded[:, :kv_len] = tile
                cells = padded.view(-1, nk, kvb)
                some = cells.any(dim=2).any(dim=0)                         # [nk]
                every = torch.ones(kv_len, dtype=torch.bool)
                if tile.shape[0]:
                    every = tile.all(dim=0)
                every_pad = torch.ones(nk * kvb, dtype=torch.bool)
                every_pad[:kv_len] = every
                whole = every_pad.view(nk, kvb).all(dim=1)                 # [nk]
                in_full = torch.zeros(nk, dtype=torch.bool)
                in_part = torch.zeros(nk, dtype=torch.bool)
                in_full[[b for b in full if 0 <= b < nk]] = True
                in_part[[b for b in part if 0 <= b < nk]] = True
                for kb in (in_full & ~whole).nonzero().flatten().tolist():
                    errors.append(f"z{z} h{h} qb{qb}: full block {kb} has masked pairs")
                for kb in (in_part & ~some).nonzero().flatten().tolist():
                    errors.append(f"z{z} h{h} qb{qb}: partial block {kb} sees nothing")
                for kb in (~in_full & ~in_part & some).nonzero().flatten().tolist():
                    errors.append(f"z{z} h{h} qb{qb}: block {kb} has visible pairs, "
                                  "not listed")
                if len(errors) >= max_errors:
                    return errors[:max_errors]
    return errors
