"""PagedCache: token-for-token equal to DynamicCache in transformers' generate and in the package's forward;
after fork() of a prefilled prefix; with a prefix-cache hit; in batches; with clear errors."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from memos_ref.caches import ContiguousCache
from memos_ref.errors import (
    ArgumentTypeError,
    DTypeError,
    InvalidArgumentError,
    LayerIndexError,
    OutOfBlocksError,
    ShapeError,
    StateError,
    UseAfterFreeError,
)
from memos_ref.hf import PagedCache
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec

NEW = 64
tok = ByteTokenizer()


def _kv(model, num_blocks=128, block_size=16, **kw):
    return PagedKV(model.kv_spec(block_size=block_size), num_blocks, **kw)


def _greedy(hf, ids, cache, n=NEW, **kw):
    return hf.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("which", ["shipped", "tiny"])
def test_generate_equals_dynamic_cache_in_both_forwards(which, block_size, shipped_pair, tiny_pair):
    ours, hf = shipped_pair if which == "shipped" else tiny_pair
    ids = tok("class Stack:\n    def __init__(self):\n", add_bos=hf.config.vocab_size > 256)
    expected = _greedy(hf, ids, DynamicCache())
    kv = _kv(ours, block_size=block_size)
    assert torch.equal(_greedy(hf, ids, PagedCache(kv)), expected)
    assert torch.equal(ours.generate(ids, NEW, PagedCache(kv)), expected)
    kv.check()


def test_forked_sub_agents_equal_independent_runs(shipped_pair):
    ours, hf = shipped_pair
    system = tok("# A helpful agent that writes Python.\nimport os\nimport sys\n")  # 58 tokens: a partial tail
    kv = _kv(ours)
    main = PagedCache(kv)
    with torch.no_grad():
        ours(system, main)  # prefill the shared prefix once
    blocks_after_prefill = kv.allocator.num_active
    tasks = ["def main():\n", "class Config:\n", "def parse(text):\n"]
    subs = [main.fork() for _ in tasks]
    assert kv.allocator.num_active == blocks_after_prefill  # forks copy nothing
    for task, sub in zip(tasks, subs):
        full = torch.cat([system, tok(task, add_bos=False)], dim=1)
        expected = _greedy(hf, full, DynamicCache(), n=32)
        assert torch.equal(_greedy(hf, full, sub, n=32), expected)
    assert all(seq.cow_copies == 1 for sub in subs for seq in sub.sequences)  # the shared tail, once each
    kv.check()


def test_prefix_cache_hit_computes_only_the_rest(shipped_pair):
    ours, hf = shipped_pair
    kv = _kv(ours, fingerprint="shipped")
    first = tok("import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as fh:\n")
    cache = PagedCache(kv)
    out = _greedy(hf, first, cache, n=16)
    cache.set_token_ids(out[:, :-1])
    cache.free()  # the blocks stay cached
    second = torch.cat([first, tok("        return fh.read()\n", add_bos=False)], dim=1)
    hit = PagedCache.from_prefix(kv, second)
    reused = hit.get_seq_length()
    assert reused == (first.shape[1] + 15) // 16 * 16 and reused < second.shape[1]
    computed = []
    hook = ours.register_forward_pre_hook(lambda mod, args: computed.append(args[0].shape[1]))
    try:
        got = ours.generate(second[:, reused:], 24, hit)  # the package forward: feed only the rest
    finally:
        hook.remove()
    assert computed[0] == second.shape[1] - reused  # prefill computed only the uncached tokens
    expected = _greedy(hf, second, DynamicCache(), n=24)
    assert torch.equal(torch.cat([second[:, :reused], got], dim=1), expected)
    hit2 = PagedCache.from_prefix(kv, second)
    assert torch.equal(_greedy(hf, second, hit2, n=24), expected)  # transformers skips the cached part
    assert kv.prefix_cache.stats()["prefix_hit_tokens"] == 2 * reused
    kv.check()


def test_left_padded_batch_and_beam_search(shipped_pair):
    ours, hf = shipped_pair
    ids, mask = tok.batch_encode(["x = 1\n", "def f(a, b):\n    return"])
    args = dict(attention_mask=mask, pad_token_id=tok.pad_id)
    kv = _kv(ours)
    assert torch.equal(_greedy(hf, ids, PagedCache(kv), n=24, **args), _greedy(hf, ids, DynamicCache(), n=24, **args))
    beams = dict(num_beams=3, max_new_tokens=12, do_sample=False, early_stopping=True)
    prompt = tok("def f(a, b):\n    return")
    assert torch.equal(
        hf.generate(prompt, cache=PagedCache(kv), **beams), hf.generate(prompt, cache=DynamicCache(), **beams)
    )
    kv.check()


def test_errors_leave_the_memory_unchanged(shipped_pair):
    ours, _ = shipped_pair
    kv = _kv(ours, num_blocks=3, block_size=16)
    cache = PagedCache(kv)
    with torch.no_grad():
        ours(tok("a" * 30), cache)  # 31 tokens: 2 blocks
    before = (kv.allocator.stats(), cache.get_seq_length())
    with pytest.raises(OutOfBlocksError):
        ours(tok("b" * 40, add_bos=False), cache)
    assert (kv.allocator.stats(), cache.get_seq_length()) == before
    with pytest.raises(DTypeError):
        cache.update(torch.zeros(1, 2, 1, 32, dtype=torch.float16), torch.zeros(1, 2, 1, 32, dtype=torch.float16), 0)
    with pytest.raises(ShapeError):
        cache.update(torch.zeros(1, 3, 1, 32), torch.zeros(1, 3, 1, 32), 0)
    with pytest.raises(ShapeError, match="holds 1"):
        cache.update(torch.zeros(2, 2, 1, 32), torch.zeros(2, 2, 1, 32), 0)
    cache.free()
    assert kv.allocator.num_active == 0
    kv.check()


@pytest.mark.parametrize("segments", [1, 2])
def test_attend_path_matches_the_dense_path(segments, tiny_pair):
    ours, _ = tiny_pair
    ids = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(0))
    kv = PagedKV(ours.kv_spec(block_size=8), 64, segments=segments)
    paged, dense = PagedCache(kv), ContiguousCache()
    with torch.no_grad():
        chunks = [(0, 20), (20, 27), *[(i, i + 1) for i in range(27, 45)]]
        got = torch.cat([ours(ids[:, a:b], paged) for a, b in chunks], dim=1)  # attend(): no dense K/V handed back
        expected = torch.cat([ours(ids[:, a:b], dense) for a, b in chunks], dim=1)
    assert callable(paged.attend)
    assert (got - expected).abs().max().item() < 1e-5
    kv.check()


def test_registered_paged_attention_reads_the_pages_in_transformers(shipped_pair):
    from memos_ref.hf import PagedView, register_paged_attention
    from memos_ref.model import load_hf_model

    ours, hf = shipped_pair
    paged_hf = load_hf_model(attn=register_paged_attention())
    ids = tok("class Stack:\n    def __init__(self):\n")
    expected = _greedy(hf, ids, DynamicCache())
    kv = _kv(ours)
    direct = PagedCache(kv, direct=True)
    assert torch.equal(_greedy(paged_hf, ids, direct), expected)
    assert isinstance(direct.layers[0].keys, PagedView)  # no dense K/V was handed to attention
    sub = direct.fork()
    more = torch.cat([expected[:, :-1], tok("    def push(self, item):\n", add_bos=False)], dim=1)
    assert torch.equal(_greedy(paged_hf, more, sub, n=16), _greedy(hf, more, DynamicCache(), n=16))
    # without a paged cache the registered function falls back to SDPA
    assert torch.equal(_greedy(paged_hf, ids, DynamicCache()), expected)
    kv.check()


def test_from_prefix_counts_only_tokens_reused_by_every_row(shipped_pair):
    ours, _ = shipped_pair
    kv = _kv(ours, fingerprint="rows")
    long_ids = tok("import os\nimport sys\nimport json\nimport time\n" * 2)  # several full blocks
    first = PagedCache(kv)
    with torch.no_grad():
        ours(long_ids, first)
    first.set_token_ids(long_ids)
    first.free()
    rows = torch.cat([long_ids, torch.cat([long_ids[:, :20], long_ids[:, 20:].flip(1)], dim=1)])  # row 1 diverges
    hit = PagedCache.from_prefix(kv, rows)
    reused = hit.get_seq_length()
    assert reused == 16  # the second row shares only the first block
    assert kv.prefix_cache.stats()["prefix_hit_tokens"] == 2 * reused
    hit.free()
    kv.check()


# ---------------------------------------------------------------------------------------------- lifetime (issue 13.6)
def test_dropped_caches_free_their_blocks_so_a_request_loop_never_runs_out(shipped_pair):
    _, hf = shipped_pair
    kv = _kv(shipped_pair[0], num_blocks=16)
    ids = tok("def f(x):\n")  # 11 tokens + 53 new = 64 tokens = 4 blocks: 4 requests fill the pool
    outputs = []
    for _ in range(6):  # a new PagedCache per request, never freed
        outputs.append(_greedy(hf, ids, PagedCache(kv), n=53))
    assert all(torch.equal(out, outputs[0]) for out in outputs)
    assert kv.allocator.num_active == 0 and not kv.sequences  # every dropped cache gave its blocks back
    kv.check()


def test_out_of_blocks_says_what_to_do_and_changes_nothing(shipped_pair):
    ours, _ = shipped_pair
    kv = PagedKV(ours.kv_spec(block_size=16), 8)
    held = [PagedCache(kv) for _ in range(2)]  # live caches: their blocks cannot be reclaimed
    with torch.no_grad():
        for cache in held:
            ours(tok("a" * 60), cache)  # 61 tokens: 4 blocks each
    before = kv.allocator.stats()
    late = PagedCache(kv)
    with pytest.raises(OutOfBlocksError, match=r"cache\.free\(\)") as info:
        ours(tok("b" * 20), late)
    assert "2 sequences" in str(info.value) and info.value.needed == 2
    assert kv.allocator.stats() == before and not late.sequences
    held[0].free()
    with torch.no_grad():
        ours(tok("b" * 20), late)  # room again
    kv.check()


def test_deepcopy_of_a_prompt_cache_is_a_fork_as_in_transformers_prompt_reuse(shipped_pair):
    """transformers' recipe: prefill a prompt cache once, ``copy.deepcopy`` it per question, generate."""
    _, hf = shipped_pair
    kv = _kv(shipped_pair[0], num_blocks=64)
    prompt = tok("import os\nimport sys\n\n\ndef main(")  # 32 tokens: two full blocks and a partial one
    prompt_cache, reference_cache = PagedCache(kv), DynamicCache()
    with torch.no_grad():
        hf(prompt, cache=prompt_cache)
        hf(prompt, cache=reference_cache)
    questions = [tok("argv):\n", add_bos=False), tok("path, mode):\n", add_bos=False)]
    copies = []
    for question in questions:
        full = torch.cat([prompt, question], dim=1)
        blocks = kv.allocator.num_active
        mine = copy.deepcopy(prompt_cache)
        assert isinstance(mine, PagedCache) and kv.allocator.num_active == blocks  # shared, nothing copied
        expected = _greedy(hf, full, copy.deepcopy(reference_cache), n=20)
        assert torch.equal(_greedy(hf, full, mine, n=20), expected)
        copies.append((mine, full, expected))
    first, second = copies
    kept = [second[0].sequences[0].to_dense(layer) for layer in range(kv.spec.num_layers)]
    first[0].free()  # freeing one copy changes neither the other nor the prompt cache
    for layer, (k, v) in enumerate(kept):
        got_k, got_v = second[0].sequences[0].to_dense(layer)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    again = copy.deepcopy(prompt_cache)
    assert torch.equal(_greedy(hf, second[1], again, n=20), second[2])
    assert prompt_cache.get_seq_length() == prompt.shape[1]
    kv.check()


