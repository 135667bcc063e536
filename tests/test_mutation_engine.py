"""The engine's scheduling policy (issue 30's survivors): outputs do not change when admission forgets the running
rows' next tokens or when preemption picks another victim, so only the policy shows it. The oracle is block
arithmetic done here from the block size and the prompt lengths."""

from __future__ import annotations

import pytest

from memos_ref.engine import Engine, Request
from memos_ref.paged import PagedKV

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
