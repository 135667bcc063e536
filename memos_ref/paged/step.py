"""StepBatch: one forward step's paged metadata for every row, built once before the layer loop.

nano-vllm's ``Context`` is the model: before a forward runs its layers, the slots of the new tokens (the slot
mapping), the rows' block tables and their lengths are computed once, blocks are reserved for every row (all rows
or none), and each layer then writes its K/V with one indexed store (:meth:`StepBatch.write`) and attends through
one call (:func:`memos_ref.attention.attend_step`) that reads these tensors. Without it a decode step of B rows and
L layers made B·L appends, B·L slot tensors, 2·B·L K/V validations and L block-table builds.

A batch covers positions ``starts[i] .. starts[i] + query_len - 1`` of row ``i`` (rows may hold different
lengths: the engine's continuous batch). Layer ``l`` has written the step once ``layer_tokens[l]`` of every row
reaches ``seq_lens``; after the last layer the rows register their full blocks (``SequenceCache.mark_written``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from memos_ref.errors import ConfigError, DeviceError, DTypeError, ShapeError, StateError, check_layer_index
from memos_ref.paged.sequence import SequenceCache

__all__ = ["StepBatch", "rollback"]


def rollback(seq: SequenceCache, n: int) -> None:
    """Cut ``seq`` back to its first ``n`` tokens after a step failed part-way (some layers written, blocks
    perhaps reserved): every layer back to ``n``, blocks past them freed."""
    if seq.freed:
        return
    seq.layer_tokens = [min(t, n) for t in seq.layer_tokens]
    seq.num_tokens = max(seq.layer_tokens)
    seq.truncate(min(n, seq.num_tokens))


class StepBatch:
    """The metadata of one forward step over ``sequences`` (see the module notes).

    Attributes:
        sequences: the rows.
        query_len: new tokens per row (``n``).
        starts: tokens each row held before the step.
        seq_lens: ``[B]`` tokens after the step (tensor), ``lens`` the same as a list.
        slot_mapping: ``[B·n]`` physical slots of the new tokens, row-major.
        block_tables: ``[B, max_blocks]`` block ids, ``-1`` padding.
        tables: the same as lists (one per row, each as long as the row's blocks).
    """

    __slots__ = (
        "_blocks",
        "_offsets",
        "block_tables",
        "lens",
        "notes",
        "pool",
        "query_len",
        "resumed",
        "seq_lens",
        "sequences",
        "slot_mapping",
        "starts",
        "tables",
        "written",
    )

    def __init__(self, sequences: list[SequenceCache], starts: list[int], n: int) -> None:
        self.sequences, self.starts, self.query_len = sequences, starts, n
        pool = sequences[0].pool
        self.pool = pool
        t = pool.spec.block_size
        self.lens = [s + n for s in starts]
        slots: list[int] = []
        for seq, start in zip(sequences, starts):
            table = seq.block_table
            slots.extend(table[p // t] * t + p % t for p in range(start, start + n))
        device = pool.device
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)  # [B·n]
        self._blocks = torch.div(self.slot_mapping, t, rounding_mode="floor")
        self._offsets = self.slot_mapping - self._blocks * t
        self.tables = [seq.block_table[:] for seq in sequences]
        widest = max(len(table) for table in self.tables)
        padded = [table + [-1] * (widest - len(table)) for table in self.tables]
        self.block_tables = torch.tensor(padded, dtype=torch.long, device=device).reshape(len(sequences), widest)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.long, device=device)  # [B]
        self.written = [False] * len(sequences[0].layer_tokens)
        self.resumed = False  # a batch of one catching-up layer (see resume)
        self.notes: dict[str, object] = {}  # what a consumer decides once per step (attention: the kernel choice)

    # ------------------------------------------------------------------ construction
    @classmethod
    def reserve(cls, sequences: Sequence[SequenceCache], n: int) -> StepBatch:
        """Reserve ``n`` new tokens in every row (all rows or none: a failure gives back what earlier rows took)
        and build the step's metadata. Every row must be caught up (each layer holds every reserved token)."""
        rows = list(sequences)
        if not rows:
            raise ConfigError("a step needs at least one sequence")
        starts: list[int] = []
        for seq in rows:
            if min(seq.layer_tokens) != seq.num_tokens:
                raise ConfigError(
                    f"sequence {seq.seq_id}: layers hold {sorted(set(seq.layer_tokens))} of {seq.num_tokens} reserved "
                    f"tokens; a step starts only when every layer holds every token (roll the last step back)"
                )
            starts.append(seq.num_tokens)
        done = 0
        try:
            for seq in rows:
                seq.reserve_positions(n)
                done += 1
        except BaseException:
            for seq, start in zip(rows[:done], starts):
                rollback(seq, start)
            raise
        return cls(rows, starts, n)

    @classmethod
    def resume(cls, sequences: Sequence[SequenceCache], layer: int, n: int) -> StepBatch:
        """A batch over positions already reserved: layer ``layer`` holds fewer tokens than are reserved (it
        catches up after an earlier layer reserved them, outside a prepared step)."""
        rows = list(sequences)
        starts = [seq.layer_tokens[layer] for seq in rows]
        for seq, start in zip(rows, starts):
            if start + n > seq.num_tokens:
                raise ConfigError(
                    f"layer {layer} holds {start} tokens and gets {n}, but {seq.num_tokens} are reserved: layers "
                    f"must write the same tokens in order"
                )
        batch = cls(rows, starts, n)
        batch.resumed = True
        return batch

    # ------------------------------------------------------------------ per layer
    def check_kv(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """K/V ``[B, H, n, D]`` of this step in the pool's geometry, dtype and device (once per layer)."""
        spec = self.pool.spec
        expected = (len(self.sequences), spec.num_kv_heads, self.query_len, spec.head_dim)
        if tuple(key.shape) != expected or tuple(value.shape) != expected:
            raise ShapeError(
                f"key/value: expected [batch, kv_heads, tokens, head_dim] = {list(expected)}, got "
                f"{list(key.shape)} and {list(value.shape)}"
            )
        if key.dtype != spec.dtype or value.dtype != spec.dtype:
            raise DTypeError(f"key/value dtype {key.dtype}/{value.dtype} does not match the pool's {spec.dtype}")
        for name, t in (("key", key), ("value", value)):
            if t.device != self.pool.device:
                raise DeviceError(f"{name} device {t.device} does not match the pool's {self.pool.device}")

    def write(
        self,
        layer: int,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        store: Callable[[StepBatch, int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """Store layer ``layer``'s K/V ``[B, H, n, D]`` of every row: one indexed store into a plain
        single-segment pool, one ``pool.write`` otherwise (a quantized pool encodes, and checks the values).

        ``store(step, layer, k, v)`` replaces that store (``k, v [B·n, H, D]``, row-major like
        :attr:`slot_mapping`): the attention layer passes a kernel's write here (``memos_ref.attention.write_step``;
        this layer imports no kernel). The checks before and the bookkeeping after are the same; a store that
        raises leaves every row's counts as they were."""
        layer = check_layer_index(layer, len(self.written))
        if self.written[layer]:
            raise StateError(f"layer {layer} already wrote this step")
        for seq, start in zip(self.sequences, self.starts):
            if seq.freed or seq.layer_tokens[layer] != start:
                raise StateError(f"sequence {seq.seq_id} changed since this step was prepared")
        self.check_kv(key, value)
        h, d = key.shape[1], key.shape[3]
        k = key.transpose(1, 2).reshape(-1, h, d)  # [B·n, H, D], row-major like the slot mapping
        v = value.transpose(1, 2).reshape(-1, h, d)
        pool = self.pool
        if store is not None:
            store(self, layer, k, v)
        elif len(pool.segments) == 1 and not pool.quantized:
            kv = pool.segments[0][:, layer]  # [N, 2, H, T, D]
            kv[self._blocks, :, :, self._offsets] = torch.stack((k, v), dim=1)  # [B·n, 2, H, D]
        else:
            pool.write(layer, self.slot_mapping, k, v)
        self.written[layer] = True
        for seq, stop in zip(self.sequences, self.lens):
            seq.layer_tokens[layer] = stop
        if self.resumed or all(self.written):
            self.finish()

    def mark_written_by_kernel(self, layers: Sequence[int] | None = None) -> None:
        """Count ``layers`` (default: every layer) as written this step when their K/V were stored outside
        :meth:`write` — by kernels replayed from a CUDA graph (:mod:`memos_ref.decode_graph`). The same checks as
        :meth:`write` (each layer once per step, rows unchanged since the step was prepared), for every layer before
        any is counted (all or none), then the same bookkeeping: each row's ``layer_tokens`` and, once every layer
        has written, :meth:`finish`."""
        n = len(self.written)
        todo = list(range(n)) if layers is None else [check_layer_index(layer, n) for layer in layers]
        if len(set(todo)) != len(todo):
            raise StateError(f"layers {todo}: a layer is written once per step")
        for layer in todo:
            if self.written[layer]:
                raise StateError(f"layer {layer} already wrote this step")
            for seq, start in zip(self.sequences, self.starts):
                if seq.freed or seq.layer_tokens[layer] != start:
                    raise StateError(f"sequence {seq.seq_id} changed since this step was prepared")
        for layer in todo:
            self.written[layer] = True
            for seq, stop in zip(self.sequences, self.lens):
                seq.layer_tokens[layer] = stop
        if todo and (self.resumed or all(self.written)):
            self.finish()

    def finish(self) -> None:
        """Every layer wrote the step: register the rows' full blocks for prefix reuse (and let a quantized pool
        seal what left its residual window)."""
        for seq in self.sequences:
            if not seq.freed and seq.caught_up:
                seq.mark_written()

    @property
    def complete(self) -> bool:
        """Whether every layer has written this step."""
        return all(self.written)
