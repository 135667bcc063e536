"""KVPool: what the paged layer needs from a pool of K/V blocks — the seam between block bookkeeping and storage.

Three pools implement it: :class:`~memos_ref.paged.pool.BlockPool` (plain full-precision blocks),
:class:`~memos_ref.quant.pool.QuantizedBlockPool` (codes and scales, a full-precision staging slab) and the
benchmarks' metadata-only ``memos_ref.bench.common.NullPool``. :class:`~memos_ref.paged.store.PagedKV`,
:class:`~memos_ref.paged.sequence.SequenceCache`, attention and the cache adapters talk to a pool only through
these members, so a layer above (``memos_ref.quant``) can build a pool that the paged layer holds without the
paged layer ever importing it.

Two plain attributes say which optional behaviour a pool has, so no caller needs ``getattr(pool, ..., default)``:

* ``quantized`` — reads decode (dequantize) and the pool has no float view of its blocks (``layer_view``): a
  reader must go through :meth:`KVPool.gather`.
* ``tracks_windows`` — blocks are staged at full precision and sealed later; sequences must report their
  residual windows through the :class:`WindowedKVPool` members (``hold``/``unhold``/``seal_unheld``...).

Block events: a pool names the allocator events it must hear in ``block_events`` (kinds from
:mod:`memos_ref.paged.allocator`, e.g. a quantized pool releases the staging slot of a freed or evicted block);
:class:`~memos_ref.paged.store.PagedKV` subscribes :meth:`KVPool.on_block_event` to exactly those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from memos_ref.spec import KVSpec

if TYPE_CHECKING:
    from memos_ref.paged.allocator import BlockEvent

__all__ = ["KVPool", "PoolBuilder", "WindowedKVPool"]


@runtime_checkable
class KVPool(Protocol):
    """The members every pool has (``isinstance(pool, KVPool)`` checks that they are all present)."""

    #: KV geometry: layers, KV heads, head dim, dtype and block size of what the pool stores.
    spec: KVSpec
    #: Where the blocks live.
    device: torch.device
    #: Reads dequantize; there is no float view of a block (no ``layer_view``).
    quantized: bool
    #: Sequences must report their residual windows (the pool is a :class:`WindowedKVPool`).
    tracks_windows: bool
    #: Allocator event kinds :meth:`on_block_event` must hear (empty: none).
    block_events: frozenset[str]

    @property
    def num_blocks(self) -> int:
        """Block ids are ``0 .. num_blocks - 1``."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (codes, scales, staging)."""
        ...

    @property
    def segments(self) -> list[torch.Tensor]:
        """The storage tensors (one for a contiguous pool; readers that need one tensor check ``len == 1``)."""
        ...

    def check_kv(self, key: torch.Tensor, value: torch.Tensor, layer: int | None = None) -> None:
        """Raise unless K/V ``[n, H, D]`` can be stored (shape, dtype, device, values); changes nothing."""
        ...

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one layer's K/V ``[n, H, D]`` at ``slots [n]`` (slot = block · T + offset; -1 skips)."""
        ...

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` keys and values of a sequence, ``[H, num_tokens, D]`` each, in ``spec.dtype``."""
        ...

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's contents (all layers) onto another: the copy of copy-on-write."""
        ...

    def block(self, block: int) -> torch.Tensor:
        """One block ``[L, 2, H, T, D]`` (a view for a plain pool, a dequantized copy for a quantized one)."""
        ...

    def poison(self, block: int) -> None:
        """Debug mode: make a freed block read back as NaN."""
        ...

    def on_block_event(self, event: BlockEvent) -> None:
        """Hear one allocator event whose kind is in :attr:`block_events`."""
        ...


@runtime_checkable
class WindowedKVPool(KVPool, Protocol):
    """A pool with ``tracks_windows``: full-precision staging of the recent blocks, sealed into codes later."""

    #: The most recent tokens of each sequence kept at full precision.
    residual_tokens: int
    #: Per block: the slab row it is staged in, ``-1`` when sealed (``[num_blocks]``, on the CPU).
    staging_slot: torch.Tensor
    #: Per block: how many live sequences hold it inside their residual window (``[num_blocks]``).
    window_holds: torch.Tensor

    @property
    def staging_available(self) -> int:
        """Free full-precision staging blocks."""
        ...

    @property
    def staging_capacity(self) -> int:
        """Staging blocks in all."""
        ...

    def hold(self, blocks: list[int]) -> None:
        """A sequence now holds ``blocks`` inside its residual window."""
        ...

    def unhold(self, blocks: list[int]) -> None:
        """The reverse of :meth:`hold`."""
        ...

    def seal_unheld(self, blocks: list[int]) -> int:
        """Seal those of ``blocks`` that are staged and inside no live window; returns how many."""
        ...


class PoolBuilder(Protocol):
    """Something that builds a pool for :class:`~memos_ref.paged.store.PagedKV` (``PagedKV(spec, n, quant=...)``):
    a quantization scheme of :mod:`memos_ref.quant` builds its quantized pool, so the paged layer never imports
    the layer above it."""

    def build_pool(
        self,
        spec: KVSpec,
        num_blocks: int,
        *,
        residual_tokens: int | None = None,
        staging_blocks: int | None = None,
        layer_scales: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
    ) -> KVPool:
        """A pool of ``num_blocks`` blocks for ``spec``."""
        ...
