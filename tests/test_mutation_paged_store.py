"""PagedKV.start_from_prefix (issue 30's survivors in memos_ref/paged/store.py): the argument a bad prompt is refused
by, the salt the new sequence keeps, and the part of the tiers below the device — what the tier hook hears
(``touch``) and is asked (``extend_prefix``), how the blocks it reloads join the device prefix without hashing the
prompt again, and that a failing hook leaves no reference behind.

The tier is a :class:`~memos_ref.paged.store.TierHook` test double holding K/V by prefix hash; the oracles are
:func:`block_hashes` of the prompt, the K/V tensors the test wrote and the allocator's counts before the call."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, InvariantError
from memos_ref.paged import PagedKV, block_hashes
from memos_ref.paged.prefix import PrefixCache
from memos_ref.paged.store import TierHook
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V [H, n, D]


def _random_kv(gen: torch.Generator, n: int) -> Layers:
    """Random K/V of ``n`` tokens for every layer."""
    return [tuple(torch.randn(2, SPEC.num_kv_heads, n, SPEC.head_dim, generator=gen).unbind(0)) for _ in range(2)]


def _write(seq, ids: list[int], layers: Layers) -> None:
    """Append ``ids`` with their K/V ``layers`` to every layer of ``seq``."""
    for layer, (k, v) in enumerate(layers):
        seq.append(layer, k, v, ids)


def _cat(*parts: Layers) -> Layers:
    """The per-layer K/V of consecutive token runs, joined along the tokens."""
    return [tuple(torch.cat([p[layer][i] for p in parts], dim=1) for i in range(2)) for layer in range(2)]


def _assert_kv(seq, want: Layers) -> None:
    """The sequence's dense K/V of every layer equals ``want``."""
    for layer, (k, v) in enumerate(want):
        got_k, got_v = seq.to_dense(layer)
        torch.testing.assert_close(got_k, k, rtol=0, atol=0)
        torch.testing.assert_close(got_v, v, rtol=0, atol=0)


class _Tier:
    """A tier below the device (a :class:`TierHook`): K/V of full blocks by prefix hash. ``extend_prefix`` reloads
    the blocks continuing the device prefix into fresh device blocks, registered under their hashes, one
    reference each for the caller (what ``memos_ref.tiering.TierManager`` does); every call is recorded."""

    driven_by_thread = False

    def __init__(self, kv: PagedKV, fail: BaseException | None = None) -> None:
        self.kv, self.fail = kv, fail
        self.held: dict[bytes, Layers] = {}  # prefix hash -> per layer K/V [H, T, D]
        self.touched: list[list[int]] = []
        self.asked: list[tuple[list[int], str | None, list[int]]] = []

    def step(self) -> object:
        return {}

    def touch(self, blocks, now=None) -> None:
        self.touched.append(list(blocks))

    def extend_prefix(self, token_ids, cache_salt, device_blocks) -> list[int]:
        self.asked.append((list(token_ids), cache_salt, list(device_blocks)))
        if self.fail is not None:
            raise self.fail
        ids = list(token_ids)
        chain = block_hashes(ids, T, cache_salt=cache_salt)[: (len(ids) - 1) // T]  # one token is always left
        out: list[int] = []
        for i in range(len(device_blocks), len(chain)):
            layers = self.held.get(chain[i])
            if layers is None:
                break
            (block,) = self.kv.allocator.allocate(1)
            slots = torch.arange(block * T, (block + 1) * T)
            for layer, (k, v) in enumerate(layers):
                self.kv.pool.write(layer, slots, k.transpose(0, 1), v.transpose(0, 1))  # [T, H, D]
            self.kv.prefix_cache.register(block, chain[i], ids[i * T : (i + 1) * T])
            out.append(block)
        return out


def _tiered(salt: str | None, seed: int) -> tuple[PagedKV, _Tier, list[int], Layers, int]:
    """A store whose device caches the prompt's block 0 (under ``salt``) and whose tier holds blocks 1 and 2.
    Returns the store, the tier, the prompt (3 full blocks and one token), the prompt's K/V of those 3 blocks and
    the device block holding block 0."""
    kv, gen = PagedKV(SPEC, 16), torch.Generator().manual_seed(seed)
    tier = _Tier(kv)
    assert isinstance(tier, TierHook)
    kv.tier_manager = tier
    prompt = [*range(300, 300 + 3 * T), 7]
    want = _random_kv(gen, 3 * T)
    src = kv.new_sequence(salt)
    _write(src, prompt[:T], [(k[:, :T], v[:, :T]) for k, v in want])
    first = src.block_table[0]
    src.free()  # block 0 stays cached on the device
    chain = block_hashes(prompt, T, cache_salt=salt)
    for i in (1, 2):
        tier.held[chain[i]] = [(k[:, i * T : (i + 1) * T], v[:, i * T : (i + 1) * T]) for k, v in want]
    return kv, tier, prompt, want, first


# ---------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ("abc", ArgumentTypeError, r"^token_ids: expected a sequence of int token ids, got str"),
        ([1, 2.5], ArgumentTypeError, r"^token_ids\[1\]: "),
        ([5, -2], InvalidArgumentError, r"^token_ids: token ids must lie in \[0, 2\*\*63\)"),
    ],
)
def test_a_bad_prompt_is_refused_by_the_name_token_ids_and_creates_no_sequence(bad, error, message):
    """A prompt start_from_prefix cannot take is refused naming the argument (``token_ids``, with the index of a
    bad element) before anything is created: no sequence is registered and no block is held."""
    kv = PagedKV(SPEC, 8)
    before = kv.allocator.stats()
    with pytest.raises(error, match=message):
        kv.start_from_prefix(bad)
    assert kv.sequences == {} and kv.allocator.stats() == before


