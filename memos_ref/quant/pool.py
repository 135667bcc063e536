"""QuantizedBlockPool: the paged pool with quantized blocks — same block ids, block tables, refcounts, sharing
and copy-on-write as :class:`~memos_ref.paged.pool.BlockPool`; only what a block *holds* changes.

The pool is the staging slab, the window bookkeeping and dispatch: what a sealed block holds, and how it is
encoded and decoded, belongs to the scheme's :class:`~memos_ref.quant.codec.BlockCodec` (one file per scheme:
:mod:`~memos_ref.quant.fp16`, :mod:`~memos_ref.quant.int8_token`, :mod:`~memos_ref.quant.int8_tensor`,
:mod:`~memos_ref.quant.fp8`, :mod:`~memos_ref.quant.kivi`). Storage, preallocated per scheme (``N`` blocks,
``L`` layers, ``H`` KV heads, ``T`` tokens, ``D`` dims):

* fp16: ``[N, L, 2, H, T, D]`` float16 (for an fp32 model);
* int8 per token: codes int8 ``[N, L, 2, H, T, D]`` + fp16 scales ``[N, L, 2, H, T]``;
* int8 per tensor: codes int8 ``[N, L, 2, H, T, D]`` + one scale per (layer, K/V);
* fp8 e4m3: codes ``[N, L, 2, H, T, D]`` (stored as bytes) + fp32 scales per block and head ``[N, L, 2, H]``;
* KIVI: packed key codes ``[N, L, H, T, D·b/8]`` with fp16 scale/zero per channel per group ``[N, L, H, T/G, D]``,
  packed value codes ``[N, L, H, T, D·b/8]`` with fp16 scale/zero per token per channel group.

Two ways in:

* **Streaming** (int8, fp8 with no residual window): each write quantizes its tokens straight into the codes.
  fp8's per-head scale belongs to the block; a token that needs more range *raises the block's scale and
  re-encodes what the block holds* (counted in ``rescales``) — never a silent clip at ±448.
* **Sealed** (KIVI, or any scheme with ``residual_tokens > 0`` — mixed-precision aging): tokens are written at
  full precision into a small *staging* slab of ``staging_blocks`` blocks; once a block is full and lies at
  least ``residual_tokens`` behind its sequence's end, it is encoded into the codes and its staging slot is
  released. KIVI's full-precision residual window and seed 001 §4.1's "recent blocks at full precision, old
  ones in int8" are the same mechanism.

  Blocks are shared (forks, beams, prefix-cache hits), and each holder has its own window. ``window_holds``
  counts, per block, the live sequences that hold it inside theirs; a block is sealed only when that count is
  zero — by whichever sequence's window moves past it last, or when a sequence that held it lets go. So what
  a sequence reads inside its window never changes under it, whatever its siblings do. A block whose last
  holder lets go and that stays in the prefix cache is sealed then (no window applies to cached blocks); a
  write that would need more staging blocks than are free is refused before anything changes.

Reads (:meth:`gather`) dequantize on the fly: staged blocks come from the slab, sealed ones are decoded.
"""

from __future__ import annotations

import torch

from memos_ref.errors import (
    ConfigError,
    InvalidArgumentError,
    StagingFullError,
    check_type,
)
from memos_ref.paged.allocator import CACHED, EVICTED, FREED, BlockEvent
from memos_ref.paged.pool import check_block_id, check_block_table, check_kv, check_layer, check_slots
from memos_ref.quant.codec import BlockCodec, BlockScheme
from memos_ref.spec import KVSpec

__all__ = ["QuantizedBlockPool"]


