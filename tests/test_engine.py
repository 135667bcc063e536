"""The engine: every request's output equals generating it alone with transformers' DynamicCache, with
continuous batching, prefix reuse, sampling and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from memos_ref.engine import Engine, Request
from memos_ref.errors import InvalidArgumentError
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec

tok = ByteTokenizer()
SYSTEM = "# A Python agent. Tools: read_file, write_file.\nimport os\nimport sys\n\n"
TASKS = [
    "def load(path):\n",
    "class Store:\n    def __init__(self):\n",
    "x = 1\n",
    "def main(argv):\n    ",
    "import json\n",
]


def _solo(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), cache=DynamicCache(), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("num_blocks", [256, 12])  # plenty, and so few that requests must wait or be preempted
def test_batched_outputs_equal_solo_generation(shipped_pair, num_blocks):
    ours, hf = shipped_pair
    kv = PagedKV(ours.kv_spec(block_size=16), num_blocks)
    engine = Engine(ours, kv, max_batch=4)
    prompts = [tok.encode(SYSTEM + task, add_bos=True) for task in TASKS]
    lengths = [40, 12, 25, 33, 7]
    requests = [engine.submit(Request(p, n)) for p, n in zip(prompts, lengths)]
    engine.run()
    for request, prompt, n in zip(requests, prompts, lengths):
        assert request.finished and request.output == _solo(hf, prompt, n), request.request_id
    kv.check()
    assert kv.allocator.num_active == 0
    if num_blocks == 256:  # later requests reuse the shared system prompt's blocks
        assert sum(r.stats.reused_tokens for r in requests) >= 4 * 48
        assert engine.preemptions == 0 and engine.deferred_admissions == 0
    else:  # 12 blocks cannot hold four of these at once: requests had to wait
        assert engine.deferred_admissions > 0
    for r in requests:
        assert r.stats.ttft_s is not None and r.stats.computed_tokens + r.stats.reused_tokens >= len(r.prompt)


def test_preemption_recomputes_and_still_matches(shipped_pair):
    ours, hf = shipped_pair
    kv = PagedKV(ours.kv_spec(block_size=8), 20, prefix_caching=False)
    engine = Engine(ours, kv, max_batch=4)
    prompts = [tok.encode(t * 3, add_bos=True) for t in TASKS[:4]]
    requests = [engine.submit(Request(p, 30)) for p in prompts]
    engine.run()
    assert engine.preemptions > 0
    for request, prompt in zip(requests, prompts):
        assert request.output == _solo(hf, prompt, 30)
    kv.check()


def test_sampling_is_seeded_and_stop_ids_end_requests(shipped_pair):
    ours, _ = shipped_pair
    prompt = tok.encode("def f(x):\n", add_bos=True)

    def run(seed):
        kv = PagedKV(ours.kv_spec(), 64)
        engine = Engine(ours, kv)
        req = engine.submit(Request(prompt, 20, temperature=1.0, seed=seed))
        engine.run()
        return req.output

    assert run(1) == run(1) and run(1) != run(2)
    kv = PagedKV(ours.kv_spec(), 64)
    engine = Engine(ours, kv)
    greedy = engine.submit(Request(prompt, 20))
    engine.run()
    stop = greedy.output[5]
    kv = PagedKV(ours.kv_spec(), 64)
    engine = Engine(ours, kv)
    stopped = engine.submit(Request(prompt, 20, stop_ids=(stop,)))
    engine.run()
    assert stopped.output == greedy.output[: greedy.output.index(stop) + 1]
    with pytest.raises(InvalidArgumentError):
        Request([], 3)


def test_a_request_that_can_never_fit_is_refused_at_submission(shipped_pair):
    from memos_ref.errors import OutOfBlocksError

    ours, _ = shipped_pair
    engine = Engine(ours, PagedKV(ours.kv_spec(block_size=8), 2))
    with pytest.raises(OutOfBlocksError):
        engine.submit(Request(list(range(40)), 4))
    assert not engine.waiting and engine.run() == []
    assert engine.kv.allocator.num_active == 0


# ---------------------------------------------------------------------------------------------- the per-step batch
def test_decode_step_builds_one_step_batch_and_writes_each_layer_once(shipped_pair, monkeypatch):
    """Issue 15 item 2: a decode step of B rows and L layers reserves once per row (one StepBatch before the layer
    loop), writes each layer with one store for every row and attends with one call per layer — not B·L appends,
    B·L slot tensors and L block-table builds. The model sees the one forward-facing cache class, PagedCache."""
    import memos_ref.attention as attention_mod
    from memos_ref.hf import PagedCache
    from memos_ref.paged.sequence import SequenceCache
    from memos_ref.paged.step import StepBatch

    ours, hf = shipped_pair
    layers = ours.kv_spec().num_layers
    engine = Engine(ours, PagedKV(ours.kv_spec(block_size=16), 128), max_batch=3)
    prompts = [tok.encode(SYSTEM + task, add_bos=True) for task in TASKS[:3]]
    requests = [engine.submit(Request(p, 6)) for p in prompts]
    engine.step()  # admit and prefill every row
    assert len(engine.running) == 3
    counts = {"append": 0, "reserve": 0, "write": 0, "attend": 0, "slot_mapping": 0}

    def counting(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(SequenceCache, "append", counting("append", SequenceCache.append))
    monkeypatch.setattr(SequenceCache, "slot_mapping", counting("slot_mapping", SequenceCache.slot_mapping))
    monkeypatch.setattr(StepBatch, "reserve", classmethod(counting("reserve", StepBatch.reserve.__func__)))
    monkeypatch.setattr(StepBatch, "write", counting("write", StepBatch.write))
    monkeypatch.setattr(attention_mod, "attend_step", counting("attend", attention_mod.attend_step))
    seen = []
    real_model = engine.model

    def model(ids, cache, **kw):
        seen.append(type(cache))
        return real_model(ids, cache, **kw)

    model.config = real_model.config
    engine.model = model
    engine.step()  # one batched decode step
    assert counts == {"append": 0, "reserve": 1, "write": layers, "attend": layers, "slot_mapping": 0}
    assert seen == [PagedCache]
    engine.model = real_model
    monkeypatch.undo()
    engine.run()
    for request, prompt in zip(requests, prompts):
        assert request.output == _solo(hf, prompt, 6)


def test_request_ids_are_checked_in_one_pass_and_still_named_when_bad(shipped_pair):
    """A prompt is validated once per request with one pass (no check per token), and a bad id is still named."""
    ours, _hf = shipped_pair
    engine = Engine(ours, PagedKV(ours.kv_spec(block_size=16), 64), max_batch=2)
    with pytest.raises(InvalidArgumentError, match=r"prompt\[2\]"):
        engine.submit(Request([1, 2, ours.config.vocab_size, 3], 2))
    with pytest.raises(InvalidArgumentError, match=r"stop_ids\[0\]"):
        engine.submit(Request([1, 2], 2, stop_ids=(ours.config.vocab_size,)))
    assert not engine.waiting


@pytest.mark.parametrize("segments", [1, 3])
def test_an_engine_whose_pool_grows_mid_run_gives_the_solo_outputs(shipped_pair, segments):
    """issue 15: a pool grows by segments (PagedKV.grow); the engine refused a multi-segment pool when built but
    not after a grow. It needs no refusal: its rows are read through their block tables whatever the segment,
    so the outputs stay equal to generating each request alone, with the new blocks in use."""
    ours, hf = shipped_pair
    kv = PagedKV(ours.kv_spec(block_size=16), 8, segments=segments)  # too small: requests wait for the growth
    engine = Engine(ours, kv, max_batch=4)
    prompts = [tok.encode(SYSTEM + task, add_bos=True) for task in TASKS[:3]]
    requests = [engine.submit(Request(p, 16)) for p in prompts]
    engine.step()
    engine.step()
    grown = kv.grow(24)
    assert len(kv.pool.segments) == segments + 1 and list(grown) == list(range(8, 32))
    used_new = False
    while engine.waiting or engine.running:
        engine.step()
        used_new |= any(b >= 8 for _, seq in engine.running for b in seq.block_table)
    assert used_new
    for request, prompt in zip(requests, prompts):
        assert not request.failed and request.output == _solo(hf, prompt, 16)
    kv.check()


def test_importing_the_engine_does_not_import_transformers():
    """`import memos_ref.engine` (a serve process's first import, a Request's) does not pull transformers in: the
    transformers-facing PagedCache is imported when an Engine is built."""
    import subprocess
    import sys

    code = "import sys, memos_ref.engine; print('transformers' in sys.modules, 'memos_ref.hf' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == ["False", "False"]


class _DeviceSpy:
    """A model that records where its inputs live, stores nothing (the pool is on ``meta``: no data) and counts
    every layer as written, so the engine's bookkeeping runs; its logits (on the CPU) always prefer token 7."""

    def __init__(self, vocab: int, layers: int) -> None:
        self.config = type("Config", (), {"vocab_size": vocab, "num_hidden_layers": layers})()
        self.seen: list[tuple[str, torch.device, torch.device]] = []

    def __call__(self, input_ids, cache, *, position_ids):
        self.seen.append(("prefill" if input_ids.shape[1] > 1 else "decode", input_ids.device, position_ids.device))
        cache.prepare_step(*input_ids.shape).mark_written_by_kernel()
        logits = torch.zeros(*input_ids.shape, self.config.vocab_size)
        logits[..., 7] = 1.0
        return logits


def test_the_engine_hands_the_model_ids_and_positions_on_the_pools_device():
    """Token ids and positions of prefill and decode steps are made on the pool's device (a GPU model would refuse
    CPU ids); a ``meta`` pool shows it without a GPU."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=8)
    kv = PagedKV(spec, num_blocks=16, device="meta")
    spy = _DeviceSpy(vocab=50, layers=2)
    engine = Engine(spy, kv, max_batch=2)
    reqs = [engine.submit(Request(prompt=[1, 2, 3, 4, 5], max_new_tokens=3)) for _ in range(2)]
    engine.run()
    assert [r.output for r in reqs] == [[7, 7, 7]] * 2 and not any(r.failed for r in reqs)
    assert {kind for kind, _, _ in spy.seen} == {"prefill", "decode"}
    assert all(ids.type == "meta" and pos.type == "meta" for _, ids, pos in spy.seen), spy.seen
    assert kv.allocator.num_free == kv.allocator.num_blocks  # finished rows gave their blocks back
