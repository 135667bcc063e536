"""BlockPool.write: a decode step's K/V is one direct store per run of slots, equal to the indexed scatter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from memos_ref.errors import ArgumentTypeError, InvalidArgumentError, ShapeError
from memos_ref.paged.pool import BlockPool
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


class _Ops(TorchDispatchMode):
    """Records the aten ops run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, SPEC.num_kv_heads, SPEC.head_dim, generator=gen), torch.randn(
        n, SPEC.num_kv_heads, SPEC.head_dim, generator=gen
    )


def _reference_write(pool: BlockPool, layer: int, slots: list[int], key, value) -> None:
    """Token by token, through the public block view."""
    t = SPEC.block_size
    for i, s in enumerate(slots):
        if s >= 0:
            pool.block(s // t)[layer, 0, :, s % t] = key[i]
            pool.block(s // t)[layer, 1, :, s % t] = value[i]


def test_decode_write_is_a_direct_store():
    """One token: no index tensors, no data-dependent checks (nonzero / any / index_put) — a handful of view and
    copy ops (the old path ran ~30 ops, ~100 µs, for it)."""
    pool = BlockPool(SPEC, 16)
    key, value = _kv(1, 0)
    slots = torch.tensor([37])
    with _Ops() as ops:
        pool.write(1, slots, key, value)
    banned = {"aten.nonzero.default", "aten.index_put_.default", "aten.any.default", "aten.index.Tensor"}
    assert not banned & set(ops.names), ops.names
    assert len(ops.names) <= 12, ops.names
    assert torch.equal(pool.block(4)[1, 0, :, 5], key[0]) and torch.equal(pool.block(4)[1, 1, :, 5], value[0])


@settings(max_examples=40, deadline=None)
@given(
    slots=st.lists(st.integers(min_value=-1, max_value=16 * 8 - 1), min_size=0, max_size=80, unique=True),
    segments=st.sampled_from([1, 3]),
    layer=st.integers(0, 1),
)
def test_write_equals_the_token_by_token_reference(slots, segments, layer):
    """Runs crossing block boundaries, skipped tokens, both segment layouts, and more tokens than
    DIRECT_WRITE_TOKENS (the indexed path) — all equal the token-by-token reference."""
    pool, want = BlockPool(SPEC, 16, segments=segments), BlockPool(SPEC, 16, segments=segments)
    slots = sorted(s for s in slots if s >= 0)[:40] + [s for s in slots if s < 0]  # runs, then skips
    key, value = _kv(len(slots), len(slots))
    pool.write(layer, torch.tensor(slots, dtype=torch.long), key, value)
    _reference_write(want, layer, slots, key, value)
    assert all(torch.equal(a, b) for a, b in zip(pool.segments, want.segments))


def test_long_consecutive_write_takes_the_indexed_path_and_matches():
    pool, want = BlockPool(SPEC, 16), BlockPool(SPEC, 16)
    n = BlockPool.DIRECT_WRITE_TOKENS + 9
    slots = list(range(3, 3 + n))
    key, value = _kv(n, 7)
    pool.write(0, torch.tensor(slots), key, value)
    _reference_write(want, 0, slots, key, value)
    assert torch.equal(pool.segments[0], want.segments[0])


@pytest.mark.parametrize(
    ("slots", "error", "match"),
    [
        ([0], ArgumentTypeError, "expected Tensor"),
        (torch.tensor([True]), ArgumentTypeError, "integer tensor"),
        (torch.tensor([1, 2]), ShapeError, r"slots must be \[1\]"),
        (torch.tensor([16 * 8]), InvalidArgumentError, "slot in"),
        (torch.tensor([-2]), InvalidArgumentError, "slot in"),
        (torch.tensor([1.0]), ArgumentTypeError, "integer tensor"),
        (torch.tensor([[1]]), ShapeError, "1-d"),
    ],
)
def test_refused_write_leaves_the_pool_unchanged(slots, error, match):
    pool = BlockPool(SPEC, 16)
    before = pool.segments[0].clone()
    key, value = _kv(1, 3)
    with pytest.raises(error, match=match):
        pool.write(0, slots, key, value)
    assert torch.equal(pool.segments[0], before)
