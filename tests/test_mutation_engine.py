"""The engine's scheduling policy (issue 30's survivors): outputs do not change when admission forgets the running
rows' next tokens or when preemption picks another victim, so only the policy shows it. The oracle is block
arithmetic done here from the block size and the prompt lengths."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from memos_ref.engine import Engine, Request
from memos_ref.errors import ConfigError, InvalidArgumentError, OutOfBlocksError, StagingFullError, StateError
from memos_ref.paged import PagedKV
from memos_ref.quant import PerTokenInt8
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import HostMemoryBackend
from memos_ref.tiering.manager import TierManager
from memos_ref.tiering.store import Tier, TierStore

T = 8


@pytest.fixture(scope="module")
def model():
    from memos_ref.model import load_model

    return load_model()  # the shipped tiny weights


def _prompt(n: int, salt: int) -> list[int]:
    return [1 + (salt * 7 + i) % 50 for i in range(n)]


def test_admission_keeps_room_for_the_running_rows_next_tokens(model):
    """4 blocks: R1 (16 tokens, 2 full blocks) runs and its next token needs a 3rd block. R2 (15 tokens) needs 2
    blocks, and 2 are free, but admitting it would leave R1 no block for its next token (the next decode step
    would preempt R2 at once). So R2 waits, nothing is ever preempted, and both finish."""
    kv = PagedKV(model.kv_spec(block_size=T), 4, prefix_caching=False)
    engine = Engine(model, kv, max_batch=4)
    r1 = engine.submit(Request(_prompt(16, 1), 3))
    r2 = engine.submit(Request(_prompt(15, 2), 3))
    engine.step()
    assert [r for r, _ in engine.running] == [r1] and list(engine.waiting) == [r2]
    assert engine.deferred_admissions >= 1 and engine.preemptions == 0
    engine.run()
    assert r1.finished and r2.finished and not r1.failed and not r2.failed
    assert engine.preemptions == 0 and r2.stats.preemptions == 0
    assert len(r1.output) == 3 and len(r2.output) == 3
    assert kv.allocator.num_active == 0


def test_a_decode_step_short_of_blocks_preempts_the_newest_request_first(model):
    """6 blocks, three 9-token prompts (2 blocks each) all admitted. After 7 decode steps every row holds 16
    tokens and needs a new block, none is free: the most recently admitted request (R3) is preempted and
    re-queued at the head of the queue; R1 and R2 keep running."""
    kv = PagedKV(model.kv_spec(block_size=T), 6, prefix_caching=False)
    engine = Engine(model, kv, max_batch=4)
    reqs = [engine.submit(Request(_prompt(9, i), 12)) for i in range(3)]
    engine.step()
    assert [r for r, _ in engine.running] == reqs  # admission order
    for _ in range(20):
        if engine.preemptions:
            break
        engine.step()
    assert engine.preemptions == 1
    assert [r.stats.preemptions for r in reqs] == [0, 0, 1]
    assert [r for r, _ in engine.running] == reqs[:2] and engine.waiting[0] is reqs[2]
    assert all(seq.num_tokens == 17 for _, seq in engine.running)  # the step after the preemption ran
    engine.run()
    assert all(r.finished and not r.failed and len(r.output) == 12 for r in reqs)
    assert kv.allocator.num_active == 0


# ---------------------------------------------------------------------------------------------------------------
# Cheap policy tests with a fake model (an honest oracle for scheduling: it writes every layer of the step it is
# given, like the package forward, and returns logits chosen by the test). The pool lives on ``meta``: no memory.
# ---------------------------------------------------------------------------------------------------------------
V = 50
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=T)


class _Fake:
    """Writes every layer of each step (``prepare_step(...).mark_written_by_kernel()``) and returns ``logits(...)``
    (default: token 7 wins); ``hook(input_ids, cache, position_ids)`` may raise to play a failing forward."""

    def __init__(self, logits=None, hook=None) -> None:
        self.config = type("Config", (), {"vocab_size": V, "num_hidden_layers": SPEC.num_layers})()
        self.logits, self.hook = logits, hook

    def __call__(self, input_ids, cache, *, position_ids):
        if self.hook is not None:
            self.hook(input_ids, cache, position_ids)
        cache.prepare_step(*input_ids.shape).mark_written_by_kernel()
        out = torch.zeros(*input_ids.shape, V)
        if self.logits is None:
            out[..., 7] = 1.0
        else:
            out[...] = self.logits
        return out


def _kv(num_blocks: int) -> PagedKV:
    return PagedKV(SPEC, num_blocks, device="meta", prefix_caching=False)


def test_admission_never_runs_more_than_max_batch_rows():
    """max_batch=2 and three requests: one step admits exactly two; the third waits."""
    engine = Engine(_Fake(), _kv(16), max_batch=2)
    reqs = [engine.submit(Request(_prompt(5, i), 4)) for i in range(3)]
    engine.step()
    assert [r for r, _ in engine.running] == reqs[:2] and list(engine.waiting) == reqs[2:]
    engine.run()
    assert all(r.output == [7] * 4 for r in reqs)


def test_every_failed_request_is_counted():
    """Two requests whose prefill raises fail (error kept, blocks freed) and ``failures`` counts both; the third
    finishes."""

    def hook(ids, cache, pos):
        if ids.shape == (1, 4):  # the bad prompts' prefill (ids live on meta: shapes only)
            raise ValueError("bad row")

    kv = _kv(16)
    engine = Engine(_Fake(hook=hook), kv, max_batch=4)
    bad = [engine.submit(Request([13, 1, 2, 4], 3)) for _ in range(2)]
    good = engine.submit(Request([1, 2, 3], 3))
    engine.step()  # a failed admission does not stop the loop: the good request starts in the same step
    assert [r for r, _ in engine.running] == [good] and all(r.failed for r in bad)
    engine.run()
    assert good.error is None, repr(good.error)
    assert engine.failures == 2 and all(isinstance(r.error, ValueError) for r in bad)
    assert good.output == [7, 7, 7] and not good.failed
    assert kv.allocator.num_active == 0


def test_ttft_is_the_time_from_arrival_to_the_first_token():
    """``stats.ttft_s`` lies between 0 and the time elapsed since the request arrived."""
    engine = Engine(_Fake(), _kv(16))
    r = engine.submit(Request([1, 2, 3], 2))
    engine.run()
    assert 0 <= r.stats.ttft_s <= time.perf_counter() - r.arrived


def _one_token(logits: torch.Tensor, temperature: float, seeds=range(16)) -> list[int]:
    engine = Engine(_Fake(logits=logits), _kv(16), max_batch=16)
    reqs = [engine.submit(Request([1, 2, 3], 1, temperature=temperature, seed=s)) for s in seeds]
    engine.run()
    assert not any(r.failed for r in reqs), [r.error for r in reqs]
    return [r.output[0] for r in reqs]


def test_a_temperature_of_exactly_the_greedy_bound_samples():
    """Only temperatures *below* GREEDY_TEMPERATURE are greedy: at exactly that temperature two tied best tokens are
    both drawn over 16 seeds (greedy would always give the first)."""
    from memos_ref.engine import GREEDY_TEMPERATURE

    logits = torch.zeros(V)
    logits[7] = logits[9] = 1.0
    assert set(_one_token(logits, GREEDY_TEMPERATURE)) == {7, 9}


def test_a_low_temperature_concentrates_on_the_best_token():
    """Temperature 0.05 with a logit margin of 1 (e^20 odds): every seed draws the best token."""
    logits = torch.zeros(V)
    logits[7] = 1.0
    assert _one_token(logits, 0.05) == [7] * 16


def test_sampling_huge_logits_at_a_small_temperature_does_not_overflow():
    """Logits of 1e36 at temperature 1e-3: shifted by their max before scaling, nothing overflows to inf/NaN and
    the best token is drawn."""
    logits = torch.zeros(V)
    logits[7] = 1e36
    assert _one_token(logits, 1e-3, seeds=range(2)) == [7, 7]


@pytest.mark.parametrize(("prompt_len", "num_blocks", "needed"), [(16, 2, 3), (15, 1, 2)])
def test_a_prompt_too_long_for_the_pool_names_the_blocks_it_needs(prompt_len, num_blocks, needed):
    """The refusal carries the blocks for the prompt plus its first generated token, and the pool's size."""
    engine = Engine(_Fake(), _kv(num_blocks))
    with pytest.raises(OutOfBlocksError) as info:
        engine.submit(Request(_prompt(prompt_len, 0), 2))
    assert (info.value.needed, info.value.available) == (needed, num_blocks)
    assert not engine.waiting