def test_use_after_free_raises_and_changes_nothing(shipped_pair):
    ours, _ = shipped_pair
    kv = _kv(ours)
    cache = PagedCache(kv)
    with torch.no_grad():
        ours(tok("x = 1\n"), cache)
    with PagedCache(kv) as scoped, torch.no_grad():
        ours(tok("y = 2\n"), scoped)
    assert scoped.is_freed
    cache.free()
    cache.free()  # a second free does nothing
    before = kv.allocator.stats()
    k = torch.zeros(1, 2, 1, 32)
    for call in (
        lambda: cache.update(k, k, 0),
        lambda: ours(tok("z", add_bos=False), cache),
        cache.fork,
        lambda: copy.deepcopy(cache),
        lambda: cache.crop(-1),
        lambda: cache.set_token_ids(torch.zeros(0, 0, dtype=torch.long)),
    ):
        with pytest.raises(UseAfterFreeError, match="freed"):
            call()
    assert kv.allocator.stats() == before and kv.allocator.num_active == 0
    kv.check()


def test_reset_keeps_the_cache_usable(shipped_pair):
    ours, _ = shipped_pair
    kv = _kv(ours)
    cache = PagedCache(kv)
    with torch.no_grad():
        first = ours(tok("x = 1\n"), cache)
        cache.reset()
        assert kv.allocator.num_active == 0 and cache.get_seq_length() == 0
        assert torch.equal(ours(tok("x = 1\n"), cache), first)
    kv.check()


