"""What every kernel file shares: the pool-layout checks, a finite "minus infinity", and the result of a check.

The kernels work on the canonical pool layout ``[blocks, L, 2, H, T, D]``: one layer's K or V cache is the
strided view ``[blocks, H, T, D]``. They take strides, so no copy is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from memos_ref.errors import ConfigError, DeviceError, DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError

__all__ = [
    "CACHE_DTYPES",
    "INDEX_DTYPES",
    "NEG",
    "CheckResult",
    "check_cache",
    "check_fp8",
    "check_index_dtypes",
    "check_slots",
    "check_tables",
    "default_device",
    "is_pow2",
    "should_validate",
]

NEG = tl.constexpr(-1.0e30)  # a finite "minus infinity": exp(NEG - m) is 0 and never NaN (jit globals: constexpr)

CACHE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "none": (torch.float32, torch.float16, torch.bfloat16),
    "int8": (torch.int8,),
    "fp8": (torch.uint8,),  # e4m3 codes stored as bytes
}

INDEX_DTYPES = (torch.int32, torch.int64)  # block ids, slots and lengths: exact integers, never truncated floats


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


def check_index_dtypes(**tensors: torch.Tensor) -> None:
    """Refuse metadata (block tables, lengths, slot mappings, copy pairs) that is not int32/int64: a float or
    bool tensor would be truncated by ``.to(int64)`` or read as bytes by a kernel — the wrong blocks, silently.
    Free (reads only the dtype, never the values)."""
    for name, x in tensors.items():
        if x.dtype not in INDEX_DTYPES:
            raise DTypeError(f"{name} must be int32 or int64, got {x.dtype}")


def should_validate(validate: bool | None, device: torch.device) -> bool:
    """Whether a wrapper reads its metadata's values (:func:`check_tables`, :func:`check_slots`): ``validate``
    when given; by default only on the CPU, where the read is free — on a GPU it would synchronize the host every
    call (and a ``meta`` tensor has no values), so the caller checks once per step (or not) and the kernels mask
    every index they derive instead."""
    return device.type == "cpu" if validate is None else validate


def check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, max_len: int | None = None
) -> None:
    """Refuse paged metadata a kernel would read past: lengths below 0, beyond the tables' width × block size
    (or the host's ``max_len`` bound the launch was planned for), and block ids outside ``[0, num_blocks)`` among
    the columns a sequence uses. Reads the values (free on the CPU; one host sync on a GPU)."""
    check_index_dtypes(block_tables=block_tables, seq_lens=seq_lens)
    width = block_tables.shape[1]
    cap = width * block_size if max_len is None else min(width * block_size, max_len)
    if seq_lens.numel() == 0:
        return
    lens = seq_lens.to(torch.int64)
    lo, hi = (int(x) for x in torch.stack([lens.min(), lens.max()]).tolist())
    if lo < 0 or hi > cap:
        bad = int(((lens < 0) | (lens > cap)).nonzero()[0, 0])
        raise ShapeError(
            f"sequence {bad}: {int(lens[bad])} tokens, expected 0..{cap} (block table width {width} x block size "
            f"{block_size}" + (f", max_seq_len {max_len})" if max_len is not None else ")")
        )
    used = torch.arange(width, device=lens.device)[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    bad_ids = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad_ids.any()):
        row, col = (int(x) for x in bad_ids.nonzero()[0])
        raise InvalidBlockError(
            f"sequence {row}: block table column {col} holds block id {int(block_tables[row, col])}, expected an id "
            f"in [0, {num_blocks})"
        )


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """Refuse a slot mapping with an entry other than -1 (skip) or a slot in ``[0, num_slots)``, or with one slot
    named twice (on a GPU which token's write wins is undefined). Reads the values: free on the CPU; one host sync
    on a GPU."""
    check_index_dtypes(slot_mapping=slots)
    bad = (slots < -1) | (slots >= num_slots)
    if slots.numel() and bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise InvalidArgumentError(
            f"slot_mapping[{i}] = {int(slots[i])}, expected -1 (skip) or a slot in [0, {num_slots})"
        )
    live = slots[slots >= 0]
    if live.numel() > 1:
        values, counts = torch.unique(live, return_counts=True)
        if bool((counts > 1).any()):
            slot = int(values[counts > 1][0])
            first, second = (int(i) for i in (slots == slot).nonzero()[:2, 0])
            raise InvalidArgumentError(
                f"slot_mapping[{first}] and slot_mapping[{second}] both name slot {slot}, expected distinct slots "
                "(-1 may repeat)"
            )


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
