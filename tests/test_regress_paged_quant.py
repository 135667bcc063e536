"""Regressions of issue 13 in the paged cache and the quantizers (items 1, 5, 10 and 16 for paged/ and quant/).

* item 1: a scale chosen to fit must fit — no value counted (or cast) as clipped by float rounding;
* item 5: a quantized pool with a residual window never seals a block another live sequence still holds in its
  window (forks, beam search, prefix-cache sharing); truncate-then-free leaks no staging slot; a StagingFullError
  leaves everything as it was;
* item 10: index arguments are validated (a negative ``start`` no longer shifts recorded token ids);
* item 16: wrongly typed arguments raise the package's errors; use after free raises ``UseAfterFreeError``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memos_ref.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    KVCacheError,
    ShapeError,
    StagingFullError,
    UseAfterFreeError,
)
from memos_ref.paged import BlockAllocator, BlockPool, PagedKV
from memos_ref.quant import FP8E4M3, KIVI, PerTensorInt8, PerTokenInt8, pack, unpack
from memos_ref.spec import KVSpec

FP8_MAX = 448.0
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)


# ---------------------------------------------------------------------- item 1: a scale chosen to fit fits
def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


# amax values for which float32 amax / (amax / 448) is 448.0000305 (one step above the fp8 maximum)
ADVERSARIAL = [911.1808471679688, 476.8038330078125, 926.2105102539062, 236.90377807617188, 574.6957397460938]


def test_adversarial_values_really_are_adversarial():
    """The naive scale of every value above lands one float32 step past 448: the tests below probe that edge."""
    for a in ADVERSARIAL:
        amax = torch.tensor(a, dtype=torch.float32)
        assert float(amax / (amax / FP8_MAX)) > FP8_MAX


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=2.0**-20, max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32))
@example(ADVERSARIAL[0])
@example(ADVERSARIAL[1])
@example(ADVERSARIAL[3])
def test_fp8_scale_fits_its_absmax_exactly(amax):
    """FP8E4M3.quantize: amax / scale <= 448 as computed in float32, nothing counted clipped, the largest value
    round-trips within fp8's relative precision."""
    x = torch.tensor([[[amax, -amax / 3, 0.0, amax / 7]], [[-amax, amax / 2, amax / 5, 0.0]]], dtype=torch.float32)
    q = FP8E4M3()
    qt = q.quantize(x)
    assert (x.abs().amax(dim=(-1, -2)) / qt.scale <= FP8_MAX).all()
    assert qt.meta["clipped"] == 0
    back = q.dequantize(qt)
    assert ((back - x).abs() <= x.abs() * 2**-4 + qt.scale[:, None, None] * 2**-9).all()
    # a frozen scale grown by the rescale path fits too
    grown = q.quantize(x, scale=qt.scale / 4)
    assert grown.meta["clipped"] == 0


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=2**-10, max_value=2.0**20, allow_nan=False, allow_infinity=False, width=32))
@example(ADVERSARIAL[0])
def test_int8_calibrated_scale_never_counts_a_clip(amax):
    x = torch.tensor([[[amax, -amax / 3, 0.5 * amax]]], dtype=torch.float32)
    qt = PerTensorInt8().quantize(x)
    assert qt.meta["clipped"] == 0
    assert float((PerTensorInt8().dequantize(qt) - x).abs().max()) <= float(qt.scale) / 2 * (1 + 2**-16)


# values whose power-of-two block scale float32's log2 rounds down: 448 · 2^k · (1 + 2^-23)
POW2_EDGE = [448.0 * 2.0**k * (1 + 2**-23) for k in (12, 20, 40)]


@pytest.mark.parametrize("amax", POW2_EDGE)
def test_streaming_fp8_pool_block_scale_fits(amax):
    """The streaming fp8 write path: a token whose absmax sits just above a power of two times 448 gets a block
    scale that holds it (the cast would otherwise saturate it silently), and nothing is counted clipped."""
    kv = PagedKV(SPEC, 4, quant=FP8E4M3(), prefix_caching=False)
    seq = kv.new_sequence()
    x = torch.zeros(2, 1, 32)
    x[:, 0, 0] = _f32(amax)
    x[:, 0, 1] = -_f32(amax)
    for layer in range(2):
        seq.append(layer, x, x)
    k, _ = seq.to_dense(0)
    assert ((k - x).abs() <= x.abs() * 2**-4).all()
    assert kv.pool.clipped == 0
    scale = kv.pool.payload["scale"][seq.block_table[0], :, :]  # [L, 2, H]
    assert (x.abs().amax() / scale <= FP8_MAX).all()  # the block scale holds the token: nothing saturates


