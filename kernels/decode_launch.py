"""What every decode wrapper shares before it launches: the input checks, the launch configuration, the split-K
plan and the preallocated workspace of partial softmaxes.

:func:`validate_decode_inputs` and :func:`decode_bounds` check a decode call's query and paged metadata (the
values only as :func:`~memos_kernels.common.should_validate` says); :func:`decode_config` picks the token tile,
warps and stages of a specialization; :func:`plan_decode` splits the sequences over the GPU (:func:`plan_splits`
from a host-known length bound and :func:`sm_count`) and takes the partials from a :class:`DecodeWorkspace`
(no allocation, fill or host sync per call). The kernels that use them are in :mod:`memos_kernels.paged_decode`,
:mod:`memos_kernels.kivi_decode` and :mod:`memos_kernels.paged_prefill`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from memos_kernels.common import check_index_dtypes, check_tables, should_validate
from memos_kernels.launch_plan import DecodeConfig, check_launchable, decode_config

from memos_ref.errors import ConfigError, DeviceError, DTypeError, ShapeError

__all__ = [
    "DecodeConfig",
    "DecodePlan",
    "DecodeWorkspace",
    "decode_bounds",
    "decode_config",
    "default_workspace",
    "dot_flags",
    "plan_decode",
    "plan_splits",
    "sm_count",
    "validate_decode_inputs",
]


# ---------------------------------------------------------------------------------------------- configuration
# DecodeConfig and decode_config live in memos_kernels.launch_plan (the launch planner), re-exported here.


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs a driver call); 1 elsewhere (the
    interpreter runs programs one after another, so more splits only cost time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(batch: int, kv_heads: int, max_len: int, tile: int, sms: int) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)``: enough programs to fill the GPU about twice over (``batch · kv_heads
    · splits ≈ 2 · SMs``), no split shorter than one tile. ``max_len`` is a host-known bound on the lengths
    (the caller's, or the block tables' width), so planning never reads the device."""
    tiles = max(1, -(-max_len // tile))
    want = max(1, -(-2 * sms // max(1, batch * kv_heads)))
    splits = min(want, tiles)
    per = -(-tiles // splits) * tile
    return max(1, -(-max_len // per)), per


class DecodeWorkspace:
    """Preallocated split-K partials for the decode kernels, grown (never shrunk) on demand: after the first
    call of a given size no call allocates, fills or synchronizes, so the decode step can be captured in a CUDA
    graph (allocate it at the largest size first, or pass ``capacity`` rows)."""

    def __init__(self, device: torch.device | str, capacity: int = 0, head_dim: int = 128) -> None:
        self.device = torch.device(device)
        self.acc = torch.empty((capacity, head_dim), dtype=torch.float32, device=self.device)
        self.ml = torch.empty((2, capacity), dtype=torch.float32, device=self.device)
        self._views: tuple[int, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def take(self, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``acc [rows, D]``, ``m [rows]``, ``l [rows]`` of the buffers (grown when too small; the views of
        the last size are reused: every layer of a step asks for the same)."""
        if self._views is not None and self._views[:2] == (rows, head_dim):
            return self._views[2]
        if self.acc.shape[0] < rows or self.acc.shape[1] != head_dim:
            grow = max(rows, self.acc.shape[0] if self.acc.shape[1] == head_dim else 0)
            self.acc = torch.empty((grow, head_dim), dtype=torch.float32, device=self.device)
            self.ml = torch.empty((2, grow), dtype=torch.float32, device=self.device)
        views = (self.acc[:rows], self.ml[0, :rows], self.ml[1, :rows])
        self._views = (rows, head_dim, views)
        return views


_WORKSPACES: dict[torch.device, DecodeWorkspace] = {}


def default_workspace(device: torch.device) -> DecodeWorkspace:
    """The module's workspace for ``device`` (one per device, shared by every decode call on it)."""
    if device not in _WORKSPACES:
        _WORKSPACES[device] = DecodeWorkspace(device)
    return _WORKSPACES[device]


@dataclass
class DecodePlan:
    """The split-K plan shared by the decode wrappers: the grid ``(B, Hkv, S)``, the tokens each split reads,
    the launch configuration and the partial softmaxes (views of a :class:`DecodeWorkspace`)."""

    grid: tuple[int, int, int]
    tokens_per_split: int
    config: DecodeConfig
    group: int
    acc: torch.Tensor
    m: torch.Tensor
    l_sum: torch.Tensor
    out: torch.Tensor

    @property
    def num_splits(self) -> int:
        return self.grid[2]


def plan_decode(
    query: torch.Tensor,
    kv_heads: int,
    block_size: int,
    max_len: int,
    *,
    tokens_per_split: int | None = None,
    blocks_per_split: int | None = None,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,
    quant: str = "none",
) -> DecodePlan:
    """Plan a decode launch for ``query [B, Hq, D]`` over sequences of at most ``max_len`` tokens: the tile
    (:func:`decode_config`), the splits (:func:`plan_splits`, or ``tokens_per_split`` — or ``blocks_per_split``
    blocks — when given), the partials, taken from ``workspace`` (default: the device's), and the output
    (``out``, checked, or a new uninitialized tensor). ``quant`` names the cache (``"none"``, ``"int8"``,
    ``"fp8"``, ``"kivi"``) for the launch configuration."""
    b, hq, d = query.shape
    if blocks_per_split is not None:
        if blocks_per_split < 1:
            raise ConfigError(f"blocks_per_split must be at least 1, got {blocks_per_split}")
        tokens_per_split = blocks_per_split * block_size
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.device != query.device or out.stride(-1) != 1:
        raise ShapeError(f"out must be like the query {tuple(query.shape)} on {query.device}, got {tuple(out.shape)}")
    group = hq // kv_heads
    check_launchable("decode attention", d, block_size, group, query.dtype, query.device)
    config = decode_config(group, block_size, d, query.dtype, quant)
    if tokens_per_split is None:
        splits, tokens_per_split = plan_splits(b, kv_heads, max_len, config.tile, sm_count(query.device))
    elif tokens_per_split < 1:
        raise ConfigError(f"tokens_per_split must be at least 1, got {tokens_per_split}")
    else:
        splits = max(1, -(-max_len // tokens_per_split))
    ws = workspace if workspace is not None else default_workspace(query.device)
    if ws.device != query.device:
        raise DeviceError(f"the workspace is on {ws.device}, the query on {query.device}")
    acc, m, l_sum = ws.take(b * kv_heads * splits * group, d)
    return DecodePlan((b, kv_heads, splits), tokens_per_split, config, group, acc, m, l_sum, out)


def dot_flags(query: torch.Tensor) -> tuple[bool, str]:
    """``(DOT_F32, PREC)`` for the kernels: upcast ``tl.dot``'s operands in the interpreter (CPU tensors), and
    exact fp32 products (``"ieee"``, not TF32) for fp32 queries."""
    interpreted = query.device.type != "cuda"
    return interpreted, "ieee" if interpreted or query.dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------------------------- input checks
def validate_decode_inputs(
    query: torch.Tensor, kv_heads: int, head_dim: int, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    """The checks every decode wrapper shares: ``query [B, k·Hkv, D]`` floating point and contiguous along D,
    integer ``block_tables [B, *]`` and ``seq_lens [B]`` on the query's device."""
    if query.ndim != 3 or query.shape[2] != head_dim:
        raise ShapeError(f"query must be [batch, q_heads, head_dim={head_dim}], got {tuple(query.shape)}")
    b, hq, _ = query.shape
    if hq % kv_heads:
        raise ShapeError(f"query heads ({hq}) must be a multiple of KV heads ({kv_heads})")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ShapeError(
            f"block_tables [{b}, max_blocks] and seq_lens [{b}] expected, got {tuple(block_tables.shape)} and "
            f"{tuple(seq_lens.shape)}"
        )
    check_index_dtypes(block_tables=block_tables, seq_lens=seq_lens)
    if not query.dtype.is_floating_point:
        raise DTypeError(f"query must be floating point, got {query.dtype}")
    if len({query.device, block_tables.device, seq_lens.device}) != 1:
        raise DeviceError("query, caches, block tables and lengths must be on one device")
    if query.stride(-1) != 1:
        raise ShapeError("query must be contiguous along head_dim")


def decode_bounds(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    max_seq_len: int | None,
    validate: bool | None,
) -> int:
    """The host-known length bound of a decode launch (``max_seq_len``, default the tables' width × block size),
    refused when it passes the tables' capacity; the metadata's values checked as :func:`should_validate` says
    (:func:`~memos_kernels.common.check_tables`). Returns the bound."""
    cap = block_tables.shape[1] * block_size
    if max_seq_len is not None and max_seq_len > cap:
        raise ShapeError(
            f"max_seq_len {max_seq_len} exceeds the block tables' capacity {cap} (width {block_tables.shape[1]} x "
            f"block size {block_size})"
        )
    if should_validate(validate, seq_lens.device):
        check_tables(block_tables, seq_lens, num_blocks, block_size, max_seq_len)
    return max_seq_len if max_seq_len is not None else cap
