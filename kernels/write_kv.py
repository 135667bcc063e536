"""Reshape-and-cache: scatter new K/V ``[n, H, D]`` into their slots of one layer's paged caches.

Three writes, each told in the Triton tutorials' order — reference (plain torch) → kernel → wrapper → check →
benchmark:

* :func:`write_kv` — float caches, stored as they come;
* :func:`write_kv_int8` — int8 codes with an fp16 scale per (token, head), quantized on the way exactly as the
  quantized pool's per-token int8 scheme;
* :func:`write_kv_fp8` — fp8 e4m3 codes (stored as uint8) under the block's per-head fp32 scale.

A slot is ``block · T + offset``; slot ``-1`` skips its token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from memos_kernels.common import (
    CheckResult,
    check_cache,
    check_fp8,
    check_index_dtypes,
    check_slots,
    default_device,
    should_validate,
)
from memos_kernels.launch_plan import DTYPES, RUNTIME_ARGS, check_launchable
from memos_kernels.timing import time_ms

from memos_ref.errors import DeviceError, DTypeError, ShapeError

__all__ = [
    "KERNELS",
    "benchmark_write_kv",
    "check_write_kv",
    "check_write_kv_fp8",
    "check_write_kv_int8",
    "write_kv",
    "write_kv_fp8",
    "write_kv_fp8_kernel",
    "write_kv_fp8_reference",
    "write_kv_int8",
    "write_kv_int8_kernel",
    "write_kv_int8_reference",
    "write_kv_kernel",
    "write_kv_reference",
    "write_quantized",
]

FP8_MAX = 448.0  # the largest finite e4m3 value
INT8_SCALE_FLOOR = 5.960464477539063e-08  # the smallest positive fp16 (subnormal): a scale is never 0


# ---------------------------------------------------------------------------------------------- reference
def _live(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens to write (slot >= 0), their blocks and their offsets."""
    keep = slots >= 0
    live = slots[keep].long()
    return keep, live // block_size, live % block_size


