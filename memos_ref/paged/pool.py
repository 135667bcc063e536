"""BlockPool: the KV memory itself, in the canonical layout ``[num_blocks, L, 2, H, T, D]``.

One block is one contiguous range of bytes holding ``T`` tokens' keys and values for *every* layer, so moving
a block between tiers is one copy, and the layout is TensorRT-LLM's paged-pool layout (export is a view).
Inside a layer a block is head-major ``[H, T, D]``.

The pool is allocated once. When one contiguous allocation is not possible (seed 000 §6.1) it can be built
from, or grown by, *segments*: several tensors of the same block shape whose block ids follow one another.
Every operation takes global block ids and works across segments.

Growth is safe beside lock-free readers: the segment layout is one immutable :class:`SegmentLayout` (the
segments, their first ids and the block count together), replaced by a single assignment when a segment is
added or dropped. Every operation reads it once, so a reader sees the pool before a growth or after it, never
a half-published segment (copy-on-write and the tier copies read blocks without the allocator lock).
"""

from __future__ import annotations

import bisect
import os
import threading
from typing import TYPE_CHECKING, NamedTuple

import torch

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    ShapeError,
    check_index,
    check_layer_index,
    check_type,
)
from memos_ref.paged.allocator import MAX_BLOCKS
from memos_ref.spec import KVSpec

if TYPE_CHECKING:
    from memos_ref.paged.allocator import BlockEvent

__all__ = [
    "POISON",
    "BlockPool",
    "SegmentLayout",
    "check_block_id",
    "check_block_table",
    "check_kv",
    "check_layer",
    "check_slots",
    "gather_blocks",
]

#: Value written into freed blocks in debug mode, so a use-after-free shows as NaN in the output.
POISON = float("nan")


def check_layer(spec: KVSpec, layer: object) -> int:
    """A layer index in ``[0, num_layers)`` as an int: :class:`ArgumentTypeError` for a non-integer,
    :class:`LayerIndexError` (an :class:`InvalidArgumentError`) outside the range."""
    return check_layer_index(layer, spec.num_layers)


def check_block_id(block: object, num_blocks: int, name: str = "block") -> int:
    """A block id as an int: :class:`ArgumentTypeError` for a non-integer, :class:`InvalidBlockError` when it is
    outside ``[0, num_blocks)``."""
    try:
        b = check_index(name, block)
    except InvalidArgumentError as exc:  # negative: an unknown block, as for one past the end
        raise InvalidBlockError(f"{name} id {block!r} is not in [0, {num_blocks})") from exc
    if b >= num_blocks:
        raise InvalidBlockError(f"{name} id {b} is not in [0, {num_blocks})")
    return b


def _check_int_tensor(name: str, t: object) -> torch.Tensor:
    check_type(name, t, torch.Tensor)
    assert isinstance(t, torch.Tensor)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ArgumentTypeError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    if t.ndim != 1:
        raise ShapeError(f"{name}: expected a 1-d tensor, got shape {tuple(t.shape)}")
    return t


def check_slots(slots: object, n: int, num_blocks: int, block_size: int) -> torch.Tensor:
    """Slots ``[n]`` of an integer dtype, each ``-1`` (skip) or in ``[0, num_blocks · block_size)``."""
    slots = _check_int_tensor("slots", slots)
    if slots.shape != (n,):
        raise ShapeError(f"slots must be [{n}], got {tuple(slots.shape)}")
    limit = num_blocks * block_size
    if n and bool(((slots < -1) | (slots >= limit)).any()):
        bad = slots[(slots < -1) | (slots >= limit)][:4].tolist()
        raise InvalidArgumentError(f"slots: expected -1 (skip) or a slot in [0, {limit}), got {bad}")
    return slots


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in ``blocks``: ``(first id, past-the-last id, position in blocks)``."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(blocks):
        if runs and b == runs[-1][1]:
            runs[-1] = (runs[-1][0], b + 1, runs[-1][2])
        else:
            runs.append((b, b + 1, pos))
    return runs