def test_sealed_fp8_blocks_count_no_clip():
    kv = PagedKV(SPEC, 8, quant=FP8E4M3(), residual_tokens=32, staging_blocks=4, prefix_caching=False)
    seq = kv.new_sequence()
    x = torch.full((2, 96, 32), ADVERSARIAL[0])
    for layer in range(2):
        seq.append(layer, x, x)
    assert kv.pool.seals > 0 and kv.pool.clipped == 0
    k, _ = seq.to_dense(1)
    assert ((k - x).abs() <= x.abs() * 2**-4).all()
    sealed = [b for b in seq.block_table if int(kv.pool.staging_slot[b]) < 0]
    assert sealed and (x.abs().amax() / kv.pool.payload["scale"][sealed] <= FP8_MAX).all()


# ---------------------------------------------------------------------- item 5: sealing shared blocks
AGING = {
    "int8": (PerTokenInt8, {"residual_tokens": 64}),
    "kivi4": (lambda: KIVI(4, 32), {"residual_tokens": 64}),
}


def _kv(name: str, num_blocks: int = 24, **kw: Any) -> PagedKV:
    make, base = AGING[name]
    return PagedKV(SPEC, num_blocks, quant=make(), **{"prefix_caching": False, **base, **kw})


def _write(seq, n: int, seed: int, ids=None) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(2):
        k = torch.randn(2, n, 32, generator=g) * 3
        seq.append(layer, k, k.flip(-1), ids if layer == 0 else None)


