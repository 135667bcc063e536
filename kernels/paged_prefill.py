"""Chunked-prefill attention over paged caches: a chunk of queries per sequence, causal over its cached prefix
and the chunk up to itself.

Told in the Triton tutorials' order — reference (plain torch) → kernel → wrapper → check → benchmark.
:func:`prefill_kernel` is tiled: one program per (sequence, KV head, query tile) holds ``QB`` query positions ×
the whole GQA group as the rows of one ``tl.dot`` operand, and streams the sequence's K/V once per tile in token
tiles gathered through the block table (the decode kernel's :func:`~memos_kernels.paged_decode.tile_slots`),
stopping at the tile's last causal position; online softmax in base 2. The whole tiles every row sees run
mask-free (:func:`full_tile`); only the diagonal and the last partial tile are masked. One launch for every
sequence's chunk, no per-row loop. Quantized caches (``quant=``) still run as decode rows through
:mod:`memos_kernels.paged_decode`'s kernels (every (sequence, query position) a row whose length stops there).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from memos_kernels.common import (
    NEG,
    CheckResult,
    check_cache,
    check_index_dtypes,
    check_tables,
    default_device,
    should_validate,
)
from memos_kernels.launch_plan import RUNTIME_ARGS, check_launchable, prefill_launch
from memos_kernels.paged_decode import (
    LOG2E,
    dot_flags,
    paged_decode_attention,
    random_paged_case,
    tile_slots,
)
from memos_kernels.timing import time_ms

from memos_ref.errors import DeviceError, DTypeError, ShapeError

__all__ = [
    "KERNELS",
    "benchmark_paged_prefill",
    "check_paged_prefill",
    "full_tile",
    "paged_prefill_attention",
    "paged_prefill_reference",
    "prefill_config",
    "prefill_kernel",
]


# ---------------------------------------------------------------------------------------------- reference
def paged_prefill_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time: gather its ``n`` tokens, then causal attention of its ``nq`` newest
    positions (query row ``j`` sees tokens ``0 .. n - nq + j``). ``query [B, Hq, Q, D]`` -> ``[B, Hq, Q, D]``,
    zeros past ``query_lens``."""
    _, h, t, d = key_cache.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b in range(query.shape[0]):
        n, nq = int(seq_lens[b]), int(query_lens[b])
        if nq == 0:
            continue
        blocks = block_tables[b, : -(-n // t)].long()
        k = key_cache[blocks].float().permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]  # [H, n, D]
        v = value_cache[blocks].float().permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        group = query.shape[1] // h
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
        q = query[b, :, :nq].float()  # [Hq, nq, D]
        scores = q @ k.transpose(1, 2) * scale  # [Hq, nq, n]
        pos = torch.arange(n, device=query.device)
        last = n - nq + torch.arange(nq, device=query.device)  # the last token row j may see
        scores = scores.masked_fill(pos[None, None, :] > last[None, :, None], float("-inf"))
        out[b, :, :nq] = torch.softmax(scores, dim=-1) @ v
    return out.to(query.dtype)


# ---------------------------------------------------------------------------------------------- kernel
@triton.jit
def full_tile(q, kc_ptr, vc_ptr, tables_ptr, b, h, s_tb, s_tc, s_cb, s_ch, s_ct, tok0, num_blocks, m_i, l_i, acc,
              qk_scale, T, D: tl.constexpr, TILE: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """Fold a whole token tile that every row of the program sees (``tok0 + TILE`` at or before its first
    position, inside the length and the table) into ``m_i``, ``l_i``, ``acc``: no causal or length mask, loads
    unmasked. Bounds: a block id outside ``[0, num_blocks)`` (unvalidated metadata) is read as block 0, inside
    the pool, and its tokens are then masked out — the only mask, taken only by a tile holding one."""
    tok = tok0 + tl.arange(0, TILE)
    block = tl.load(tables_ptr + b * s_tb + (tok // T) * s_tc).to(tl.int64)
    ok = (block >= 0) & (block < num_blocks)
    bad = tl.sum((~ok).to(tl.int32), axis=0) > 0
    block = tl.where(ok, block, 0)
    d = tl.arange(0, D)
    ptrs = (block * s_cb + h * s_ch + (tok % T) * s_ct)[:, None] + d[None, :]
    k = tl.load(kc_ptr + ptrs)
    v = tl.load(vc_ptr + ptrs)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
    if bad:
        scores = tl.where(ok[None, :], scores, NEG)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])
    if bad:
        p = tl.where(ok[None, :], p, 0.0)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, tables_ptr, lens_ptr, qlens_ptr, out_ptr,
    qk_scale,
    s_qb, s_qh, s_qq,
    s_ob, s_oh, s_oq,
    s_cb, s_ch, s_ct,
    s_tb, s_tc, width, num_blocks, num_q,
    G, GP: tl.constexpr, QB: tl.constexpr, T, D: tl.constexpr, TILE: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, KV head h, query tile qt): rows ``r = j · GP + g`` are query ``qt · QB + j`` of head
    ``h · G + g``; query j of a chunk of ``qlen`` sits at position ``n - qlen + j`` and sees tokens up to it. The
    token loop stops after the tile's last query position (causal), every tile of K/V serves all ``QB · G`` rows.
    Two loops, as in FlashAttention: whole tiles that every row sees, without masks (:func:`full_tile`), then the
    diagonal and the partial last tile, masked; a query tile past the chunk reads nothing.
    Bounds: query rows past ``num_q`` (the query tensor's Q) are neither read nor written; table columns past
    ``width`` and block ids outside ``[0, num_blocks)`` are masked (:func:`tile_slots`)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    qt = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    qlen = tl.load(qlens_ptr + b).to(tl.int32)
    r = tl.arange(0, QB * GP)
    j = qt * QB + r // GP
    g = r % GP
    row_ok = (g < G) & (j < qlen) & (j < num_q)
    pos = seq_len - qlen + j  # [QB·GP] each row's own position
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh + j[:, None] * s_qq + d[None, :],
                mask=row_ok[:, None], other=0.0)  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full((QB * GP,), NEG, tl.float32)
    l_i = tl.zeros((QB * GP,), tl.float32)
    acc = tl.zeros((QB * GP, D), tl.float32)
    end = tl.minimum(seq_len, seq_len - qlen + qt * QB + QB)  # past the tile's last query: nothing to see
    end = tl.minimum(end, width * T)  # past the table's capacity: nothing to read
    end = tl.where(qt * QB < tl.minimum(qlen, num_q), end, 0)  # a tile without queries reads nothing
    # Main loop, mask-free: whole tiles at or before the program's first position, which every row sees (rows
    # past qlen or G sit later, or are never stored), inside the length and the table, so no causal mask.
    full = tl.maximum(tl.minimum(seq_len - qlen + qt * QB + 1, end), 0) // TILE * TILE
    for tok0 in range(0, full, TILE):
        m_i, l_i, acc = full_tile(q, kc_ptr, vc_ptr, tables_ptr, b, h, s_tb, s_tc, s_cb, s_ch, s_ct, tok0,
                                  num_blocks, m_i, l_i, acc, qk_scale, T, D, TILE, DOT_F32, PREC)  # fmt: skip
    # The tail: the diagonal tile(s) and the last partial one, masked (causal, length, table width).
    for tok0 in range(full, end, TILE):
        ok, block, off = tile_slots(tables_ptr, b, s_tb, s_tc, tok0, end, width, num_blocks, T, TILE)
        ptrs = (block * s_cb + h * s_ch + off * s_ct)[:, None] + d[None, :]
        k = tl.load(kc_ptr + ptrs, mask=ok[:, None], other=0)
        v = tl.load(vc_ptr + ptrs, mask=ok[:, None], other=0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        tok = tok0 + tl.arange(0, TILE)
        seen = ok[None, :] & (tok[None, :] <= pos[:, None])  # [QB·GP, TILE] causal
        scores = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        scores = tl.where(seen, scores, NEG)
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.where(seen, tl.exp2(scores - m_new[:, None]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    dst = out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + j[:, None] * s_oq + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


KERNELS = (prefill_kernel,)


# ---------------------------------------------------------------------------------------------- wrapper
def prefill_config(group: int, block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(QB, GP, TILE)`` of :func:`memos_kernels.launch_plan.prefill_launch` (which also gives warps and
    stages)."""
    cfg = prefill_launch(group, block_size, head_dim, dtype)
    return cfg.qb, cfg.gp, cfg.tile


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    validate: bool | None = None,
    **quant: object,
) -> torch.Tensor:
    """Chunked-prefill attention: ``query [B, Hq, Q, D]``, sequence b's first ``query_lens[b]`` rows being its
    newest tokens (already written to the cache), each attending causally over its cached prefix and the chunk
    up to itself. Returns ``out`` (zeros allocated when not given) ``[B, Hq, Q, D]``, zeros past ``query_lens``.
    Float caches: one launch of :func:`prefill_kernel`. ``quant`` passes the dequantizing arguments of
    :func:`~memos_kernels.paged_decode.paged_decode_attention` through (decode rows).

    ``validate`` (default: on the CPU only, where reading the lengths costs no host sync) refuses query lengths
    outside ``0..min(seq_len, Q)``, lengths past the tables' capacity and block ids outside the pool; on a GPU
    the caller checks once per step (the package's forward does) and the kernel masks every derived index."""
    if query.ndim != 4:
        raise ShapeError(f"query must be [batch, q_heads, queries, head_dim], got {tuple(query.shape)}")
    b, hq, q, d = query.shape
    if query_lens.shape != (b,) or seq_lens.shape != (b,):
        raise ShapeError(
            f"seq_lens and query_lens must be [{b}], got {tuple(seq_lens.shape)}, {tuple(query_lens.shape)}"
        )
    check_index_dtypes(block_tables=block_tables, seq_lens=seq_lens, query_lens=query_lens)
    checked = should_validate(validate, query.device)
    if checked and bool(((query_lens > seq_lens) | (query_lens > q) | (query_lens < 0)).any()):  # one check
        bad = int(((query_lens > seq_lens) | (query_lens > q) | (query_lens < 0)).nonzero()[0, 0])
        raise ShapeError(f"sequence {bad}: {int(query_lens[bad])} queries but {int(seq_lens[bad])} tokens (and Q={q})")
    if quant.get("quant", "none") != "none":
        extras = {**quant, "validate": validate}
        return _prefill_by_rows(query, key_cache, value_cache, block_tables, seq_lens, query_lens, scale, extras)
    n_blocks, h, t, _ = check_cache(key_cache, value_cache)
    if key_cache.stride() != value_cache.stride():
        raise ShapeError("key and value caches must have the same strides (two views of one pool)")
    if query.dtype != key_cache.dtype:
        raise DTypeError(f"query dtype {query.dtype} does not match the caches' {key_cache.dtype}")
    if d != key_cache.shape[3] or hq % h:
        raise ShapeError(f"query [B, k·{h}, Q, {key_cache.shape[3]}] expected, got {tuple(query.shape)}")
    devices = {query.device, key_cache.device, block_tables.device, seq_lens.device, query_lens.device}
    if len(devices) != 1:
        raise DeviceError("query, caches, block tables and lengths must be on one device")
    if query.stride(-1) != 1:
        raise ShapeError("query must be contiguous along head_dim")
    if out is None:
        out = torch.zeros_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ShapeError(f"out must be {query.dtype} {list(query.shape)} on {query.device}")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ShapeError(f"block_tables must be [{b}, max_blocks], got {tuple(block_tables.shape)}")
    if checked:
        check_tables(block_tables, seq_lens, n_blocks, t)
    group = hq // h
    check_launchable("prefill attention", d, t, group, query.dtype, query.device)
    cfg = prefill_launch(group, t, d, query.dtype)
    if b == 0 or q == 0:
        return out
    dot_f32, prec = dot_flags(query)
    prefill_kernel[(b, h, triton.cdiv(q, cfg.qb))](
        query, key_cache, value_cache, block_tables, seq_lens, query_lens, out,
        (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E,
        query.stride(0), query.stride(1), query.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1), block_tables.shape[1], n_blocks, q,
        G=group, GP=cfg.gp, QB=cfg.qb, T=t, D=d, TILE=cfg.tile, DOT_F32=dot_f32, PREC=prec,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _prefill_by_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float | None,
    quant: dict[str, object],
) -> torch.Tensor:
    """Quantized caches: every (sequence, query position) as a decode row whose length stops at it."""
    rows, lens, src = [], [], []
    for i in range(query.shape[0]):
        n, nq = int(seq_lens[i]), int(query_lens[i])
        for j in range(nq):
            rows.append(i)
            lens.append(n - nq + j + 1)
            src.append((i, j))
    out = torch.zeros_like(query)
    if not rows:
        return out
    idx = torch.tensor(rows, device=query.device)
    flat_q = torch.stack([query[i, :, j] for i, j in src])  # [R, Hq, D]
    res = paged_decode_attention(
        flat_q, key_cache, value_cache, block_tables[idx], torch.tensor(lens, device=query.device), scale=scale,
        **quant,  # type: ignore[arg-type]
    )  # fmt: skip
    for r, (i, j) in enumerate(src):
        out[i, :, j] = res[r]
    return out


# ---------------------------------------------------------------------------------------------- check
def check_paged_prefill(device: str | None = None, *, seed: int = 0) -> CheckResult:
    """:func:`paged_prefill_attention` against :func:`paged_prefill_reference`: chunks of 4 and 5 queries over
    20 and 5 cached tokens (the second is all chunk) and a sequence with no queries."""
    device = device or default_device()
    _, pool, tables, lens = random_paged_case(seed, [20, 5, 3], device=device)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(3, 8, 5, 32, generator=g).to(device)
    qlens = torch.tensor([4, 5, 0], device=device)
    got = paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    want = paged_prefill_reference(query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    return CheckResult("paged_prefill", float((got - want).abs().max()), 1e-5)


# ---------------------------------------------------------------------------------------------- benchmark
def benchmark_paged_prefill(
    device: str | None = None, *, batch: int = 2, context: int = 1024, chunk: int = 64, head_dim: int = 128
) -> dict[str, float]:
    """Time :func:`paged_prefill_attention` against :func:`paged_prefill_reference` (8 KV heads, GQA 4, fp32,
    ``chunk`` new tokens on ``context`` cached ones): medians and min–max in milliseconds."""
    device = device or default_device()
    _, pool, tables, lens = random_paged_case(0, [context] * batch, kv_heads=8, head_dim=head_dim, device=device)
    query = torch.randn(batch, 32, chunk, head_dim, device=device)
    qlens = torch.full((batch,), chunk, device=device)
    args = (query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    kernel = time_ms(lambda: paged_prefill_attention(*args), device)
    reference = time_ms(lambda: paged_prefill_reference(*args), device)
    return {**kernel.as_dict("kernel"), **reference.as_dict("reference")}
