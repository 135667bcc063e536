"""Re-staging a sealed quantized block (issue 30's survivor: the test that said it wrote "back into a sealed block"
after a truncate landed in a block still staged). Here the block is checked to be sealed before the write; the
oracle is the K/V the test wrote, within the scheme's quantization error."""

from __future__ import annotations

import pytest
import torch

from memos_ref.paged import PagedKV
from memos_ref.quant import FP8E4M3, PerTokenInt8, QuantizedBlockPool
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=T)


def _write(seq, n, gen):
    """n tokens into every layer; returns [(k, v)] per layer, each [H, n, D]."""
    out = []
    for layer in range(SPEC.num_layers):
        k, v = torch.randn(2, 2, n, 16, generator=gen).unbind(0)
        seq.append(layer, k, v)
        out.append((k, v))
    return out


@pytest.mark.parametrize("kept", [1, 4])
@pytest.mark.parametrize("scheme", [PerTokenInt8(), FP8E4M3()], ids=["int8", "fp8"])
def test_writing_into_the_middle_of_a_sealed_block_keeps_its_earlier_tokens(scheme, kept):
    """Truncate into a block that was sealed (quantized, no staging slot), then write the next token: the block is
    re-staged with its sealed contents decoded, so the tokens before the write read back as written (within the
    codec's error), not as zeros, and the new token reads back at full precision."""
    kv = PagedKV(SPEC, 16, quant=scheme, residual_tokens=T, staging_blocks=4, prefix_caching=False)
    gen = torch.Generator().manual_seed(21)
    seq = kv.new_sequence()
    written = _write(seq, 3 * T, gen)
    seq.truncate(T + kept)  # into block 1
    block = seq.block_table[1]
    assert not kv.pool.is_staged(block), "the premise: block 1 is sealed before the write"
    new = _write(seq, 1, gen)
    assert kv.pool.is_staged(block)  # re-staged for the write
    for layer in range(SPEC.num_layers):
        k, v = seq.to_dense(layer)  # [H, T + kept + 1, D]
        for got, want in ((k, written[layer][0]), (v, written[layer][1])):
            err = (got[:, T : T + kept] - want[:, T : T + kept]).abs().max().item()
            assert err <= 0.05 * want.abs().max().item(), err  # quantization error, never a zeroed token
            torch.testing.assert_close(got[:, :T], want[:, :T], atol=0.05 * want.abs().max().item(), rtol=0)
        torch.testing.assert_close(k[:, T + kept :], new[layer][0])
        torch.testing.assert_close(v[:, T + kept :], new[layer][1])
    kv.check()


def test_a_whole_block_written_from_offset_zero_into_a_sealed_block_needs_no_decode():
    """At pool level: a write covering offset 0 of a sealed block replaces it (nothing to keep); a write that starts
    past offset 0 keeps the earlier offsets' decoded values; both leave other blocks' codes untouched."""
    pool = QuantizedBlockPool(SPEC, 4, PerTokenInt8(), residual_tokens=T, staging_blocks=2)
    gen = torch.Generator().manual_seed(22)
    first = [torch.randn(T, 2, 16, generator=gen) for _ in range(2 * SPEC.num_layers)]
    slots = torch.arange(T)  # block 0
    for layer in range(SPEC.num_layers):
        pool.write(layer, slots, first[2 * layer], first[2 * layer + 1])
    pool.seal([0])
    assert not pool.is_staged(0)
    sealed = [pool.read_blocks(torch.tensor([0]), layer).clone() for layer in range(SPEC.num_layers)]
    tail = [torch.randn(3, 2, 16, generator=gen) for _ in range(2)]
    for layer in range(SPEC.num_layers):
        pool.write(layer, torch.arange(5, 8), tail[0], tail[1])  # offsets 5..7 only
    assert pool.is_staged(0)
    for layer in range(SPEC.num_layers):
        now = pool.read_blocks(torch.tensor([0]), layer)  # [1, 2, H, T, D]
        torch.testing.assert_close(now[..., :5, :], sealed[layer][..., :5, :])  # decoded, kept exactly
        torch.testing.assert_close(now[0, 0, :, 5:8], tail[0].transpose(0, 1))
