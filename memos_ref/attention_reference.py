"""The torch reference of attention over dense and paged K/V: the oracle every kernel is checked against.

:func:`dense_attention` attends one sequence's queries over its dense K/V (GQA, causal within the new tokens, and
the optional mask, sliding window, softcap and sinks of the models the package runs); :func:`gather_kv` reads one
sequence's K/V out of the pool with one copy of *its* blocks; :func:`paged_attention` has the kernels' signature
(one layer's K and V caches in pool layout, block tables, sequence lengths) and attends every row through them.
The switch that sends a step to the Triton kernels instead, and the per-step path, are in
:mod:`memos_ref.attention` (which re-exports these names).
"""

from __future__ import annotations

import math
import threading

import torch

from memos_ref.errors import ArgumentTypeError, DTypeError, InvalidArgumentError, ShapeError, check_type
from memos_ref.paged.pool import gather_blocks

__all__ = ["dense_attention", "drop_trivial_mask", "gather_kv", "paged_attention"]


def _check_options(
    scale: float | None, sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None, hq: int
) -> None:
    """Validate the optional attention features (before anything is computed)."""
    if scale is not None:
        check_type("scale", scale, (int, float))
    if sliding_window is not None:
        check_type("sliding_window", sliding_window, int)
        if sliding_window <= 0:
            raise InvalidArgumentError(f"sliding_window: expected a positive int (keys kept), got {sliding_window}")
    if softcap is not None:
        check_type("softcap", softcap, (int, float))
        if not softcap > 0:
            raise InvalidArgumentError(f"softcap: expected a positive float, got {softcap}")
    if sinks is not None:
        check_type("sinks", sinks, torch.Tensor)
        if sinks.shape != (hq,):
            raise ShapeError(f"sinks: expected one logit per query head [{hq}], got {tuple(sinks.shape)}")