# ---------------------------------------------------------------------------------------------- argument types (13.16)
def test_wrong_argument_types_raise_the_package_errors(shipped_pair):
    ours, _ = shipped_pair
    kv = _kv(ours)
    other = _kv(ours)
    gone = kv.new_sequence()
    gone.free()
    cases = [
        (lambda: PagedCache("kv"), ArgumentTypeError, "kv: expected PagedKV, got str"),
        (lambda: PagedCache(kv, [gone]), UseAfterFreeError, r"^sequences\[0\] was freed; create a new sequence"),
        (lambda: PagedCache(kv, direct="yes"), ArgumentTypeError, "direct: expected bool, got str"),
        (lambda: PagedCache(kv, cache_salt=3), ArgumentTypeError, "cache_salt: expected str, got int"),
        (lambda: PagedCache(kv, [object()]), ArgumentTypeError, r"sequences\[0\]: expected SequenceCache"),
        (lambda: PagedCache(kv, other.new_sequence()), ArgumentTypeError, "sequences: expected list or tuple"),
        (lambda: PagedCache(kv, [other.new_sequence()]), InvalidArgumentError, "another PagedKV"),
        (lambda: PagedCache.from_prefix(kv, [[1, 2, 3]]), ArgumentTypeError, "input_ids: expected Tensor, got list"),
        (lambda: PagedCache(kv).update([0.0], [0.0], 0), ArgumentTypeError, "key_states: expected Tensor, got list"),
        (
            lambda: PagedCache(kv).update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), "0"),
            ArgumentTypeError,
            "layer_idx: expected int, got str",
        ),
        (
            lambda: PagedCache(kv).update(torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), 9),
            LayerIndexError,
            r"layer_idx 9 is out of range: expected a layer index in \[0, 4\)",
        ),
        (lambda: PagedCache(kv).crop(-1.5), ArgumentTypeError, "tokens_to_remove: expected int, got float"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    assert kv.allocator.num_active == 0 and not kv.sequences
    kv.check()


@pytest.mark.parametrize("had_tokens", [0, 4])
def test_a_write_past_the_pool_is_a_package_error_and_gives_back_the_step(had_tokens):
    """An allocator that holds more blocks than its pool (the pool's last segment dropped behind its back) hands
    out ids with no memory: update refuses with a package error and keeps none of the step's blocks (it raised a
    raw IndexError and kept them)."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=8)
    kv = PagedKV(spec, 2, prefix_caching=False)
    kv.pool.shrink(kv.grow(2))  # allocator 4 blocks, pool 2
    cache = PagedCache(kv)
    if had_tokens:
        k0 = torch.ones(1, 1, had_tokens, 4)
        for layer in range(2):
            cache.update(k0, k0, layer)
    before = (kv.allocator.num_active, [s.block_table[:] for s in cache.sequences], cache.get_seq_length())
    k = torch.arange(80.0).reshape(1, 1, 20, 4)  # up to 3 blocks in all: some have no memory
    with pytest.raises(StateError, match="pool holds 2 blocks and the allocator 4"):
        cache.update(k, k, 0)
    assert (kv.allocator.num_active, [s.block_table for s in cache.sequences], cache.get_seq_length()) == before
    assert kv.allocator.num_available == 4 - before[0]
    kv.check()
    if had_tokens:  # the cache still works within the pool
        out, _ = cache.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), 0)
        assert out.shape == (1, 1, had_tokens + 1, 4)


def test_a_cache_dropped_inside_the_allocator_is_freed_on_the_next_operation(shipped_pair):
    """A garbage collection can finalize a cache while this thread is inside the allocator: the release waits."""
    ours, _ = shipped_pair
    kv = _kv(ours, num_blocks=8)
    cache = PagedCache(kv)
    with torch.no_grad():
        ours(tok("a" * 40), cache)  # 41 tokens: 3 blocks
    with kv.allocator._lock:  # as if the collection started inside an allocator call
        del cache
        assert kv.allocator.num_active == 3  # not freed under the allocator's feet
    kv.check()
    PagedCache(kv)  # the next operation releases it
    assert kv.allocator.num_active == 0 and not kv.sequences
    kv.check()


_COLLECT_INSIDE_THE_DRAIN = """
import gc, torch
from memos_ref.hf import PagedCache, rows
from memos_ref.paged.store import PagedKV
from memos_ref.spec import KVSpec

gc.disable()  # collections happen where this script says
kv = PagedKV(KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, block_size=8), 8)

