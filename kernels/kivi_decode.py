"""Paged decode attention straight over KIVI's packed 4/2-bit blocks, with its full-precision residual window.

Told in the Triton tutorials' order — reference (plain torch) → kernel → wrapper → check → benchmark. The
split-K plan, the online-softmax step and the reduce kernel are :mod:`memos_kernels.paged_decode`'s.

KIVI quantizes keys per channel over groups of ``group_size`` tokens and values per token over groups of
``min(group_size, D)`` channels, asymmetrically (an fp16 scale and zero per group), and packs ``8 // bits``
codes per byte, low bits first (channel ``d`` sits in byte ``d // (8 // bits)`` at bit ``(d % (8 // bits)) ·
bits``). A block still inside the residual window has no codes yet: it lives at full precision in a row of the
staging slab, and ``staging_slot[block]`` names the row (``-1``: the block is sealed, read its codes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from memos_kernels.common import NEG, CheckResult, check_index_dtypes, default_device, is_pow2, should_validate
from memos_kernels.launch_plan import RUNTIME_ARGS, kivi_config
from memos_kernels.paged_decode import (
    LOG2E,
    DecodeWorkspace,
    attend_tile,
    decode_bounds,
    dot_flags,
    load_group,
    paged_decode_reference,
    plan_decode,
    random_paged_case,
    reduce_decode,
    split_bounds,
    store_split,
    tile_slots,
    validate_decode_inputs,
)
from memos_kernels.timing import time_ms

from memos_ref.errors import ConfigError, DeviceError, DTypeError, InvalidBlockError, ShapeError

__all__ = [
    "KERNELS",
    "KIVI_PAYLOAD",
    "KiviBlocks",
    "benchmark_kivi_decode",
    "check_kivi_decode",
    "decode_kivi_split_kernel",
    "kivi_dequantize",
    "kivi_pack",
    "kivi_unpack",
    "kivi_warps",
    "paged_decode_attention_kivi",
    "paged_decode_attention_kivi_packed",
    "paged_decode_kivi_reference",
    "random_kivi_blocks",
]

KIVI_PAYLOAD = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")  # a KIVI pool's payload keys


# ---------------------------------------------------------------------------------------------- reference
def kivi_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-bit codes ``[..., D]`` (uint8) into bytes ``[..., D · bits / 8]``, low bits first."""
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def kivi_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`kivi_pack`: bytes ``[..., n]`` to codes ``[..., n · 8 / bits]`` (uint8)."""
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


@dataclass
class KiviBlocks:
    """One layer of a KIVI pool as plain tensors: codes ``[N, H, T, D·bits/8]`` (uint8), key scale/zero
    ``[N, H, T/group, D]`` and value scale/zero ``[N, H, T, D/min(group, D)]`` (fp16), the staging slab
    ``[S, 2, H, T, D]`` and ``staging_slot [N]`` (-1: sealed); ``bits`` 4 or 2, ``group_size`` tokens per key
    group."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    staging: torch.Tensor
    staging_slot: torch.Tensor
    bits: int
    group_size: int