class QuantizedBlockPool:
    """Quantized KV blocks for one model (see the module docstring).

    Args:
        spec: the model's KV geometry; K/V arrive and are returned in ``spec.dtype``.
        num_blocks: blocks (ids ``0..num_blocks-1``).
        scheme: a :class:`~memos_ref.quant.base.Quantizer` (``PerTokenInt8``, ``PerTensorInt8`` with a fixed scale or
            ``layer_scales``, ``FP8E4M3``, ``KIVI``).
        residual_tokens: the most recent tokens of each sequence kept at full precision (KIVI default 128).
        staging_blocks: full-precision blocks available for them (default: a quarter of the pool, at least 8).
        layer_scales: ``[L, 2]`` calibrated per-tensor int8 scales (per layer, K and V).
    """

    #: :class:`~memos_ref.paged.kvpool.KVPool` flags: reads decode, and the allocator events the pool hears
    #: (the staging slot of a freed or evicted block is released; a block left in the prefix cache is sealed).
    quantized: bool = True
    block_events: frozenset[str] = frozenset({FREED, EVICTED, CACHED})

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int,
        scheme: BlockScheme,
        *,
        residual_tokens: int | None = None,
        staging_blocks: int | None = None,
        layer_scales: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        check_type("num_blocks", num_blocks, int)
        if num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(scheme, BlockScheme):  # a Quantizer: its name and codec (the pool needs no more)
            raise ConfigError(
                f"unsupported scheme {scheme!r}: expected Float16, PerTokenInt8, PerTensorInt8, FP8E4M3 or KIVI"
            )
        check_type("residual_tokens", residual_tokens, (int, type(None)))
        check_type("staging_blocks", staging_blocks, (int, type(None)))
        check_type("layer_scales", layer_scales, (torch.Tensor, type(None)))
        self.device = torch.device(device)
        # the scheme's block layout, encode and decode (ConfigError when spec does not fit it)
        self.codec: BlockCodec = scheme.codec(spec, self.device, layer_scales)
        if residual_tokens is None:
            residual_tokens = self.codec.default_residual_tokens
        if residual_tokens < 0:
            raise ConfigError(f"residual_tokens must be >= 0, got {residual_tokens}")
        if staging_blocks is not None and staging_blocks < 0:
            raise ConfigError(f"staging_blocks must be >= 0, got {staging_blocks}")
        self.spec, self.scheme = spec, scheme
        self.num_blocks = num_blocks
        self.residual_tokens = residual_tokens
        self.streaming = self.codec.streams and residual_tokens == 0
        # whether sequences must report their residual windows (hold/unhold): blocks are staged at full
        # precision and sealed later
        self.tracks_windows: bool = not self.streaming
        if staging_blocks is None:
            staging_blocks = 0 if self.streaming else max(8, num_blocks // 4)
        self.staging = torch.zeros((staging_blocks, *spec.block_shape), dtype=spec.dtype, device=self.device)
        self._staging_free = list(range(staging_blocks - 1, -1, -1))
        # block -> slab row, -1 = sealed: the host's map (bookkeeping reads it per block, free on the CPU), and
        # its copy on the pool's device for the kernels (:attr:`device_staging_slot`), refreshed when stale
        self.staging_slot = torch.full((num_blocks,), -1, dtype=torch.long, device="cpu")
        self._slot_device = torch.full((num_blocks,), -1, dtype=torch.long, device=self.device)
        self._slot_stale = False
        # per block: how many live sequences hold it inside their residual window (they read it at full
        # precision); a block is sealed only when none does (see SequenceCache and the module docstring)
        self.window_holds = torch.zeros((num_blocks,), dtype=torch.int32, device="cpu")
        self.layer_scales = self.codec.layer_scales  # [L, 2] per-tensor int8 scales, else None
        self.payload = self.codec.allocate(num_blocks)
        self.rescales = 0  # fp8 blocks whose scale had to grow
        self.seals = 0
        self.clipped = 0  # per-tensor int8 values beyond ±127·scale (fixed scales clip)

    # ------------------------------------------------------------------ structure
    @property
    def segments(self) -> list[torch.Tensor]:
        return [self.staging]  # for code that counts segments; quantized pools are never segmented

    @property
    def nbytes(self) -> int:
        return self.staging.nbytes + sum(p.nbytes for p in self.payload.values()) + self.codec.extra_nbytes

    @property
    def block_payload_bytes(self) -> int:
        """Bytes of one sealed block's codes and scales."""
        return sum(p[0].nbytes for p in self.payload.values())

    @property
    def staged_blocks(self) -> int:
        return int((self.staging_slot >= 0).sum())

    def grow(self, n: int) -> range:
        raise ConfigError("a quantized pool cannot grow; size it for the workload")

    def _check_block(self, block: int) -> int:
        return check_block_id(block, self.num_blocks)

    @property
    def staging_available(self) -> int:
        """Free full-precision staging blocks."""
        return len(self._staging_free)

    @property
    def staging_capacity(self) -> int:
        """Full-precision staging blocks in all."""
        return self.staging.shape[0]

    @property
    def device_staging_slot(self) -> torch.Tensor:
        """The block -> staging row map ``[N]`` (int64, -1: sealed) on the pool's device, for kernels: one tensor
        for the pool's life (a CUDA graph can hold it), refreshed from the host map only after it changed."""
        if self._slot_stale:
            self._slot_device.copy_(self.staging_slot)
            self._slot_stale = False
        return self._slot_device

    def is_staged(self, block: int) -> bool:
        return int(self.staging_slot[block]) >= 0

    # ------------------------------------------------------------------ staging
    def _stage(self, block: int, keep_contents: bool) -> int:
        """Give ``block`` a full-precision slab row; ``keep_contents`` decodes a sealed block into it first (a
        write into the middle of a sealed block, after a truncate)."""
        slot = int(self.staging_slot[block])
        if slot < 0:
            slot = self._staging_free.pop()
            if keep_contents:
                idx = torch.tensor([block], device=self.device)
                for layer in range(self.spec.num_layers):
                    self.staging[slot, layer] = self.codec.decode(self.payload, idx, layer)[0].to(self.spec.dtype)
            self.staging_slot[block] = slot
            self._slot_stale = True
        return slot

    def on_block_event(self, event: BlockEvent) -> None:
        """Allocator events (:attr:`block_events`): a freed or evicted block gives back its staging slot; a block
        whose last holder let go and that stays cached is sealed (:meth:`seal_cached`)."""
        if event.kind in (FREED, EVICTED):
            self.release(event.block)
        elif event.kind == CACHED:
            self.seal_cached(event.block)

    def release(self, block: int) -> None:
        """Forget a freed or evicted block's staging slot (allocator hook)."""
        block = self._check_block(block)
        slot = int(self.staging_slot[block])
        if slot >= 0:
            self.staging_slot[block] = -1
            self._slot_stale = True
            self._staging_free.append(slot)

    # ------------------------------------------------------------------ writes
    def check_kv(self, key: torch.Tensor, value: torch.Tensor, layer: int | None = None) -> None:
        """Reject K/V ``[n, H, D]`` this pool cannot store: shape, dtype, device, and values it cannot encode
        (non-finite; beyond an int8 per-token scale), naming ``layer`` where given."""
        check_kv(self.spec, self.device, key, value)
        self._check_values(layer, key, value)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one layer's K/V ``[n, H, D]`` at ``slots [n]`` (slot = block · T + offset; -1 skips)."""
        layer = check_layer(self.spec, layer)
        self.check_kv(key, value, layer)  # before anything is written
        slots = check_slots(slots, key.shape[0], self.num_blocks, self.spec.block_size)
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
        if slots.numel() == 0:
            return
        t = self.spec.block_size
        blocks, offsets = slots // t, slots % t
        if not self.streaming:
            touched = blocks.unique().tolist()
            unstaged = [b for b in touched if int(self.staging_slot[b]) < 0]
            if len(unstaged) > len(self._staging_free):  # refuse before changing anything
                raise StagingFullError(
                    f"{len(unstaged)} blocks need full-precision staging but {len(self._staging_free)} of "
                    f"{self.staging.shape[0]} staging blocks are free (they hold the residual windows of live "
                    f"sequences): raise staging_blocks or lower residual_tokens",
                    needed=len(unstaged),
                    capacity=len(self._staging_free),
                )
            for b in unstaged:
                self._stage(b, keep_contents=bool((offsets[blocks == b] > 0).all()))
            where = self.staging_slot[blocks]
            self.staging[where, layer, 0, :, offsets] = key
            self.staging[where, layer, 1, :, offsets] = value
            return
        for kv, x in ((0, key), (1, value)):
            clipped, rescales = self.codec.write(self.payload, layer, kv, blocks, offsets, x)
            self.clipped += clipped  # per-tensor int8 with a fixed scale; fp8 grows its scales instead
            self.rescales += rescales

    def _check_values(self, layer: int | None, key: torch.Tensor, value: torch.Tensor) -> None:
        """Refuse K/V this pool cannot encode (:class:`InvalidArgumentError`): a non-finite value would poison the
        scale it shares with other tokens (fp8: every token of the block decodes to NaN), and per-token int8
        cannot scale an absmax beyond 127 · 65504."""
        where = "" if layer is None else f"layer {layer} "
        for what, x in ((f"{where}key", key), (f"{where}value", value)):
            if not bool(torch.isfinite(x).all()):
                bad = x[~torch.isfinite(x)].flatten()[0].item()
                raise InvalidArgumentError(
                    f"{what}: found a non-finite value ({bad}); a {self.scheme.name} pool stores "
                    f"only finite K/V — check the model's numerics (nothing was written)"
                )
            self.codec.check_values(x, what)

    # ------------------------------------------------------------------ sealing (residual window / aging)
    def hold(self, blocks: list[int]) -> None:
        """A sequence now holds ``blocks`` inside its residual window: they must stay at full precision."""
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device="cpu")
            self.window_holds.index_add_(0, idx, torch.ones(len(blocks), dtype=torch.int32, device="cpu"))

    def unhold(self, blocks: list[int]) -> None:
        """The reverse of :meth:`hold` (the window moved past them, or the sequence let them go)."""
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device="cpu")
            self.window_holds.index_add_(0, idx, torch.full((len(blocks),), -1, dtype=torch.int32, device="cpu"))
            if bool((self.window_holds[idx] < 0).any()):  # a bookkeeping bug, never a user error
                raise AssertionError(f"window holds below zero for blocks {blocks}")

    def seal_unheld(self, blocks: list[int]) -> int:
        """Seal those of ``blocks`` (full, every layer written — the caller's guarantee) that are staged and inside
        no live sequence's residual window. Returns how many were sealed."""
        if self.streaming or not blocks:
            return 0
        idx = torch.tensor(blocks, dtype=torch.long, device="cpu")
        todo = idx[(self.staging_slot[idx] >= 0) & (self.window_holds[idx] == 0)].tolist()
        self.seal(todo)
        return len(todo)

    def seal_cached(self, block: int) -> None:
        """Allocator hook: a block whose last holder let go stays in the prefix cache, where no residual window
        applies (it holds a full, registered block): seal it so it holds no staging slot."""
        if int(self.staging_slot[block]) >= 0 and int(self.window_holds[block]) == 0:
            self.seal([block])

    def seal(self, blocks: list[int]) -> None:
        """Encode staged (full) blocks into the codes and release their staging slots (unconditionally: a
        sequence seals through :meth:`seal_unheld`, which spares blocks inside another's residual window)."""
        check_type("blocks", blocks, (list, tuple))
        blocks = [self._check_block(b) for b in blocks]
        blocks = [b for b in blocks if int(self.staging_slot[b]) >= 0]
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device="cpu")
        kv = self.staging[self.staging_slot[idx]]  # [m, L, 2, H, T, D]
        self.clipped += self.codec.encode(self.payload, idx, kv)  # fp8 counts 0: its scales fit
        for b in blocks:
            self.release(b)
        self.seals += len(blocks)

    # ------------------------------------------------------------------ reads
    def read_blocks(self, blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """``[n, 2, H, T, D]`` of ``blocks`` in one layer, dequantized to the pool's dtype."""
        layer = check_layer(self.spec, layer)
        t = self.spec.block_size
        check_block_table(blocks, self.num_blocks, blocks.numel() * t if isinstance(blocks, torch.Tensor) else 0, t)
        n = blocks.numel()
        out = torch.empty((n, 2, *self.spec.block_shape[2:]), dtype=self.spec.dtype, device=self.device)
        slots = self.staging_slot[blocks.cpu()]  # host, as the slot map: a host mask indexes host and device alike
        staged = slots >= 0
        if bool(staged.any()):
            out[staged] = self.staging[slots[staged], layer]
        if bool((~staged).any()):
            out[~staged] = self.codec.decode(self.payload, blocks[~staged], layer).to(self.spec.dtype)
        return out

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_tokens`` keys and values of a sequence, dequantized: ``[H, num_tokens, D]`` each."""
        layer = check_layer(self.spec, layer)
        block_table, num_tokens = check_block_table(block_table, self.num_blocks, num_tokens, self.spec.block_size)
        n_blocks = -(-num_tokens // self.spec.block_size)
        blocks = block_table[:n_blocks].to(torch.long)
        h, t, d = self.spec.num_kv_heads, self.spec.block_size, self.spec.head_dim
        kv = self.read_blocks(blocks, layer).permute(1, 2, 0, 3, 4)  # [2, H, n, T, D]
        kv = kv.reshape(2, h, n_blocks * t, d)[:, :, :num_tokens]
        return kv[0], kv[1]

    def block(self, block: int) -> torch.Tensor:
        """A dequantized *copy* of one block ``[L, 2, H, T, D]`` (quantized blocks have no float view)."""
        block = self._check_block(block)
        idx = torch.tensor([block], device=self.device)
        return torch.stack([self.read_blocks(idx, layer)[0] for layer in range(self.spec.num_layers)])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: the codes, scales and (if staged) the full-precision slab row."""
        src, dst = self._check_block(src), self._check_block(dst)
        src_slot = int(self.staging_slot[src])
        if src_slot >= 0 and int(self.staging_slot[dst]) < 0 and not self._staging_free:  # refuse before copying
            raise StagingFullError(
                "no free staging block for a copy-on-write of a staged block: raise staging_blocks or lower "
                "residual_tokens",
                needed=1,
                capacity=0,
            )
        for tensor in self.payload.values():
            tensor[dst] = tensor[src]
        if src_slot >= 0:
            self.staging[self._stage(dst, keep_contents=False)] = self.staging[src_slot]
        else:
            self.release(dst)

    def poison(self, block: int) -> None:
        """Debug mode: make a freed block decode to NaN (per-tensor int8 has no per-block scale to poison)."""
        block = self._check_block(block)
        self.codec.poison(self.payload, block)
        self.release(block)

    def kernel_args(self, layer: int) -> dict[str, object]:
        """The ``memos_kernels`` arguments of one layer (views; see the scheme's codec), every tensor on the pool's
        device: the sealed blocks' payload and, for a pool with a residual window, ``staging`` (the layer's slab
        ``[S, 2, H, T, D]``) and ``staging_slot`` (:attr:`device_staging_slot`)."""
        layer = check_layer(self.spec, layer)
        args = self.codec.kernel_args(self.payload, layer)
        if not self.streaming:
            args = {**args, "staging": self.staging[:, layer], "staging_slot": self.device_staging_slot}
        return args

    def stats(self) -> dict[str, int]:
        return {
            "staged_blocks": self.staged_blocks,
            "staging_capacity": self.staging.shape[0],
            "seals": self.seals,
            "rescales": self.rescales,
            "clipped": self.clipped,
            "staging_free": len(self._staging_free),
        }