def gather_blocks(cache: torch.Tensor, blocks: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``blocks`` of ``cache [N, *lead, T, D]`` (a strided per-layer view of the pool is fine) as a new
    ``[*lead, n, T, D]`` tensor, whose ``[*lead, n·T, D]`` reshape is a view.

    Only the blocks' own bytes are read, in one strided copy per run of consecutive ids (a freshly filled pool
    gives one run); a scattered table takes one ``index_select`` over the block dimension and one re-layout
    copy instead. Either way the cost follows ``n``, never ``N`` (``index_select`` on a permuted view, or
    advanced indexing, made the whole layer contiguous first or ran ~10x slower per byte). ``out``: a
    contiguous tensor of that shape to fill instead of a new one (a fresh multi-MiB tensor costs its page
    faults, often more than the copy itself).
    """
    lead = tuple(cache.shape[1:-2])
    k = len(lead)
    order = (*range(1, k + 1), 0, k + 1, k + 2)  # [n, *lead, T, D] -> [*lead, n, T, D]
    shape = (*lead, len(blocks), *cache.shape[-2:])
    if out is None:
        out = cache.new_empty(shape)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise ShapeError(f"out: expected a contiguous {shape}, got {tuple(out.shape)}")
    runs = _runs(blocks)
    if len(runs) > max(8, len(blocks) // 8):
        index = torch.tensor(blocks, dtype=torch.long, device=cache.device)
        out.copy_(cache.index_select(0, index).permute(order))
        return out
    for first, stop, pos in runs:
        out[..., pos : pos + stop - first, :, :] = cache[first:stop].permute(order)
    return out


def _slot_list(slots: object, n: int, limit: int) -> list[int]:
    """Slots ``[n]`` (an integer tensor) as validated Python ints, each -1 or in ``[0, limit)`` — the checks of
    :func:`check_slots` with one ``tolist`` instead of a tensor op per check (a decode step's write)."""
    slots = _check_int_tensor("slots", slots)
    if slots.shape != (n,):
        raise ShapeError(f"slots must be [{n}], got {tuple(slots.shape)}")
    ids = slots.tolist()
    bad = [s for s in ids if s < -1 or s >= limit]
    if bad:
        raise InvalidArgumentError(f"slots: expected -1 (skip) or a slot in [0, {limit}), got {bad[:4]}")
    return ids


def check_block_table(table: object, num_blocks: int, num_tokens: object, block_size: int) -> tuple[torch.Tensor, int]:
    """A block table ``[n]`` of valid block ids covering ``num_tokens`` (an int in ``[0, n · block_size]``)."""
    table = _check_int_tensor("block_table", table)
    n = check_index("num_tokens", num_tokens, lo=0, hi=table.shape[0] * block_size)
    used = table[: -(-n // block_size)]
    if used.numel() and bool(((used < 0) | (used >= num_blocks)).any()):
        bad = used[(used < 0) | (used >= num_blocks)][:4].tolist()
        raise InvalidBlockError(f"block_table holds block ids {bad} outside [0, {num_blocks})")
    return table, n


def check_kv(spec: KVSpec, device: torch.device, key: torch.Tensor, value: torch.Tensor) -> None:
    """Reject K/V ``[n, H, D]`` a pool of ``spec`` on ``device`` cannot store, naming expected and actual."""
    check_type("key", key, torch.Tensor)
    check_type("value", value, torch.Tensor)
    h, d = spec.num_kv_heads, spec.head_dim
    if key.shape != value.shape or key.ndim != 3 or key.shape[1:] != (h, d):
        raise ShapeError(
            f"key/value must both be [tokens, kv_heads={h}, head_dim={d}], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if key.dtype != spec.dtype or value.dtype != spec.dtype:
        raise DTypeError(f"key/value dtype {key.dtype}/{value.dtype} does not match the pool's {spec.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.device != device:
            raise DeviceError(f"{name} device {t.device} does not match the pool's {device}")


class SegmentLayout(NamedTuple):
    """One immutable snapshot of a pool's segments: published by a single assignment, read once per operation."""

    #: The storage tensors, each ``[n_i, L, 2, H, T, D]``.
    segments: tuple[torch.Tensor, ...]
    #: Global id of each segment's first block (ascending, ``starts[0] == 0``).
    starts: tuple[int, ...]
    #: Blocks in all segments: valid ids are ``0 .. num_blocks - 1``.
    num_blocks: int

    def locate(self, block: int) -> tuple[torch.Tensor, int]:
        """The segment holding a valid global block id, and the block's id inside it."""
        if len(self.segments) == 1:
            return self.segments[0], block
        i = bisect.bisect_right(self.starts, block) - 1
        return self.segments[i], block - self.starts[i]

    def index(self, blocks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Split valid global ids into (segment, positions in ``blocks``, local ids) groups."""
        groups = []
        for start, seg in zip(self.starts, self.segments):
            inside = (blocks >= start) & (blocks < start + seg.shape[0])
            if bool(inside.any()):
                where = inside.nonzero().flatten()
                groups.append((seg, where, blocks[where] - start))
        return groups


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on ``device`` (the host's physical memory for the CPU, the GPU's total for CUDA), or
    ``None`` when unknown: an allocation larger than this is refused before it is tried."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
    except (ValueError, OSError, RuntimeError, AssertionError):  # no sysconf names, no CUDA build
        return None
    return None


class BlockPool:
    """Preallocated KV blocks for one model.

    Args:
        spec: the model's KV geometry (layers, KV heads, head dim, dtype, block size).
        num_blocks: blocks to allocate; or give ``byte_budget`` instead.
        byte_budget: allocate as many whole blocks as fit in this many bytes.
        segments: split the initial allocation into this many tensors (to exercise and teach segmenting).
        device: where the blocks live.
    """

    #: :meth:`write` stores up to this many tokens with slice copies (more: one indexed scatter).
    DIRECT_WRITE_TOKENS = 64

    #: :class:`~memos_ref.paged.kvpool.KVPool` flags: full-precision blocks with a float view, no residual windows,
    #: and no allocator events to hear.
    quantized: bool = False
    tracks_windows: bool = False
    block_events: frozenset[str] = frozenset()

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int | None = None,
        *,
        byte_budget: int | None = None,
        segments: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if (num_blocks is None) == (byte_budget is None):
            raise ConfigError("give exactly one of num_blocks or byte_budget")
        if byte_budget is not None:
            num_blocks = byte_budget // spec.bytes_per_block
            if num_blocks <= 0:
                raise ConfigError(f"byte_budget {byte_budget} is smaller than one block ({spec.bytes_per_block} bytes)")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(segments, int) or not 1 <= segments <= num_blocks:
            raise ConfigError(f"segments must be an int in [1, num_blocks={num_blocks}], got {segments!r}")
        if num_blocks > MAX_BLOCKS:
            raise ConfigError(f"num_blocks: expected at most {MAX_BLOCKS} blocks, got {num_blocks}")
        self.spec = spec
        self.device = torch.device(device)
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if self.device.type == "cuda" and (self.device.index or 0) >= seen:  # before torch's own, rawer errors
            raise DeviceError(f"device: expected a CUDA device this torch can use, got {self.device} (it sees {seen})")
        self._check_fits(num_blocks)
        self._layout = SegmentLayout((), (), 0)  # replaced whole, never changed in place
        self._grow_lock = threading.Lock()  # one writer at a time (readers take no lock)
        base, extra = divmod(num_blocks, segments)
        for i in range(segments):
            self._add_segment(base + (1 if i < extra else 0))

    # ------------------------------------------------------------------ structure
    def _check_fits(self, n: int) -> None:
        """Refuse ``n`` new blocks whose bytes exceed the device's whole memory (:class:`CapacityExceededError`,
        needed vs capacity), before any allocation is tried."""
        needed, capacity = n * self.spec.bytes_per_block, device_memory(self.device)
        if capacity is not None and needed > capacity:
            raise CapacityExceededError(
                f"{n} blocks of {self.spec.bytes_per_block} bytes need {needed} bytes; the {self.device} has "
                f"{capacity} bytes in all",
                needed=needed,
                capacity=capacity,
            )

    def _add_segment(self, n: int) -> None:
        """Allocate a segment of ``n`` blocks and publish it: one assignment of a new :class:`SegmentLayout`."""
        try:
            segment = torch.zeros((n, *self.spec.block_shape), dtype=self.spec.dtype, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # out of memory (torch.OutOfMemoryError is a RuntimeError)
            needed = n * self.spec.bytes_per_block
            raise CapacityExceededError(
                f"could not allocate {n} blocks ({needed} bytes) on {self.device}: {exc}", needed=needed
            ) from exc
        old = self._layout
        self._layout = SegmentLayout((*old.segments, segment), (*old.starts, old.num_blocks), old.num_blocks + n)

    @property
    def layout(self) -> SegmentLayout:
        """The current segment layout: an immutable snapshot (read it once, then use only it)."""
        return self._layout

    def check_grow(self, n: object, name: str = "n") -> int:
        """``n`` as the int number of blocks a :meth:`grow` may add, checked before any allocation and changing
        nothing: :class:`ArgumentTypeError` for a non-integer; :class:`InvalidArgumentError` unless
        ``1 <= n <= MAX_BLOCKS - num_blocks``; :class:`CapacityExceededError` when the new segment's bytes exceed
        the device's whole memory (so ``grow(2**62)`` is refused by name, expected vs got, never by a raw
        allocator error; an allocation that still fails is a :class:`CapacityExceededError` too)."""
        have = self._layout.num_blocks
        room = MAX_BLOCKS - have
        n = check_index(name, n, lo=1)
        if n > room:
            raise InvalidArgumentError(
                f"{name}: expected at most {room} more blocks (a pool holds at most {MAX_BLOCKS}; it holds {have}), "
                f"got {n}"
            )
        self._check_fits(n)
        return n

    def grow(self, n: int, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> range:
        """Add a segment of ``n`` blocks; returns the new block ids, which follow the old ones (grow the allocator by
        as many: :meth:`memos_ref.paged.store.PagedKV.grow` does both). ``dtype`` / ``device``, when given, must
        be the pool's (a segment of another dtype or device cannot join it: :class:`DTypeError` /
        :class:`DeviceError`). All or nothing: on any error (a bad ``n``, out of memory) the pool is unchanged."""
        n = self.check_grow(n)
        if dtype is not None and dtype != self.spec.dtype:
            raise DTypeError(f"a new segment must hold the pool's dtype {self.spec.dtype}, got {dtype}")
        if device is not None:
            try:
                where = torch.device(device)
            except (RuntimeError, TypeError) as exc:  # torch.device("nonsense")
                raise DeviceError(
                    f"device: a new segment must live on the pool's device {self.device}, got {device!r:.80} "
                    f"(not a device: {exc})"
                ) from None
            if where != self.device:
                raise DeviceError(f"a new segment must live on the pool's device {self.device}, got {where}")
        with self._grow_lock:
            start = self._layout.num_blocks
            self._add_segment(n)
            return range(start, start + n)

    def shrink(self, ids: range) -> None:
        """Undo the last :meth:`grow`: drop its segment, whose ids ``ids`` it returned (the rollback of a grow
        whose allocator half failed; only the last segment, never the first, can go)."""
        check_type("ids", ids, range)
        with self._grow_lock:
            lay = self._layout
            if len(lay.segments) < 2 or ids != range(lay.starts[-1], lay.num_blocks):
                raise InvalidArgumentError(
                    f"ids: only the last grown segment range({lay.starts[-1]}, {lay.num_blocks}) can be dropped "
                    f"(and never the first segment), got {ids}"
                )
            self._layout = SegmentLayout(lay.segments[:-1], lay.starts[:-1], lay.starts[-1])

    @property
    def segments(self) -> list[torch.Tensor]:
        """The storage tensors, each ``[n_i, L, 2, H, T, D]`` (a new list from one snapshot of the layout)."""
        return list(self._layout.segments)

    @property
    def num_blocks(self) -> int:
        return self._layout.num_blocks

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for seg in self._layout.segments)

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool ``[num_blocks, L, 2, H, T, D]`` — only when it is a single segment (no copy)."""
        segments = self._layout.segments
        if len(segments) != 1:
            raise ConfigError(f"the pool has {len(segments)} segments; use block() or gather() instead")
        return segments[0]

    def block(self, block: int) -> torch.Tensor:
        """A view of one block ``[L, 2, H, T, D]``."""
        lay = self._layout  # one snapshot: the id check and the lookup agree
        seg, local = lay.locate(check_block_id(block, lay.num_blocks))
        return seg[local]

    def layer_view(self, layer: int, segment: int = 0) -> torch.Tensor:
        """Per-layer view of a segment ``[n, 2, H, T, D]`` (K at ``[:, 0]``, V at ``[:, 1]``) — no copy."""
        layer = check_layer(self.spec, layer)
        segments = self._layout.segments
        segment = check_index("segment", segment, lo=0, hi=len(segments) - 1)
        return segments[segment][:, layer]

    # ------------------------------------------------------------------ data movement
    def check_kv(self, key: torch.Tensor, value: torch.Tensor, layer: int | None = None) -> None:
        """Reject K/V ``[n, H, D]`` this pool cannot store (shape, dtype, device), naming expected and actual
        (``layer``, for the messages of pools that also check values, is unused here)."""
        check_kv(self.spec, self.device, key, value)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Scatter one layer's K/V ``[n, H, D]`` into ``slots [n]`` (slot = block · T + offset; -1 skips).

        Up to :attr:`DIRECT_WRITE_TOKENS` tokens (a decode step, a short chunk) are stored directly: one slice
        copy per run of consecutive slots in one block, validated in Python (about 20 µs for a decode step,
        against ~100 µs through index tensors).
        """
        layer = check_layer(self.spec, layer)
        self.check_kv(key, value)
        lay = self._layout  # one snapshot for the checks and the stores
        t = self.spec.block_size
        n = key.shape[0]
        if n <= self.DIRECT_WRITE_TOKENS:
            self._store_runs(lay, layer, _slot_list(slots, n, lay.num_blocks * t), key, value)
            return
        slots = check_slots(slots, n, lay.num_blocks, t)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        blocks, offsets = slots // t, slots % t
        for seg, where, local in lay.index(blocks):
            kv = seg[:, layer]  # [n, 2, H, T, D]
            kv[local, 0, :, offsets[where]] = key[where]
            kv[local, 1, :, offsets[where]] = value[where]

    def _store_runs(
        self, lay: SegmentLayout, layer: int, slots: list[int], key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Copy K/V ``[n, H, D]`` into validated ``slots``, one slice per run of consecutive slots in a block."""
        t, i, n = self.spec.block_size, 0, len(slots)
        while i < n:
            start = slots[i]
            if start < 0:  # -1: skip this token
                i += 1
                continue
            j = i + 1
            while j < n and slots[j] == slots[j - 1] + 1 and slots[j] % t:
                j += 1
            block, offset = divmod(start, t)
            seg, local = lay.locate(block)
            kv = seg[local, layer]  # view [2, H, T, D]
            kv[0, :, offset : offset + j - i] = key[i:j].transpose(0, 1)  # [H, run, D]
            kv[1, :, offset : offset + j - i] = value[i:j].transpose(0, 1)
            i = j

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` keys and values of a sequence, densely: ``[H, num_tokens, D]`` each.

        One copy of the sequence's own blocks (:func:`gather_blocks`) into ``[2, H, n, T, D]`` order, whose
        ``[2, H, n·T, D]`` reshape is a view.
        """
        layer = check_layer(self.spec, layer)
        lay = self._layout  # one snapshot for the checks and the reads
        block_table, num_tokens = check_block_table(block_table, lay.num_blocks, num_tokens, self.spec.block_size)
        n_blocks = -(-num_tokens // self.spec.block_size)
        h, t, d = self.spec.num_kv_heads, self.spec.block_size, self.spec.head_dim
        if len(lay.segments) == 1:
            kv = gather_blocks(lay.segments[0][:, layer], block_table[:n_blocks].tolist())  # [2, H, n, T, D]
        else:
            blocks = block_table[:n_blocks].to(self.device)
            kv = torch.empty((2, h, n_blocks, t, d), dtype=self.spec.dtype, device=self.device)
            for seg, where, local in lay.index(blocks):
                kv[:, :, where] = seg[local, layer].permute(1, 2, 0, 3, 4)
        kv = kv.reshape(2, h, n_blocks * t, d)[:, :, :num_tokens]  # [2, H, S, D]
        return kv[0], kv[1]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's contents (all layers) onto another: the copy of copy-on-write."""
        lay = self._layout  # one snapshot for both ids
        src_seg, src_local = lay.locate(check_block_id(src, lay.num_blocks, "src"))
        dst_seg, dst_local = lay.locate(check_block_id(dst, lay.num_blocks, "dst"))
        dst_seg[dst_local].copy_(src_seg[src_local])

    def poison(self, block: int) -> None:
        """Fill a block with NaN (debug mode: makes a use-after-free visible)."""
        if self.spec.dtype.is_floating_point:
            self.block(block).fill_(POISON)
        else:
            self.block(block).fill_(-1)

    def on_block_event(self, event: BlockEvent) -> None:
        """A plain pool hears no allocator events (:attr:`block_events` is empty)."""
