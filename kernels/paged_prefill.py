"""Chunked-prefill attention over paged caches: a chunk of queries per sequence, causal over its cached prefix
and the chunk up to itself.

Told in the Triton tutorials' order — reference (plain torch) → wrapper → check → benchmark. There is no kernel
of its own yet: every (sequence, query position) becomes a decode row whose length stops at that position, run
by :mod:`memos_kernels.paged_decode`'s split-K kernels — simple and exact; a tiled kernel that shares K/V loads
across the chunk's queries is the faster form.
"""

from __future__ import annotations

import math

import torch
from memos_kernels.common import CheckResult, default_device
from memos_kernels.paged_decode import paged_decode_attention, random_paged_case
from memos_kernels.timing import time_ms

from memos_ref.errors import ShapeError

__all__ = [
    "KERNELS",
    "benchmark_paged_prefill",
    "check_paged_prefill",
    "paged_prefill_attention",
    "paged_prefill_reference",
]

KERNELS = ()  # runs paged_decode's kernels


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


# ---------------------------------------------------------------------------------------------- wrapper
def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    *,
    scale: float | None = None,
    **quant: object,
) -> torch.Tensor:
    """Chunked-prefill attention: ``query [B, Hq, Q, D]``, sequence b's first ``query_lens[b]`` rows being its
    newest tokens (already written to the cache), each attending causally over its cached prefix and the chunk
    up to itself. Returns ``[B, Hq, Q, D]`` with zeros past ``query_lens``. ``quant`` passes the dequantizing
    arguments of :func:`~memos_kernels.paged_decode.paged_decode_attention` through."""
    if query.ndim != 4:
        raise ShapeError(f"query must be [batch, q_heads, queries, head_dim], got {tuple(query.shape)}")
    b, _, q, _ = query.shape
    if query_lens.shape != (b,) or seq_lens.shape != (b,):
        raise ShapeError(
            f"seq_lens and query_lens must be [{b}], got {tuple(seq_lens.shape)}, {tuple(query_lens.shape)}"
        )
    rows, lens, src = [], [], []
    for i in range(b):
        n, nq = int(seq_lens[i]), int(query_lens[i])
        if nq > q or nq > n:
            raise ShapeError(f"sequence {i}: {nq} queries but {n} tokens (and Q={q})")
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
