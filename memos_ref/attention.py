"""Attention over dense and paged K/V: the torch reference, and the one switch to the kernels.

``paged_attention`` has a kernel-shaped signature (one layer's K and V caches in pool layout, block tables,
sequence lengths), the same inputs a Triton or CUDA paged-attention kernel takes, so the kernels of
``memos_kernels`` are checked against it element for element.

Where a decode step runs (:func:`paged_decode`) is chosen by ``MEMOS_REF_KERNELS``:

* ``auto`` (default): Triton on CUDA tensors when Triton is installed, the reference otherwise;
* ``reference``: always the torch reference;
* ``triton``: always Triton (CUDA tensors);
* ``interpret``: Triton's interpreter on CPU tensors (slow; for tests and learning). It must be chosen before
  Triton is first imported — this module sets ``TRITON_INTERPRET=1`` itself when it sees ``interpret``.

The package's forward, the engine and ``PagedCache`` (its ``memos_paged`` attention function included) reach
the kernels through one per-step decision, :func:`step_path`, taken once per :class:`~memos_ref.paged.step.StepBatch`
and kept in ``step.notes["path"]``: ``"plain"`` (a float pool: writes with ``memos_kernels``' ``write_kv``, decode
with ``paged_decode_attention``), ``"int8"`` (a streaming per-token int8 pool: ``write_kv_int8``, the int8 decode
kernel), ``"fp8"`` (a streaming fp8 pool: the pool grows its block scales and encodes, the fp8 decode kernel
reads), ``"kivi"`` (a KIVI pool: the pool stages and seals, the KIVI decode kernel reads codes and staging), or
``"reference"`` (torch). :func:`write_step` writes a layer through it and :func:`attend_step` attends. Decode
steps (one query per row, no mask, window, softcap or sinks) take the kernels, and so do prefill chunks of a float
pool (the tiled causal prefill kernel); quantized prefill and feature cases run the reference (the oracle the
kernels are tested against). A kernel that fails raises
:class:`~memos_ref.errors.BackendUnavailableError` naming the kernel (``MEMOS_REF_KERNELS=reference`` avoids it).
(``memos_ref.ops`` re-exports the switch for older imports.)

Cost: the reference reads a sequence's pages with one indexed copy of *its* blocks (:func:`gather_kv`), so a
decode step costs the same in a pool of 300 blocks or of 30,000.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from memos_ref.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    ConfigError,
    InvalidArgumentError,
    KVCacheError,
    ShapeError,
    check_type,
)
from memos_ref.paged.pool import gather_blocks

if TYPE_CHECKING:
    from memos_ref.paged.sequence import SequenceCache
    from memos_ref.paged.step import StepBatch

__all__ = [
    "MODES",
    "PATHS",
    "attend_sequences",
    "attend_step",
    "dense_attention",
    "gather_kv",
    "kernel_mode",
    "paged_attention",
    "paged_decode",
    "step_path",
    "use_kernels",
    "write_step",
]

#: The values of ``MEMOS_REF_KERNELS``.
MODES = ("auto", "reference", "triton", "interpret")

#: What a step runs on (:func:`step_path`).
PATHS = ("reference", "plain", "int8", "fp8", "kivi")


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


def _drop_trivial_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``None`` for a bool mask that allows everything (so a decode step can still take the kernel)."""
    if mask is not None and mask.dtype == torch.bool and bool(mask.all()):
        return None
    return mask