def a_cache_of_two_blocks():
    cache = PagedCache(kv)
    cache.update(torch.ones(1, 1, 9, 4), torch.ones(1, 1, 9, 4), 0)
    cache.cycle = cache  # once dropped, only a collection frees it
    return cache

class CollectAtFirstRead(list):  # a collection starts at the drain's first touch of the deferred rows
    armed = True
    def _collect(self):
        if self.armed:
            self.armed = False
            gc.collect()
    def __getitem__(self, i):
        self._collect()
        return super().__getitem__(i)
    def pop(self, *i):
        self._collect()
        return super().pop(*i)

with kv.allocator.lock:  # the user's code holds the allocator (its lock is public) around cache operations
    first, second = a_cache_of_two_blocks(), a_cache_of_two_blocks()
    del first
    gc.collect()  # finalized inside the allocator: its rows wait
    assert kv.allocator.num_active == 4, kv.allocator.num_active
    rows._pending = CollectAtFirstRead(rows._pending)
    del second
    PagedCache(kv)  # the next operation frees the waiting rows; a collection inside it finalizes the second cache
    assert kv.allocator.num_active == 0, kv.allocator.num_active
kv.check()
print("freed")
"""


def test_a_cache_finalized_while_the_deferred_rows_are_freed_is_freed_too_without_a_deadlock():
    """The deferred rows' list is touched by finalizers, which a collection can start inside the code that frees
    that list: so that code holds no lock a finalizer would wait for (a lock there hung the thread for good), and
    the rows that arrive while it runs are freed in the same pass."""
    run = subprocess.run([sys.executable, "-c", _COLLECT_INSIDE_THE_DRAIN], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "freed", f"rc {run.returncode}: {run.stdout}{run.stderr}"


def test_staging_full_in_a_batch_leaves_every_row_as_it_was():
    """A quantized pool with a residual window has a fixed number of full-precision staging blocks. A batch
    whose second row cannot get one must fail before the first row is written (issue 13, item 5: "a
    StagingFullError leaves the sequence half-written")."""
    from memos_ref.errors import StagingFullError
    from memos_ref.quant import PerTokenInt8

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, dtype=torch.float32)
    kv = PagedKV(spec, 16, quant=PerTokenInt8(), residual_tokens=64, staging_blocks=3, prefix_caching=False)
    cache = PagedCache(kv)
    g = torch.Generator().manual_seed(0)
    kv0 = torch.randn(2, 2, 8, 8, generator=g)  # [B=2, H, n=8, D]: one staged block per row
    for layer in range(2):
        cache.update(kv0, kv0, layer)
    before = ([list(s.block_table) for s in cache.sequences], [s.num_tokens for s in cache.sequences])
    free_before, staging_before = kv.allocator.num_available, kv.pool.staging_available
    step = torch.randn(2, 2, 1, 8, generator=g)  # each row needs a new block: 2 staging blocks, 1 free
    with pytest.raises(StagingFullError, match="staging"):
        cache.update(step, step, 0)
    assert ([list(s.block_table) for s in cache.sequences], [s.num_tokens for s in cache.sequences]) == before
    assert (kv.allocator.num_available, kv.pool.staging_available) == (free_before, staging_before)
    kv.check()
    cache.free()
    kv.check()


