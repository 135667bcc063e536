"""What every kernel file shares: the pool-layout checks, a finite "minus infinity", and the result of a check.

The kernels work on the canonical pool layout ``[blocks, L, 2, H, T, D]``: one layer's K or V cache is the
strided view ``[blocks, H, T, D]``. They take strides, so no copy is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from memos_ref.errors import ConfigError, DeviceError, DTypeError, ShapeError

__all__ = [
    "CACHE_DTYPES",
    "NEG",
    "CheckResult",
    "check_cache",
    "check_fp8",
    "default_device",
    "is_pow2",
]

NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": exp(NEG - m) is 0 and never NaN (jit globals: constexpr)

CACHE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "none": (torch.float32, torch.float16, torch.bfloat16),
    "int8": (torch.int8,),
    "fp8": (torch.uint8,),  # e4m3 codes stored as bytes
}


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two (``tl.arange`` sizes must be)."""
    return n > 0 and n & (n - 1) == 0


def default_device() -> str:
    """``"cuda"`` where a GPU is present, else ``"cpu"`` (the kernels then need ``TRITON_INTERPRET=1``)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_fp8(device: torch.device) -> None:
    """Triton's float8e4nv needs sm_89 or newer (Ada, Hopper); Jetson Orin (sm_87) and A100 (sm_80) lack it."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(f"fp8 KV kernels need sm_89 or newer; this GPU is sm_{major}{minor}: use int8")


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, quant: str = "none") -> tuple[int, int, int, int]:
    """Check one layer's K and V caches ``[N, H, T, D]`` for the kernels; returns ``(N, H, T, D)``."""
    if key_cache.ndim != 4 or key_cache.shape != value_cache.shape:
        raise ShapeError(
            f"key/value caches must both be [num_blocks, kv_heads, block_size, head_dim], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    n, h, t, d = key_cache.shape
    if not is_pow2(t) or not 8 <= t <= 128:
        raise ConfigError(f"block size must be a power of two in 8-128, got {t}")
    if not is_pow2(d):
        raise ConfigError(f"head_dim must be a power of two for these kernels, got {d}")
    allowed = CACHE_DTYPES[quant]
    if key_cache.dtype not in allowed or value_cache.dtype != key_cache.dtype:
        raise DTypeError(
            f"caches for quant={quant!r} must be {allowed} and equal, got {key_cache.dtype}/{value_cache.dtype}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ShapeError("the head_dim axis of the caches must be contiguous (stride 1)")
    if key_cache.device != value_cache.device:
        raise DeviceError(f"key and value caches are on {key_cache.device} and {value_cache.device}: use one device")
    return n, h, t, d


@dataclass(frozen=True)
class CheckResult:
    """What a kernel file's ``check_*`` function measured: the largest absolute difference between the kernel's
    output and the plain-torch reference's on one random case, and the tolerance it must stay within."""

    name: str
    max_abs_err: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_err <= self.tolerance  # NaN compares False: a poisoned output fails