def write_kv_reference(
    key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    """Plain torch: ``key_cache[slot // T, :, slot % T] = key[i]`` (and V) for every slot ``>= 0``."""
    keep, block, off = _live(slots, key_cache.shape[2])
    key_cache[block, :, off] = key[keep]
    value_cache[block, :, off] = value[keep]


def int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [n, H, D]`` -> int8 codes ``[n, H, D]`` and fp16 scales ``[n, H]``: absmax / 127 rounded to fp16,
    ties rounded half up (the kernel's rule)."""
    xf = x.float()
    s16 = (xf.abs().amax(-1) / 127.0).clamp(min=1e-8).to(torch.float16)
    s32 = s16.float().clamp(min=INT8_SCALE_FLOOR)
    codes = torch.floor(xf / s32[..., None] + 0.5).clamp(-127, 127).to(torch.int8)
    return codes, s32.to(torch.float16)


def write_kv_int8_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
) -> None:
    """Plain torch: quantize per (token, head) with :func:`int8_per_token`, then store codes and scales."""
    keep, block, off = _live(slots, key_codes.shape[2])
    for x, codes, scale in ((key, key_codes, key_scale), (value, value_codes, value_scale)):
        q, s = int8_per_token(x[keep])
        codes[block, :, off] = q
        scale[block, :, off] = s


def write_kv_fp8_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
) -> None:
    """Plain torch: divide by the block's per-head scale, saturate at ±448, encode as e4m3 bytes."""
    keep, block, off = _live(slots, key_codes.shape[2])
    for x, codes, scale in ((key, key_codes, key_scale), (value, value_codes, value_scale)):
        y = (x[keep].float() / scale[block][..., None]).clamp(-FP8_MAX, FP8_MAX)  # [n, H, D]
        codes[block, :, off] = y.to(torch.float8_e4m3fn).view(torch.uint8)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def token_slot(slots_ptr, num_slots, T, D: tl.constexpr):
    """The write kernels' program (token i, KV head h): whether to write (the slot is in ``[0, num_slots)``:
    -1 skips, and a slot past the pool is never written), the block and offset."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + i)
    live = (slot >= 0) & (slot < num_slots)
    return i, h, live, slot // T, slot % T, tl.arange(0, D)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def write_kv_kernel(
    key_ptr, value_ptr, slots_ptr, kc_ptr, vc_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_ch, s_ct, num_slots,
    T, D: tl.constexpr,
):  # fmt: skip
    i, h, live, block, off, d = token_slot(slots_ptr, num_slots, T, D)
    if live:
        k = tl.load(key_ptr + i * s_kn + h * s_kh + d)
        v = tl.load(value_ptr + i * s_vn + h * s_vh + d)
        dst = block * s_cb + h * s_ch + off * s_ct + d
        tl.store(kc_ptr + dst, k)
        tl.store(vc_ptr + dst, v)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def write_kv_int8_kernel(
    key_ptr, value_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_ch, s_ct,
    s_sb, s_sh, s_st, num_slots,
    T, D: tl.constexpr,
):  # fmt: skip
    i, h, live, block, off, d = token_slot(slots_ptr, num_slots, T, D)
    if live:
        dst = block * s_cb + h * s_ch + off * s_ct + d
        sdst = block * s_sb + h * s_sh + off * s_st
        for which in tl.static_range(2):
            if which == 0:
                x = tl.load(key_ptr + i * s_kn + h * s_kh + d).to(tl.float32)
            else:
                x = tl.load(value_ptr + i * s_vn + h * s_vh + d).to(tl.float32)
            # the scale exactly as int8_per_token: absmax / 127, rounded to fp16, floored
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


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def write_kv_fp8_kernel(
    key_ptr, value_ptr, slots_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_ch, s_ct,
    s_sb, s_sh, s_st, num_slots,
    T, D: tl.constexpr,
):  # fmt: skip
    i, h, live, block, off, d = token_slot(slots_ptr, num_slots, T, D)
    if live:  # s_st is unused: one scale per (block, head), the argument list is the int8 kernel's
        dst = block * s_cb + h * s_ch + off * s_ct + d
        k_s = tl.load(ks_ptr + block * s_sb + h * s_sh)
        v_s = tl.load(vs_ptr + block * s_sb + h * s_sh)
        k = tl.load(key_ptr + i * s_kn + h * s_kh + d).to(tl.float32) / k_s
        v = tl.load(value_ptr + i * s_vn + h * s_vh + d).to(tl.float32) / v_s
        k = tl.minimum(tl.maximum(k, -448.0), 448.0)
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        tl.store(kc_ptr + dst, k.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        tl.store(vc_ptr + dst, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True))


KERNELS = (write_kv_kernel, write_kv_int8_kernel, write_kv_fp8_kernel)


# ---------------------------------------------------------------------------------------------- wrappers
def _check_write(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    quant: str,
    validate: bool | None = None,
) -> tuple[int, int, int, torch.Tensor]:
    """Shared checks of the write wrappers; returns (H, T, D) and the slots as int64. ``validate`` (default: on
    the CPU only, where it costs no host sync) refuses slots other than -1 or ``[0, N · T)``; unvalidated, the
    kernels skip such slots (never write outside the pool); validated, a slot named twice is refused too. A slot
    mapping that is not int32/int64 is always refused (:class:`~memos_ref.errors.DTypeError`)."""
    n, h, t, d = check_cache(key_cache, value_cache, quant)
    if key.dtype != value.dtype or key.dtype not in DTYPES.values():
        raise DTypeError(f"key and value must share one of {sorted(DTYPES)}, got {key.dtype} and {value.dtype}")
    check_launchable("write_kv", d, t, 1, key.dtype, key.device)
    if key.ndim != 3 or key.shape != value.shape or tuple(key.shape[1:]) != (h, d):
        raise ShapeError(f"key/value must both be [tokens, {h}, {d}], got {tuple(key.shape)} and {tuple(value.shape)}")
    if slots.shape != (key.shape[0],):
        raise ShapeError(f"slots must be an integer tensor [{key.shape[0]}], got {tuple(slots.shape)} {slots.dtype}")
    check_index_dtypes(slot_mapping=slots)
    if key.device != key_cache.device or slots.device != key_cache.device:
        raise DeviceError("key, value, slots and caches must be on one device")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ShapeError("key/value must be contiguous along head_dim")
    if key_cache.stride() != value_cache.stride():
        raise ShapeError("key and value caches must have the same strides (two views of one pool)")
    if should_validate(validate, slots.device):
        check_slots(slots, n * t)
    return h, t, d, slots.to(torch.int64)  # 64-bit offsets: block × stride overflows 32 bits past 2 GiB


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Scatter ``key, value [n, H, D]`` into ``key_cache, value_cache [N, H, T, D]`` at ``slots [n]``
    (slot = block · T + offset; ``-1`` skips the token; ``validate`` as in :func:`_check_write`)."""
    h, t, d, slots = _check_write(key, value, slots, key_cache, value_cache, "none", validate)
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise DTypeError(f"key/value dtype {key.dtype} does not match the cache's {key_cache.dtype}")
    if key.shape[0] == 0:
        return
    write_kv_kernel[(key.shape[0], h)](
        key, value, slots, key_cache, value_cache,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.shape[0] * t,
        T=t, D=d,
    )  # fmt: skip