def test_a_salted_start_registers_its_blocks_under_its_salt_only():
    """A sequence started from a prefix under a cache salt keeps that salt: the blocks it fills after the hit are
    registered under the salted chain (block_hashes with that salt), so the same prompt finds them under that
    salt and finds nothing without it or under another (tenant isolation)."""
    kv, gen = PagedKV(SPEC, 16), torch.Generator().manual_seed(1)
    ids = list(range(40, 40 + 3 * T))
    want = _random_kv(gen, 3 * T)
    src = kv.new_sequence("a")
    _write(src, ids[:T], [(k[:, :T], v[:, :T]) for k, v in want])
    src.free()
    seq = kv.start_from_prefix([*ids[: 2 * T], 1], cache_salt="a")
    assert seq.cache_salt == "a" and seq.num_tokens == T
    _write(seq, ids[T:], [(k[:, T:], v[:, T:]) for k, v in want])
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == block_hashes(ids, T, cache_salt="a")
    _assert_kv(seq, want)
    seq.free()
    assert kv.start_from_prefix([*ids, 1]).num_tokens == 0
    assert kv.start_from_prefix([*ids, 1], cache_salt="b").num_tokens == 0
    again = kv.start_from_prefix([*ids, 1], cache_salt="a")
    assert again.num_tokens == 3 * T
    _assert_kv(again, want)
    kv.check()


# ---------------------------------------------------------------------------------------------- the tiers
@pytest.mark.parametrize("salt", [None, "tenant-s"])
def test_a_prefix_continued_from_the_tiers_holds_every_block_and_the_hook_hears_the_device_hit(salt):
    """With a tier hook attached, the new sequence holds the device hit followed by the blocks the tiers reload —
    the prompt's K/V for all of them — and the hook is told the device blocks used (``touch``) and asked once,
    with the prompt, the salt and the device blocks, for the continuation."""
    kv, tier, prompt, want, first = _tiered(salt, seed=2)
    seq = kv.start_from_prefix(prompt, cache_salt=salt)
    assert seq.num_tokens == 3 * T and seq.block_table[0] == first and len(seq.block_table) == 3
    assert seq.token_ids == prompt[: 3 * T]
    _assert_kv(seq, want)
    assert tier.touched == [[first]]
    assert tier.asked == [(prompt, salt, [first])]
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == block_hashes(prompt, T, cache_salt=salt)
    kv.check()
    seq.free()
    again = kv.start_from_prefix(prompt, cache_salt=salt)  # all three are on the device now
    assert again.block_table[0] == first and again.num_tokens == 3 * T
    _assert_kv(again, want)
    kv.check()


