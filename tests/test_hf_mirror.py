"""PagedCache(dense_mirror=True): a dense per-layer copy grown by appends instead of a gather of every row's
history each step — equal outputs, no re-gather per step, rebuilt when rows change (fork, beams, rollback),
never used over a quantized pool or where a kernel runs."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import memos_ref.hf.cache as hf_cache
from memos_ref.errors import ArgumentTypeError
from memos_ref.hf import PagedCache
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.paged import PagedKV
from memos_ref.quant import PerTokenInt8

tok = ByteTokenizer()
PROMPT = "class Stack:\n    def __init__(self):\n"


def _kv(model, num_blocks=96, **kw):
    return PagedKV(model.kv_spec(block_size=16), num_blocks, **kw)


def _greedy(hf, ids, cache, n=24, **kw):
    return hf.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


class _CountingGather:
    """Wraps a pool's gather, counting calls."""

    def __init__(self, pool):
        self.inner, self.calls = pool.gather, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_mirror_generate_equals_dynamic_cache_in_both_forwards(shipped_pair):
    ours, hf = shipped_pair
    ids = tok(PROMPT)
    expected = _greedy(hf, ids, DynamicCache())
    kv = _kv(ours)
    assert torch.equal(_greedy(hf, ids, PagedCache(kv, dense_mirror=True)), expected)
    assert torch.equal(ours.generate(ids, 24, PagedCache(kv, dense_mirror=True)), expected)
    kv.check()


def test_mirror_decode_steps_do_not_regather_the_history(shipped_pair, monkeypatch):
    """After the first step of each layer the mirror grows by appends: no pool.gather per layer and step (the
    plain path gathers every row's whole history, L times per step)."""
    ours, hf = shipped_pair
    ids = tok(PROMPT)
    layers = ours.kv_spec().num_layers
    for mirror, expected_calls in ((False, layers * 8), (True, 0)):
        kv = _kv(ours)
        counter = _CountingGather(kv.pool)
        monkeypatch.setattr(kv.pool, "gather", counter)
        step_gather = _CountingGather(type("Seam", (), {"gather": staticmethod(hf_cache.gather_step)}))
        monkeypatch.setattr(hf_cache, "gather_step", step_gather)  # the plain path's gather of a whole step
        cache = PagedCache(kv, dense_mirror=mirror)
        with torch.inference_mode():
            hf(input_ids=ids, cache=cache, use_cache=True)  # prefill
            counter.calls = step_gather.calls = 0
            nxt = ids[:, -1:]
            for _ in range(8):
                nxt = hf(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        assert counter.calls + step_gather.calls == expected_calls
        cache.free()


def _logits(model, ids, cache):
    with torch.inference_mode():
        return model(ids, cache)[:, -1]


def test_mirror_follows_crop_fork_and_external_truncate(shipped_pair):
    """Rollback (crop, or a row truncated behind the cache's back), forks and continued decoding give the same
    logits as the plain paged cache."""
    ours, _hf = shipped_pair
    ids = tok(PROMPT)
    kv = _kv(ours, 200)
    plain, mirrored = PagedCache(kv), PagedCache(kv, dense_mirror=True)
    steps = [tok("x = 1\n"), tok("y"), tok("def f():\n")]
    for cache in (plain, mirrored):
        _logits(ours, ids, cache)
    for i, chunk in enumerate(steps):
        a, b = _logits(ours, chunk, plain), _logits(ours, chunk, mirrored)
        assert torch.allclose(a, b, atol=1e-5), i
    plain.crop(-5)
    mirrored.crop(-5)
    assert torch.allclose(_logits(ours, tok("z"), plain), _logits(ours, tok("z"), mirrored), atol=1e-5)
    plain_child, mirrored_child = plain.fork(), mirrored.fork()
    assert mirrored_child.dense_mirror
    for cache in (plain, mirrored):
        _logits(ours, tok("A"), cache)
    assert torch.allclose(_logits(ours, tok("B"), plain_child), _logits(ours, tok("B"), mirrored_child), atol=1e-5)
    for cache in (plain, mirrored):  # a rollback straight on the row, then more tokens through the cache
        cache.sequences[0].truncate(cache.sequences[0].num_tokens - 3)
    assert torch.allclose(_logits(ours, tok("q"), plain), _logits(ours, tok("q"), mirrored), atol=1e-5)
    for cache in (plain, mirrored, plain_child, mirrored_child):
        cache.free()
    kv.check()


def test_mirror_beam_search_equals_dynamic_cache(shipped_pair):
    """Beam reordering replaces the rows (forks): the mirror is rebuilt for the new rows."""
    _ours, hf = shipped_pair
    ids = tok(PROMPT)
    expected = _greedy(hf, ids, DynamicCache(), n=8, num_beams=2)
    kv = PagedKV(_ours.kv_spec(block_size=16), 200)
    assert torch.equal(_greedy(hf, ids, PagedCache(kv, dense_mirror=True), n=8, num_beams=2), expected)


def test_mirror_is_not_used_over_a_quantized_pool_or_with_kernels(shipped_pair, monkeypatch):
    ours, _hf = shipped_pair
    spec = ours.kv_spec(block_size=16)
    quantized = PagedCache(PagedKV(spec, 64, quant=PerTokenInt8(), prefix_caching=False), dense_mirror=True)
    assert not quantized._mirrored(torch.device("cpu"))
    _logits(ours, tok(PROMPT), quantized)
    assert all(m is None for m in quantized._mirrors)  # reads went to the (dequantizing) pages
    plain = PagedCache(PagedKV(spec, 64), dense_mirror=True)
    assert plain._mirrored(torch.device("cpu"))
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    assert not plain._mirrored(torch.device("cpu"))  # the kernel reads the pages in place


def test_mirror_is_released_with_the_cache_and_checked(shipped_pair):
    ours, _hf = shipped_pair
    cache = PagedCache(_kv(ours), dense_mirror=True)
    _logits(ours, tok(PROMPT), cache)
    assert all(m is not None for m in cache._mirrors)
    cache.reset()
    assert all(m is None for m in cache._mirrors)
    with pytest.raises(ArgumentTypeError, match="dense_mirror"):
        PagedCache(_kv(ours), dense_mirror="yes")
