"""Paged decode attention: one query token per sequence over its cached tokens, read through its block table.

Told in the Triton tutorials' order — reference (plain torch) → kernels → wrapper → check → benchmark.

Flash-decoding: one program per (sequence, KV head, split) computes every query head of the GQA group at once
with ``tl.dot`` (the group padded to ``tl.dot``'s 16 rows, so tensor cores do the products), over token tiles
whose size does not depend on the block size — a tile gathers several blocks (or part of one) through the block
table — with online softmax in base 2; a reduce kernel merges the splits' partial softmaxes. The number of
splits follows a host-known length bound and the SM count; the partials live in a preallocated
:class:`DecodeWorkspace` (no allocation, fill or host sync per call). ``num_warps``/``num_stages`` come from
:func:`~memos_kernels.decode_launch.decode_config`; the launch planning, workspace and input checks every decode
wrapper shares live in :mod:`memos_kernels.decode_launch` (re-exported here). Dequantizing variants read the
quantized pool's int8 blocks (an fp16 scale per token and head) and fp8 e4m3 blocks (an fp32 scale per block and
head) in place; fp16 and bf16 run natively, and in Triton's interpreter ``tl.dot``'s operands are upcast to
fp32 (its bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from memos_kernels.common import NEG, CheckResult, check_cache, check_fp8, default_device, should_validate
from memos_kernels.decode_launch import (
    DecodeConfig,
    DecodePlan,
    DecodeWorkspace,
    decode_bounds,
    decode_config,
    default_workspace,
    dot_flags,
    plan_decode,
    plan_splits,
    sm_count,
    validate_decode_inputs,
)
from memos_kernels.decode_step import DecodeStepLaunch
from memos_kernels.launch_plan import RUNTIME_ARGS
from memos_kernels.timing import time_ms

from memos_ref.errors import ConfigError, DeviceError, DTypeError, ShapeError

__all__ = [
    "KERNELS",
    "QUANT_MODES",
    "DecodeConfig",
    "DecodePlan",
    "DecodeWorkspace",
    "attend_tile",
    "benchmark_paged_decode",
    "check_paged_decode",
    "decode_bounds",
    "decode_config",
    "decode_reduce_kernel",
    "decode_split_kernel",
    "decode_step_launch",
    "default_workspace",
    "dequantize_cache",
    "dot_flags",
    "paged_decode_attention",
    "paged_decode_reference",
    "plan_decode",
    "plan_splits",
    "random_paged_case",
    "reduce_decode",
    "sm_count",
    "validate_decode_inputs",
]

QUANT_MODES = {"none": 0, "int8": 1, "fp8": 2}
LOG2E = 1.4426950408889634  # the kernels work in base 2: exp(x) == exp2(x · log2 e)


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
def tile_slots(tables_ptr, b, s_tb, s_tc, tok0, end, width, num_blocks, T, TILE: tl.constexpr):
    """A token tile ``tok0 .. tok0 + TILE`` of sequence ``b`` (valid below ``end``) through its block table:
    the tokens' positions, validity, blocks (int64: block × stride passes 2^31 in big pools) and offsets. The
    tile spans ``TILE / T`` blocks, or part of one, whatever the block size. Bounds: a column past the table's
    ``width`` is never read, and a token whose block id is outside ``[0, num_blocks)`` is invalid (masked): no
    metadata can make a kernel read outside the table or the pool."""
    tok = tok0 + tl.arange(0, TILE)
    col = tok // T
    ok = (tok < end) & (col < width)
    block = tl.load(tables_ptr + b * s_tb + col * s_tc, mask=ok, other=0).to(tl.int64)
    ok = ok & (block >= 0) & (block < num_blocks)
    return ok, block, tok % T


@triton.jit
def attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """Fold one tile of keys ``k`` and values ``v`` ``[TILE, D]`` (valid rows ``ok``) into the running maximum
    ``m_i``, sum ``l_i`` (log2 domain) and accumulator ``acc [GP, D]`` of the query group ``q [GP, D]``, with
    ``tl.dot`` (tensor cores; ``DOT_F32`` upcasts the operands — the interpreter's bf16 ``tl.dot`` is wrong)."""
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [GP, TILE], log2 units
    scores = tl.where(ok[None, :], scores, NEG)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])  # masked columns: exp2(NEG - m) == 0
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def split_bounds(lens_ptr, b, s, tokens_per_split, capacity):
    """This program's share of sequence ``b``: tokens ``start .. end`` (empty past its length, and past the
    ``capacity`` of its block table: width × block size)."""
    seq_len = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), capacity)
    start = s * tokens_per_split
    return start, tl.minimum(start + tokens_per_split, seq_len)