def write_quantized(
    kernel: triton.JITFunction,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    codes: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    quant: str,
    validate: bool | None = None,
) -> None:
    """Launch a quantizing write kernel (``write_kv_int8_kernel`` or ``write_kv_fp8_kernel``): checks the codes
    like a cache and the scales against the scheme's layout (int8: fp16 ``[N, H, T]``; fp8: fp32 ``[N, H]``),
    then one program per (token, KV head)."""
    h, t, d, slots = _check_write(key, value, slots, codes[0], codes[1], quant, validate)
    dtype, ndim = (torch.float16, 3) if quant == "int8" else (torch.float32, 2)
    if quant == "fp8":
        check_fp8(key.device)
    ks, vs = scales
    if ks.dtype != dtype or ks.ndim != ndim or ks.shape != vs.shape or ks.stride() != vs.stride():
        raise DTypeError(f"{quant} scales must be {dtype} views of one payload with {ndim} dimensions")
    if ks.device != key.device or vs.device != key.device:
        raise DeviceError(f"the scales are on {ks.device}, the keys on {key.device}: use one device")
    if key.shape[0] == 0:
        return
    scale_strides = ks.stride() if quant == "int8" else (*ks.stride(), 0)
    kernel[(key.shape[0], h)](
        key, value, slots, codes[0], codes[1], ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        codes[0].stride(0), codes[0].stride(1), codes[0].stride(2),
        *scale_strides, codes[0].shape[0] * t,
        T=t, D=d,
    )  # fmt: skip