def kivi_dequantize(blocks: KiviBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: every block's K and V ``[N, H, T, D]`` in fp32 — staged blocks from the slab, sealed ones
    unpacked and dequantized (``code · scale + zero``)."""
    bits = blocks.bits
    d = blocks.k_scale.shape[-1]
    gk, gv = blocks.group_size, min(blocks.group_size, d)
    k = kivi_unpack(blocks.k_codes, bits).float() * blocks.k_scale.float().repeat_interleave(gk, 2)
    k = k + blocks.k_zero.float().repeat_interleave(gk, 2)
    v = kivi_unpack(blocks.v_codes, bits).float() * blocks.v_scale.float().repeat_interleave(gv, 3)
    v = v + blocks.v_zero.float().repeat_interleave(gv, 3)
    staged = (blocks.staging_slot >= 0).nonzero()[:, 0]
    if staged.numel():
        rows = blocks.staging[blocks.staging_slot[staged]].float()  # [n, 2, H, T, D]
        k[staged], v[staged] = rows[:, 0], rows[:, 1]
    return k, v


def paged_decode_kivi_reference(
    query: torch.Tensor,
    blocks: KiviBlocks,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain torch: dequantize every block (:func:`kivi_dequantize`), then the float decode reference."""
    k, v = kivi_dequantize(blocks)
    return paged_decode_reference(query, k, v, block_tables, seq_lens, scale=scale)


# ---------------------------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=RUNTIME_ARGS)
def decode_kivi_split_kernel(
    q_ptr, tables_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, stg_ptr, slot_ptr,
    qk_scale,
    s_qb, s_qh,
    s_cb, s_ch, s_ct,
    s_kb, s_kh, s_kg,
    s_vb, s_vh, s_vt,
    s_fb, s_fk, s_fh, s_ft,
    s_tb, s_tc, width, num_blocks, num_staged, tokens_per_split,
    G, GP: tl.constexpr, T, D: tl.constexpr, TILE: tl.constexpr,
    BITS: tl.constexpr, GK, GV, DOT_F32: tl.constexpr, PREC: tl.constexpr,
    DIRECT,
):  # fmt: skip
    """Split-K decode over KIVI blocks on :mod:`memos_kernels.paged_decode`'s skeleton (token tiles through the
    table, ``tl.dot`` over the query group): each token is read from its block's packed codes (keys per channel
    over GK tokens, values per token over GV channels, fp16 scale and zero) or, for a block still in the
    residual window, from the full-precision staging slab. Bounds: table columns, block ids and staging rows
    outside ``[0, width)``, ``[0, num_blocks)`` and ``[-1, num_staged)`` are masked, never read."""
    PER: tl.constexpr = 8 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    start, end = split_bounds(lens_ptr, b, s, tokens_per_split, width * T)
    q = load_group(q_ptr, b, h, s_qb, s_qh, G, GP, D, DOT_F32)
    d = tl.arange(0, D)
    shift = ((d % PER) * BITS)[None, :]
    m_i = tl.full((GP,), NEG, tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    for tok0 in range(start, end, TILE):
        ok, block, off = tile_slots(tables_ptr, b, s_tb, s_tc, tok0, end, width, num_blocks, T, TILE)
        slot = tl.load(slot_ptr + block, mask=ok, other=-1)  # [TILE]: the block's staging row, -1 sealed
        ok = ok & (slot >= -1) & (slot < num_staged)  # a row outside the slab: the token is invalid
        staged = (ok & (slot >= 0))[:, None]
        sealed = (ok & (slot < 0))[:, None]
        f = slot.to(tl.int64) * s_fb + h * s_fh + off * s_ft
        k = tl.load(stg_ptr + f[:, None] + d[None, :], mask=staged, other=0.0).to(tl.float32)
        v = tl.load(stg_ptr + s_fk + f[:, None] + d[None, :], mask=staged, other=0.0).to(tl.float32)
        c = (block * s_cb + h * s_ch + off * s_ct)[:, None] + (d // PER)[None, :]
        kcode = ((tl.load(kc_ptr + c, mask=sealed, other=0).to(tl.int32) >> shift) & MASK).to(tl.float32)
        vcode = ((tl.load(vc_ptr + c, mask=sealed, other=0).to(tl.int32) >> shift) & MASK).to(tl.float32)
        kq = (block * s_kb + h * s_kh + (off // GK) * s_kg)[:, None] + d[None, :]
        k_sc = tl.load(ks_ptr + kq, mask=sealed, other=0.0).to(tl.float32)
        k += kcode * k_sc + tl.load(kz_ptr + kq, mask=sealed, other=0.0).to(tl.float32)
        vq = (block * s_vb + h * s_vh + off * s_vt)[:, None] + (d // GV)[None, :]
        v_sc = tl.load(vs_ptr + vq, mask=sealed, other=0.0).to(tl.float32)
        v += vcode * v_sc + tl.load(vz_ptr + vq, mask=sealed, other=0.0).to(tl.float32)
        m_i, l_i, acc = attend_tile(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_F32, PREC)
    store_split(acc_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_oh, b, h, s, acc, m_i, l_i, G, GP, D, DIRECT)


KERNELS = (decode_kivi_split_kernel,)


# ---------------------------------------------------------------------------------------------- wrappers
def kivi_warps(head_dim: int) -> int:
    """Warps of a KIVI decode launch (:func:`memos_kernels.launch_plan.kivi_config`): 8 (the unpacking's
    registers shared by more threads)."""
    return kivi_config(1, 32, head_dim, torch.float16).num_warps


def _check_blocks(blocks: KiviBlocks, device: torch.device) -> tuple[int, int, int, int]:
    """The KIVI tensors' shapes, dtypes, strides and device; returns ``(H, T, D, value group)``."""
    bits, group = blocks.bits, blocks.group_size
    if bits not in (2, 4) or not is_pow2(group):
        raise ConfigError(f"KIVI bits must be 2 or 4 and group_size a power of two, got {bits} and {group}")
    if blocks.k_scale.ndim != 4 or blocks.k_codes.ndim != 4:
        raise ShapeError(
            f"k_codes [N, H, T, D·bits/8] and k_scale [N, H, T/group, D] expected, got "
            f"{tuple(blocks.k_codes.shape)} and {tuple(blocks.k_scale.shape)}"
        )
    n, h, t, _ = blocks.k_codes.shape
    d = blocks.k_scale.shape[-1]
    if not is_pow2(d) or not is_pow2(t):
        raise ConfigError(f"head_dim and block size must be powers of two, got {d} and {t}")
    if t % group:
        raise ConfigError(f"block size {t} must be a multiple of the KIVI key group {group}")
    gv = min(group, d)
    want = {
        "k_codes": ((n, h, t, d * bits // 8), torch.uint8),
        "v_codes": ((n, h, t, d * bits // 8), torch.uint8),
        "k_scale": ((n, h, t // group, d), torch.float16),
        "k_zero": ((n, h, t // group, d), torch.float16),
        "v_scale": ((n, h, t, d // gv), torch.float16),
        "v_zero": ((n, h, t, d // gv), torch.float16),
    }
    for name, (shape, dtype) in want.items():
        x = getattr(blocks, name)
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ShapeError(f"{name} must be {dtype} {list(shape)}, got {x.dtype} {list(x.shape)}")
        if x.device != device:
            raise DeviceError(f"{name} is on {x.device}, the query on {device}: use one device")
    if blocks.v_codes.stride() != blocks.k_codes.stride() or blocks.k_zero.stride() != blocks.k_scale.stride():
        raise ShapeError("k/v codes, and each scale with its zero, must have the same strides (views of one payload)")
    if blocks.v_zero.stride() != blocks.v_scale.stride():
        raise ShapeError("v_scale and v_zero must have the same strides (views of one payload)")
    stg = blocks.staging
    if stg.ndim != 5 or tuple(stg.shape[1:]) != (2, h, t, d) or not stg.dtype.is_floating_point:
        raise ShapeError(f"staging must be a float [S, 2, {h}, {t}, {d}] slab, got {stg.dtype} {list(stg.shape)}")
    if blocks.staging_slot.shape != (n,):
        raise ShapeError(f"staging_slot must be an integer [{n}] (one row per block, -1: sealed)")
    check_index_dtypes(staging_slot=blocks.staging_slot)
    if blocks.staging_slot.device != device or stg.device != device:
        raise DeviceError(f"the staging slab and slot map must be on the query's device {device}")
    return h, t, d, gv


def paged_decode_attention_kivi_packed(
    query: torch.Tensor,
    blocks: KiviBlocks,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    blocks_per_split: int | None = None,
    tokens_per_split: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Decode attention ``query [B, Hq, D]`` -> ``[B, Hq, D]`` over one layer of KIVI blocks given as plain
    tensors (:class:`KiviBlocks`): sealed blocks are unpacked and dequantized in the kernel, blocks of the
    residual window are read from the full-precision staging slab. The split and workspace arguments are
    :func:`~memos_kernels.paged_decode.paged_decode_attention`'s; nothing is copied to the device per call (the
    staging slot map must already be there). ``validate`` as in
    :func:`~memos_kernels.paged_decode.paged_decode_attention` (the staging slot map's rows too)."""
    h, t, d, gv = _check_blocks(blocks, query.device)
    if blocks.staging.dtype != query.dtype:  # the pool keeps its residual window in the model's dtype
        raise DTypeError(f"the staging slab must be in the query's dtype {query.dtype}, got {blocks.staging.dtype}")
    validate_decode_inputs(query, h, d, block_tables, seq_lens)
    b = query.shape[0]
    stg = blocks.staging
    if stg.shape[0] == 0:  # no block is staged (every slot is -1): any pointer serves, none is read
        stg = stg.new_empty((1, 2, h, t, d))
    kc, ks, kz, vc, vs, vz = (blocks.k_codes, blocks.k_scale, blocks.k_zero, blocks.v_codes, blocks.v_scale,
                              blocks.v_zero)  # fmt: skip
    n_blocks, n_staged = blocks.k_codes.shape[0], blocks.staging.shape[0]
    max_len = decode_bounds(block_tables, seq_lens, n_blocks, t, max_seq_len, validate)
    if should_validate(validate, query.device):
        slot = blocks.staging_slot
        if slot.numel() and bool(((slot < -1) | (slot >= n_staged)).any()):
            bad = int(((slot < -1) | (slot >= n_staged)).nonzero()[0, 0])
            raise InvalidBlockError(
                f"staging_slot[{bad}] = {int(slot[bad])}, expected -1 (sealed) or 0..{n_staged - 1}"
            )
    plan = plan_decode(query, h, t, max_len, tokens_per_split=tokens_per_split, blocks_per_split=blocks_per_split,
                       workspace=workspace, out=out, quant="kivi")  # fmt: skip
    if b == 0:
        return plan.out
    dot_f32, prec = dot_flags(query)
    cfg = plan.config
    decode_kivi_split_kernel[plan.grid](
        query, block_tables, seq_lens, plan.acc, plan.m, plan.l_sum, plan.out, plan.out.stride(0), plan.out.stride(1),
        kc, ks, kz, vc, vs, vz, stg, blocks.staging_slot,
        (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E,
        query.stride(0), query.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        stg.stride(0), stg.stride(1), stg.stride(2), stg.stride(3),
        block_tables.stride(0), block_tables.stride(1), block_tables.shape[1], n_blocks, n_staged,
        plan.tokens_per_split,
        G=plan.group, GP=cfg.gp, T=t, D=d, TILE=cfg.tile,
        BITS=blocks.bits, GK=blocks.group_size, GV=gv, DOT_F32=dot_f32, PREC=prec, DIRECT=int(plan.num_splits == 1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return reduce_decode(plan, seq_lens)


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
    """Decode attention ``[B, Hq, D]`` over layer ``layer`` of a KIVI quantized pool, read by duck typing (no
    import of the pool's class): ``pool.scheme.bits`` / ``.group_size``, ``pool.payload`` (the
    :data:`KIVI_PAYLOAD` tensors ``[N, L, ...]``), ``pool.staging [S, L, 2, H, T, D]`` and the slot map
    ``pool.device_staging_slot [N]`` (on the pool's device; ``pool.staging_slot`` for a pool without one). Slices
    the layer and calls :func:`paged_decode_attention_kivi_packed`."""
    scheme = getattr(pool, "scheme", None)
    bits, group = getattr(scheme, "bits", None), getattr(scheme, "group_size", None)
    payload = getattr(pool, "payload", None)
    if not (isinstance(bits, int) and isinstance(group, int) and isinstance(payload, dict)) or not set(
        KIVI_PAYLOAD
    ) <= set(payload):
        raise ConfigError(f"expected a quantized pool with a KIVI scheme, got {type(pool).__name__}")
    staging = pool.staging  # type: ignore[attr-defined]
    slot_map = getattr(pool, "device_staging_slot", None)
    if slot_map is None:
        slot_map = pool.staging_slot  # type: ignore[attr-defined]
    blocks = KiviBlocks(
        *(payload[name][:, layer] for name in KIVI_PAYLOAD),
        staging[:, layer],
        slot_map,
        bits=bits,
        group_size=group,
    )
    return paged_decode_attention_kivi_packed(
        query, blocks, block_tables, seq_lens, scale=scale, blocks_per_split=blocks_per_split
    )


# ---------------------------------------------------------------------------------------------- check
def random_kivi_blocks(
    seed: int,
    num_blocks: int,
    *,
    bits: int = 4,
    group_size: int = 16,
    kv_heads: int = 2,
    block_size: int = 32,
    head_dim: int = 32,
    staged: tuple[int, ...] = (),
    device: str = "cpu",
) -> KiviBlocks:
    """Random KIVI blocks: random codes packed, positive scales, zeros around 0; the blocks ``staged`` live in
    the staging slab (in reverse row order, so block id and row differ)."""
    g = torch.Generator().manual_seed(seed)
    n, h, t, d = num_blocks, kv_heads, block_size, head_dim
    gv = min(group_size, d)

    def codes() -> torch.Tensor:
        return kivi_pack(torch.randint(0, 1 << bits, (n, h, t, d), generator=g, dtype=torch.uint8), bits)

    def half(*shape: int, lo: float) -> torch.Tensor:
        return (torch.rand(*shape, generator=g) + lo).to(torch.float16)

    slot = torch.full((n,), -1, dtype=torch.long)
    slot[list(staged)] = torch.arange(len(staged) - 1, -1, -1)
    blocks = KiviBlocks(
        codes(), half(n, h, t // group_size, d, lo=0.1), half(n, h, t // group_size, d, lo=-1.0),
        codes(), half(n, h, t, d // gv, lo=0.1), half(n, h, t, d // gv, lo=-1.0),
        torch.randn(len(staged), 2, h, t, d, generator=g), slot,
        bits=bits, group_size=group_size,
    )  # fmt: skip
    for name in (*KIVI_PAYLOAD, "staging", "staging_slot"):
        setattr(blocks, name, getattr(blocks, name).to(device))
    return blocks


def check_kivi_decode(device: str | None = None, *, seed: int = 0, bits: int = 4) -> CheckResult:
    """:func:`paged_decode_attention_kivi_packed` against :func:`paged_decode_kivi_reference`: three sequences
    (70, 9 and 0 tokens in 32-token blocks) over packed and staged blocks, one block per split."""
    device = device or default_device()
    q, pool, tables, lens = random_paged_case(seed, [70, 9, 0], block_size=32, device=device)
    staged = (int(tables[0, 2]), int(tables[1, 0]))  # the newest block of the first sequence, the second's only
    blocks = random_kivi_blocks(seed, pool.shape[0], bits=bits, staged=staged, device=device)
    got = paged_decode_attention_kivi_packed(q, blocks, tables, lens, tokens_per_split=32)
    want = paged_decode_kivi_reference(q, blocks, tables, lens)
    return CheckResult(f"kivi_decode[{bits}bit]", float((got - want).abs().max()), 1e-4)


# ---------------------------------------------------------------------------------------------- benchmark
def benchmark_kivi_decode(
    device: str | None = None, *, batch: int = 8, context: int = 1024, bits: int = 4, head_dim: int = 128
) -> dict[str, float]:
    """Time :func:`paged_decode_attention_kivi_packed` against :func:`paged_decode_kivi_reference` (8 KV heads,
    GQA 4, 32-token blocks, one staged block): medians and min–max in milliseconds."""
    device = device or default_device()
    q, pool, tables, lens = random_paged_case(
        0, [context] * batch, kv_heads=8, block_size=32, head_dim=head_dim, device=device
    )
    blocks = random_kivi_blocks(
        0, pool.shape[0], bits=bits, kv_heads=8, head_dim=head_dim, staged=(int(tables[0, -1]),), device=device
    )
    kernel = time_ms(lambda: paged_decode_attention_kivi_packed(q, blocks, tables, lens), device)
    reference = time_ms(lambda: paged_decode_kivi_reference(q, blocks, tables, lens), device)
    return {**kernel.as_dict("kernel"), **reference.as_dict("reference")}