def test_a_prompt_too_long_for_the_staging_slab_names_needed_and_capacity():
    """A quantized pool with 2 staging blocks refuses a 24-token prompt (3 blocks) with needed=3, capacity=2."""
    kv = PagedKV(SPEC, 16, quant=PerTokenInt8(), residual_tokens=T, staging_blocks=2, prefix_caching=False)
    engine = Engine(_Fake(), kv)
    with pytest.raises(StagingFullError) as info:
        engine.submit(Request(_prompt(24, 0), 2))
    assert (info.value.needed, info.value.capacity) == (3, 2)
    assert not engine.waiting


def test_run_checks_max_steps_and_one_step_is_allowed():
    """``max_steps`` must be >= 1 (the error names it); 1 is accepted."""
    engine = Engine(_Fake(), _kv(4))
    with pytest.raises(InvalidArgumentError, match=r"^max_steps: expected an integer in >= 1, got 0"):
        engine.run(max_steps=0)
    assert engine.run(max_steps=1) == []


def test_run_gives_up_after_max_steps():
    """A request needing 10 steps, run for 3: ConfigError naming the 3 steps."""
    engine = Engine(_Fake(), _kv(4))
    engine.submit(Request([1, 2, 3], 10))
    with pytest.raises(ConfigError, match="after 3 steps"):
        engine.run(max_steps=3)


def test_run_raises_when_the_head_request_can_never_start_now():
    """All 4 blocks held outside the engine: a 7-token prompt (needs 1 block with its next token) can't start and
    nothing else runs, so run raises OutOfBlocksError(needed=1, available=0) at once instead of spinning."""
    kv = _kv(4)
    held = kv.allocator.allocate(4)
    engine = Engine(_Fake(), kv)
    other = engine.submit(Request(_prompt(7, 0), 3))
    engine.submit(Request(_prompt(30, 1), 3))
    with pytest.raises(OutOfBlocksError) as info:
        engine.run(max_steps=50)
    assert (info.value.needed, info.value.available) == (1, 0)
    assert engine.waiting[0] is other and engine.steps == 0
    kv.allocator.free_many(held)


def test_a_request_preempted_twice_counts_twice_and_recomputes_what_it_generated():
    """4 blocks, 3 held outside. A 5-token prompt fills its block after 4 tokens and is preempted; run then raises
    needing blocks for prompt + output + 1 = 10 tokens (2 blocks, 1 available). With one more block released it
    is readmitted, fills its 2 blocks at 16 tokens and is preempted again (needs 3 for 18, 2 available). Both
    preemptions are counted, on the request and the engine; once all blocks are back it finishes."""
    kv = _kv(4)
    held = kv.allocator.allocate(3)
    engine = Engine(_Fake(), kv)
    r = engine.submit(Request(_prompt(5, 0), 20))
    with pytest.raises(OutOfBlocksError) as info:
        engine.run(max_steps=50)
    assert (info.value.needed, info.value.available) == (2, 1) and len(r.output) == 4
    assert (r.stats.preemptions, engine.preemptions) == (1, 1)
    kv.allocator.free_many(held[:1])
    with pytest.raises(OutOfBlocksError) as info:
        engine.run(max_steps=50)
    assert (info.value.needed, info.value.available) == (3, 2) and len(r.output) == 12
    assert (r.stats.preemptions, engine.preemptions) == (2, 2)
    kv.allocator.free_many(held[1:])
    engine.run(max_steps=50)
    assert r.output == [7] * 20 and not r.failed and kv.allocator.num_active == 0
    # computed: each admission its prompt + output so far (5, 9, 17), each decode step one token (3 + 7 + 7)
    assert (r.stats.prompt_tokens, r.stats.reused_tokens, r.stats.computed_tokens) == (5, 0, 48)