def test_a_prefix_continued_from_the_tiers_hashes_the_prompt_once(monkeypatch):
    """The blocks reloaded from the tiers join the lookup's hit with its hash chain: the device lookup hashes the
    prompt (one PrefixCache.hashes call) and the sequence adopting the joined blocks hashes none of it again."""
    kv, _tier, prompt, want, _first = _tiered("s", seed=3)
    calls: list[int] = []
    real = PrefixCache.hashes

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PrefixCache, "hashes", counting)
    seq = kv.start_from_prefix(prompt, cache_salt="s")
    assert seq.num_tokens == 3 * T and len(calls) == 1
    monkeypatch.undo()
    _assert_kv(seq, want)
    kv.check()


def test_a_failing_tier_hook_leaves_no_sequence_and_no_reference_behind():
    """When the tier hook raises while continuing the prefix, start_from_prefix raises that error and the device
    hit's references go back: the allocator's counts are those before the call, no sequence is left, and the
    cached block still serves a later start."""
    kv, tier, prompt, want, first = _tiered(None, seed=4)
    tier.fail = OSError("tier unreachable")
    before = kv.allocator.stats()
    with pytest.raises(OSError, match=r"^tier unreachable$"):
        kv.start_from_prefix(prompt)
    assert kv.allocator.stats() == before and kv.sequences == {}
    assert kv.allocator.refcount[first] == 0 and kv.allocator.hash_of(first) == block_hashes(prompt, T)[0]
    kv.check()
    tier.fail = None
    seq = kv.start_from_prefix(prompt)
    assert seq.block_table[0] == first and seq.num_tokens == 3 * T
    _assert_kv(seq, want)
    kv.check()


def test_the_stores_check_compares_its_sequences_token_ids_with_its_prefix_cache():
    """``PagedKV.check`` hands the checker its prefix cache: a sequence whose ids for a registered block were
    changed behind the store's back (here by hand) no longer matches the ids the cache verified, and the check
    names the sequence and the block."""
    kv = PagedKV(SPEC, 8, fingerprint="store-check")
    seq = kv.new_sequence()
    ids = list(range(100, 100 + T + 3))
    _write(seq, ids, _random_kv(torch.Generator().manual_seed(3), len(ids)))
    kv.check()
    (block, _) = seq.block_table
    seq.token_ids[2] = 7  # one id of the registered first block
    with pytest.raises(InvariantError) as caught:
        kv.check()
    assert str(caught.value) == f"sequence {seq.seq_id} holds prefix-cached block {block} with other token ids"


def test_a_sequence_or_store_of_the_wrong_parts_is_refused_naming_the_argument():
    """``SequenceCache``, ``PagedKV`` and ``new_sequence`` check their arguments' types before building anything:
    each refusal names the argument, the types it takes and what was given, and no sequence is registered."""
    from memos_ref.paged import SequenceCache

    kv = PagedKV(SPEC, 4, fingerprint="parts")
    cases = [
        (
            lambda: SequenceCache(kv.pool, kv.allocator, cache_salt=5),
            "cache_salt: expected str or NoneType, got int (5)",
        ),
        (lambda: SequenceCache(kv.pool, "alloc"), "allocator: expected BlockAllocator, got str ('alloc')"),
        (
            lambda: SequenceCache(kv.pool, kv.allocator, 7),
            "prefix_cache: expected PrefixCache or NoneType, got int (7)",
        ),
        (lambda: kv.new_sequence(cache_salt=b"t"), "cache_salt: expected str or NoneType, got bytes (b't')"),
        (lambda: PagedKV("spec", 4), "spec: expected KVSpec, got str ('spec')"),
    ]
    for build, message in cases:
        with pytest.raises(ArgumentTypeError) as caught:
            build()
        assert str(caught.value) == message
    assert not kv.sequences and kv.allocator.num_available == 4
    assert kv.new_sequence(cache_salt="tenant").cache_salt == "tenant"


