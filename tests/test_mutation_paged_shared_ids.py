"""Token ids recorded for blocks a fork put in the prefix cache (issue 30's survivors of ``set_token_ids``' check):
ids that agree with what the index holds are accepted wherever the recorded range starts and ends inside the
blocks, ids that differ are refused naming exactly the positions up to the clashing block's end. The oracle is
the fork's ids, known here."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import InvalidArgumentError
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
IDS = list(range(100, 100 + 2 * T))  # what the fork records for the two shared full blocks


def _shared():
    """A holds 17 tokens of unknown ids; its fork B records IDS, which puts A's two full blocks in the index."""
    kv = PagedKV(SPEC, 16)
    a = kv.new_sequence()
    a.advance([-1] * (2 * T) + [5])
    b = a.fork()
    b.set_token_ids(IDS)
    assert a.num_registered == 0 and kv.allocator.tokens_of(a.block_table[1]) == tuple(IDS[T:])
    return kv, a


@pytest.mark.parametrize(("start", "stop"), [(10, 16), (4, 16), (8, 14), (0, 5), (0, 16), (3, 11)])
def test_ids_that_agree_with_the_index_are_recorded_wherever_they_start_and_end(start, stop):
    kv, a = _shared()
    a.set_token_ids(IDS[start:stop], start=start)
    assert a.token_ids[start:stop] == IDS[start:stop]
    kv.check()


@pytest.mark.parametrize(("start", "bad"), [(10, 15), (3, 12), (0, 2)])
def test_ids_that_differ_are_refused_naming_the_positions_to_the_clashing_blocks_end(start, bad):
    kv, a = _shared()
    ids = IDS[start : 2 * T]
    ids[bad - start] = 7
    before = a.token_ids[:]
    end = (bad // T + 1) * T - 1
    with pytest.raises(InvalidArgumentError, match=rf"^token_ids: positions {start}\.\.{end} lie in blocks already"):
        a.set_token_ids(ids, start=start)
    assert a.token_ids == before
    kv.check()
