"""Dense reads of the pages for attention implementations that want ``[B, H, S, D]`` K/V.

Two ways a :class:`~memos_ref.hf.PagedCache` hands transformers' attention dense K/V:

* :func:`gather_step` — every row's blocks of one layer copied into new dense tensors each step (one indexed copy
  of each row's own blocks; the cost follows the sequence, not the pool);
* :class:`DenseMirror` — with ``PagedCache(kv, dense_mirror=True)``, a dense copy of each layer's K/V kept beside
  the pages and grown by appends (as ``DynamicCache`` holds its K/V), so a decode step copies only its new token.
"""

from __future__ import annotations

import torch

from memos_ref.paged.pool import gather_blocks
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.step import StepBatch

__all__ = ["MIN_MIRROR_TOKENS", "DenseMirror", "gather_step"]

MIN_MIRROR_TOKENS = 256  # the first capacity of a dense mirror (it doubles when full)


class DenseMirror:
    """One layer's K/V of every row, dense ``[B, H, capacity, D]``, valid for the first ``length`` positions of
    the rows whose sequence ids are ``rows`` (positions below a row's length never change while the sequence
    lives: appends go after them, and a truncation is seen as a shorter length)."""

    __slots__ = ("keys", "length", "rows", "values")

    def __init__(self, rows: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.rows, self.keys, self.values, self.length = rows, keys, values, length

    @classmethod
    def from_pages(cls, sequences: list[SequenceCache], layer: int, length: int) -> DenseMirror:
        """Gather the first ``length`` positions of every row from the pool (the one full copy)."""
        dense = [seq.pool.gather(layer, seq.block_table_tensor(), length) for seq in sequences]  # ([H, S, D],) * 2
        k0 = dense[0][0]
        shape = (len(sequences), k0.shape[0], max(MIN_MIRROR_TOKENS, 2 * length), k0.shape[2])
        keys, values = k0.new_empty(shape), k0.new_empty(shape)
        for row, (k, v) in enumerate(dense):
            keys[row, :, :length] = k
            values[row, :, :length] = v
        return cls(tuple(seq.seq_id for seq in sequences), keys, values, length)

    @classmethod
    def follow(
        cls,
        mirror: DenseMirror | None,
        sequences: list[SequenceCache],
        layer: int,
        before: int,
        key: torch.Tensor,
        value: torch.Tensor,
    ) -> DenseMirror:
        """The mirror of ``layer`` after a step's K/V ``[B, H, n, D]`` were written to the pages of ``sequences``
        (which held ``before`` tokens): ``mirror`` grown by them, or a new one from the pages when its rows changed
        (fork, beam reorder, reset) or its length no longer follows theirs (rolled back, or written elsewhere)."""
        rows = tuple(seq.seq_id for seq in sequences)
        if mirror is None or mirror.rows != rows or mirror.length != before:
            return cls.from_pages(sequences, layer, before + key.shape[2])
        mirror.append(key, value)
        return mirror

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Copy ``[B, H, n, D]`` after the valid positions (doubling the capacity when full)."""
        n, stop = key.shape[2], self.length + key.shape[2]
        if stop > self.keys.shape[2]:
            shape = (*self.keys.shape[:2], max(2 * self.keys.shape[2], stop), self.keys.shape[3])
            keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length : stop] = key
        self.values[:, :, self.length : stop] = value
        self.length += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid K/V ``[B, H, length, D]`` (views, no copy)."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


def gather_step(step: StepBatch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's K and V of ``layer`` as new dense ``[B, H, S, D]`` tensors (rows of one length): one copy of each
    row's own blocks straight into the result (a plain single-segment pool), else a gather per row (dequantized)
    and a stack."""
    pool, seqs, n = step.pool, step.sequences, step.lens[0]
    segs = pool.segments  # one snapshot: a growing pool publishes a new tuple
    if len(segs) != 1 or pool.quantized or len(set(step.lens)) > 1:
        dense = [seq.to_dense(layer) for seq in seqs]
        if len(dense) == 1:
            return dense[0][0].unsqueeze(0), dense[0][1].unsqueeze(0)
        return torch.stack([k for k, _ in dense]), torch.stack([v for _, v in dense])
    spec = pool.spec
    t, nb = spec.block_size, -(-n // spec.block_size)
    out = segs[0].new_empty((len(seqs), 2, spec.num_kv_heads, nb, t, spec.head_dim))
    view = segs[0][:, layer]  # [N, 2, H, T, D]
    for i, table in enumerate(step.tables):
        gather_blocks(view, table[:nb], out[i])  # [2, H, nb, T, D]
    kv = out.view(len(seqs), 2, spec.num_kv_heads, nb * t, spec.head_dim)[:, :, :, :n]
    return kv[:, 0], kv[:, 1]
