"""Block copies inside one pool, for copy-on-write and compaction.

Told in the Triton tutorials' order — reference (plain torch) → kernel → wrapper → check → benchmark.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from memos_kernels.common import CheckResult, check_index_dtypes, default_device
from memos_kernels.launch_plan import POOL_DTYPES
from memos_kernels.timing import time_ms

from memos_ref.errors import DeviceError, DTypeError, InvalidArgumentError, ShapeError

__all__ = [
    "KERNELS",
    "benchmark_copy_blocks",
    "check_copy_blocks",
    "copy_blocks",
    "copy_blocks_kernel",
    "copy_blocks_reference",
]


# ---------------------------------------------------------------------------------------------- reference
def copy_blocks_reference(pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Plain torch: ``pool[dst] = pool[src]`` for every row ``(src, dst)`` of ``pairs [n, 2]``."""
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    pool[dst] = pool[src]


# ---------------------------------------------------------------------------------------------- kernel
@triton.jit
def copy_blocks_kernel(pool_ptr, pairs_ptr, block_numel, num_blocks, CHUNK: tl.constexpr):
    """Program (pair i, chunk c): copy elements ``[c·CHUNK, (c+1)·CHUNK)`` of block ``src`` onto ``dst`` (a
    pair with an id outside ``[0, num_blocks)`` copies nothing: never a read or write outside the pool)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * i)
    dst = tl.load(pairs_ptr + 2 * i + 1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inside = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    ok = offs < tl.where(inside, block_numel, 0)  # a pair outside the pool: no element
    tl.store(pool_ptr + dst * block_numel + offs, tl.load(pool_ptr + src * block_numel + offs, mask=ok), mask=ok)


KERNELS = (copy_blocks_kernel,)


# ---------------------------------------------------------------------------------------------- wrapper
def copy_blocks(pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole blocks ``pool[src] -> pool[dst]`` for every row ``(src, dst)`` of ``pairs [n, 2]`` (a
    contiguous pool ``[N, ...]``); ``pairs`` int32/int64 (else :class:`~memos_ref.errors.DTypeError`), ids in
    ``[0, N)``, destinations distinct and not also sources (else
    :class:`~memos_ref.errors.InvalidArgumentError`). Always validated: it reads the pairs' values (one host sync
    on a GPU)."""
    if not pool.is_contiguous():
        raise ShapeError("copy_blocks needs a contiguous pool")
    if pool.dtype not in POOL_DTYPES.values():  # the launch planner's set: nothing else is compiled
        raise DTypeError(f"copy_blocks copies {sorted(POOL_DTYPES)} pools, got {pool.dtype}")
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ShapeError(f"pairs must be [n, 2] (src, dst), got {tuple(pairs.shape)}")
    check_index_dtypes(pairs=pairs)
    if pairs.numel() == 0:
        return
    if pairs.device != pool.device:
        raise DeviceError(f"pairs are on {pairs.device}, the pool on {pool.device}: use one device")
    flat = pairs.to(torch.int64).contiguous()
    n = pool.shape[0]
    if int(flat.min()) < 0 or int(flat.max()) >= n:
        raise ShapeError(f"block ids must be in [0, {n})")
    srcs, dsts = flat[:, 0].tolist(), flat[:, 1].tolist()
    seen: dict[int, int] = {}
    for i, dst in enumerate(dsts):
        if dst in seen:  # on a GPU which pair's copy wins is undefined
            raise InvalidArgumentError(
                f"pairs[{seen[dst]}] and pairs[{i}] both copy onto block {dst}: destinations must be distinct"
            )
        seen[dst] = i
    both = sorted(set(dsts) & set(srcs))
    if both:
        raise InvalidArgumentError(
            f"block {both[0]} is both a source and a destination: destinations must be distinct and not sources"
        )
    numel = pool[0].numel()
    chunk = 1024
    copy_blocks_kernel[(flat.shape[0], triton.cdiv(numel, chunk))](pool, flat, numel, n, CHUNK=chunk)


# ---------------------------------------------------------------------------------------------- check
def check_copy_blocks(device: str | None = None, *, seed: int = 0) -> CheckResult:
    """:func:`copy_blocks` against :func:`copy_blocks_reference` on a pool whose blocks span more than one
    kernel chunk (2,048 + 512 elements): every element equal, copied or untouched."""
    device = device or default_device()
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(6, 2, 2, 2, 16, 40, generator=g).to(device)  # [N, L, K/V, H, T, D]: 2,560 per block
    pairs = torch.tensor([[0, 3], [2, 5], [4, 1]], device=device)
    want = pool.clone()
    copy_blocks(pool, pairs)
    copy_blocks_reference(want, pairs)
    return CheckResult("copy_blocks", float((pool - want).abs().max()), 0.0)


# ---------------------------------------------------------------------------------------------- benchmark
def benchmark_copy_blocks(
    device: str | None = None, *, pairs: int = 256, block_shape: tuple[int, ...] = (2, 8, 16, 128)
) -> dict[str, float]:
    """Time :func:`copy_blocks` against :func:`copy_blocks_reference` copying ``pairs`` blocks of ``block_shape``
    (default: one layer of a Llama-3-8B block, 16 tokens, fp32): medians and min–max in milliseconds."""
    device = device or default_device()
    pool = torch.zeros(2 * pairs, *block_shape, device=device)
    plan = torch.stack([torch.arange(pairs), torch.arange(pairs, 2 * pairs)], 1).to(device)
    kernel = time_ms(lambda: copy_blocks(pool, plan), device)
    reference = time_ms(lambda: copy_blocks_reference(pool, plan), device)
    return {**kernel.as_dict("kernel"), **reference.as_dict("reference")}