def test_a_row_out_of_room_in_the_row_by_row_retry_waits_again_and_the_others_carry_on():
    """The batched decode step raises; the engine retries row by row and R2's solo step runs out of blocks (after
    it started writing). R2 is rolled back, freed and re-queued at the head (one preemption, not a failure); R1
    keeps running with a real latency recorded. Both then finish with every token."""
    state = {"armed": True}

    def hook(ids, cache, pos):
        if ids.shape[1] == 1 and ids.shape[0] > 1:
            raise RuntimeError("batched step fails")
        if ids.shape == (1, 1) and cache.sequences[0].num_tokens == 6 and state["armed"]:  # R2 alone
            state["armed"] = False
            cache.prepare_step(1, 1)  # started writing
            raise OutOfBlocksError(needed=1, available=0)

    kv = _kv(16)
    engine = Engine(_Fake(hook=hook), kv, max_batch=4)
    r1 = engine.submit(Request(_prompt(5, 1), 4))
    r2 = engine.submit(Request(_prompt(6, 2), 4))
    engine.step()  # admits both, then the batched decode fails; row by row: R1 decodes, R2 is out of room
    assert [r for r, _ in engine.running] == [r1] and list(engine.waiting) == [r2]
    assert (r2.stats.preemptions, engine.preemptions, engine.failures) == (1, 1, 0) and not r2.failed
    assert r1.stats.token_latencies_s and all(isinstance(x, float) for x in r1.stats.token_latencies_s)
    assert kv.allocator.num_active == 1  # only R1's block
    engine.run(max_steps=50)
    assert r1.output == [7] * 4 and r2.output == [7] * 4 and not r1.failed and not r2.failed
    assert kv.allocator.num_active == 0


def test_a_prompt_that_exactly_fills_the_pool_runs():
    """2 blocks of 8: a 15-token prompt plus its first generated token fill the pool exactly; it is admitted."""
    engine = Engine(_Fake(), _kv(2))
    r = engine.submit(Request(_prompt(15, 0), 1))
    engine.run(max_steps=5)
    assert r.output == [7] and not r.failed


def test_a_preempted_request_grown_past_the_pool_fails_and_the_next_one_starts_in_the_same_step():
    """2 blocks, max_batch 1: R (5 tokens) is preempted at 16 tokens; re-admitting it would need 3 blocks (its
    prompt, 12 generated tokens and the next), more than the pool, so it fails with OutOfBlocksError(3, 2) and R2,
    queued behind it, starts in that same step."""
    kv = _kv(2)
    engine = Engine(_Fake(), kv, max_batch=1)
    r = engine.submit(Request(_prompt(5, 0), 20))
    r2 = engine.submit(Request(_prompt(5, 1), 3))
    for _ in range(30):
        engine.step()
        if r.finished:
            break
    assert r.failed and isinstance(r.error, OutOfBlocksError) and len(r.output) == 12
    assert (r.error.needed, r.error.available) == (3, 2)
    assert [x for x, _ in engine.running] == [r2]
    engine.run(max_steps=5)
    assert r2.output == [7, 7, 7] and kv.allocator.num_active == 0


@pytest.mark.parametrize(("prompt_len", "admitted"), [(8, False), (7, True)])
def test_admission_needs_blocks_for_the_prompt_and_its_first_token(prompt_len, admitted):
    """One block available: a 7-token prompt (8 with its next token: 1 block) starts; an 8-token one (9: 2 blocks)
    waits, and every step it waits is counted once."""
    kv = _kv(2)
    held = kv.allocator.allocate(1)
    engine = Engine(_Fake(), kv)
    r = engine.submit(Request(_prompt(prompt_len, 0), 1 if admitted else 3))
    engine.step()
    engine.step()
    assert r.finished is admitted and engine.deferred_admissions == (0 if admitted else 2)
    kv.allocator.free_many(held)


def test_admission_counts_only_the_next_token_of_running_rows():
    """2 blocks: R1 (7 tokens) runs and its next token fits its block, so R2 (7 tokens, 1 block) starts too."""
    engine = Engine(_Fake(), _kv(2))
    reqs = [engine.submit(Request(_prompt(7, i), 5)) for i in range(2)]
    engine.step()
    assert engine.deferred_admissions == 0 and [r for r, _ in engine.running] == reqs


def test_a_prefill_short_of_room_waits_at_the_head_and_gives_its_blocks_back():
    """A prefill that raises a capacity error (the pool's, or the staging slab's when it could fit) is not the
    request's fault: its blocks go back, it stays at the head of the queue, each try is counted, and it runs later."""
    tries = {"n": 0}

    def hook(ids, cache, pos):
        if ids.shape[1] > 1 and tries["n"] < 2:
            tries["n"] += 1
            cache.prepare_step(*ids.shape)  # holds its blocks when it fails
            raise OutOfBlocksError(needed=1, available=0) if tries["n"] == 1 else StagingFullError("x", needed=1)

    kv = _kv(8)
    engine = Engine(_Fake(hook=hook), kv)
    r = engine.submit(Request(_prompt(9, 0), 2))
    engine.step()
    assert list(engine.waiting) == [r] and kv.allocator.num_active == 0 and engine.deferred_admissions == 1
    engine.step()
    assert list(engine.waiting) == [r] and kv.allocator.num_active == 0 and engine.deferred_admissions == 2
    engine.run(max_steps=5)
    assert r.output == [7, 7] and not r.failed and kv.allocator.num_active == 0