def attend_sequences(
    query: torch.Tensor,
    sequences: Sequence[SequenceCache],
    layer: int,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest queries ``[B, Hq, Q, D]`` over its own pages in one layer.

    Builds the block tables and lengths :func:`paged_attention` takes (the call a kernel replaces); a pool in
    several segments has no single cache tensor, and a quantized pool must be decoded, so their sequences are
    gathered (dequantized on read) one by one instead. ``mask``, ``sliding_window``, ``softcap`` and ``sinks``
    are those of :func:`paged_attention`; a decode step with any of them runs the reference, not the kernel.
    """
    check_type("query", query, torch.Tensor)
    if not sequences:
        raise InvalidArgumentError("sequences: expected at least one sequence, got none")
    if query.ndim != 4 or query.shape[0] != len(sequences):
        raise ShapeError(f"query: expected [{len(sequences)}, q_heads, queries, head_dim], got {tuple(query.shape)}")
    mask = _drop_trivial_mask(mask)
    extras = dict(mask=mask, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    pool = sequences[0].pool
    if len(pool.segments) != 1 or pool.quantized:  # gather (and dequantize) per sequence
        lens = torch.tensor([seq.layer_tokens[layer] for seq in sequences])
        if mask is not None and (mask.ndim != 4 or mask.shape[3] < int(lens.max())):
            raise ShapeError(f"mask: expected [batch, heads, queries, >= {int(lens.max())}], got {tuple(mask.shape)}")
        rows = []
        for i, seq in enumerate(sequences):
            row_mask = None if mask is None else mask[i if mask.shape[0] > 1 else 0, :, :, : int(lens[i])]
            k, v = seq.to_dense(layer)
            rows.append(dense_attention(query[i], k, v, scale=scale, **{**extras, "mask": row_mask}))
        return torch.stack(rows)
    widest = max(seq.num_blocks for seq in sequences)
    tables = torch.full((len(sequences), widest), -1, dtype=torch.long)  # [B, max_blocks], -1 = padding
    for i, seq in enumerate(sequences):
        tables[i, : seq.num_blocks] = seq.block_table_tensor()
    lens = torch.tensor([seq.layer_tokens[layer] for seq in sequences])  # [B]
    view = pool.layer_view(layer)  # [num_blocks, 2, H, T, D]
    plain = all(value is None for value in extras.values())
    if query.shape[2] == 1 and plain:  # a decode step: the kernel when MEMOS_REF_KERNELS says so, else the reference
        device = view.device
        out = paged_decode(query[:, :, 0], view[:, 0], view[:, 1], tables.to(device), lens.to(device), scale=scale)
        return out[:, :, None]
    return paged_attention(query, view[:, 0], view[:, 1], tables, lens, scale=scale, **extras)


def attend_step(
    query: torch.Tensor,
    step: StepBatch,
    layer: int,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a prepared step's queries ``[B, Hq, n, D]`` over its rows' pages in one layer (after the layer
    wrote the step): the block tables and lengths come from the :class:`~memos_ref.paged.step.StepBatch`, built
    once for every layer, and the kernel choice is made once per step. A quantized or segmented pool gathers its
    rows one by one (:func:`attend_sequences`). Options as in :func:`paged_attention`."""
    check_type("query", query, torch.Tensor)
    b = len(step.sequences)
    if query.ndim != 4 or query.shape[0] != b or query.shape[2] != step.query_len:
        raise ShapeError(f"query: expected [{b}, q_heads, {step.query_len}, head_dim], got {tuple(query.shape)}")
    pool = step.pool
    extras = dict(mask=_drop_trivial_mask(mask), sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    path = step_path(step)
    if path != "reference" and all(value is None for value in extras.values()) and query.dtype == pool.spec.dtype:
        if step.query_len == 1:
            return _attend_kernel(path, query[:, :, 0], step, layer, scale)[:, :, None]
        if path == "plain":  # a chunk of queries per row: the tiled causal prefill kernel, one launch
            return _prefill_kernel(query, step, layer, scale)
    if len(pool.segments) != 1 or pool.quantized:
        return attend_sequences(query, step.sequences, layer, scale=scale, **extras)
    view = pool.segments[0][:, layer]  # [num_blocks, 2, H, T, D]
    return paged_attention(query, view[:, 0], view[:, 1], step.block_tables, step.seq_lens, scale=scale, **extras)


# ---------------------------------------------------------------------------------------------- kernel switch
def kernel_mode() -> str:
    """``MEMOS_REF_KERNELS`` (read at each call, so a test can change it), one of :data:`MODES`."""
    mode = os.environ.get("MEMOS_REF_KERNELS", "auto")
    if mode not in MODES:
        raise ConfigError(f"MEMOS_REF_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


@functools.cache
def _triton() -> Any:
    if kernel_mode() == "interpret":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from memos_kernels import triton_paged
    except ImportError as exc:
        raise BackendUnavailableError("Triton is not installed: pip install 'memos-ref[kernels]'") from exc
    return triton_paged


def use_kernels(device: torch.device) -> bool:
    """Whether attention on ``device`` goes through the Triton kernels under the current mode."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "interpret":
        return True
    if mode == "triton":
        if device.type != "cuda":
            raise ConfigError("MEMOS_REF_KERNELS=triton needs CUDA tensors; use interpret on the CPU")
        return True
    if device.type != "cuda":
        return False
    try:
        _triton()
    except BackendUnavailableError:
        return False
    return True


def _kernel_fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """The kernel's limits (power-of-two head_dim, block size 8-128, one dtype): outside them, the reference."""
    t, d = key_cache.shape[2], key_cache.shape[3]
    pow2 = d > 0 and d & (d - 1) == 0 and t & (t - 1) == 0 and 8 <= t <= 128
    same = query.dtype == key_cache.dtype == value_cache.dtype and key_cache.stride() == value_cache.stride()
    return pow2 and same  # outside the limits even the explicit modes fall back, rather than fail mid-generation


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention ``query [B, Hq, D]`` over paged caches ``[N, H, T, D]``: the kernel or the reference."""
    for name, value in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        check_type(name, value, torch.Tensor)
    if query.ndim != 3:
        raise ShapeError(f"query: expected [batch, q_heads, head_dim] (one decode step), got {tuple(query.shape)}")
    if use_kernels(query.device) and _kernel_fits(query, key_cache, value_cache):
        return _triton().paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale)
    return paged_attention(query[:, :, None], key_cache, value_cache, block_tables, seq_lens, scale=scale)[:, :, 0]


# ---------------------------------------------------------------------------------------------- kernel path
def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fp8_ok(device: torch.device) -> bool:
    """Triton's e4m3 needs sm_89+ on a GPU (the interpreter has it on the CPU)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _pool_path(pool: Any) -> str:
    """:func:`step_path` for a pool: which kernels can read and write it (duck-typed: this layer is below quant)."""
    spec = pool.spec
    floats = (torch.float32, torch.float16, torch.bfloat16)
    fits = _pow2(spec.head_dim) and _pow2(spec.block_size) and 8 <= spec.block_size <= 128 and spec.dtype in floats
    if len(pool.segments) != 1 or not fits or not use_kernels(pool.device):
        return "reference"
    if not pool.quantized:
        return "plain"
    name = getattr(pool.scheme, "name", "")
    streaming = getattr(pool, "streaming", False)  # no residual window: every token is encoded as it is written
    if name == "int8_token" and streaming:
        return "int8"
    if name == "fp8_e4m3" and streaming and _fp8_ok(pool.device):
        return "fp8"
    group = getattr(pool.scheme, "group_size", 0)
    if name.startswith("kivi") and _pow2(group) and spec.block_size % group == 0:
        return "kivi"
    return "reference"  # per-tensor int8, fp16 codes, residual windows over int8/fp8: the torch reference


def step_path(step: StepBatch) -> str:
    """The one switch: what ``step`` writes and attends with, one of :data:`PATHS`, decided at its first call and
    kept in ``step.notes["path"]`` (every layer of the step then takes the same path).

    ``MEMOS_REF_KERNELS`` (:func:`use_kernels`) says whether kernels run on the pool's device at all; then the
    pool says which: a float pool ``"plain"``, a streaming per-token int8 pool ``"int8"``, a streaming fp8 pool
    ``"fp8"`` (sm_89+), a KIVI pool ``"kivi"``; anything else, or a geometry outside the kernels' limits
    (head_dim and block size powers of two, block size 8-128), ``"reference"``."""
    path = step.notes.get("path")
    if path is None:
        path = step.notes["path"] = _pool_path(step.pool)
    return path  # type: ignore[return-value]


def _launch(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a ``memos_kernels`` wrapper; a failure that is not already one of the package's errors (a Triton
    compile or launch error) becomes :class:`BackendUnavailableError` naming the kernel and the way around it."""
    try:
        return fn(*args, **kwargs)
    except KVCacheError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"the Triton kernel {what} failed ({type(exc).__name__}: {exc}); MEMOS_REF_KERNELS=reference runs the "
            f"torch reference instead"
        ) from exc


def _validate(step: StepBatch, what: str) -> bool | None:
    """The ``validate`` argument of a kernel wrapper: the metadata's values (block tables, lengths, slots) are
    checked at the step's first call of ``what`` — on the CPU; on a GPU that would be a host sync, and the kernels
    mask every index they derive instead — and never again for the step's other layers."""
    key = f"validated:{what}"
    if key in step.notes:
        return False
    step.notes[key] = True
    return None


def _store_plain(step: StepBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """``write_kv`` of ``key, value [B·n, H, D]`` into a float pool's layer at the step's slots."""
    view = step.pool.segments[0][:, layer]  # [N, 2, H, T, D]
    _launch("write_kv", _triton().write_kv, key, value, step.slot_mapping, view[:, 0], view[:, 1],
            validate=_validate(step, "write"))  # fmt: skip


def _store_int8(step: StepBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """``write_kv_int8`` into a streaming per-token int8 pool (the pool refuses values it cannot encode first)."""
    pool = step.pool
    pool.check_kv(key, value, layer)
    _launch("write_kv_int8", _triton().write_kv_int8, key, value, step.slot_mapping, **pool.kernel_args(layer),
            validate=_validate(step, "write"))  # fmt: skip


#: The kernel write of each path; a path without one writes through the pool (fp8 grows its block scales, KIVI
#: stages full-precision blocks and seals them: the pool's own bookkeeping).
_STORES = {"plain": _store_plain, "int8": _store_int8}


def write_step(step: StepBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write layer ``layer``'s K/V ``[B, H, n, D]`` of every row of ``step`` through :func:`step_path`'s choice:
    ``write_kv`` / ``write_kv_int8`` on the kernel path, the pool's own store otherwise
    (:meth:`~memos_ref.paged.step.StepBatch.write` checks before and counts after either way)."""
    step.write(layer, key, value, store=_STORES.get(step_path(step)))


def _prefill_kernel(query: torch.Tensor, step: StepBatch, layer: int, scale: float | None) -> torch.Tensor:
    """A chunk ``query [B, Hq, n, D]`` of every row, causal over its pages, through ``paged_prefill_attention``."""
    qlens = step.notes.get("query_lens")
    if qlens is None:  # once per step, on the pool's device
        qlens = step.notes["query_lens"] = torch.full_like(step.seq_lens, step.query_len)
    view = step.pool.segments[0][:, layer]  # [N, 2, H, T, D]
    return _launch(
        "paged_prefill_attention",
        _triton().paged_prefill_attention,
        query, view[:, 0], view[:, 1], step.block_tables, step.seq_lens, qlens, scale=scale,
        validate=_validate(step, "prefill"),
    )  # fmt: skip


def _attend_kernel(path: str, query: torch.Tensor, step: StepBatch, layer: int, scale: float | None) -> torch.Tensor:
    """One decode step ``query [B, Hq, D]`` of layer ``layer`` through the ``path`` kernel; returns ``[B, Hq, D]``."""
    tk, pool = _triton(), step.pool
    tables, lens, longest = step.block_tables, step.seq_lens, max(step.lens)
    if path == "plain":
        view = pool.segments[0][:, layer]  # [N, 2, H, T, D]
        return _launch(
            "paged_decode_attention",
            tk.paged_decode_attention,
            query, view[:, 0], view[:, 1], tables, lens, scale=scale, max_seq_len=longest,
            validate=_validate(step, "decode"),
        )  # fmt: skip
    if path in ("int8", "fp8"):
        args = pool.kernel_args(layer)
        return _launch(
            f"paged_decode_attention(quant={path!r})",
            tk.paged_decode_attention,
            query, args["key_codes"], args["value_codes"], tables, lens, scale=scale, max_seq_len=longest,
            quant=path, key_scale=args["key_scale"], value_scale=args["value_scale"],
            validate=_validate(step, "decode"),
        )  # fmt: skip
    from memos_kernels.kivi_decode import KIVI_PAYLOAD, KiviBlocks

    args = pool.kernel_args(layer)  # every tensor on the pool's device (the staging slot map refreshed if stale)
    blocks = KiviBlocks(
        *(args[name] for name in KIVI_PAYLOAD),
        args["staging"],
        args["staging_slot"],
        bits=args["bits"],
        group_size=args["group_size"],
    )
    return _launch(
        "paged_decode_attention_kivi",
        tk.paged_decode_attention_kivi_packed,
        query, blocks, tables, lens, scale=scale, max_seq_len=longest, validate=_validate(step, "decode"),
    )  # fmt: skip
