"""Triton kernels on the canonical pool layout ``[blocks, L, 2, H, T, D]`` (one layer's K or V cache is the
strided view ``[blocks, H, T, D]``; the kernels take strides, so no copy is made).

* :func:`write_kv` — reshape-and-cache: scatter new K/V ``[n, H, D]`` into their slots (``-1`` skips);
  :func:`write_kv_int8` and :func:`write_kv_fp8` quantize on the way (int8 per token and head with an fp16
  scale; fp8 e4m3 with the block's per-head scale);
* :func:`paged_decode_attention` — one query token per sequence, GQA (a program serves one KV head and all its
  query heads), variable lengths, online softmax, split-K over the context (flash-decoding) with a reduce step;
  dequantizing variants for the int8 and fp8 blocks of the quantized pool, and for KIVI's packed 4/2-bit blocks
  (with its full-precision residual window read from the staging slab);
* :func:`paged_prefill_attention` — a chunk of queries per sequence against its cached prefix and itself;
* :func:`copy_blocks` — block copies for copy-on-write and compaction.

They run natively on a CUDA GPU and, with ``TRITON_INTERPRET=1`` (set before Triton is imported), in Triton's
interpreter on CPU tensors — how the tests check them against :mod:`memos_ref.attention` on any machine.
Scores use an elementwise product and a sum instead of ``tl.dot``: a decode query block is 1-8 rows (below
``tl.dot``'s 16-row minimum), the step is memory-bound anyway, and it avoids the interpreter's bf16 ``tl.dot``
bug. Every wrapper checks its preconditions and raises a clear error.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from memos_ref.errors import ConfigError, DeviceError, DTypeError, ShapeError

__all__ = [
    "QUANT_MODES",
    "copy_blocks",
    "paged_decode_attention",
    "paged_decode_attention_kivi",
    "paged_prefill_attention",
    "write_kv",
    "write_kv_fp8",
    "write_kv_int8",
]

_NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": exp(_NEG - m) is 0 and never NaN (jit globals: constexpr)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_fp8(device: torch.device) -> None:
    """Triton's float8e4nv needs sm_89 or newer (Ada, Hopper); Jetson Orin (sm_87) and A100 (sm_80) lack it."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"fp8 KV kernels need sm_89 or newer; this GPU is sm_{major}{minor}: use int8")


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, quant: str = "none") -> tuple[int, int, int, int]:
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ShapeError(
            f"key/value caches must both be [num_blocks, kv_heads, block_size, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    n, h, t, d = key_cache.shape
    if not _pow2(t) or not 8 <= t <= 128:
        raise ConfigError(f"block size must be a power of two in 8-128, got {t}")
    if not _pow2(d):
        raise ConfigError(f"head_dim must be a power of two for these kernels, got {d}")
    allowed = {"none": (torch.float32, torch.float16, torch.bfloat16), "int8": (torch.int8,), "fp8": (torch.uint8,)}
    if key_cache.dtype not in allowed[quant] or value_cache.dtype != key_cache.dtype:
        raise DTypeError(
            f"caches for quant={quant!r} must be {allowed[quant]} and equal, got {key_cache.dtype}/{value_cache.dtype}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ShapeError("the head_dim axis of the caches must be contiguous (stride 1)")
    return n, h, t, d


def _check_write(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    quant: str,
) -> tuple[int, int, int]:
    """Shared checks of the write kernels; returns (H, T, D)."""
    _, h, t, d = _check_cache(key_cache, value_cache, quant)
    if key.ndim != 3 or key.shape != value.shape or tuple(key.shape[1:]) != (h, d):
        raise ShapeError(f"key/value must both be [tokens, {h}, {d}], got {tuple(key.shape)} and {tuple(value.shape)}")
    if slots.shape != (key.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"slots must be an integer tensor [{key.shape[0]}], got {tuple(slots.shape)} {slots.dtype}")
    if key.device != key_cache.device or slots.device != key_cache.device:
        raise DeviceError("key, value, slots and caches must be on one device")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ShapeError("key/value must be contiguous along head_dim")
    if key_cache.stride() != value_cache.stride():
        raise ShapeError("key and value caches must have the same strides (two views of one pool)")
    return h, t, d, slots.to(torch.int64)  # 64-bit offsets: block × stride overflows 32 bits past 2 GiB


# ---------------------------------------------------------------------- write_kv
@triton.jit
def _token_slot(slots_ptr, T: tl.constexpr, D: tl.constexpr):
    """The write kernels' program (token i, KV head h): the token's slot (-1 skips), its block and offset."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + i)
    return i, h, slot, slot // T, slot % T, tl.arange(0, D)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, slots_ptr, kc_ptr, vc_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_ch, s_ct,
    T: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    i, h, slot, block, off, d = _token_slot(slots_ptr, T, D)
    if slot >= 0:
        k = tl.load(key_ptr + i * s_kn + h * s_kh + d)
        v = tl.load(value_ptr + i * s_vn + h * s_vh + d)
        dst = block * s_cb + h * s_ch + off * s_ct + d
        tl.store(kc_ptr + dst, k)
        tl.store(vc_ptr + dst, v)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    """Scatter ``key, value [n, H, D]`` into ``key_cache, value_cache [N, H, T, D]`` at ``slots [n]``
    (slot = block · T + offset; ``-1`` skips the token)."""
    h, t, d, slots = _check_write(key, value, slots, key_cache, value_cache, "none")
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise DTypeError(f"key/value dtype {key.dtype} does not match the cache's {key_cache.dtype}")
    if key.shape[0] == 0:
        return
    _write_kv_kernel[(key.shape[0], h)](
        key, value, slots, key_cache, value_cache,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        T=t, D=d,
    )  # fmt: skip


@triton.jit
def _write_kv_int8_kernel(
    key_ptr, value_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_ch, s_ct,
    s_sb, s_sh, s_st,
    T: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    i, h, slot, block, off, d = _token_slot(slots_ptr, T, D)
    if slot >= 0:
        dst = block * s_cb + h * s_ch + off * s_ct + d
        sdst = block * s_sb + h * s_sh + off * s_st
        for which in tl.static_range(2):
            if which == 0:
                x = tl.load(key_ptr + i * s_kn + h * s_kh + d).to(tl.float32)
            else:
                x = tl.load(value_ptr + i * s_vn + h * s_vh + d).to(tl.float32)
            # the scale exactly as memos_ref.quant.PerTokenInt8: absmax / 127, rounded to fp16, floored
            s16 = tl.maximum(tl.max(tl.abs(x), axis=0) / 127.0, 1e-8).to(tl.float16)
            s32 = tl.maximum(s16.to(tl.float32), 5.960464477539063e-08)
            y = x / s32
            q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
            if which == 0:
                tl.store(kc_ptr + dst, q)
                tl.store(ks_ptr + sdst, s32.to(tl.float16))
            else:
                tl.store(vc_ptr + dst, q)
                tl.store(vs_ptr + sdst, s32.to(tl.float16))


def write_kv_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
) -> None:
    """Reshape-and-cache with int8 quantization on write (per token and head, fp16 scale): the streaming int8
    path of the quantized pool. ``*_codes [N, H, T, D]`` int8, ``*_scale [N, H, T]`` fp16. Ties round half up
    (torch rounds half to even: codes can differ by one at exact halves)."""
    h, t, d, slots = _check_write(key, value, slots, key_codes, value_codes, "int8")
    if key_scale.dtype != torch.float16 or key_scale.ndim != 3 or key_scale.stride() != value_scale.stride():
        raise DTypeError("scales must be fp16 [N, H, T] views of one payload")
    if key.shape[0] == 0:
        return
    _write_kv_int8_kernel[(key.shape[0], h)](
        key, value, slots, key_codes, value_codes, key_scale, value_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_codes.stride(0), key_codes.stride(1), key_codes.stride(2),
        key_scale.stride(0), key_scale.stride(1), key_scale.stride(2),
        T=t, D=d,
    )  # fmt: skip


@triton.jit
def _write_kv_fp8_kernel(
    key_ptr, value_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_ch, s_ct,
    s_sb, s_sh,
    T: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    i, h, slot, block, off, d = _token_slot(slots_ptr, T, D)
    if slot >= 0:
        dst = block * s_cb + h * s_ch + off * s_ct + d
        k_s = tl.load(ks_ptr + block * s_sb + h * s_sh)
        v_s = tl.load(vs_ptr + block * s_sb + h * s_sh)
        k = tl.load(key_ptr + i * s_kn + h * s_kh + d).to(tl.float32) / k_s
        v = tl.load(value_ptr + i * s_vn + h * s_vh + d).to(tl.float32) / v_s
        k = tl.minimum(tl.maximum(k, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(kc_ptr + dst, k.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        tl.store(vc_ptr + dst, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True))


def write_kv_fp8(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
) -> None:
    """Reshape-and-cache into fp8 e4m3 blocks (codes as uint8 ``[N, H, T, D]``) with the per-(block, head)
    scales ``[N, H]`` fp32 already in place. The caller grows a scale, and re-encodes its block, before a token
    that needs more range is written (the quantized pool does): the kernel only encodes, saturating at ±448."""
    h, t, d, slots = _check_write(key, value, slots, key_codes, value_codes, "fp8")
    _check_fp8(key.device)
    if key_scale.dtype != torch.float32 or key_scale.ndim != 2 or key_scale.stride() != value_scale.stride():
        raise DTypeError("scales must be fp32 [N, H] views of one payload")
    if key.shape[0] == 0:
        return
    _write_kv_fp8_kernel[(key.shape[0], h)](
        key, value, slots, key_codes, value_codes, key_scale, value_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_codes.stride(0), key_codes.stride(1), key_codes.stride(2),
        key_scale.stride(0), key_scale.stride(1),
        T=t, D=d,
    )  # fmt: skip


# ---------------------------------------------------------------------- paged decode attention
@triton.jit
def _online_softmax_step(q, k, v, ok, m_i, l_i, acc, scale):
    """Fold one block of keys ``k`` and values ``v`` ``[T, D]`` (valid rows ``ok``) into the running maximum
    ``m_i``, sum ``l_i`` and accumulator ``acc`` of the query group ``q [GP, D]``."""
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, T]
    scores = tl.where(ok[None, :], scores, _NEG)
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.where(ok[None, :], tl.exp(scores - m_new[:, None]), 0.0)  # [GP, T]
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
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
    m_i = tl.full((GP,), _NEG, tl.float32)
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
            m_i, l_i, acc = _online_softmax_step(q, k, v, ok, m_i, l_i, acc, scale)
    row = (b * tl.num_programs(1) + h) * num_splits + s  # partials [B, Hkv, S, GP, ...]
    tl.store(acc_ptr + (row * GP + g)[:, None] * D + d[None, :], acc)
    tl.store(m_ptr + row * GP + g, m_i)
    tl.store(l_ptr + row * GP + g, l_i)


@triton.jit
def _decode_reduce_kernel(
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
    m = tl.full((GP,), _NEG, tl.float32)
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


QUANT_MODES = {"none": 0, "int8": 1, "fp8": 2}


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

    Dequantizing variants read the quantized pool's payload (:class:`memos_ref.quant.pool.QuantizedBlockPool`):
    ``quant="int8"`` — int8 codes with fp16 scales ``[N, H, T]`` per (head, token); ``quant="fp8"`` — e4m3
    codes stored as uint8 with fp32 scales ``[N, H]`` per (block, head)."""
    if quant not in QUANT_MODES:
        raise ConfigError(f"quant must be one of {sorted(QUANT_MODES)}, got {quant!r}")
    _n, h, t, d = _check_cache(key_cache, value_cache, quant)
    if key_cache.stride() != value_cache.stride():
        raise ShapeError("key and value caches must have the same strides (two views of one pool)")
    if quant == "fp8":
        _check_fp8(query.device)
    if quant != "none":
        want = 3 if quant == "int8" else 2
        if key_scale is None or value_scale is None or key_scale.ndim != want or value_scale.shape != key_scale.shape:
            raise ShapeError(f"quant={quant!r} needs key_scale and value_scale of {want} dimensions")
        if key_scale.stride() != value_scale.stride():
            raise ShapeError("key and value scales must have the same strides (two views of one payload)")
    else:
        key_scale = value_scale = key_cache  # unused
    if quant == "int8":
        s_sb, s_sh, s_st = key_scale.stride()
    elif quant == "fp8":
        (s_sb, s_sh), s_st = key_scale.stride(), 0
    else:
        s_sb = s_sh = s_st = 0
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
    if blocks_per_split is None:
        blocks_per_split = max(1, 512 // t)  # about 512 tokens per program; a constant, so no recompiles
    num_splits = max(1, math.ceil(max_blocks / blocks_per_split))
    group = hq // h
    gp = triton.next_power_of_2(group)
    dev = query.device
    acc = torch.empty((b, h, num_splits, gp, d), dtype=torch.float32, device=dev)
    m = torch.empty((b, h, num_splits, gp), dtype=torch.float32, device=dev)
    l_sum = torch.empty((b, h, num_splits, gp), dtype=torch.float32, device=dev)
    out = torch.full_like(query, float("nan"))  # poisoned: a row the kernels failed to write shows as NaN
    if b == 0:
        return out
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    _decode_split_kernel[(b, h, num_splits)](
        query, key_cache, value_cache, tables, lens,
        acc, m, l_sum,
        key_scale, value_scale,
        scale,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        s_sb, s_sh, s_st,
        tables.stride(0), max_blocks,
        num_splits,
        G=group, GP=gp, T=t, D=d, BLOCKS_PER_SPLIT=blocks_per_split, QUANT=QUANT_MODES[quant],
    )  # fmt: skip
    _decode_reduce_kernel[(b, h)](acc, m, l_sum, out, out.stride(0), out.stride(1), num_splits, G=group, GP=gp, D=d)
    return out


@triton.jit
def _decode_kivi_split_kernel(
    q_ptr, tables_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, stg_ptr, slot_ptr,
    scale,
    s_qb, s_qh,
    s_cb, s_ch, s_ct,
    s_kb, s_kh, s_kg,
    s_vb, s_vh, s_vt,
    s_fb, s_fk, s_fh, s_ft,
    s_tb, max_blocks, num_splits,
    G: tl.constexpr, GP: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCKS_PER_SPLIT: tl.constexpr,
    BITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
):  # fmt: skip
    """Split-K decode over KIVI blocks: packed codes (keys per channel over GK tokens, values per token over GV
    channels, fp16 scale and zero), or the full-precision staging slab for blocks still in the residual window."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, T)
    q = tl.load(q_ptr + b * s_qb + (h * G + g)[:, None] * s_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full((GP,), _NEG, tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    shift = ((d % PER) * BITS)[None, :]
    for i in range(BLOCKS_PER_SPLIT):
        idx = s * BLOCKS_PER_SPLIT + i
        tok0 = idx * T
        if (tok0 < seq_len) & (idx < max_blocks):
            block = tl.load(tables_ptr + b * s_tb + idx)
            ok = (tok0 + t) < seq_len
            slot = tl.load(slot_ptr + block)
            if slot >= 0:  # still at full precision (the residual window)
                f = slot * s_fb + h * s_fh + t[:, None] * s_ft + d[None, :]
                k = tl.load(stg_ptr + f, mask=ok[:, None], other=0.0).to(tl.float32)
                v = tl.load(stg_ptr + s_fk + f, mask=ok[:, None], other=0.0).to(tl.float32)
            else:
                c = block * s_cb + h * s_ch + t[:, None] * s_ct + (d // PER)[None, :]
                kcode = ((tl.load(kc_ptr + c, mask=ok[:, None], other=0).to(tl.int32) >> shift) & MASK).to(tl.float32)
                vcode = ((tl.load(vc_ptr + c, mask=ok[:, None], other=0).to(tl.int32) >> shift) & MASK).to(tl.float32)
                kq = block * s_kb + h * s_kh + (t // GK)[:, None] * s_kg + d[None, :]
                k = kcode * tl.load(ks_ptr + kq).to(tl.float32) + tl.load(kz_ptr + kq).to(tl.float32)
                vq = block * s_vb + h * s_vh + t[:, None] * s_vt + (d // GV)[None, :]
                v = vcode * tl.load(vs_ptr + vq).to(tl.float32) + tl.load(vz_ptr + vq).to(tl.float32)
            m_i, l_i, acc = _online_softmax_step(q, k, v, ok, m_i, l_i, acc, scale)
    row = (b * tl.num_programs(1) + h) * num_splits + s
    tl.store(acc_ptr + (row * GP + g)[:, None] * D + d[None, :], acc)
    tl.store(m_ptr + row * GP + g, m_i)
    tl.store(l_ptr + row * GP + g, l_i)


def paged_decode_attention_kivi(
    query: torch.Tensor,
    pool: object,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    blocks_per_split: int | None = None,
) -> torch.Tensor:
    """Decode attention ``[B, Hq, D]`` straight over a KIVI :class:`~memos_ref.quant.pool.QuantizedBlockPool`:
    sealed blocks are unpacked and dequantized in the kernel, blocks of the residual window are read from the
    full-precision staging slab."""
    from memos_ref.quant.schemes import KIVI

    scheme = getattr(pool, "scheme", None)
    if not isinstance(scheme, KIVI):
        raise ConfigError(f"expected a QuantizedBlockPool with a KIVI scheme, got {type(pool).__name__}")
    spec, p = pool.spec, pool.payload
    h, t, d = spec.num_kv_heads, spec.block_size, spec.head_dim
    if not _pow2(d) or not _pow2(t):
        raise ConfigError(f"head_dim and block size must be powers of two, got {d} and {t}")
    b, hq, _ = query.shape
    if query.shape[2] != d or hq % h or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ShapeError(f"query [{b}, k·{h}, {d}], block_tables [{b}, *] and seq_lens [{b}] expected")
    dev = query.device
    kc, ks, kz = p["k_codes"][:, layer], p["k_scale"][:, layer], p["k_zero"][:, layer]  # [N,H,T,DB], [N,H,T/G,D]
    vc, vs, vz = p["v_codes"][:, layer], p["v_scale"][:, layer], p["v_zero"][:, layer]  # [N,H,T,DB], [N,H,T,D/GV]
    stg = pool.staging[:, layer] if pool.staging.shape[0] else torch.zeros((1, 2, h, t, d), dtype=spec.dtype)
    slots = pool.staging_slot.to(dev)
    max_blocks = block_tables.shape[1]
    blocks_per_split = blocks_per_split or max(1, 512 // t)
    num_splits = max(1, math.ceil(max_blocks / blocks_per_split))
    group, gp = hq // h, triton.next_power_of_2(hq // h)
    acc = torch.empty((b, h, num_splits, gp, d), dtype=torch.float32, device=dev)
    m = torch.empty((b, h, num_splits, gp), dtype=torch.float32, device=dev)
    l_sum = torch.empty_like(m)
    out = torch.full_like(query, float("nan"))
    if b == 0:
        return out
    tables, lens = block_tables.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous()
    _decode_kivi_split_kernel[(b, h, num_splits)](
        query, tables, lens, acc, m, l_sum,
        kc, ks, kz, vc, vs, vz, stg, slots,
        scale if scale is not None else 1.0 / math.sqrt(d),
        query.stride(0), query.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        stg.stride(0), stg.stride(1), stg.stride(2), stg.stride(3),
        tables.stride(0), max_blocks, num_splits,
        G=group, GP=gp, T=t, D=d, BLOCKS_PER_SPLIT=blocks_per_split,
        BITS=scheme.bits, GK=scheme.group_size, GV=min(scheme.group_size, d),
    )  # fmt: skip
    _decode_reduce_kernel[(b, h)](acc, m, l_sum, out, out.stride(0), out.stride(1), num_splits, G=group, GP=gp, D=d)
    return out


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
    up to itself. Returns ``[B, Hq, Q, D]`` with zeros past ``query_lens``.

    Every (sequence, query position) becomes a decode row whose length stops at that position, run by the
    split-K decode kernel — simple and exact; a tiled kernel that shares K/V loads across the chunk's queries
    is the faster form."""
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
        flat_q, key_cache, value_cache, block_tables[idx], torch.tensor(lens, device=query.device), scale=scale, **quant
    )
    for r, (i, j) in enumerate(src):
        out[i, :, j] = res[r]
    return out


# ---------------------------------------------------------------------- copy_blocks
@triton.jit
def _copy_blocks_kernel(pool_ptr, pairs_ptr, block_numel, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * i)
    dst = tl.load(pairs_ptr + 2 * i + 1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < block_numel
    tl.store(pool_ptr + dst * block_numel + offs, tl.load(pool_ptr + src * block_numel + offs, mask=ok), mask=ok)


def copy_blocks(pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks ``pool[src] -> pool[dst]`` for every row ``(src, dst)`` of ``pairs [n, 2]`` (a
    contiguous pool ``[N, ...]``); destinations must be distinct and not also sources."""
    if not pool.is_contiguous():
        raise ShapeError("copy_blocks needs a contiguous pool")
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ShapeError(f"pairs must be [n, 2] (src, dst), got {tuple(pairs.shape)}")
    if pairs.numel() == 0:
        return
    flat = pairs.to(torch.int64).contiguous()
    n = pool.shape[0]
    if int(flat.min()) < 0 or int(flat.max()) >= n:
        raise ShapeError(f"block ids must be in [0, {n})")
    dsts = flat[:, 1].tolist()
    if len(set(dsts)) != len(dsts) or set(dsts) & set(flat[:, 0].tolist()):
        raise ConfigError("copy_blocks destinations must be distinct and must not be sources")
    numel = pool[0].numel()
    chunk = 1024
    _copy_blocks_kernel[(flat.shape[0], triton.cdiv(numel, chunk))](pool, flat, numel, CHUNK=chunk)