@pytest.mark.parametrize(("needed", "fails"), [(2, False), (3, True)])
def test_a_staging_shortfall_waits_only_when_the_slab_could_ever_hold_it(needed, fails):
    """2 staging blocks: a prefill refused for want of staging blocks waits at the head when it needs at most 2
    (others may free theirs); needing 3 it could never run, so it fails and the next request starts at once."""

    def hook(ids, cache, pos):
        if ids.shape == (1, 9):
            raise StagingFullError("staging full", needed=needed, capacity=2)

    kv = PagedKV(SPEC, 16, quant=PerTokenInt8(), residual_tokens=T, staging_blocks=2, prefix_caching=False)
    engine = Engine(_Fake(hook=hook), kv)
    r = engine.submit(Request(_prompt(9, 0), 2))
    r2 = engine.submit(Request(_prompt(5, 1), 3))
    engine.step()
    assert r.failed is fails and engine.deferred_admissions == (0 if fails else 1)
    assert list(engine.waiting) == ([] if fails else [r, r2])
    assert [x for x, _ in engine.running] == ([r2] if fails else [])


def test_a_prompt_found_in_the_prefix_cache_is_counted_as_reused_not_computed():
    """A repeated 16-token prompt reuses cached blocks: reused + computed tokens add up to the prompt."""
    kv = PagedKV(SPEC, 8, device="meta", prefix_caching=True)
    engine = Engine(_Fake(), kv)
    first = engine.submit(Request(_prompt(16, 0), 1))
    engine.run(max_steps=5)
    again = engine.submit(Request(_prompt(16, 0), 1))
    engine.run(max_steps=5)
    assert (first.stats.prompt_tokens, first.stats.reused_tokens, first.stats.computed_tokens) == (16, 0, 16)
    assert again.stats.prompt_tokens == 16 and again.stats.reused_tokens > 0
    assert again.stats.reused_tokens + again.stats.computed_tokens == 16


def test_run_returns_when_the_last_allowed_step_finishes_every_request():
    """``run(max_steps=N)`` gives up only when requests are still unfinished after N steps: a request done in
    exactly its N-th step is returned, not refused (one token: the prefill's step finishes it)."""
    engine = Engine(_Fake(), _kv(4))
    one = engine.submit(Request([1, 2, 3], 1))
    assert engine.run(max_steps=1) == [one] and one.finished and not one.failed
    two = engine.submit(Request([1, 2, 3], 2))
    assert engine.run(max_steps=2)[-1] is two and two.finished


# ---------------------------------------------------------------------------------------------------------------
# The tier path (issue 30's survivors in _publish, _read_ahead, _tiers): a CPU pool with a tier manager, and a fake
# model that writes K/V derived from each token and its position, so a block's content names the tokens it holds.
# ---------------------------------------------------------------------------------------------------------------
FP = "testmodel0000000"


class _Writer(_Fake):
    """A ``_Fake`` that writes every layer's K/V: ``K = 1000·token + position + layer/2`` (V = -K) in every head and
    channel, so the block computed for a prefix has one known content, on any pool."""

    def __call__(self, input_ids, cache, *, position_ids):
        step = cache.prepare_step(*input_ids.shape)
        base = (input_ids * 1000 + position_ids).to(SPEC.dtype)[:, None, :, None]  # [B, 1, n, 1]
        for layer in range(SPEC.num_layers):
            k = (base + 0.5 * layer).expand(-1, SPEC.num_kv_heads, -1, SPEC.head_dim).contiguous()  # [B, H, n, D]
            step.write(layer, k, -k)
        out = torch.zeros(*input_ids.shape, V)
        out[..., 7] = 1.0
        return out


def _expected_block(ids: list[int], index: int) -> torch.Tensor:
    """The oracle for the content of full block ``index`` of prefix ``ids`` as ``_Writer`` computes it."""
    block = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)  # [L, 2, H, T, D]
    for layer in range(SPEC.num_layers):
        for j in range(T):
            pos = index * T + j
            k = 1000.0 * ids[pos] + pos + 0.5 * layer
            block[layer, 0, :, j] = k
            block[layer, 1, :, j] = -k
    return block


class _Host(HostMemoryBackend):
    """Host memory under another name, recording ``read_ahead`` calls when ``bulk`` (the cluster tier's bulk fetch:
    returns how many of the keys it holds); ``refuse_after`` puts it then refuses (a full tier); ``fail`` makes both
    raise (an unreachable tier)."""

    def __init__(self, name: str, *, bulk: bool = False, refuse_after: int | None = None, fail: bool = False) -> None:
        super().__init__(1 << 20, pin=False)
        self.name, self.calls, self.refuse_after, self.fail = name, [], refuse_after, fail
        if bulk:
            self.read_ahead = self._read_ahead

    def _read_ahead(self, keys):
        if self.fail:
            raise ConnectionError("tier down")
        self.calls.append(list(keys))
        return sum(k in self._data for k in keys)

    def put(self, key, data):
        if self.fail:
            raise ConnectionError("tier down")
        if self.refuse_after is not None:
            if self.refuse_after == 0:
                return False
            self.refuse_after -= 1
        return super().put(key, data)