def write_kv_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Reshape-and-cache with int8 quantization on write (per token and head, fp16 scale): the streaming int8
    path of the quantized pool. ``*_codes [N, H, T, D]`` int8, ``*_scale [N, H, T]`` fp16. Ties round half up
    (torch rounds half to even: codes can differ by one at exact halves from ``torch.round``)."""
    write_quantized(write_kv_int8_kernel, key, value, slots, (key_codes, value_codes), (key_scale, value_scale),
                    "int8", validate)  # fmt: skip


def write_kv_fp8(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    key_codes: torch.Tensor,
    value_codes: torch.Tensor,
    key_scale: torch.Tensor,
    value_scale: torch.Tensor,
    *,
    validate: bool | None = None,
) -> None:
    """Reshape-and-cache into fp8 e4m3 blocks (codes as uint8 ``[N, H, T, D]``) with the per-(block, head)
    scales ``[N, H]`` fp32 already in place. The caller grows a scale, and re-encodes its block, before a token
    that needs more range is written (the quantized pool does): the kernel only encodes, saturating at ±448 —
    exactly ``memos_ref.quant.fp8.fp8_encode``. The scales follow the package's one fp8 law:
    ``memos_ref.quant.fp8.fp8_block_scale`` for streamed blocks, ``fp8_scale`` for sealed ones."""
    write_quantized(write_kv_fp8_kernel, key, value, slots, (key_codes, value_codes), (key_scale, value_scale),
                    "fp8", validate)  # fmt: skip


# ---------------------------------------------------------------------------------------------- checks
def _case(
    seed: int, tokens: int, heads: int, block_size: int, head_dim: int, blocks: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V ``[tokens, H, D]`` and distinct random slots, one of them -1 (skipped)."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, heads, head_dim, generator=g) * 3
    value = torch.randn(tokens, heads, head_dim, generator=g)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[tokens // 2] = -1
    return key.to(device), value.to(device), slots.to(device)


def check_write_kv(device: str | None = None, *, seed: int = 0) -> CheckResult:
    """:func:`write_kv` against :func:`write_kv_reference` into poisoned (NaN) caches: every element equal,
    written or not (NaN == NaN here)."""
    device = device or default_device()
    key, value, slots = _case(seed, 11, 2, 16, 32, 4, device)
    pool = torch.full((4, 2, 2, 16, 32), float("nan"), device=device)  # [N, K/V, H, T, D]
    want = pool.clone()
    write_kv(key, value, slots, pool[:, 0], pool[:, 1])
    write_kv_reference(key, value, slots, want[:, 0], want[:, 1])
    same_nan = torch.equal(pool.isnan(), want.isnan())
    err = float((pool.nan_to_num(0.0) - want.nan_to_num(0.0)).abs().max()) if same_nan else float("inf")
    return CheckResult("write_kv", err, 0.0)


def check_write_kv_int8(device: str | None = None, *, seed: int = 0) -> CheckResult:
    """:func:`write_kv_int8` against :func:`write_kv_int8_reference`: the largest difference of the dequantized
    blocks (codes × scales), which must be exact — both round half up."""
    device = device or default_device()
    key, value, slots = _case(seed, 11, 2, 16, 32, 4, device)
    got = [
        torch.zeros(4, 2, 2, 16, 32, dtype=torch.int8, device=device),  # codes [N, K/V, H, T, D]
        torch.zeros(4, 2, 2, 16, dtype=torch.float16, device=device),  # scales [N, K/V, H, T]
    ]
    want = [x.clone() for x in got]
    for (codes, scale), fn in ((got, write_kv_int8), (want, write_kv_int8_reference)):
        fn(key, value, slots, codes[:, 0], codes[:, 1], scale[:, 0], scale[:, 1])
    deq = [c.float() * s.float()[..., None] for c, s in (got, want)]
    return CheckResult("write_kv_int8", float((deq[0] - deq[1]).abs().max()), 0.0)


def check_write_kv_fp8(device: str | None = None, *, seed: int = 0) -> CheckResult:
    """:func:`write_kv_fp8` against :func:`write_kv_fp8_reference` on values that are e4m3 numbers times the
    scale (so encoding rounds nothing: Triton 3.9's interpreter drops the carry when a rounding overflows the
    mantissa), plus saturated ones; the codes must be byte-identical."""
    device = device or default_device()
    key, value, slots = _case(seed, 11, 2, 16, 32, 4, device)
    scale = torch.full((4, 2, 2), 0.5, device=device)  # [N, K/V, H], a power of two: division is exact
    key = (key * 40).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * 0.5
    value = (value * 40).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * 0.5
    key[0, 0, 0], value[0, 1, 1] = 1000.0, -1000.0  # saturate at ±448
    got = torch.zeros(4, 2, 2, 16, 32, dtype=torch.uint8, device=device)
    want = got.clone()
    for codes, fn in ((got, write_kv_fp8), (want, write_kv_fp8_reference)):
        fn(key, value, slots, codes[:, 0], codes[:, 1], scale[:, 0], scale[:, 1])
    return CheckResult("write_kv_fp8", float((got.int() - want.int()).abs().max()), 0.0)


# ---------------------------------------------------------------------------------------------- benchmark
def benchmark_write_kv(
    device: str | None = None, *, tokens: int = 64, heads: int = 8, head_dim: int = 128, block_size: int = 16
) -> dict[str, float]:
    """Time :func:`write_kv` against :func:`write_kv_reference` on one layer (``tokens`` new tokens into a pool
    of twice as many slots): medians and min–max in milliseconds."""
    device = device or default_device()
    blocks = -(-2 * tokens // block_size)
    key, value, slots = _case(0, tokens, heads, block_size, head_dim, blocks, device)
    pool = torch.zeros(blocks, 2, heads, block_size, head_dim, device=device)
    kernel = time_ms(lambda: write_kv(key, value, slots, pool[:, 0], pool[:, 1]), device)
    reference = time_ms(lambda: write_kv_reference(key, value, slots, pool[:, 0], pool[:, 1]), device)
    return {**kernel.as_dict("kernel"), **reference.as_dict("reference")}