def _mask_rows(mask: torch.Tensor, h: int, group: int, nq: int, s: int) -> torch.Tensor:
    """An attention mask ``[Q, S]``, ``[1, Q, S]`` or ``[Hq, Q, S]`` in the ``[H or 1, G·Q, S]`` row order of
    :func:`dense_attention` (bool: True = may attend; float: added to the logits)."""
    if mask.ndim == 2:
        mask = mask[None]
    if mask.ndim != 3 or mask.shape[1:] != (nq, s) or mask.shape[0] not in (1, h * group):
        raise ShapeError(
            f"attention mask: expected [{nq}, {s}], [1, {nq}, {s}] or [{h * group}, {nq}, {s}] "
            f"(queries, keys), got {tuple(mask.shape)}"
        )
    if mask.shape[0] == 1:
        return mask.repeat(1, group, 1)  # [1, G·Q, S]
    return mask.reshape(h, group * nq, s)  # [H, G·Q, S]


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of the *last* ``Q`` positions: ``q [Hq, Q, D]`` against ``k, v [H, S, D]``.

    Query i sits at absolute position ``S - Q + i`` and sees keys ``0..S-Q+i``. Scores and softmax in fp32.

    Optional features (each as transformers' eager attention computes it):

    * ``mask``: ``[Q, S]``, ``[1, Q, S]`` or ``[Hq, Q, S]``; bool (True = may attend, e.g. padding) or float
      (added to the logits), combined with the causal mask. A query that may attend to no key (a left-padding
      position) gets zeros, not NaN.
    * ``sliding_window``: query at position p sees only keys ``p - W + 1 .. p`` (the last ``W``).
    * ``softcap``: logits become ``tanh(logits / c) · c`` (Gemma 2), before masking.
    * ``sinks``: ``[Hq]`` one extra logit per query head in the softmax denominator (GPT-OSS ``s_aux``):
      ``p_j = exp(l_j) / (exp(sink) + Σ exp(l_i))``.
    """
    for name, value in (("q", q), ("k", k), ("v", v)):
        check_type(name, value, torch.Tensor)
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ShapeError(
            f"expected q [Hq, Q, D] and k, v [H, S, D] of one D, got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if not q.dtype == k.dtype == v.dtype:
        raise DTypeError(f"q, k, v: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    hq, nq, d = q.shape
    h, s, _ = k.shape
    if hq % h:
        raise ShapeError(f"query heads ({hq}) must be a multiple of KV heads ({h})")
    if nq > s:
        raise ShapeError(f"{nq} queries but only {s} keys: the queries are the newest of the keys")
    _check_options(scale, sliding_window, softcap, sinks, hq)
    if mask is not None:
        check_type("mask", mask, torch.Tensor)
    group = hq // h
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(h, group * nq, d)  # [H, G·Q, D]: the query heads of each KV head together
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [H, G·Q, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if nq > 1 or (sliding_window is not None and sliding_window < s):  # one newest query sees every key
        q_pos = torch.arange(s - nq, s, device=q.device).repeat(group)  # [G·Q]
        k_pos = torch.arange(s, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]  # [G·Q, S]
        if sliding_window is not None:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        rows = _mask_rows(mask.to(q.device), h, group, nq, s)  # [H or 1, G·Q, S]
        scores = scores.masked_fill(~rows, float("-inf")) if rows.dtype == torch.bool else scores + rows.float()
    if sinks is not None:
        sink = sinks.to(q.device).float().reshape(h, group, 1).repeat_interleave(nq, dim=1)  # [H, G·Q, 1]
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    if mask is not None or sliding_window is not None:
        probs = probs.nan_to_num(0.0)  # a query that may see no key (left padding) attends to nothing
    out = probs.to(v.dtype) @ v  # [H, G·Q, D]
    return out.reshape(hq, nq, d)


_scratch = threading.local()  # per thread: reusable buffers for gathers whose results never leave this module


def _scratch_buffer(slot: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``like``'s dtype and device from this thread's scratch ``slot``, valid until
    the slot's next use (grown by doubling: decode steps reuse the same pages instead of faulting in new ones)."""
    numel = math.prod(shape)
    key = (slot, like.dtype, like.device)
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: writable both inside and outside inference mode
            buf = buffers[key] = like.new_empty(max(numel, 2 * (buf.numel() if buf is not None else 0)))
    return buf[:numel].view(shape)


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    *,
    reuse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[H, seq_len, D]`` K and V of one sequence from ``[num_blocks, H, T, D]`` caches.

    One copy of the sequence's own blocks, whatever the pool's size (:func:`~memos_ref.paged.pool.gather_blocks`:
    a strided copy per run of consecutive block ids) into ``[H, n, T, D]`` order, whose ``[H, n·T, D]`` reshape
    is a view. (``index_select`` on the permuted per-layer view instead made the whole layer of the pool
    contiguous first: 142 ms for 4,096 tokens in a 4,096-block pool.) ``reuse=True`` fills this thread's scratch
    buffers instead of new tensors: the results are valid only until the next ``reuse`` gather in this thread.
    """
    t = key_cache.shape[2]
    blocks = block_table[: -(-seq_len // t)].tolist()
    h, d = key_cache.shape[1], key_cache.shape[3]
    shape = (h, len(blocks), t, d)
    k_out = _scratch_buffer("k", shape, key_cache) if reuse else None
    v_out = _scratch_buffer("v", shape, value_cache) if reuse else None
    k = gather_blocks(key_cache, blocks, k_out).reshape(h, -1, d)[:, :seq_len]  # [H, n, T, D] -> [H, S, D]
    v = gather_blocks(value_cache, blocks, v_out).reshape(h, -1, d)[:, :seq_len]
    return k, v


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    query_lens: torch.Tensor | None = None,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest tokens over its paged K/V (decode: one query; chunked prefill: many).

    Args:
        query: ``[B, Hq, Q, D]``; sequence b's queries are rows ``0..query_lens[b]-1``, its newest tokens.
        key_cache, value_cache: one layer of the pool, ``[num_blocks, H, T, D]`` each.
        block_tables: ``[B, max_blocks]`` block ids (padding -1).
        seq_lens: ``[B]`` tokens in each sequence, the new ones included.
        query_lens: ``[B]`` new tokens per sequence (default: Q for all).
        scale: softmax scale (default ``1/sqrt(D)``).
        mask: ``[B, 1 or Hq, Q, K]`` with ``K >= max(seq_lens)`` (key j = position j of the sequence), bool
            (True = may attend) or float (added to the logits): padding, or any pattern transformers built.
        sliding_window, softcap, sinks: as in :func:`dense_attention`.

    Returns:
        ``[B, Hq, Q, D]``; rows past a sequence's ``query_lens`` are zero.
    """
    for name, value in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        check_type(name, value, torch.Tensor)
    if query.ndim != 4:
        raise ShapeError(f"query: expected [batch, q_heads, queries, head_dim], got {tuple(query.shape)}")
    b, hq, nq, d = query.shape
    if key_cache.shape != value_cache.shape or key_cache.ndim != 4 or key_cache.shape[3] != d:
        raise ShapeError(
            f"key/value caches must both be [num_blocks, kv_heads, block_size, head_dim={d}], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if not query.dtype == key_cache.dtype == value_cache.dtype:
        raise DTypeError(
            f"query, key_cache, value_cache: expected one dtype, got {query.dtype}, {key_cache.dtype}, "
            f"{value_cache.dtype}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ShapeError(
            f"block_tables [{b}, *] and seq_lens [{b}] expected, got {tuple(block_tables.shape)} "
            f"and {tuple(seq_lens.shape)}"
        )
    for name, value in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_lens", query_lens)):
        if value is not None and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
            raise ArgumentTypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
    _check_options(scale, sliding_window, softcap, sinks, hq)
    if mask is not None:
        check_type("mask", mask, torch.Tensor)
        longest = int(seq_lens.max()) if b else 0
        if mask.ndim != 4 or mask.shape[0] not in (1, b) or mask.shape[2] != nq or mask.shape[3] < longest:
            raise ShapeError(
                f"mask: expected [{b}, 1 or {hq}, {nq}, >= {longest}] (batch, heads, queries, keys), got "
                f"{tuple(mask.shape)}"
            )
    lens = seq_lens.tolist()
    plain = mask is None and sliding_window is None and softcap is None and sinks is None
    if plain and b and min(lens) >= nq and (query_lens is None or query_lens.tolist() == [nq] * b):
        return _attend_batched(query, key_cache, value_cache, block_tables, lens, scale)
    query_lens = query_lens if query_lens is not None else torch.full((b,), nq, dtype=torch.long)
    out = torch.zeros_like(query)
    for i in range(b):
        n, nq_i = int(seq_lens[i]), int(query_lens[i])
        if nq_i == 0 or n == 0:
            continue
        if nq_i > n or nq_i > nq:
            raise ShapeError(f"sequence {i}: {nq_i} queries but {n} tokens (and Q={nq})")
        k, v = gather_kv(key_cache, value_cache, block_tables[i], n, reuse=True)  # used here only
        row_mask = None if mask is None else mask[i if mask.shape[0] > 1 else 0, :, :nq_i, :n]
        out[i, :, :nq_i] = dense_attention(
            query[i, :, :nq_i],
            k,
            v,
            scale=scale,
            mask=row_mask,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
    return out


def _gather_rows(
    cache: torch.Tensor, block_tables: torch.Tensor, lens: list[int], width: int, slot: str
) -> torch.Tensor:
    """K (or V) of every row from ``cache [N, H, T, D]`` into this thread's scratch ``[B, H, width, D]`` (valid until
    the slot's next use). Positions past a row's length are zero (a stale or poisoned value there would turn
    the zero weights of the padding into NaN). One row: a strided copy per run of consecutive blocks; several
    rows: one ``index_select`` of every row's blocks and one re-layout copy."""
    b, (h, t, d) = len(lens), cache.shape[1:]
    nb = -(-width // t)
    out = _scratch_buffer(slot, (b, h, nb, t, d), cache)
    if b == 1:
        gather_blocks(cache, block_tables[0, :nb].tolist(), out[0])
    else:
        index = block_tables[:, :nb].clamp(min=0).reshape(-1)  # padding -1 reads block 0, zeroed below
        picked = cache.index_select(0, index.to(cache.device))  # [B·nb, H, T, D]: the rows' blocks only
        out.copy_(picked.view(b, nb, h, t, d).permute(0, 2, 1, 3, 4))
    flat = out.view(b, h, nb * t, d)
    for i, n in enumerate(lens):
        if n < nb * t:
            flat[i, :, n:] = 0
    return flat[:, :, :width]


def _attend_batched(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: list[int],
    scale: float | None,
) -> torch.Tensor:
    """:func:`paged_attention` of every row at once (no mask, window, softcap or sinks; every row has all ``Q``
    queries): one gather of the rows' blocks, rows padded to the longest, keys past a row's length masked, the
    same fp32 scores and softmax as :func:`dense_attention`. Returns ``[B, Hq, Q, D]``."""
    b, hq, nq, d = query.shape
    h = key_cache.shape[1]
    if hq % h:
        raise ShapeError(f"query heads ({hq}) must be a multiple of KV heads ({h})")
    group, width = hq // h, max(lens)
    k = _gather_rows(key_cache, block_tables, lens, width, "k")  # [B, H, S, D]
    v = _gather_rows(value_cache, block_tables, lens, width, "v")
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qg = query.reshape(b, h, group * nq, d)  # [B, H, G·Q, D]
    scores = (qg @ k.transpose(-1, -2)).float() * scale  # [B, H, G·Q, S]
    if nq > 1 or min(lens) < width:  # causal within the new tokens, and each row's own length
        q_pos = (torch.tensor(lens)[:, None] - nq + torch.arange(nq)).repeat(1, group)  # [B, G·Q]
        allowed = torch.arange(width)[None, None, :] <= q_pos[:, :, None]  # [B, G·Q, S]
        scores = scores.masked_fill(~allowed.to(scores.device)[:, None], float("-inf"))
    out = scores.softmax(-1).to(v.dtype) @ v  # [B, H, G·Q, D]
    return out.reshape(b, hq, nq, d)


def drop_trivial_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``None`` for a bool mask that allows everything (so a decode step can still take the kernel)."""
    if mask is not None and mask.dtype == torch.bool and bool(mask.all()):
        return None
    return mask