def _dense(seq) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [seq.to_dense(layer) for layer in range(2)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@pytest.mark.parametrize("name", list(AGING))
def test_fork_keeps_its_kv_when_the_parent_is_freed(name):
    kv = _kv(name)
    parent = kv.new_sequence()
    _write(parent, 100, seed=1)  # blocks 1..3 lie in the 64-token window
    child = parent.fork()
    seen = _dense(child)
    parent.free()
    assert _same(_dense(child), seen)
    kv.check()
    child.free()
    assert kv.pool.staged_blocks == 0 and kv.allocator.num_free == 24


@pytest.mark.parametrize("name", list(AGING))
def test_fork_keeps_its_kv_when_a_sibling_writes(name):
    kv = _kv(name)
    parent = kv.new_sequence()
    _write(parent, 100, seed=2)
    child = parent.fork()
    seen = _dense(child)
    _write(parent, 60, seed=3)  # the parent's window moves past blocks the child still holds in its own
    assert _same(_dense(child), seen)
    _write(child, 1, seed=4)
    assert _same([(k[:, :100], v[:, :100]) for k, v in _dense(child)], seen)
    kv.check()
    # once the child lets go, a block outside every holder's window is sealed by the next step
    child.free()
    _write(parent, 1, seed=5)
    sealable = (161 - 64) // 32
    assert all(int(kv.pool.staging_slot[b]) < 0 for b in parent.block_table[:sealable])
    parent.free()
    assert kv.pool.staged_blocks == 0 and kv.allocator.num_free == 24


@pytest.mark.parametrize("name", list(AGING))
def test_prefix_hit_keeps_its_kv_when_the_owner_moves_on(name):
    kv = _kv(name, prefix_caching=True)
    owner = kv.new_sequence()
    ids = list(range(100, 164))
    _write(owner, 64, seed=6, ids=ids)  # two full blocks, registered in the prefix cache
    hit = kv.start_from_prefix([*ids, 7])
    assert hit.num_tokens == 64
    seen = _dense(hit)
    _write(owner, 64, seed=7)  # the owner's window leaves both blocks; the hit still holds them in its window
    assert _same(_dense(hit), seen)
    kv.check()
    hit.free()
    owner.free()
    assert kv.pool.staged_blocks == 0


@pytest.mark.parametrize("name", list(AGING))
def test_truncate_then_free_leaks_no_staging_slot(name):
    kv = _kv(name, num_blocks=8, prefix_caching=True, staging_blocks=2, residual_tokens=128)
    seq = kv.new_sequence()
    _write(seq, 64, seed=8, ids=list(range(64)))  # two full blocks, both registered
    seq.truncate(40)  # block 1 is partial again but stays in the prefix cache
    seq.free()
    assert kv.pool.staged_blocks == 0
    fresh = kv.new_sequence()
    _write(fresh, 64, seed=9)  # fits the two staging blocks of an otherwise empty pool
    assert fresh.num_tokens == 64
    kv.check()


def _snapshot(kv: PagedKV, seqs) -> dict[str, Any]:
    pool = kv.pool
    snap = {
        "tables": [list(s.block_table) for s in seqs],
        "tokens": [(s.num_tokens, list(s.layer_tokens), list(s.token_ids), s.num_registered) for s in seqs],
        "refcount": list(kv.allocator.refcount),
        "state": list(kv.allocator.state),
        "free": kv.allocator.num_free,
        "cached": kv.allocator.cached_blocks(),
        "prefix": dict(kv.prefix_cache._block_of) if kv.prefix_cache is not None else None,
    }
    if getattr(pool, "quantized", False):
        snap["staging_slot"] = pool.staging_slot.tolist()
        snap["staging_free"] = sorted(pool._staging_free)
        snap["staging"] = pool.staging.clone()
        snap["payload"] = {k: v.clone() for k, v in pool.payload.items()}
    else:
        snap["blocks"] = [seg.clone() for seg in pool.segments]
    return snap


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)):
                return False
        elif isinstance(x, dict) and x and isinstance(next(iter(x.values())), torch.Tensor):
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
        elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            if not all(torch.equal(p.nan_to_num(7.0), q.nan_to_num(7.0)) for p, q in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("case", ["new_block", "copy_on_write", "sealed_tail"])
def test_staging_full_leaves_the_cache_as_it_was(case):
    kv = PagedKV(SPEC, 16, quant=KIVI(4, 32), residual_tokens=128, staging_blocks=3, prefix_caching=False)
    a = kv.new_sequence()
    _write(a, 40, seed=10)  # two staged blocks, the second partial
    if case == "copy_on_write":
        target = a.fork()  # its first write copies the shared partial tail: one more staging block
    elif case == "sealed_tail":
        target = a
        kv.pool.seal([target.block_table[0]])  # seals block 0 ...
        target.truncate(20)  # ... and the write into its middle must re-stage it
        assert int(kv.pool.staging_slot[target.block_table[-1]]) < 0
    else:
        target = a  # 40 + 30 tokens: a third block
    b = kv.new_sequence()
    _write(b, 20 if case != "sealed_tail" else 70, seed=11)  # the slab is now full
    assert not kv.pool._staging_free
    before = _snapshot(kv, [a, b, target])
    k = torch.randn(2, 30 if case == "new_block" else 1, 32)
    with pytest.raises(StagingFullError, match="staging"):
        target.append(0, k, k)
    assert _equal(_snapshot(kv, [a, b, target]), before)
    kv.check()
    b.free()  # with room, the same write succeeds
    _write(target, k.shape[1], seed=12)
    kv.check()


def test_beam_search_with_a_quantized_pool_inside_its_window_equals_dynamic_cache():
    """Every token stays inside the full-precision residual window, so a quantized PagedCache must reproduce
    DynamicCache's beams exactly, although ``_select_rows`` forks and frees the rows every step."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from memos_ref.hf import PagedCache

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    ids = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(1))
    gen = dict(max_new_tokens=24, min_new_tokens=24, num_beams=3, do_sample=False, early_stopping=False)
    gen.update(return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        want = model.generate(ids, cache=DynamicCache(), **gen)
        for scheme in (KIVI(4, 16), PerTokenInt8()):
            kv = PagedKV(spec, 64, quant=scheme, residual_tokens=128, staging_blocks=64, prefix_caching=False)
            got = model.generate(ids, cache=PagedCache(kv), **gen)
            assert torch.equal(got.sequences, want.sequences), scheme
            # not one bit of any beam's score differs (an unquantized PagedCache gives identical scores too)
            assert torch.equal(got.sequences_scores, want.sequences_scores), scheme
            assert kv.pool.seals == 0


# ---------------------------------------------------------------------- items 10 and 16: bad arguments
def test_negative_start_is_refused_and_cannot_poison_the_prefix_cache():
    kv = PagedKV(KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32), 16)
    seq = kv.new_sequence()
    for layer in range(2):
        seq.append(layer, torch.randn(2, 16, 4), torch.randn(2, 16, 4))  # ids unknown: nothing registered
    seq.set_token_ids(list(range(8, 16)), start=8)
    before = _snapshot(kv, [seq])
    with pytest.raises(InvalidArgumentError, match="start"):
        seq.set_token_ids(list(range(8)), start=-8)  # used to insert the ids at position 8, shifting the rest
    assert _equal(_snapshot(kv, [seq]), before) and len(kv.prefix_cache) == 0
    assert kv.start_from_prefix([*range(16), 99]).num_tokens == 0


def _seq_env():
    kv = PagedKV(KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32), 16)
    seq = kv.new_sequence()
    for layer in range(2):
        seq.append(layer, torch.randn(2, 6, 4), torch.randn(2, 6, 4), list(range(6)) if layer == 0 else None)
    return kv, seq


K4 = torch.zeros(2, 1, 4)
BAD_SEQUENCE_CALLS = {
    "set_token_ids start<0": (lambda s: s.set_token_ids([1], start=-1), InvalidArgumentError),
    "set_token_ids start float": (lambda s: s.set_token_ids([1], start=1.0), ArgumentTypeError),
    "set_token_ids past end": (lambda s: s.set_token_ids([1, 2], start=5), ShapeError),
    "set_token_ids id str": (lambda s: s.set_token_ids(["a"]), ArgumentTypeError),
    "set_token_ids id < -1": (lambda s: s.set_token_ids([-5]), InvalidArgumentError),
    "set_token_ids not a list": (lambda s: s.set_token_ids(5), ArgumentTypeError),
    "truncate negative": (lambda s: s.truncate(-1), InvalidArgumentError),
    "truncate too long": (lambda s: s.truncate(7), InvalidArgumentError),
    "truncate str": (lambda s: s.truncate("2"), ArgumentTypeError),
    "truncate bool": (lambda s: s.truncate(True), ArgumentTypeError),
    "slot negative": (lambda s: s.slot(-1), InvalidArgumentError),
    "slot past end": (lambda s: s.slot(6), InvalidArgumentError),
    "slot_mapping reversed": (lambda s: s.slot_mapping(4, 2), InvalidArgumentError),
    "slot_mapping negative": (lambda s: s.slot_mapping(-2, 2), InvalidArgumentError),
    "slot_mapping past end": (lambda s: s.slot_mapping(0, 9), InvalidArgumentError),
    "append layer negative": (lambda s: s.append(-1, K4, K4), InvalidArgumentError),
    "append layer past end": (lambda s: s.append(2, K4, K4), InvalidArgumentError),
    "append layer float": (lambda s: s.append(0.0, K4, K4), ArgumentTypeError),
    "append key not a tensor": (lambda s: s.append(0, [[0.0]], K4), ArgumentTypeError),
    "append token_ids length": (lambda s: s.append(0, K4, K4, [1, 2]), ShapeError),
    "reserve negative": (lambda s: s.reserve(-1), InvalidArgumentError),
    "reserve float": (lambda s: s.reserve(1.5), ArgumentTypeError),
    "reserve ids length": (lambda s: s.reserve(2, [1]), ShapeError),
    "reserve ids str": (lambda s: s.reserve(1, ["x"]), ArgumentTypeError),
    "blocks_needed str": (lambda s: s.blocks_needed("1"), ArgumentTypeError),
    "to_dense layer": (lambda s: s.to_dense(5), InvalidArgumentError),
    "adopt_prefix non-empty": (lambda s: s.adopt_prefix([], []), KVCacheError),
}


@pytest.mark.parametrize("call", list(BAD_SEQUENCE_CALLS))
def test_bad_sequence_calls_raise_package_errors_and_change_nothing(call):
    fn, error = BAD_SEQUENCE_CALLS[call]
    kv, seq = _seq_env()
    before = _snapshot(kv, [seq])
    with pytest.raises(error) as info:
        fn(seq)
    assert isinstance(info.value, KVCacheError)
    assert _equal(_snapshot(kv, [seq]), before)
    kv.check()


BAD_ADOPT = {
    "block id out of range": (lambda kv, s: s.adopt_prefix([99], list(range(8))), InvalidBlockError),
    "block id str": (lambda kv, s: s.adopt_prefix(["0"], list(range(8))), ArgumentTypeError),
    "block not held": (lambda kv, s: s.adopt_prefix([15], list(range(8))), InvalidBlockError),
    "too few ids": (lambda kv, s: s.adopt_prefix([0], [0, 1]), ShapeError),
    "ids not ints": (lambda kv, s: s.adopt_prefix([0], [0.5, *range(7)]), ArgumentTypeError),
    "blocks not a list": (lambda kv, s: s.adopt_prefix(0, list(range(8))), ArgumentTypeError),
}


@pytest.mark.parametrize("call", list(BAD_ADOPT))
def test_bad_adopt_prefix_calls(call):
    fn, error = BAD_ADOPT[call]
    kv, other = _seq_env()
    seq = kv.new_sequence()
    before = _snapshot(kv, [seq, other])
    with pytest.raises(error):
        fn(kv, seq)
    assert _equal(_snapshot(kv, [seq, other]), before)
    kv.check()


def _alloc_env():
    alloc = BlockAllocator(4)
    alloc.allocate(2)
    return alloc


BAD_ALLOCATOR_CALLS = {
    "allocate negative": (lambda a: a.allocate(-1), InvalidArgumentError),
    "allocate float": (lambda a: a.allocate(1.0), ArgumentTypeError),
    "allocate str": (lambda a: a.allocate("1"), ArgumentTypeError),
    "free str": (lambda a: a.free("0"), ArgumentTypeError),
    "free float": (lambda a: a.free(0.0), ArgumentTypeError),
    "free bool": (lambda a: a.free(False), ArgumentTypeError),
    "free out of range": (lambda a: a.free(4), InvalidBlockError),
    "incref none": (lambda a: a.incref(None), ArgumentTypeError),
    "free_many bad id": (lambda a: a.free_many([0, "1"]), ArgumentTypeError),
    "free_many not iterable": (lambda a: a.free_many(3), ArgumentTypeError),
    "set_cacheable str flag": (lambda a: a.set_cacheable(0, "yes"), ArgumentTypeError),
    "set_cacheable bad id": (lambda a: a.set_cacheable(-1), InvalidBlockError),
}


@pytest.mark.parametrize("call", list(BAD_ALLOCATOR_CALLS))
def test_bad_allocator_calls(call):
    fn, error = BAD_ALLOCATOR_CALLS[call]
    alloc = _alloc_env()
    before = (list(alloc.refcount), list(alloc.state), alloc.free_blocks(), list(alloc.cacheable))
    with pytest.raises(error):
        fn(alloc)
    assert (list(alloc.refcount), list(alloc.state), alloc.free_blocks(), list(alloc.cacheable)) == before


def test_numpy_and_tensor_block_ids_are_accepted_as_ints():
    np = pytest.importorskip("numpy")
    alloc = BlockAllocator(4)
    (b,) = alloc.allocate(np.int64(1))
    alloc.incref(torch.tensor(b))
    alloc.free(np.int64(b))
    alloc.free(b)
    assert alloc.num_free == 4 and all(type(x) is int for x in alloc.free_blocks())


POOL_SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32)


def _pools():
    return {
        "plain": BlockPool(POOL_SPEC, 4),
        "int8": PagedKV(POOL_SPEC, 4, quant=PerTokenInt8(), prefix_caching=False).pool,
        "kivi": PagedKV(
            KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32),
            4,
            quant=KIVI(4, 16),
            prefix_caching=False,
        ).pool,
    }


def _kv1(pool):
    return torch.zeros(1, pool.spec.num_kv_heads, pool.spec.head_dim)


BAD_POOL_CALLS = {
    "write layer negative": (lambda p: p.write(-1, torch.tensor([0]), _kv1(p), _kv1(p)), InvalidArgumentError),
    "write layer past end": (lambda p: p.write(2, torch.tensor([0]), _kv1(p), _kv1(p)), InvalidArgumentError),
    "write slot past end": (lambda p: p.write(0, torch.tensor([10**4]), _kv1(p), _kv1(p)), InvalidArgumentError),
    "write slot below -1": (lambda p: p.write(0, torch.tensor([-2]), _kv1(p), _kv1(p)), InvalidArgumentError),
    "write float slots": (lambda p: p.write(0, torch.tensor([0.0]), _kv1(p), _kv1(p)), ArgumentTypeError),
    "write slots list": (lambda p: p.write(0, [0], _kv1(p), _kv1(p)), ArgumentTypeError),
    "write key list": (lambda p: p.write(0, torch.tensor([0]), [0.0], _kv1(p)), ArgumentTypeError),
    "gather layer": (lambda p: p.gather(5, torch.tensor([0]), 1), InvalidArgumentError),
    "gather too many tokens": (lambda p: p.gather(0, torch.tensor([0]), 10**3), InvalidArgumentError),
    "gather bad block": (lambda p: p.gather(0, torch.tensor([7]), 1), InvalidBlockError),
    "gather table list": (lambda p: p.gather(0, [0], 1), ArgumentTypeError),
    "copy_block str": (lambda p: p.copy_block("0", 1), ArgumentTypeError),
    "copy_block out of range": (lambda p: p.copy_block(0, 9), InvalidBlockError),
    "block float": (lambda p: p.block(1.0), ArgumentTypeError),
    "poison out of range": (lambda p: p.poison(-1), InvalidBlockError),
}


@pytest.mark.parametrize("pool_name", ["plain", "int8", "kivi"])
@pytest.mark.parametrize("call", list(BAD_POOL_CALLS))
def test_bad_pool_calls(call, pool_name):
    fn, error = BAD_POOL_CALLS[call]
    pool = _pools()[pool_name]
    snap = lambda: (  # noqa: E731
        [t.clone() for t in (pool.segments if not getattr(pool, "quantized", False) else pool.payload.values())],
        getattr(pool, "staging_slot", torch.zeros(0)).clone(),
    )
    before = snap()
    with pytest.raises(error):
        fn(pool)
    after = snap()
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(before[0], after[0]))
    assert torch.equal(before[1], after[1])


BAD_QUANT_CALLS = {
    "quantize list": (lambda: PerTokenInt8().quantize([[[1.0]]]), ArgumentTypeError),
    "quantize int tensor": (lambda: FP8E4M3().quantize(torch.ones(1, 1, 4, dtype=torch.int32)), KVCacheError),
    "kivi kind": (lambda: KIVI(4, 32).quantize(torch.ones(1, 32, 32), "keys"), InvalidArgumentError),
    "fp8 scale list": (lambda: FP8E4M3().quantize(torch.ones(2, 1, 4), scale=[1.0, 1.0]), ArgumentTypeError),
    "fp8 scale shape": (lambda: FP8E4M3().quantize(torch.ones(2, 1, 4), scale=torch.ones(3)), ShapeError),
    "int8 scale str": (lambda: PerTensorInt8(scale="0.1"), ArgumentTypeError),
    "int8 scale nan": (lambda: PerTensorInt8(scale=math.nan), KVCacheError),
    "fp8 saturation int": (lambda: FP8E4M3(saturation=1), KVCacheError),
    "kivi bits str": (lambda: KIVI("4"), KVCacheError),
    "dequantize tensor": (lambda: PerTokenInt8().dequantize(torch.ones(1, 1, 4)), ArgumentTypeError),
    "pack bits 3": (lambda: pack(torch.zeros(1, 8, dtype=torch.uint8), 3), InvalidArgumentError),
    "pack list": (lambda: pack([0, 1], 4), ArgumentTypeError),
    "unpack bits 0": (lambda: unpack(torch.zeros(1, 8, dtype=torch.uint8), 0), InvalidArgumentError),
    "pool scheme str": (lambda: PagedKV(SPEC, 4, quant="int8"), KVCacheError),
    "pool residual str": (lambda: PagedKV(SPEC, 4, quant=KIVI(4, 32), residual_tokens="64"), ArgumentTypeError),
    "pool staging negative": (lambda: PagedKV(SPEC, 4, quant=KIVI(4, 32), staging_blocks=-1), KVCacheError),
    "pool layer_scales list": (
        lambda: PagedKV(SPEC, 4, quant=PerTensorInt8(), layer_scales=[[0.1, 0.1]] * 2),
        ArgumentTypeError,
    ),
}


@pytest.mark.parametrize("call", list(BAD_QUANT_CALLS))
def test_bad_quantizer_calls(call):
    fn, error = BAD_QUANT_CALLS[call]
    with pytest.raises(error) as info:
        fn()
    assert isinstance(info.value, KVCacheError)
    assert "expected" in str(info.value) or "must" in str(info.value)


BAD_KV_CALLS = {
    "new_sequence salt int": (lambda kv: kv.new_sequence(cache_salt=3), ArgumentTypeError),
    "start_from_prefix str": (lambda kv: kv.start_from_prefix("abc"), ArgumentTypeError),
    "start_from_prefix floats": (lambda kv: kv.start_from_prefix([1.5, 2.0]), ArgumentTypeError),
    "lookup none": (lambda kv: kv.prefix_cache.lookup(None), ArgumentTypeError),
}


@pytest.mark.parametrize("call", list(BAD_KV_CALLS))
def test_bad_paged_kv_calls(call):
    fn, error = BAD_KV_CALLS[call]
    kv, seq = _seq_env()
    before = _snapshot(kv, [seq])
    n = len(kv.sequences)
    with pytest.raises(error):
        fn(kv)
    assert _equal(_snapshot(kv, [seq]), before) and len(kv.sequences) == n


USE_AFTER_FREE = {
    "append": lambda s: s.append(0, K4, K4),
    "reserve": lambda s: s.reserve(1),
    "fork": lambda s: s.fork(),
    "truncate": lambda s: s.truncate(0),
    "set_token_ids": lambda s: s.set_token_ids([]),
    "adopt_prefix": lambda s: s.adopt_prefix([], []),
    "slot_mapping": lambda s: s.slot_mapping(0, 0),
    "to_dense": lambda s: s.to_dense(0),
    "mark_written": lambda s: s.mark_written(),
    "blocks_needed": lambda s: s.blocks_needed(1),
    "seal_idle": lambda s: s.seal_idle(),
}


@pytest.mark.parametrize("call", list(USE_AFTER_FREE))
def test_use_after_free_raises_its_own_error(call):
    kv, seq = _seq_env()
    seq.free()
    before = _snapshot(kv, [seq])
    with pytest.raises(UseAfterFreeError, match="freed"):
        USE_AFTER_FREE[call](seq)
    assert _equal(_snapshot(kv, [seq]), before)
    seq.free()  # freeing twice stays harmless
    assert kv.allocator.num_active == 0


# ---------------------------------------------------------------------- item 5: random sharing, exact windows
OPS = st.lists(
    st.tuples(st.sampled_from(["append", "fork", "free", "truncate", "idle", "hit"]), st.integers(0, 10**6)),
    min_size=1,
    max_size=25,
)


class _Entry:
    """A live sequence with the keys written to it and the first position guaranteed exact (inside the window,
    never sealed: an idle seal, a truncation back behind the window, or an adopted cached prefix move it)."""

    def __init__(self, seq, keys: list[torch.Tensor], ids: list[int], exact_from: int = 0) -> None:
        self.seq, self.keys, self.ids, self.exact_from = seq, keys, ids, exact_from


@settings(max_examples=25, deadline=None)
@given(ops=OPS, name=st.sampled_from(list(AGING)))
def test_random_sharing_never_changes_a_token_inside_its_window(ops, name):
    """Random forks, appends, frees, truncations, idle seals and prefix hits over an aging pool: every live
    sequence reads the tokens inside its residual window exactly as written, the window bookkeeping agrees
    with the invariant checker, and once everything is freed no staging slot or window hold is left."""
    kv = _kv(name, num_blocks=40, prefix_caching=True, residual_tokens=64, staging_blocks=40)
    live: list[_Entry] = []
    g = torch.Generator().manual_seed(len(ops))
    fresh_ids = iter(range(10**6))

    def add_tokens(e: _Entry, n: int) -> None:
        new_ids = [next(fresh_ids) for _ in range(n)]  # unique: equal id chains mean equal contents
        x = [torch.randn(2, n, 32, generator=g) * 2 for _ in range(2)]
        before = (list(e.seq.block_table), e.seq.num_tokens)
        try:
            for layer in range(2):
                e.seq.append(layer, x[layer], x[layer], new_ids if layer == 0 else None)
        except KVCacheError:  # out of blocks or staging: refused before anything changed
            assert (list(e.seq.block_table), e.seq.num_tokens) == before and e.seq.caught_up
            return
        e.keys = [torch.cat([e.keys[layer], x[layer]], dim=1) for layer in range(2)]
        e.ids.extend(new_ids)

    for op, r in ops:
        if op == "append" or not live:
            if not live or r % 3 == 0:
                live.append(_Entry(kv.new_sequence(), [torch.zeros(2, 0, 32)] * 2, []))
            add_tokens(live[r % len(live)], 1 + r % 40)
        elif op == "fork":
            e = live[r % len(live)]
            live.append(_Entry(e.seq.fork(), list(e.keys), list(e.ids), e.exact_from))
        elif op == "free":
            live.pop(r % len(live)).seq.free()
        elif op == "truncate":
            e = live[r % len(live)]
            n = r % (e.seq.num_tokens + 1)
            e.exact_from = max(e.exact_from, min(n, e.seq.window_start * 32))  # sealed blocks back in the window
            e.seq.truncate(n)
            e.keys, e.ids = [k[:, :n] for k in e.keys], e.ids[:n]
        elif op == "idle":
            e = live[r % len(live)]
            e.seq.seal_idle()
            e.exact_from = max(e.exact_from, e.seq.num_tokens // 32 * 32)
        else:
            src = live[r % len(live)]
            hit = kv.start_from_prefix([*src.ids, -1])
            n = hit.num_tokens
            live.append(_Entry(hit, [k[:, :n] for k in src.keys], src.ids[:n], exact_from=n))
            for layer in range(2):  # cached blocks are sealed: the same tokens, within quantization error
                assert torch.allclose(hit.to_dense(layer)[0], src.keys[layer][:, :n], atol=3.0)
        kv.check()
        for e in live:
            lo = max(e.seq.window_start * 32, e.exact_from)
            for layer in range(2):
                k, _ = e.seq.to_dense(layer)
                assert torch.equal(k[:, lo:], e.keys[layer][:, lo:]), (op, e.seq)
    for e in live:
        e.seq.free()
    kv.check()
    assert kv.pool.staged_blocks == 0 and int(kv.pool.window_holds.abs().sum()) == 0


# ---------------------------------------------------------------------- token ids beyond 64 bits
HUGE_IDS = [2**63, 2**64, 2**70]
SMALL = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, dtype=torch.float32)


@pytest.mark.parametrize("huge", HUGE_IDS)
def test_token_ids_beyond_int64_are_refused_before_any_change(huge):
    kv = PagedKV(SMALL, 16)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        kv.start_from_prefix([huge] * 20)
    assert len(kv.sequences) == 0 and kv.allocator.num_active == 0  # no sequence left behind
    with pytest.raises(InvalidArgumentError, match="token ids"):
        kv.prefix_cache.lookup([1] * 8 + [huge] * 9)
    seq = kv.new_sequence()
    for layer in range(2):
        seq.append(layer, torch.ones(2, 8, 8), torch.ones(2, 8, 8))
    before = _snapshot(kv, [seq])
    with pytest.raises(InvalidArgumentError, match="token ids"):
        seq.set_token_ids([huge] + [1] * 7)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        seq.append(0, torch.ones(2, 8, 8), torch.ones(2, 8, 8), [huge] * 8)
    assert _equal(before, _snapshot(kv, [seq]))
    seq.set_token_ids([5] * 8)  # the sequence still works
    for layer in range(2):
        seq.append(layer, torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    assert seq.num_registered == 1 and seq.num_tokens == 9
    kv.check()


def test_largest_int64_token_id_is_accepted():
    kv = PagedKV(SMALL, 16)
    seq = kv.new_sequence()
    for layer in range(2):
        seq.append(layer, torch.ones(2, 8, 8), torch.ones(2, 8, 8), [2**63 - 1] * 8 if layer == 0 else None)
    assert seq.num_registered == 1


def test_uint64_token_tensors_beyond_int64_are_refused():
    from memos_ref.hf import PagedCache

    kv = PagedKV(SMALL, 16)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        PagedCache.from_prefix(kv, torch.full((1, 12), 2**63, dtype=torch.uint64))
    assert len(kv.sequences) == 0 and kv.allocator.num_active == 0
    cache = PagedCache(kv)
    for layer in range(2):
        cache.update(torch.ones(1, 2, 8, 8), torch.ones(1, 2, 8, 8), layer)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        cache.set_token_ids(torch.full((1, 8), 2**63, dtype=torch.uint64))
    assert cache.sequences[0].token_ids == [-1] * 8


# ---------------------------------------------------------------------- values a quantized pool cannot encode
ONE = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=8, dtype=torch.float32)
QUANTS = {"fp8": FP8E4M3, "int8_token": PerTokenInt8, "int8_tensor": lambda: PerTensorInt8(scale=0.1)}


@pytest.mark.parametrize("residual", [0, 8])
@pytest.mark.parametrize("name", sorted(QUANTS))
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("kind", ["key", "value"])
def test_quantized_pool_refuses_non_finite_kv_and_changes_nothing(kind, bad, name, residual):
    kv = PagedKV(ONE, 4, quant=QUANTS[name](), residual_tokens=residual, prefix_caching=False)
    seq = kv.new_sequence()
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0))
    seq.append(0, x, x)
    before, dense = _snapshot(kv, [seq]), seq.to_dense(0)
    y = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(1))
    k, v = y.clone(), y.clone()
    (k if kind == "key" else v)[0, 0, 3] = bad
    with pytest.raises(InvalidArgumentError, match=f"layer 0 {kind}: found a non-finite"):
        seq.append(0, k, v)
    assert _equal(before, _snapshot(kv, [seq]))
    assert all(torch.equal(a, b) for a, b in zip(dense, seq.to_dense(0)))  # earlier tokens still read back
    slots = torch.tensor([5])
    with pytest.raises(InvalidArgumentError, match="non-finite"):
        kv.pool.write(0, slots, k.transpose(0, 1), v.transpose(0, 1))
    assert _equal(before, _snapshot(kv, [seq]))


def test_per_token_int8_refuses_an_absmax_its_fp16_scale_cannot_hold():
    q = PerTokenInt8()
    limit = 127.0 * 65504.0
    ok = torch.tensor([[[limit, 5.0, -3.0, 1.0]]])
    assert torch.isfinite(q.dequantize(q.quantize(ok))).all()
    for big in (1.0e7, -1.0e7, 3.0e38):
        x = torch.tensor([[[big, 5.0, -3.0, 1.0]]])
        with pytest.raises(InvalidArgumentError, match="127 \\* 65504"):
            q.quantize(x)


@pytest.mark.parametrize("residual", [0, 8])
def test_int8_token_pool_refuses_an_absmax_beyond_its_scale_before_writing(residual):
    kv = PagedKV(ONE, 4, quant=PerTokenInt8(), residual_tokens=residual, prefix_caching=False)
    seq = kv.new_sequence()
    x = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(0))
    seq.append(0, x, x)
    before = _snapshot(kv, [seq])
    k = torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(1))
    k[0, 0, 0] = 1.0e7
    with pytest.raises(InvalidArgumentError, match="layer 0 key: absmax"):
        seq.append(0, k, k.clone().clamp(-1, 1))
    assert _equal(before, _snapshot(kv, [seq]))
    k[0, 0, 0] = 127.0 * 65504.0  # the largest value it can hold reads back finite
    seq.append(0, k, k)
    for _ in range(8):  # push the token out of any residual window so it is sealed
        seq.append(0, x[:, :1], x[:, :1])
    got = seq.to_dense(0)[0]
    assert torch.isfinite(got).all() and float(got[0, 2, 0]) == pytest.approx(127.0 * 65504.0, rel=1e-2)