def _tiered(store: TierStore | None = None, *tiers: _Host) -> tuple[PagedKV, TierStore]:
    """A 16-block CPU pool with a tier manager over ``store`` (or a new store of ``tiers``)."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    store = store or TierStore([Tier(t) for t in tiers], spec=SPEC, fingerprint=FP)
    TierManager(kv, store, reload="always")  # attaches itself to kv
    return kv, store


def test_a_prefill_publishes_exactly_its_new_full_blocks_to_the_named_tier():
    """``publish_to="far"``: a 20-token prompt's 2 full blocks land in the far tier (not the first tier), each one
    decoding to the K/V the model wrote. A second prompt sharing those 16 tokens and adding 9 reuses them from the
    device and publishes only its one new full block; the counts add up over both (3 published, 0 dropped)."""
    kv, store = _tiered(None, _Host("host"), far := _Host("far"))
    engine = Engine(_Writer(), kv, publish_to="far")
    first, second = _prompt(20, 0), _prompt(16, 0) + _prompt(9, 3)
    engine.submit(Request(first, 1))
    engine.run(max_steps=5)
    hashes = kv.prefix_cache.hashes(first[:16])
    assert sorted(far.keys()) == sorted(h.hex() for h in hashes) and store.tiers[0].backend.keys() == []
    for i, h in enumerate(hashes):
        got = store.get(h.hex())  # None: no copy, or one that fails its checks (key, checksum, geometry)
        assert got is not None and got[1] == "far" and torch.equal(got[0], _expected_block(first, i))
    assert engine.tier_counts == {"published_blocks": 2, "publish_dropped": 0}
    r = engine.submit(Request(second, 1))
    engine.run(max_steps=5)
    assert r.stats.reused_tokens == 16
    third = kv.prefix_cache.hashes(second[:24])[2].hex()
    assert sorted(far.keys()) == sorted([*(h.hex() for h in hashes), third])
    got = store.get(third)
    assert got is not None and torch.equal(got[0], _expected_block(second, 2))
    assert engine.tier_counts == {"published_blocks": 3, "publish_dropped": 0}


def test_blocks_the_tier_refuses_are_counted_as_dropped_not_published():
    """A tier that takes one block and then refuses: the first 2-block prefill publishes 1 and drops 1, the next
    one drops both; the counts are totals over every prefill."""
    kv, _store = _tiered(None, full := _Host("host", refuse_after=1))
    engine = Engine(_Writer(), kv, publish_to="host")
    engine.submit(Request(_prompt(20, 0), 1))
    engine.run(max_steps=5)
    assert engine.tier_counts == {"published_blocks": 1, "publish_dropped": 1} and len(full.keys()) == 1
    engine.submit(Request(_prompt(20, 1), 1))
    engine.run(max_steps=5)
    assert engine.tier_counts == {"published_blocks": 1, "publish_dropped": 3} and len(full.keys()) == 1


def test_a_failing_tier_never_fails_a_request_and_every_failure_is_counted():
    """A tier that raises on every read-ahead and every write: each admission counts two tier errors (its read-ahead
    and its publish) and the requests still finish with every token."""
    kv, _store = _tiered(None, _Host("host", bulk=True, fail=True))
    engine = Engine(_Writer(), kv, publish_to="host")
    reqs = [engine.submit(Request(_prompt(20, i), 2)) for i in range(2)]
    engine.run(max_steps=10)
    assert all(r.output == [7, 7] and not r.failed for r in reqs)
    assert engine.tier_counts == {"tier_errors": 4}


def test_nothing_is_published_without_publish_to_or_without_a_tier_manager():
    """A tier manager but no ``publish_to``: the tier stays empty and nothing is counted. ``publish_to`` but no tier
    manager: nothing to publish to, and still no error counted."""
    kv, _store = _tiered(None, host := _Host("host"))
    engine = Engine(_Writer(), kv)
    engine.submit(Request(_prompt(20, 0), 1))
    engine.run(max_steps=5)
    assert host.keys() == [] and engine.tier_counts == {}
    engine = Engine(_Writer(), PagedKV(SPEC, 16, fingerprint=FP), publish_to="host")
    r = engine.submit(Request(_prompt(20, 0), 1))
    engine.run(max_steps=5)
    assert r.output == [7] and engine.tier_counts == {}


def test_another_engine_reads_a_published_prefix_ahead_and_reloads_it():
    """Engine A publishes a 24-token prompt's 3 full blocks to a bulk tier. Engine B (its own pool, the same tiers)
    gets the first 17 tokens: it asks every bulk tier, once, for the 2 full blocks before the prompt's last token
    (found in one tier, not the other), reloads them (16 tokens reused, block contents as computed) and computes
    one token. The whole 24-token prompt then finds those blocks on B's device and block 2 holds the prompt's
    last token, so no tier is asked again."""
    tiers = [_Host("host"), near := _Host("near", bulk=True), far := _Host("far", bulk=True)]
    kv_a, store = _tiered(None, *tiers)
    prompt = _prompt(24, 0)
    a = Engine(_Writer(), kv_a, publish_to="near")
    a.submit(Request(prompt, 1))
    a.run(max_steps=5)
    assert a.tier_counts["published_blocks"] == 3 and len(near.keys()) == 3
    keys = [h.hex() for h in kv_a.prefix_cache.hashes(prompt[:16])]
    near.calls.clear()
    far.calls.clear()
    kv_b, _ = _tiered(store)
    b = Engine(_Writer(), kv_b)
    short = b.submit(Request(prompt[:17], 2))
    b.run(max_steps=5)
    assert near.calls == [keys] and far.calls == [keys]
    assert b.tier_counts == {"read_ahead_found": 2, "read_ahead_blocks": 4}
    assert (short.stats.reused_tokens, short.stats.computed_tokens) == (16, 1 + 1) and short.output == [7, 7]
    for i, h in enumerate(kv_b.prefix_cache.hashes(prompt[:16])):
        assert torch.equal(kv_b.pool.block(kv_b.allocator.block_with_hash(h)), _expected_block(prompt, i))
    whole = b.submit(Request(prompt, 1))
    b.run(max_steps=5)
    assert near.calls == [keys] and far.calls == [keys] and whole.stats.reused_tokens == 16


def test_a_model_that_skips_a_layer_fails_only_its_request_with_an_error_naming_the_sequence():
    """A decode step that leaves one row's layer 1 unwritten: that request fails with a StateError naming its
    sequence (its blocks are freed); the other row, decoded alone, finishes with every token."""
    skipped = []

    class _SkipsLayer(_Fake):
        def __call__(self, input_ids, cache, *, position_ids):
            rows = cache.sequences
            if input_ids.shape[1] == 1 and any(s.num_tokens == 5 for s in rows):  # R1's first decode step
                skipped.extend(s.seq_id for s in rows if s.num_tokens == 5)
                cache.prepare_step(*input_ids.shape).mark_written_by_kernel([0])
                return torch.zeros(*input_ids.shape, V)
            return super().__call__(input_ids, cache, position_ids=position_ids)

    kv = _kv(16)
    engine = Engine(_SkipsLayer(), kv)
    bad, good = engine.submit(Request(_prompt(5, 0), 3)), engine.submit(Request(_prompt(9, 1), 3))
    engine.run(max_steps=10)
    assert isinstance(bad.error, StateError) and bad.output == [7] and engine.failures == 1
    assert str(bad.error) == f"sequence {skipped[-1]} was not written in every layer by the decode step"
    assert good.output == [7, 7, 7] and not good.failed and kv.allocator.num_active == 0


def test_each_decode_latency_is_the_wall_time_of_its_step():
    """``stats.token_latencies_s`` holds one entry per decoded token (the first token comes from the prefill), each
    between 0 and the time the whole run took."""
    engine = Engine(_Fake(), _kv(16))
    r = engine.submit(Request([1, 2, 3], 4))
    started = time.perf_counter()
    engine.run(max_steps=10)
    wall = time.perf_counter() - started
    assert len(r.stats.token_latencies_s) == 3 and all(0 <= x <= wall for x in r.stats.token_latencies_s)


def test_an_interrupt_while_retiring_a_finished_request_does_not_decode_it_again():
    """R1 gets its last token in a step and an interrupt lands while its blocks are being released. The interrupt
    goes through; R1 (finished, with all its tokens) is no longer among the running rows, R2 is, and the run that
    follows gives R2 its tokens without decoding R1 again."""
    kv = _kv(16)
    engine = Engine(_Fake(), kv)
    r1, r2 = engine.submit(Request(_prompt(5, 0), 3)), engine.submit(Request(_prompt(5, 1), 4))
    engine.step()  # both admitted (one token each), then one decode step: two tokens each
    seq1 = next(seq for r, seq in engine.running if r is r1)

    def interrupted() -> None:
        raise KeyboardInterrupt

    seq1.free = interrupted  # the interrupt lands as R1, finished by the next step, releases its blocks
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    del seq1.free
    assert r1.finished and r1.output == [7, 7, 7]
    assert [r for r, _ in engine.running] == [r2]
    seq1.free()
    engine.run(max_steps=10)
    assert r1.output == [7, 7, 7] and r2.output == [7, 7, 7, 7] and not r2.failed
    assert kv.allocator.num_active == 0


def test_run_allows_100_000_steps_by_default():
    """``run()`` without ``max_steps`` allows 100 000 steps: a request that keeps running for exactly that many
    steps is returned, one that needs a step more raises ConfigError naming the limit. (The engine's step is
    replaced by a counter: only run's loop is under test.)"""
    for needed in (100_000, 100_001):
        engine = Engine(_Fake(), _kv(4))
        r = engine.submit(Request([1, 2, 3], 1))
        steps = itertools.count(1)

        def step(engine=engine, r=r, needed=needed, steps=steps):
            n = next(steps)
            if n == 1:
                engine.running.append((engine.waiting.popleft(), None))
            if n == needed:
                engine.running.clear()
                engine.finished.append(r)

        engine.step = step
        if needed == 100_000:
            assert engine.run() == [r]
        else:
            with pytest.raises(ConfigError, match="after 100000 steps"):
                engine.run()


@pytest.mark.parametrize("threaded", [False, True])
def test_each_engine_step_enforces_the_tier_watermarks_unless_the_managers_thread_does(threaded):
    """A finished 20-token request leaves 2 cached blocks: 2/16 is over the high watermark 0.1, so the next engine
    step moves both to the tier. When the manager's own thread drives it (started here with an hour's interval),
    the engine step leaves them on the device."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    store = TierStore([Tier(host := _Host("host"))], spec=SPEC, fingerprint=FP)
    tm = TierManager(kv, store, high_watermark=0.1, low_watermark=0.05, min_residency_s=0)
    engine = Engine(_Writer(), kv)
    engine.submit(Request(_prompt(20, 0), 1))
    engine.run(max_steps=5)
    assert kv.allocator.num_cached == 2 and host.keys() == []
    if threaded:
        tm.start(interval_s=3600.0)
    try:
        engine.step()
    finally:
        tm.stop()
    assert (kv.allocator.num_cached, len(host.keys())) == ((2, 0) if threaded else (0, 2))


def test_a_pool_without_prefix_caching_reads_nothing_ahead_even_with_bulk_tiers():
    """A tier hook (the paged layer's ``TierHook`` protocol, here not a TierManager) whose store has a bulk tier, on a
    pool without prefix caching: there are no block hashes to ask for, so the tier is never asked and no tier
    error is counted; the request runs as without tiers."""

    class _Hook:
        driven_by_thread = True  # so the engine does not step it

        def __init__(self, store: TierStore) -> None:
            self.store = store

    kv = PagedKV(SPEC, 16, prefix_caching=False)
    kv.tier_manager = _Hook(TierStore([Tier(bulk := _Host("bulk", bulk=True))], spec=SPEC, fingerprint=FP))
    engine = Engine(_Writer(), kv)
    r = engine.submit(Request(_prompt(20, 0), 2))
    engine.run(max_steps=5)
    assert r.output == [7, 7] and bulk.calls == [] and engine.tier_counts == {}


def test_a_prefix_lookup_that_raises_fails_only_its_request_and_one_out_of_blocks_waits():
    """A tier hook whose prefix extension raises for one prompt: that request fails with the hook's error, holding
    nothing, and the next request starts in the same step. When the hook runs out of blocks instead, the request
    waits at the head of the queue (counted, not failed) and runs once the hook recovers."""

    class _Hook:
        driven_by_thread = True  # so the engine does not step it
        error: Exception | None = None

        def touch(self, blocks, now=None) -> None:
            pass

        def extend_prefix(self, token_ids, cache_salt, device_blocks):
            if self.error is not None and token_ids[0] == 1:  # only _prompt(n, 0)
                raise self.error
            return []

    kv = PagedKV(SPEC, 16, device="meta", prefix_caching=True)
    kv.tier_manager = hook = _Hook()
    engine = Engine(_Fake(), kv)
    hook.error = ValueError("the hook broke")
    bad, good = engine.submit(Request(_prompt(5, 0), 2)), engine.submit(Request(_prompt(5, 1), 3))
    engine.step()
    assert bad.error is hook.error and engine.failures == 1 and [r for r, _ in engine.running] == [good]
    engine.run(max_steps=5)
    assert good.output == [7, 7, 7] and kv.allocator.num_active == 0
    hook.error = OutOfBlocksError(needed=1, available=0)
    r = engine.submit(Request(_prompt(5, 0), 2))
    engine.step()
    assert list(engine.waiting) == [r] and engine.deferred_admissions == 1 and not r.failed
    assert kv.allocator.num_active == 0
    hook.error = None
    engine.run(max_steps=5)
    assert r.output == [7, 7] and not r.failed and engine.failures == 1


def test_a_prefill_that_fails_after_taking_its_blocks_gives_them_all_back():
    """A prefill that reserves its 3 blocks and then raises: the request fails with the error and, right after that
    step, the pool holds only the other request's block."""

    def hook(ids, cache, pos):
        if ids.shape == (1, 20):
            cache.prepare_step(*ids.shape)  # 3 blocks taken
            raise ValueError("prefill broke")

    kv = _kv(16)
    engine = Engine(_Fake(hook=hook), kv)
    bad, good = engine.submit(Request(_prompt(20, 0), 2)), engine.submit(Request(_prompt(5, 1), 3))
    engine.step()
    assert isinstance(bad.error, ValueError) and [r for r, _ in engine.running] == [good]
    assert kv.allocator.num_active == 1


def test_a_preempted_request_counts_the_prefix_it_reuses_at_every_admission():
    """4 blocks with prefix caching, 2 held outside. A finished 9-token request leaves block 0 cached; R (the same
    prompt) reuses those 8 tokens and computes 1, decodes 7 tokens and is preempted at 16. Readmitted with its 17
    tokens it reuses both full blocks (16) and computes 1, then decodes its last 3. Reused totals 8 + 16, computed
    1 + 7 + 1 + 3: every token its admissions and steps processed is counted once."""
    kv = PagedKV(SPEC, 4, device="meta", prefix_caching=True)
    held = kv.allocator.allocate(2)
    engine = Engine(_Fake(), kv)
    engine.submit(Request(_prompt(9, 0), 1))
    engine.run(max_steps=5)
    r = engine.submit(Request(_prompt(9, 0), 12))
    with pytest.raises(OutOfBlocksError):
        engine.run(max_steps=50)  # preempted at 16 tokens; 17 + 1 need 3 blocks, 2 are left
    assert (r.stats.reused_tokens, r.stats.computed_tokens, len(r.output)) == (8, 8, 8)
    kv.allocator.free_many(held)
    engine.run(max_steps=50)
    assert r.output == [7] * 12 and r.stats.preemptions == 1
    assert (r.stats.reused_tokens, r.stats.computed_tokens) == (8 + 16, 1 + 7 + 1 + 3)


def test_an_interrupt_during_a_prefill_keeps_the_request_queued_and_gives_its_blocks_back():
    """A KeyboardInterrupt in the middle of a prefill (its blocks taken) goes through; the request stays at the head
    of the queue holding nothing, and the next run serves it."""
    state = {"armed": True}

    def hook(ids, cache, pos):
        if ids.shape[1] > 1 and state["armed"]:
            state["armed"] = False
            cache.prepare_step(*ids.shape)
            raise KeyboardInterrupt

    kv = _kv(16)
    engine = Engine(_Fake(hook=hook), kv)
    r = engine.submit(Request(_prompt(20, 0), 2))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert list(engine.waiting) == [r] and not engine.running and kv.allocator.num_active == 0
    engine.run(max_steps=5)
    assert r.output == [7, 7] and not r.failed


def test_a_decode_step_is_one_batched_forward_over_every_running_row():
    """Three running requests: each decode step is a single forward of 3 rows (continuous batching), never one per
    row."""
    shapes = []
    engine = Engine(_Fake(hook=lambda ids, cache, pos: shapes.append(tuple(ids.shape))), _kv(16))
    reqs = [engine.submit(Request(_prompt(5, i), 3)) for i in range(3)]
    engine.run(max_steps=5)
    assert all(r.output == [7, 7, 7] for r in reqs)
    assert shapes == [(1, 5)] * 3 + [(3, 1)] * 2


def test_an_interrupt_in_the_row_by_row_retry_keeps_every_row_running():
    """The batched decode step raises, and the row-by-row retry is interrupted at R2: the interrupt goes through,
    R1 (handled) and R2 (cut back to its tokens before the step) both stay running, in order, and then finish."""
    state = {"armed": True}

    def hook(ids, cache, pos):
        if ids.shape[1] == 1 and ids.shape[0] > 1:
            raise RuntimeError("batched step fails")
        if ids.shape == (1, 1) and cache.sequences[0].num_tokens == 6 and state["armed"]:  # R2 alone
            state["armed"] = False
            raise KeyboardInterrupt

    kv = _kv(16)
    engine = Engine(_Fake(hook=hook), kv, max_batch=4)
    r1, r2 = engine.submit(Request(_prompt(5, 1), 4)), engine.submit(Request(_prompt(6, 2), 4))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert [r for r, _ in engine.running] == [r1, r2] and [s.num_tokens for _, s in engine.running] == [6, 6]
    engine.run(max_steps=10)
    assert r1.output == [7] * 4 and r2.output == [7] * 4 and kv.allocator.num_active == 0


def test_an_interrupt_in_a_batched_decode_step_undoes_it_and_keeps_every_row():
    """A KeyboardInterrupt in the middle of a batched decode step (its slots reserved) goes through; every row is cut
    back to its tokens before the step and stays running, and the next run finishes both."""
    state = {"armed": True}

    def hook(ids, cache, pos):
        if ids.shape == (2, 1) and state["armed"]:
            state["armed"] = False
            cache.prepare_step(*ids.shape)
            raise KeyboardInterrupt

    kv = _kv(16)
    engine = Engine(_Fake(hook=hook), kv)
    r1, r2 = engine.submit(Request(_prompt(5, 1), 3)), engine.submit(Request(_prompt(6, 2), 3))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert [r for r, _ in engine.running] == [r1, r2] and [s.num_tokens for _, s in engine.running] == [5, 6]
    engine.run(max_steps=10)
    assert r1.output == [7] * 3 and r2.output == [7] * 3 and kv.allocator.num_active == 0


def test_steps_counts_the_decode_steps_run():
    """A 4-token request decodes 3 steps (its first token comes from the prefill); a second run adds 2 more."""
    engine = Engine(_Fake(), _kv(16))
    engine.submit(Request([1, 2, 3], 4))
    engine.run(max_steps=10)
    assert engine.steps == 3
    engine.submit(Request([1, 2, 3], 3))
    engine.run(max_steps=10)
    assert engine.steps == 5


# ---------------------------------------------------------------------------------------------------------------
# An interrupt (KeyboardInterrupt) at any point of a row's handling loses no request and no block: whatever the
# row had become (finished, failed, queued again, its token recorded) is what the engine keeps.
# ---------------------------------------------------------------------------------------------------------------
def _interrupt_once(obj, name: str) -> None:
    """Make ``obj.name()`` raise KeyboardInterrupt on its first call (then behave as before)."""
    original = getattr(obj, name)

    def interrupted(*args, **kwargs):
        setattr(obj, name, original)
        raise KeyboardInterrupt

    setattr(obj, name, interrupted)


def _where(engine, request) -> list[str]:
    """Every engine list ``request`` is in (by identity): a request is in exactly one, or it was lost."""
    lists = {"waiting": list(engine.waiting), "running": [r for r, _ in engine.running], "finished": engine.finished}
    return [name for name, items in lists.items() for r in items if r is request]


def test_an_interrupt_as_a_finished_request_releases_its_blocks_leaves_it_finished_and_released():
    """R1 gets its last token and the interrupt lands as its blocks are released: R1 is among the finished (it
    was among none before), its blocks are released anyway, and R2 keeps running and then finishes."""
    kv = _kv(16)
    engine = Engine(_Fake(), kv)
    r1, r2 = engine.submit(Request(_prompt(5, 0), 3)), engine.submit(Request(_prompt(5, 1), 4))
    engine.step()
    seq1, seq2 = (seq for _, seq in engine.running)
    _interrupt_once(seq1, "free")
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert _where(engine, r1) == ["finished"] and _where(engine, r2) == ["running"]
    assert r1.output == [7, 7, 7] and seq1.freed and kv.allocator.num_active == len(seq2.block_table)
    engine.run(max_steps=10)
    assert engine.finished == [r1, r2] and r2.output == [7] * 4 and kv.allocator.num_active == 0


def _failing_alone(engine, target, error: Exception):
    """A hook: every batched decode step fails; retried alone, ``target``'s row raises ``error`` (once), and the
    release of its blocks is interrupted (once)."""
    state = {"armed": True}

    def hook(ids, cache, pos):
        if ids.shape[0] > 1 and ids.shape[1] == 1:
            if state["armed"]:
                _interrupt_once(next(seq for r, seq in engine.running if r is target), "free")
            raise RuntimeError("the batched step fails")
        if ids.shape == (1, 1) and state["armed"] and cache.sequences[0].seq_id == _seq_id_of(engine, target):
            state["armed"] = False
            raise error

    return hook


def _seq_id_of(engine, target) -> int | None:
    return next((seq.seq_id for r, seq in engine.running if r is target), None)


@pytest.mark.parametrize("error", ["fails", "queued again"])
def test_an_interrupt_as_a_failed_or_requeued_row_releases_its_blocks_loses_neither_request_nor_block(error):
    """The batched step fails and R1, retried alone, fails (ValueError: it is finished with the error) or finds
    the pool full (CapacityExceededError: it is queued again); the interrupt lands as its blocks are released.
    R1 is in exactly the list it was moved to — finished with its error, or waiting — its blocks are released, R2
    is still running, and the next run finishes R2 (and R1 when it was queued again)."""
    from memos_ref.errors import CapacityExceededError

    kv = _kv(16)
    model = _Fake()
    engine = Engine(model, kv)
    r1, r2 = engine.submit(Request(_prompt(5, 0), 3)), engine.submit(Request(_prompt(6, 1), 3))
    exc = ValueError("R1 fails alone") if error == "fails" else CapacityExceededError("no room for R1 alone")
    model.hook = _failing_alone(engine, r1, exc)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert _where(engine, r1) == (["finished"] if error == "fails" else ["waiting"])
    assert (r1.error is exc) == (error == "fails") and _where(engine, r2) == ["running"]
    assert kv.allocator.num_active == len(engine.running[0][1].block_table)  # R1's blocks are back
    model.hook = None
    engine.run(max_steps=10)
    assert r2.output == [7] * 3 and kv.allocator.num_active == 0
    assert r1.output == ([7] if error == "fails" else [7] * 3)


class _InterruptAfterAppend(list):
    """An output list whose next append records the token and then raises KeyboardInterrupt (once)."""

    armed = False

    def append(self, item) -> None:
        super().append(item)
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def test_an_interrupt_after_a_rows_token_is_recorded_keeps_the_token_and_its_kv():
    """The interrupt lands right after R1's new token is recorded (its step complete). R1 keeps the token and the
    K/V of the step: every running row holds exactly prompt + output - 1 tokens (the last token's K/V is written by
    the next step). Cutting R1 back would drop the K/V of a token the next step no longer feeds, and the row would
    attend over a gap."""
    kv = _kv(16)
    engine = Engine(_Fake(), kv)
    r1, r2 = engine.submit(Request(_prompt(5, 0), 4)), engine.submit(Request(_prompt(6, 1), 4))
    engine.step()
    r1.output = _InterruptAfterAppend(r1.output)
    r1.output.armed = True
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert r1.output == [7, 7, 7] and [r for r, _ in engine.running] == [r1, r2]
    for r, seq in engine.running:
        assert seq.num_tokens == len(r.prompt) + len(r.output) - 1, (r.request_id, seq.num_tokens)
    engine.run(max_steps=10)
    assert r1.output == [7] * 4 and r2.output == [7] * 4 and kv.allocator.num_active == 0