@triton.jit
def load_group(q_ptr, b, h, s_qb, s_qh, G, GP: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr):
    """The query heads of KV head ``h`` as a ``[GP, D]`` tile (rows past the group ``G`` are zero)."""
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def store_partials(acc_ptr, m_ptr, l_ptr, b, h, s, acc, m_i, l_i, G, GP: tl.constexpr,
                   D: tl.constexpr):  # fmt: skip
    """The split's partial softmax: ``acc [B, Hkv, S, G, D]``, ``m, l [B, Hkv, S, G]`` (the group's real rows)."""
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    row = ((b * tl.num_programs(1) + h) * tl.num_programs(2) + s) * G + g
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=(g < G)[:, None])
    tl.store(m_ptr + row, m_i, mask=g < G)
    tl.store(l_ptr + row, l_i, mask=g < G)


@triton.jit
def store_split(acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh, b, h, s, acc, m_i, l_i, G,
                GP: tl.constexpr, D: tl.constexpr, DIRECT):  # fmt: skip
    """The end of a split program: with one split (``DIRECT``) the normalized output itself, straight into
    ``out [B, Hq, D]`` (no reduce launch); otherwise the partial softmax (:func:`store_partials`)."""
    if DIRECT != 0:  # a runtime flag (one compilation for both)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        res = acc / tl.maximum(l_i, 1e-30)[:, None]
        dst = out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :]
        tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])
    else:
        store_partials(acc_ptr, m_ptr, l_ptr, b, h, s, acc, m_i, l_i, G, GP, D)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, tables_ptr, lens_ptr,
    acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh,
    ks_ptr, vs_ptr,
    qk_scale,
    s_qb, s_qh,
    s_cb, s_ch, s_ct,
    s_sb, s_sh, s_st,
    s_tb, s_tc, width, num_blocks,
    tokens_per_split,
    G, GP: tl.constexpr, T, D: tl.constexpr, TILE: tl.constexpr,
    QUANT: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, DIRECT,
):  # fmt: skip
    """Program (sequence b, KV head h, split s): the whole query group over tokens ``start .. end`` of the
    sequence in tiles of ``TILE`` tokens gathered through the block table. ``QUANT`` 0: float caches; 1: int8
    codes with an fp16 scale per (head, token); 2: fp8 e4m3 bytes with an fp32 scale per (block, head).
    ``DIRECT`` (one split): the program writes the output itself (:func:`store_split`)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    start, end = split_bounds(lens_ptr, b, s, tokens_per_split, width * T)
    q = load_group(q_ptr, b, h, s_qb, s_qh, G, GP, D, DOT_F32)  # [GP, D]
    d = tl.arange(0, D)
    m_i = tl.full((GP,), NEG, tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for tok0 in range(start, end, TILE):
        ok, block, off = tile_slots(tables_ptr, b, s_tb, s_tc, tok0, end, width, num_blocks, T, TILE)
        row = block * s_cb + h * s_ch + off * s_ct  # [TILE]
        ptrs = row[:, None] + d[None, :]
        k = tl.load(kc_ptr + ptrs, mask=ok[:, None], other=0)
        v = tl.load(vc_ptr + ptrs, mask=ok[:, None], other=0)
        if QUANT == 1:  # int8 codes, an fp16 scale per (head, token)
            sc = block * s_sb + h * s_sh + off * s_st
            k = k.to(tl.float32) * tl.load(ks_ptr + sc, mask=ok, other=0.0).to(tl.float32)[:, None]
            v = v.to(tl.float32) * tl.load(vs_ptr + sc, mask=ok, other=0.0).to(tl.float32)[:, None]
        elif QUANT == 2:  # fp8 e4m3 codes stored as bytes, an fp32 scale per (block, head)
            sc = block * s_sb + h * s_sh
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(ks_ptr + sc, mask=ok, other=0.0)[:, None]
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(vs_ptr + sc, mask=ok, other=0.0)[:, None]
        m_i, l_i, acc = attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_F32, PREC)
    store_split(acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh, b, h, s, acc, m_i, l_i, G, GP, D, DIRECT)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def decode_reduce_kernel(
    acc_ptr, m_ptr, l_ptr, out_ptr, lens_ptr,
    s_ob, s_oh,
    num_splits, tokens_per_split,
    G, GP: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, KV head h): merge the partial softmaxes of the splits that hold tokens (an empty
    sequence gives zeros)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    g_ok = g < G
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    active = tl.minimum((seq_len + tokens_per_split - 1) // tokens_per_split, num_splits)
    base = (b * tl.num_programs(1) + h) * num_splits
    m = tl.full((GP,), NEG, tl.float32)
    for s in range(0, active):
        m = tl.maximum(m, tl.load(m_ptr + (base + s) * G + g, mask=g_ok, other=NEG))
    total = tl.zeros((GP,), tl.float32)
    out = tl.zeros((GP, D), tl.float32)
    for s in range(0, active):
        row = (base + s) * G + g
        w = tl.exp2(tl.load(m_ptr + row, mask=g_ok, other=NEG) - m)
        total += tl.load(l_ptr + row, mask=g_ok, other=0.0) * w
        out += tl.load(acc_ptr + row[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0) * w[:, None]
    out = out / tl.maximum(total, 1e-30)[:, None]
    dst = out_ptr + b * s_ob + (h * G + g)[:, None] * s_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


KERNELS = (decode_split_kernel, decode_reduce_kernel)


# ---------------------------------------------------------------------------------------------- wrapper
def reduce_decode(plan: DecodePlan, seq_lens: torch.Tensor) -> torch.Tensor:
    """Merge the split kernel's partial softmaxes into ``plan.out [B, Hq, D]`` and return it (nothing to do with
    one split: the split kernel wrote the output directly)."""
    b, h, _ = plan.grid
    out = plan.out
    if b and plan.num_splits > 1:
        decode_reduce_kernel[(b, h)](
            plan.acc, plan.m, plan.l_sum, out, seq_lens, out.stride(0), out.stride(1),
            plan.num_splits, plan.tokens_per_split,
            G=plan.group, GP=plan.config.gp, D=out.shape[2], num_warps=4,
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
    tokens_per_split: int | None = None,
    max_seq_len: int | None = None,
    quant: str = "none",
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    validate: bool | None = None,
    step_memo: dict[str, object] | None = None,
) -> torch.Tensor:
    """Decode attention: ``query [B, Hq, D]`` (one token per sequence) over each sequence's ``seq_lens[b]`` cached
    tokens, found through ``block_tables [B, max_blocks]`` in ``key_cache, value_cache [N, H, T, D]``.

    One program per (sequence, KV head, split) attends with the whole query group (``tl.dot``, the group padded
    to 16 rows) over tiles of tokens gathered through the table; a second kernel merges the splits. The splits
    follow ``max_seq_len`` (default: the table's width × T, known on the host) and the SM count, or
    ``tokens_per_split`` / ``blocks_per_split`` when given. Returns ``out`` (allocated when not given) ``[B, Hq,
    D]``; a sequence of length 0 gets zeros. No host synchronization, no fill: pass ``out`` and a
    ``workspace`` sized beforehand to capture it in a CUDA graph.

    Dequantizing variants read a quantized pool's payload: ``quant="int8"`` — int8 codes with fp16 scales
    ``[N, H, T]`` per (head, token); ``quant="fp8"`` — e4m3 codes stored as uint8 with fp32 scales ``[N, H]``
    per (block, head).

    Bounds: ``validate`` (default: on the CPU only, where it costs no host sync) refuses lengths past the tables'
    capacity or ``max_seq_len`` and block ids outside the pool; unvalidated, the kernel still never reads outside
    the table or the pool (it masks such tokens: the result is the reference's over the valid tokens).

    ``step_memo`` (a dict the caller keeps for one step, e.g. its step's notes): a float-cache call checks and plans
    once (:class:`~memos_kernels.decode_step.DecodeStepLaunch`, kept there) and every later call with the same
    tables, lengths, scale, bound and layouts only launches (the values still checked when ``validate`` says)."""
    if step_memo is not None and quant == "none" and tokens_per_split is None and blocks_per_split is None:
        planned = step_memo.get("decode_step_launch")
        if (
            isinstance(planned, DecodeStepLaunch)
            and workspace is None
            and planned.matches(query, key_cache, value_cache, block_tables, seq_lens, scale, max_seq_len)
        ):
            if should_validate(validate, seq_lens.device):
                decode_bounds(block_tables, seq_lens, key_cache.shape[0], key_cache.shape[2], max_seq_len, True)
            return planned.launch(query, key_cache, value_cache, out, checked=True)
        if workspace is None:
            planned = step_memo["decode_step_launch"] = decode_step_launch(
                query, key_cache, value_cache, block_tables, seq_lens, scale=scale, max_seq_len=max_seq_len,
                validate=validate,
            )  # fmt: skip
            return planned.launch(query, key_cache, value_cache, out)
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
    if quant == "none" and query.dtype != key_cache.dtype:
        raise DTypeError(f"query dtype {query.dtype} does not match the caches' {key_cache.dtype}")
    validate_decode_inputs(query, h, d, block_tables, seq_lens)
    if query.device != key_cache.device:
        raise DeviceError("query, caches, block tables and lengths must be on one device")
    max_len = decode_bounds(block_tables, seq_lens, _n, t, max_seq_len, validate)
    plan = plan_decode(query, h, t, max_len, tokens_per_split=tokens_per_split, blocks_per_split=blocks_per_split,
                       workspace=workspace, out=out, quant=quant)  # fmt: skip
    if query.shape[0] == 0:
        return plan.out
    dot_f32, prec = dot_flags(query)
    cfg = plan.config
    decode_split_kernel[plan.grid](
        query, key_cache, value_cache, block_tables, seq_lens,
        plan.acc, plan.m, plan.l_sum, plan.out, plan.out.stride(0), plan.out.stride(1),
        key_scale, value_scale,
        (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        s_sb, s_sh, s_st,
        block_tables.stride(0), block_tables.stride(1), block_tables.shape[1], _n,
        plan.tokens_per_split,
        G=plan.group, GP=cfg.gp, T=t, D=d, TILE=cfg.tile, QUANT=QUANT_MODES[quant], DOT_F32=dot_f32, PREC=prec,
        DIRECT=int(plan.num_splits == 1), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return reduce_decode(plan, seq_lens)


def _kernels() -> tuple[object, object]:
    return decode_split_kernel, decode_reduce_kernel  # looked up at each launch (tests replace them)


def decode_step_launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    **options: object,
) -> DecodeStepLaunch:
    """:class:`~memos_kernels.decode_step.DecodeStepLaunch` of this module's kernels: a float-cache decode checked
    and planned once (``options``: ``scale``, ``max_seq_len``, ``tokens_per_split``, ``workspace``, ``validate``),
    launched per layer with ``.launch(query, key_cache, value_cache)``."""
    return DecodeStepLaunch(query, key_cache, value_cache, block_tables, seq_lens, kernels=_kernels,
                            **options)  # type: ignore[arg-type]  # fmt: skip


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
    a block boundary, an empty one), GQA 4, 16-token splits; ``quant="int8"`` quantizes the pool first."""
    device = device or default_device()
    q, pool, tables, lens = random_paged_case(seed, [37, 16, 0], device=device)
    extras: dict[str, torch.Tensor | str] = {}
    if quant == "int8":
        scales = (pool.abs().amax(-1) / 127).clamp(min=1e-4).to(torch.float16)  # [N, 2, H, T]
        pool = torch.round(pool / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
        extras = {"quant": "int8", "key_scale": scales[:, 0], "value_scale": scales[:, 1]}
    elif quant != "none":
        raise ConfigError(f"check_paged_decode runs quant 'none' or 'int8' (fp8 needs sm_89+), got {quant!r}")
    got = paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, tokens_per_split=16, **extras)  # type: ignore[arg-type]
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
