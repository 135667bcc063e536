"""Paged decode attention: one query token per sequence over its cached tokens, read through its block table.

Told in the Triton tutorials' order — reference (plain torch) → kernels → wrapper → check → benchmark.

GQA (a program serves one KV head and all its query heads), variable lengths, online softmax, split-K over the
context (flash-decoding: one program per (sequence, KV head, chunk of blocks)) and a reduce kernel that merges
the chunks' partial softmaxes. Dequantizing variants read the quantized pool's int8 blocks (an fp16 scale per
token and head) and fp8 e4m3 blocks (an fp32 scale per block and head) in place.

Scores use an elementwise product and a sum instead of ``tl.dot``: a decode query block is 1-8 rows (below
``tl.dot``'s 16-row minimum), the step is memory-bound anyway, and it avoids the interpreter's bf16 ``tl.dot``
bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from memos_kernels.common import NEG, CheckResult, check_cache, check_fp8, default_device
from memos_kernels.timing import time_ms

from memos_ref.errors import ConfigError, DeviceError, DTypeError, ShapeError

__all__ = [
    "KERNELS",
    "QUANT_MODES",
    "DecodePlan",
    "benchmark_paged_decode",
    "check_paged_decode",
    "decode_reduce_kernel",
    "decode_split_kernel",
    "dequantize_cache",
    "online_softmax_step",
    "paged_decode_attention",
    "paged_decode_reference",
    "plan_decode",
    "random_paged_case",
    "reduce_decode",
]

QUANT_MODES = {"none": 0, "int8": 1, "fp8": 2}


# ---------------------------------------------------------------------------------------------- reference
def dequantize_cache(cache: torch.Tensor, scale: torch.Tensor | None, quant: str) -> torch.Tensor:
    """One layer's K or V cache ``[N, H, T, D]`` as fp32: as stored (``"none"``), int8 codes × the fp16 scale
    ``[N, H, T]`` (``"int8"``), or e4m3 bytes × the fp32 scale ``[N, H]`` (``"fp8"``)."""
    if quant == "none":
        return cache.float()
    if scale is None:
        raise ShapeError(f"quant={quant!r} needs a scale")
    if quant == "int8":
        return cache.float() * scale.float()[..., None]
    return cache.view(torch.float8_e4m3fn).float() * scale.float()[..., None, None]


def paged_decode_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    quant: str = "none",
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, one sequence at a time: gather the sequence's blocks, dequantize, softmax over its tokens.
    ``query [B, Hq, D]`` -> ``[B, Hq, D]`` in the query's dtype; an empty sequence gives zeros."""
    k_all = dequantize_cache(key_cache, key_scale, quant)  # [N, H, T, D]
    v_all = dequantize_cache(value_cache, value_scale, quant)
    _, h, t, d = k_all.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b in range(query.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        blocks = block_tables[b, : -(-n // t)].long()
        k = k_all[blocks].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]  # [H, n, D]
        v = v_all[blocks].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        group = query.shape[1] // h
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
        weights = torch.softmax((k @ query[b].float()[:, :, None])[..., 0] * scale, dim=-1)  # [Hq, n]
        out[b] = (weights[:, None, :] @ v)[:, 0]
    return out.to(query.dtype)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def online_softmax_step(q, k, v, ok, m_i, l_i, acc, scale):
    """Fold one block of keys ``k`` and values ``v`` ``[T, D]`` (valid rows ``ok``) into the running maximum
    ``m_i``, sum ``l_i`` and accumulator ``acc`` of the query group ``q [GP, D]``."""
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, T]
    scores = tl.where(ok[None, :], scores, NEG)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.where(ok[None, :], tl.exp(scores - m_new[:, None]), 0.0)  # [GP, T]
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit
def decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, tables_ptr, lens_ptr,
    acc_ptr, m_ptr, l_ptr,
    ks_ptr, vs_ptr,
    scale,
    s_qb, s_qh,
    s_cb, s_ch, s_ct,
    s_sb, s_sh, s_st,
    s_tb, max_blocks,
    num_splits,
    G: tl.constexpr, GP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
    QUANT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, T)
    g_ok = g < G
    q = tl.load(q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    q = q.to(tl.float32)  # [GP, D]
    m_i = tl.full((GP,), NEG, tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        idx = s * BLOCKS_PER_SPLIT + i
        tok0 = idx * T
        if (tok0 < seq_len) & (idx < max_blocks):
            block = tl.load(tables_ptr + b * s_tb + idx)
            ok = (tok0 + t) < seq_len  # [T]
            base = block * s_cb + h * s_ch + t[:, None] * s_ct + d[None, :]
            if QUANT == 0:  # float caches
                k = tl.load(kc_ptr + base, mask=ok[:, None], other=0.0).to(tl.float32)  # [T, D]
                v = tl.load(vc_ptr + base, mask=ok[:, None], other=0.0).to(tl.float32)  # [T, D]
            elif QUANT == 1:  # int8 codes, an fp16 scale per (head, token)
                sc = block * s_sb + h * s_sh + t * s_st
                k_s = tl.load(ks_ptr + sc, mask=ok, other=0.0).to(tl.float32)
                v_s = tl.load(vs_ptr + sc, mask=ok, other=0.0).to(tl.float32)
                k = tl.load(kc_ptr + base, mask=ok[:, None], other=0).to(tl.float32) * k_s[:, None]
                v = tl.load(vc_ptr + base, mask=ok[:, None], other=0).to(tl.float32) * v_s[:, None]
            else:  # fp8 e4m3 codes stored as bytes, an fp32 scale per (block, head)
                k_s = tl.load(ks_ptr + block * s_sb + h * s_sh)
                v_s = tl.load(vs_ptr + block * s_sb + h * s_sh)
                k = tl.load(kc_ptr + base, mask=ok[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
                v = tl.load(vc_ptr + base, mask=ok[:, None], other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
                k, v = k * k_s, v * v_s
            m_i, l_i, acc = online_softmax_step(q, k, v, ok, m_i, l_i, acc, scale)
    row = (b * tl.num_programs(1) + h) * num_splits + s  # partials [B, Hkv, S, GP, ...]
    tl.store(acc_ptr + (row * GP + g)[:, None] * D + d[None, :], acc)
    tl.store(m_ptr + row * GP + g, m_i)
    tl.store(l_ptr + row * GP + g, l_i)


@triton.jit
def decode_reduce_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr,
    s_ob, s_oh,
    num_splits,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    base = (b * tl.num_programs(1) + h) * num_splits
    m = tl.full((GP,), NEG, tl.float32)
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(m_ptr + (base + s) * GP + g))
    total = tl.zeros((GP,), tl.float32)
    out = tl.zeros((GP, D), tl.float32)
    for s in range(num_splits):
        row = base + s
        w = tl.exp(tl.load(m_ptr + row * GP + g) - m)
        total += tl.load(l_ptr + row * GP + g) * w
        out += tl.load(acc_ptr + (row * GP + g)[:, None] * D + d[None, :]) * w[:, None]
    out = out / tl.maximum(total, 1e-30)[:, None]
    dst = out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


KERNELS = (decode_split_kernel, decode_reduce_kernel)


# ---------------------------------------------------------------------------------------------- wrapper
@dataclass
class DecodePlan:
    """The split-K plan shared by the decode wrappers: the grid ``(B, Hkv, S)``, the partial softmaxes
    ``acc [B, Hkv, S, GP, D]``, ``m, l [B, Hkv, S, GP]`` and the output (poisoned with NaN: a row the kernels
    fail to write shows)."""

    grid: tuple[int, int, int]
    acc: torch.Tensor
    m: torch.Tensor
    l_sum: torch.Tensor
    out: torch.Tensor
    group: int
    gp: int
    blocks_per_split: int

    @property
    def num_splits(self) -> int:
        return self.grid[2]


def plan_decode(
    query: torch.Tensor, kv_heads: int, block_size: int, max_blocks: int, blocks_per_split: int | None
) -> DecodePlan:
    """Split each sequence's ``max_blocks`` into chunks of ``blocks_per_split`` (default: about 512 tokens, a
    constant, so no recompiles) and allocate the partials."""
    b, hq, d = query.shape
    if blocks_per_split is None:
        blocks_per_split = max(1, 512 // block_size)
    if blocks_per_split < 1:
        raise ConfigError(f"blocks_per_split must be at least 1, got {blocks_per_split}")
    num_splits = max(1, math.ceil(max_blocks / blocks_per_split))
    group = hq // kv_heads
    gp = triton.next_power_of_2(group)
    dev = query.device
    return DecodePlan(
        grid=(b, kv_heads, num_splits),
        acc=torch.empty((b, kv_heads, num_splits, gp, d), dtype=torch.float32, device=dev),
        m=torch.empty((b, kv_heads, num_splits, gp), dtype=torch.float32, device=dev),
        l_sum=torch.empty((b, kv_heads, num_splits, gp), dtype=torch.float32, device=dev),
        out=torch.full_like(query, float("nan")),
        group=group,
        gp=gp,
        blocks_per_split=blocks_per_split,
    )


def reduce_decode(plan: DecodePlan) -> torch.Tensor:
    """Merge the split kernel's partial softmaxes into ``plan.out [B, Hq, D]`` and return it."""
    b, h, _ = plan.grid
    out = plan.out
    decode_reduce_kernel[(b, h)](
        plan.acc, plan.m, plan.l_sum, out, out.stride(0), out.stride(1), plan.num_splits,
        G=plan.group, GP=plan.gp, D=out.shape[2],
    )  # fmt: skip
    return out


def _check_scales(quant: str, key_scale: torch.Tensor | None, value_scale: torch.Tensor | None) -> tuple[int, int, int]:
    """The scale tensors a quantized cache needs; returns their strides (block, head, token) for the kernel."""
    if quant == "none":
        return 0, 0, 0
    want = 3 if quant == "int8" else 2
    if key_scale is None or value_scale is None or key_scale.ndim != want or value_scale.shape != key_scale.shape:
        raise ShapeError(f"quant={quant!r} needs key_scale and value_scale of {want} dimensions")
    if key_scale.stride() != value_scale.stride():
        raise ShapeError("key and value scales must have the same strides (two views of one payload)")
    if quant == "int8":
        return key_scale.stride(0), key_scale.stride(1), key_scale.stride(2)
    return key_scale.stride(0), key_scale.stride(1), 0


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    blocks_per_split: int | None = None,
    quant: str = "none",
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: ``query [B, Hq, D]`` (one token per sequence) over each sequence's ``seq_lens[b]`` cached
    tokens, found through ``block_tables [B, max_blocks]`` in ``key_cache, value_cache [N, H, T, D]``.

    The context is split into chunks of ``blocks_per_split`` blocks, one program per (sequence, KV head,
    chunk); a second kernel merges the chunks' partial softmaxes. Returns ``[B, Hq, D]``; a sequence of length
    0 gets zeros.

    Dequantizing variants read a quantized pool's payload: ``quant="int8"`` — int8 codes with fp16 scales
    ``[N, H, T]`` per (head, token); ``quant="fp8"`` — e4m3 codes stored as uint8 with fp32 scales ``[N, H]``
    per (block, head)."""
    if quant not in QUANT_MODES:
        raise ConfigError(f"quant must be one of {sorted(QUANT_MODES)}, got {quant!r}")
    _n, h, t, d = check_cache(key_cache, value_cache, quant)
    if key_cache.stride() != value_cache.stride():
        raise ShapeError("key and value caches must have the same strides (two views of one pool)")
    if quant == "fp8":
        check_fp8(query.device)
    s_sb, s_sh, s_st = _check_scales(quant, key_scale, value_scale)
    if quant == "none":
        key_scale = value_scale = key_cache  # unused by the kernel
    if query.ndim != 3 or query.shape[2] != d:
        raise ShapeError(f"query must be [batch, q_heads, head_dim={d}], got {tuple(query.shape)}")
    b, hq, _ = query.shape
    if hq % h:
        raise ShapeError(f"query heads ({hq}) must be a multiple of KV heads ({h})")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ShapeError(
            f"block_tables [{b}, max_blocks] and seq_lens [{b}] expected, got {tuple(block_tables.shape)} and "
            f"{tuple(seq_lens.shape)}"
        )
    if quant == "none" and query.dtype != key_cache.dtype:
        raise DTypeError(f"query dtype {query.dtype} does not match the caches' {key_cache.dtype}")
    if not query.dtype.is_floating_point:
        raise DTypeError(f"query must be floating point, got {query.dtype}")
    if len({query.device, key_cache.device, block_tables.device, seq_lens.device}) != 1:
        raise DeviceError("query, caches, block tables and lengths must be on one device")
    if query.stride(-1) != 1:
        raise ShapeError("query must be contiguous along head_dim")
    max_blocks = block_tables.shape[1]
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    scale = scale if scale is not None else 1.0 / math.sqrt(d)

    plan = plan_decode(query, h, t, max_blocks, blocks_per_split)
    if b == 0:
        return plan.out
    decode_split_kernel[plan.grid](
        query, key_cache, value_cache, tables, lens,
        plan.acc, plan.m, plan.l_sum,
        key_scale, value_scale,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        s_sb, s_sh, s_st,
        tables.stride(0), max_blocks,
        plan.num_splits,
        G=plan.group, GP=plan.gp, T=t, D=d, BLOCKS_PER_SPLIT=plan.blocks_per_split, QUANT=QUANT_MODES[quant],
    )  # fmt: skip
    return reduce_decode(plan)


# ---------------------------------------------------------------------------------------------- check
def random_paged_case(
    seed: int,
    lens: list[int],
    *,
    kv_heads: int = 2,
    group: int = 4,
    block_size: int = 16,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random decode case: ``query [B, H·group, D]``, one layer's pool ``[N, 2, H, T, D]`` (K and V), block
    tables scattered over the pool in random order (padded with -1) and the lengths."""
    g = torch.Generator().manual_seed(seed)
    n = sum(-(-x // block_size) for x in lens) + 3
    pool = torch.randn(n, 2, kv_heads, block_size, head_dim, generator=g).to(dtype)
    perm = torch.randperm(n, generator=g).tolist()
    widest = max(1, max(-(-x // block_size) for x in lens))
    tables = torch.full((len(lens), widest), -1, dtype=torch.long)
    for i, x in enumerate(lens):
        k = -(-x // block_size)
        tables[i, :k] = torch.tensor(perm[:k], dtype=torch.long)
        perm = perm[k:]
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    return q.to(device), pool.to(device), tables.to(device), torch.tensor(lens, device=device)


def check_paged_decode(device: str | None = None, *, seed: int = 0, quant: str = "none") -> CheckResult:
    """:func:`paged_decode_attention` against :func:`paged_decode_reference` on three sequences (odd lengths,
    a block boundary, an empty one), GQA 4, several splits; ``quant="int8"`` quantizes the pool first."""
    device = device or default_device()
    q, pool, tables, lens = random_paged_case(seed, [37, 16, 0], device=device)
    extras: dict[str, torch.Tensor | str] = {}
    if quant == "int8":
        scales = (pool.abs().amax(-1) / 127).clamp(min=1e-4).to(torch.float16)  # [N, 2, H, T]
        pool = torch.round(pool / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
        extras = {"quant": "int8", "key_scale": scales[:, 0], "value_scale": scales[:, 1]}
    elif quant != "none":
        raise ConfigError(f"check_paged_decode runs quant 'none' or 'int8' (fp8 needs sm_89+), got {quant!r}")
    got = paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, blocks_per_split=1, **extras)  # type: ignore[arg-type]
    want = paged_decode_reference(q, pool[:, 0], pool[:, 1], tables, lens, **extras)  # type: ignore[arg-type]
    return CheckResult(f"paged_decode[{quant}]", float((got - want).abs().max()), 1e-5)


# ---------------------------------------------------------------------------------------------- benchmark
def benchmark_paged_decode(
    device: str | None = None,
    *,
    batch: int = 8,
    context: int = 1024,
    kv_heads: int = 8,
    group: int = 4,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
) -> dict[str, float]:
    """Time :func:`paged_decode_attention` against :func:`paged_decode_reference` on one case: medians and
    min–max in milliseconds."""
    device = device or default_device()
    q, pool, tables, lens = random_paged_case(
        0, [context] * batch, kv_heads=kv_heads, group=group, block_size=block_size, head_dim=head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    kernel = time_ms(lambda: paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens), device)
    reference = time_ms(lambda: paged_decode_reference(q, pool[:, 0], pool[:, 1], tables, lens), device)
    return {**kernel.as_dict("kernel"), **reference.as_dict("reference")}