def test_a_store_sized_by_a_byte_budget_holds_the_whole_blocks_that_fit():
    """``PagedKV(spec, byte_budget=...)`` passes the budget on: the pool and the allocator hold as many whole
    blocks as the bytes pay for (a remainder smaller than a block buys nothing). ``segments`` and ``device`` reach
    the pool too."""
    kv = PagedKV(SPEC, byte_budget=5 * SPEC.bytes_per_block + SPEC.bytes_per_block - 1)
    assert kv.pool.num_blocks == kv.allocator.num_blocks == 5
    split = PagedKV(SPEC, 5, segments=2)
    assert [s.shape[0] for s in split.pool.segments] == [3, 2] and split.allocator.num_blocks == 5
    assert PagedKV(SPEC, 4, device="meta").pool.device == torch.device("meta")


def test_each_way_of_building_the_pool_refuses_the_options_of_the_others_naming_them():
    """``PagedKV`` builds its pool one of three ways — the pool given, one a quantization scheme builds, or a plain
    ``BlockPool`` — and refuses an option that belongs to another way, naming every such option given (a
    ``ConfigError``), a pool that is not one, or one built for another spec. The pool given is used as it is."""
    from memos_ref.paged import BlockPool
    from memos_ref.quant import FP8E4M3

    pool = BlockPool(SPEC, 4)
    scales = torch.ones(2)
    whole = "pool= is the whole storage: drop {} (they size or build a pool)"
    refused = [
        (dict(pool=pool, num_blocks=4), ConfigError, whole.format(["num_blocks"])),
        (dict(pool=pool, byte_budget=10**6), ConfigError, whole.format(["byte_budget"])),
        (dict(pool=pool, quant=FP8E4M3()), ConfigError, whole.format(["quant"])),
        (dict(pool=pool, residual_tokens=8), ConfigError, whole.format(["residual_tokens"])),
        (dict(pool=pool, staging_blocks=2), ConfigError, whole.format(["staging_blocks"])),
        (dict(pool=pool, layer_scales=scales), ConfigError, whole.format(["layer_scales"])),
        (dict(pool=pool, segments=2), ConfigError, whole.format(["segments"])),
        (dict(pool=pool, num_blocks=4, staging_blocks=2, segments=2), ConfigError,
         whole.format(["num_blocks", "staging_blocks", "segments"])),
        (dict(pool="pool"), ArgumentTypeError,
         "pool: expected a KVPool (BlockPool, QuantizedBlockPool...), got <class 'str'>"),
        (dict(num_blocks=4, residual_tokens=8), ConfigError,
         "['residual_tokens'] configure a quantized pool: pass quant=<scheme> too"),
        (dict(num_blocks=4, staging_blocks=2, layer_scales=scales), ConfigError,
         "['staging_blocks', 'layer_scales'] configure a quantized pool: pass quant=<scheme> too"),
        (dict(num_blocks=4, quant="fp8"), ConfigError,
         "quant: expected a memos_ref.quant scheme (one that builds its pool), got 'fp8'"),
        (dict(num_blocks=4, quant=FP8E4M3(), segments=2), ConfigError,
         "a quantized pool is sized by num_blocks and has one segment"),
        (dict(quant=FP8E4M3(), byte_budget=10**6), ConfigError,
         "a quantized pool is sized by num_blocks and has one segment"),
    ]  # fmt: skip
    for options, error, message in refused:
        with pytest.raises(error) as caught:
            PagedKV(SPEC, **options)
        assert str(caught.value) == message, options
    other = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
    with pytest.raises(
        ConfigError, match=r"^pool was built for KVSpec\(num_layers=3, .* not for this PagedKV's KVSpec"
    ):
        PagedKV(SPEC, pool=BlockPool(other, 4))
    assert PagedKV(SPEC, pool=pool).pool is pool
    quantized = PagedKV(SPEC, 4, quant=FP8E4M3(), residual_tokens=8, staging_blocks=2)
    assert quantized.pool.num_blocks == 4 and quantized.pool.tracks_windows