# ---------------------------------------------------------------------------------------------- the per-step batch
def test_one_forward_reserves_each_row_once_and_reads_the_kernel_mode_once(shipped_pair, monkeypatch):
    """Issue 15 item 2: the package forward prepares one StepBatch before its layer loop (each row reserved once,
    not once per layer through append), and the kernel switch is read once per step, not once per layer."""
    import memos_ref.attention as attention_mod
    from memos_ref.paged.sequence import SequenceCache

    ours, _hf = shipped_pair
    kv = _kv(ours)
    ids = torch.stack(
        [tok(p)[0, :12] for p in ("def f(x):\n    return x\n", "class A:\n    pass\n\n\n", "import os\n\n\n\n")]
    )
    cache = PagedCache(kv)
    with torch.inference_mode():
        ours(ids, cache)  # prefill three rows
    counts = {"reserve": 0, "append": 0, "mode": 0}

    def counting(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(SequenceCache, "reserve_positions", counting("reserve", SequenceCache.reserve_positions))
    monkeypatch.setattr(SequenceCache, "append", counting("append", SequenceCache.append))
    monkeypatch.setattr(attention_mod, "kernel_mode", counting("mode", attention_mod.kernel_mode))
    with torch.inference_mode():
        ours(ids[:, -1:], cache)  # one decode step
    assert counts == {"reserve": 3, "append": 0, "mode": 1}
    assert [seq.num_tokens for seq in cache.sequences] == [13] * 3
    assert all(seq.caught_up for seq in cache.sequences)
    cache.free()
    kv.check()


def test_step_batch_reserves_every_row_or_none(shipped_pair):
    """StepBatch.reserve is all or nothing: when a later row cannot get its block, the rows reserved before it
    give theirs back (state before == state after, no leaked block)."""
    from memos_ref.paged.step import StepBatch

    ours, _hf = shipped_pair
    kv = _kv(ours, num_blocks=3, block_size=16)
    rows = [kv.new_sequence(), kv.new_sequence()]
    for seq in rows:
        seq.advance([1] * 16)  # one full block each; the next token needs a new block
    before = ([seq.block_table[:] for seq in rows], [seq.num_tokens for seq in rows], kv.allocator.num_available)
    with pytest.raises(OutOfBlocksError):
        StepBatch.reserve(rows, 17)  # row 0 alone needs two blocks
    with pytest.raises(OutOfBlocksError):
        StepBatch.reserve(rows, 1)  # row 0 gets the last free block, row 1 none
    after = ([seq.block_table[:] for seq in rows], [seq.num_tokens for seq in rows], kv.allocator.num_available)
    assert after == before
    assert all(seq.caught_up for seq in rows)
    kv.check()


def test_borrowed_rows_may_differ_in_length_and_are_not_freed(shipped_pair):
    """PagedCache(owns_rows=False), the engine's face of its batch: rows of different lengths attend at their own
    positions (equal to each row alone), and free() detaches them without freeing their blocks."""
    ours, _hf = shipped_pair
    kv = _kv(ours)
    prompts = [tok("def load(path):\n")[0], tok("x = 1\n")[0]]
    rows, alone = [], []
    for p in prompts:
        seq = kv.new_sequence()
        with torch.inference_mode():
            ours(p[None], PagedCache(kv, [seq], owns_rows=False))
            solo = PagedCache(kv)
            ours(p[None], solo)
            alone.append(ours(p[None, -1:], solo)[0, -1])
            solo.free()
        rows.append(seq)
    with pytest.raises(InvalidArgumentError):
        PagedCache(kv, rows)  # an owned cache's rows hold one length
    cache = PagedCache(kv, rows, owns_rows=False)
    last = torch.stack([p[-1:] for p in prompts])  # [2, 1]
    positions = torch.tensor([[len(p)] for p in prompts])
    with torch.inference_mode():
        logits = ours(last, cache, position_ids=positions)
    for row in range(2):
        torch.testing.assert_close(logits[row, -1], alone[row], rtol=1e-4, atol=1e-4)
    held = kv.allocator.num_active
    cache.free()
    assert kv.allocator.num_active == held and not any(seq.freed for seq in rows)
    for seq in rows:
        seq.free()
    kv.check()
