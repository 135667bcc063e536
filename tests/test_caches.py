"""ConcatCache and ContiguousCache: equal to transformers' DynamicCache token for token, in both forwards;
contents equal under random appends; clear errors that leave the cache unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    DeviceError,
    DTypeError,
    LayerIndexError,
    ShapeError,
)
from memos_ref.model.tokenizer import ByteTokenizer

NEW_TOKENS = 64
CACHES = {
    "concat": lambda: ConcatCache(),
    "contiguous-hsd": lambda: ContiguousCache(capacity=16),  # grows several times while generating
    "contiguous-shd": lambda: ContiguousCache(capacity=16, layout="SHD", growth_factor=2.0),
    "contiguous-fixed": lambda: ContiguousCache(capacity=256, growth_factor=None),
}


def _prompt(vocab: int) -> torch.Tensor:
    return torch.tensor([ByteTokenizer().encode("def parse_args(argv):\n    ", add_bos=vocab > 256)])


@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("which", ["shipped", "tiny"])
def test_hf_generate_equals_dynamic_cache(kind, which, shipped_pair, tiny_pair):
    _, hf = shipped_pair if which == "shipped" else tiny_pair
    prompt = _prompt(hf.config.vocab_size)
    args = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = hf.generate(prompt, cache=DynamicCache(), **args)
    cache = CACHES[kind]()
    got = hf.generate(prompt, cache=cache, **args)
    assert got.shape[1] == prompt.shape[1] + NEW_TOKENS
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == got.shape[1] - 1  # the last token is sampled, never fed back


@pytest.mark.parametrize("kind", sorted(CACHES))
@pytest.mark.parametrize("which", ["shipped", "tiny"])
def test_manual_loops_in_both_forwards_equal_dynamic_cache(kind, which, shipped_pair, tiny_pair):
    ours, hf = shipped_pair if which == "shipped" else tiny_pair
    prompt = _prompt(hf.config.vocab_size)
    expected = hf.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    # the package's forward
    assert torch.equal(ours.generate(prompt, NEW_TOKENS, CACHES[kind]()), expected)
    # a hand-written loop over transformers' forward
    cache, ids, step = CACHES[kind](), prompt, prompt
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(input_ids=step, cache=cache, use_cache=True).logits
            step = logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, step], dim=1)
    assert torch.equal(ids, expected)


def test_cached_equals_uncached_generation(shipped_pair):
    ours, _ = shipped_pair
    prompt = _prompt(300)
    assert torch.equal(ours.generate(prompt, 48, None), ours.generate(prompt, 48, ContiguousCache()))


@pytest.mark.parametrize("kind", ["concat", "contiguous-hsd", "contiguous-shd"])
def test_left_padded_batch_equals_dynamic_cache(kind, shipped_pair):
    ours, hf = shipped_pair
    ids, mask = ByteTokenizer().batch_encode(["class Foo:\n    def", "import os\n\ndef main():\n    return"])
    args = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=ByteTokenizer().pad_id)
    expected = hf.generate(ids, attention_mask=mask, cache=DynamicCache(), **args)
    assert torch.equal(hf.generate(ids, attention_mask=mask, cache=CACHES[kind](), **args), expected)
    # the package's forward, with the same mask, agrees too
    assert torch.equal(ours.generate(ids, 32, CACHES[kind](), attention_mask=mask), expected)


# ----------------------------------------------------------------------------- contents, property-based
@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    capacity=st.integers(1, 20),
    growth=st.sampled_from([1.25, 1.5, 2.0]),
    layout=st.sampled_from(["HSD", "SHD"]),
    batch=st.integers(1, 3),
    crop=st.integers(0, 5),
)
def test_random_appends_leave_contiguous_equal_to_concat(chunks, capacity, growth, layout, batch, crop):
    gen = torch.Generator().manual_seed(sum(chunks) + capacity)
    concat, contiguous = ConcatCache(num_layers=2), ContiguousCache(capacity, growth, layout, num_layers=2)
    for n in chunks:
        for layer in range(2):
            k, v = torch.randn(2, batch, 3, n, 4, generator=gen).unbind(0)
            k1, v1 = concat.update(k, v, layer)
            k2, v2 = contiguous.update(k.clone(), v.clone(), layer)
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
    total = sum(chunks)
    assert contiguous.get_seq_length() == concat.get_seq_length() == total
    assert contiguous.layers[0].capacity >= total
    assert contiguous.nbytes_used() == concat.nbytes_used()
    # bytes written, from first principles: concat rewrites the whole layer on every append (the sum of the
    # running lengths); the contiguous cache writes each token once plus what its growths copied
    token_bytes = 2 * batch * 3 * 4 * 4  # K and V, 3 heads, head_dim 4, fp32
    running = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    assert concat.bytes_copied == 2 * token_bytes * sum(running)
    growth_bytes = sum(e.bytes_copied for e in contiguous.growth_events)
    assert contiguous.bytes_copied == 2 * token_bytes * total + growth_bytes
    drop = min(crop, total)
    concat.crop(-drop)
    contiguous.crop(-drop)
    for cache in (concat, contiguous):
        assert cache.get_seq_length() == total - drop
    for a, b in zip(concat.layers, contiguous.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # writing after a crop overwrites the dropped positions
    k, v = torch.randn(2, batch, 3, 2, 4, generator=gen).unbind(0)
    for layer in range(2):
        assert torch.equal(concat.update(k, v, layer)[0], contiguous.update(k, v, layer)[0])


def test_growth_policy_is_the_configured_factor():
    cache = ContiguousCache(capacity=1024, growth_factor=1.5, num_layers=1)
    cache.update(torch.zeros(1, 2, 1024, 8), torch.zeros(1, 2, 1024, 8), 0)
    cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)
    (event,) = cache.growth_events
    assert (event.old_capacity, event.new_capacity) == (1024, 1536)
    assert event.bytes_copied == 2 * 2 * 1024 * 8 * 4
    assert cache.nbytes_reserved() == 2 * 2 * 1536 * 8 * 4


# ----------------------------------------------------------------------------- errors
def _kv(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("factory", [lambda: ConcatCache(num_layers=2), lambda: ContiguousCache(8, num_layers=2)])
def test_errors_name_expected_and_actual_and_leave_the_cache_unchanged(factory):
    cache = factory()
    cache.update(*_kv(1, 2, 3, 4), 0)
    before = (cache.get_seq_length(), cache.layers[0].keys.clone())
    with pytest.raises(LayerIndexError, match="out of range"):
        cache.update(*_kv(1, 2, 1, 4), 2)
    with pytest.raises(LayerIndexError):
        cache.update(*_kv(1, 2, 1, 4), -1)
    with pytest.raises(ShapeError, match=r"kv_heads=2"):
        cache.update(*_kv(1, 3, 1, 4), 0)
    with pytest.raises(ShapeError, match="4-D"):
        cache.update(*_kv(2, 1, 4), 0)
    with pytest.raises(ShapeError, match="differ"):
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4), 0)
    with pytest.raises(DTypeError, match="float16"):
        cache.update(*_kv(1, 2, 1, 4, dtype=torch.float16), 0)
    with pytest.raises(DeviceError, match="meta"):
        cache.update(*_kv(1, 2, 1, 4, device="meta"), 0)
    assert cache.get_seq_length() == before[0]
    assert torch.equal(cache.layers[0].keys, before[1])


def test_fixed_capacity_raises_and_keeps_state():
    cache = ContiguousCache(capacity=4, growth_factor=None, num_layers=1)
    cache.update(*_kv(1, 1, 3, 2), 0)
    with pytest.raises(CapacityExceededError, match="fixed capacity is 4") as info:
        cache.update(*_kv(1, 1, 2, 2), 0)
    assert (info.value.needed, info.value.capacity) == (5, 4)
    assert cache.get_seq_length() == 3
    with pytest.raises(CapacityExceededError, match="prefill of 5"):
        ContiguousCache(capacity=4, growth_factor=None).update(*_kv(1, 1, 5, 2), 0)


@pytest.mark.parametrize(
    "kwargs", [dict(capacity=0), dict(growth_factor=1.0), dict(growth_factor=0.5), dict(layout="SDH")]
)
def test_bad_options(kwargs):
    with pytest.raises(ConfigError):
        ContiguousCache(**kwargs)


def test_beam_reorder_and_batch_select():
    cache = ContiguousCache(4, num_layers=1)
    keys = torch.arange(3 * 1 * 2 * 1, dtype=torch.float32).view(3, 1, 2, 1)
    cache.update(keys, keys.clone(), 0)
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(cache.layers[0].keys, keys[[2, 0, 1]])
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.layers[0].keys, keys[[0]])
    cache.update(torch.ones(1, 1, 1, 1), torch.ones(1, 1, 1, 1), 0)  # still writable after reindexing
    assert cache.get_seq_length() == 3


def test_failed_calls_do_not_create_layers():
    cache = ConcatCache()
    with pytest.raises(ShapeError):
        cache.update(torch.zeros(2, 3), torch.zeros(2, 3), 3)
    assert len(cache.layers) == 0
    cache.update(*_kv(1, 2, 1, 4), 0)
    with pytest.raises(LayerIndexError, match="num_layers"):
        cache.update(*_kv(1, 2, 1, 4), 10**6)
    assert len(cache.layers) == 1


def test_fixed_capacity_prefill_failure_then_reuse():
    cache = ContiguousCache(capacity=4, growth_factor=None, num_layers=1)
    with pytest.raises(CapacityExceededError):
        cache.update(*_kv(2, 1, 5, 2), 0)
    assert not cache.layers[0].is_initialized and cache.get_seq_length() == 0
    cache.update(*_kv(1, 1, 4, 2), 0)  # a different batch, within capacity, works
    assert cache.get_seq_length() == 4


def test_reset_then_a_new_batch_size():
    for cache in (ConcatCache(num_layers=1), ContiguousCache(8, num_layers=1)):
        cache.update(*_kv(2, 1, 3, 2), 0)
        cache.reset()
        assert cache.get_seq_length() == 0
        k = torch.arange(5 * 1 * 2 * 2, dtype=torch.float32).view(5, 1, 2, 2)
        keys, _ = cache.update(k, k.clone(), 0)
        assert torch.equal(keys, k)


@pytest.mark.parametrize("factory", [lambda: ConcatCache(num_layers=1), lambda: ContiguousCache(4, num_layers=1)])
def test_batch_operations_keep_the_cache_writable(factory):
    cache = factory()
    keys = torch.arange(3 * 1 * 2 * 1, dtype=torch.float32).view(3, 1, 2, 1)
    cache.update(keys, keys.clone(), 0)
    cache.batch_repeat_interleave(2)  # [0, 0, 1, 1, 2, 2]
    assert torch.equal(cache.layers[0].keys, keys.repeat_interleave(2, dim=0))
    cache.batch_select_indices(torch.tensor([True, False, False, False, True, False]))  # a mask: rows 0 and 4
    assert torch.equal(cache.layers[0].keys, keys[[0, 2]])
    new = torch.full((2, 1, 1, 1), 7.0)
    out, _ = cache.update(new, new, 0)
    assert out.shape == (2, 1, 3, 1) and torch.equal(out[:, :, 2], new[:, :, 0])


def test_generate_stops_rows_at_eos_independently(tiny_pair):
    ours, _ = tiny_pair
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    free = ours.generate(prompt, 12, ContiguousCache())
    eos = int(free[0, 4])  # pretend the token row 0 emits at its 2nd step is EOS
    out = ours.generate(prompt, 12, ContiguousCache(), eos_token_id=eos, pad_token_id=0)
    row0 = out[0, 3:].tolist()
    first = row0.index(eos)
    assert all(t == 0 for t in row0[first + 1 :])
    if eos not in free[1, 3:].tolist():  # row 1 never emits it: it runs the full length, unchanged
        assert out.shape[1] == 15 and torch.equal(out[1], free[1])


def test_fp16_left_padding_stays_finite():
    from memos_ref.model import load_model

    model = load_model(dtype=torch.float16)
    ids, mask = ByteTokenizer().batch_encode(["x", "def main():\n    return 0\n"])
    out = model.generate(ids, 8, ContiguousCache(), attention_mask=mask)
    assert out.shape == (2, ids.shape[1] + 8)
    with torch.no_grad():
        assert torch.isfinite(model(ids, attention_mask=mask)).all()


# ----------------------------------------------------------------------------- argument types (issue 13.16)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ContiguousCache(capacity="256"), "capacity: expected int, got str"),
        (lambda: ContiguousCache(capacity=True), "capacity: expected int, got bool"),
        (lambda: ContiguousCache(growth_factor="1.5"), "growth_factor: expected int or float, got str"),
        (lambda: ContiguousCache(layout=0), "layout: expected str, got int"),
        (lambda: ConcatCache(num_layers=2.0), "num_layers: expected int, got float"),
        (lambda: ContiguousCache(num_layers=1).update([0.0], torch.zeros(1), 0), "key_states: expected Tensor"),
        (lambda: ConcatCache().update(torch.zeros(1, 1, 1, 1), None, 0), "value_states: expected Tensor, got NoneType"),
        (lambda: ConcatCache().update(*_kv(1, 1, 1, 1), "0"), "layer_idx: expected int, got str"),
        (lambda: ContiguousCache(num_layers=1).crop(-1.0), "tokens_to_remove: expected int, got float"),
    ],
)
def test_wrong_argument_types_raise_argument_type_error(call, match):
    with pytest.raises(ArgumentTypeError, match=match):
        call()


def test_a_wrongly_typed_update_changes_nothing():
    cache = ContiguousCache(4, num_layers=1)
    cache.update(*_kv(1, 1, 2, 2), 0)
    with pytest.raises(ArgumentTypeError):
        cache.update(torch.zeros(1, 1, 1, 2), [[0.0, 0.0]], 0)
    assert cache.get_seq_length() == 2
