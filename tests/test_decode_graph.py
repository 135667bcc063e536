"""The whole-forward CUDA-graph decode (``memos_ref.decode_graph``, issue 25 item 5), its bookkeeping checked on
the CPU: the graphed step's kernels run in Triton's interpreter (``MEMOS_REF_KERNELS=interpret``) and a counting
capture stands in for ``torch.cuda.CUDAGraph`` (it runs the step at capture and again at each replay, on the same
static buffers); on a GPU the same tests capture real graphs.

The oracle is the package's eager forward through ``PagedCache`` with the torch reference attention
(``MEMOS_REF_KERNELS=reference``), each fed its own argmax: greedy tokens equal, logits within 1e-4 (fp32: the
kernels' online softmax sums in another order than torch's softmax, the graph plans its splits for the table's
capacity rather than the step's longest row, and its projections multiply the padded bucket — rounding of the order
at most 5e-7 here; a wrong row, position or slot moves logits by O(0.1-1)), the pool's K/V within 1e-5, and the rows'
counts, block tables, registered prefix blocks and free blocks equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import kernel_modules

from memos_ref.engine import Engine, Request
from memos_ref.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    ConfigError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
    StateError,
)
from memos_ref.hf import PagedCache
from memos_ref.model.llama import LlamaConfig, LlamaForward
from memos_ref.paged import PagedKV
from memos_ref.paged.step import StepBatch
from memos_ref.quant import PerTokenInt8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = "triton" if DEVICE == "cuda" else "interpret"
CFG = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
T = 8  # block size


@pytest.fixture(scope="module")
def dg():
    (mod,) = kernel_modules("decode_graphs")  # skips without Triton (raises in CI)
    from memos_ref import decode_graph

    return mod, decode_graph


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForward(LlamaConfig(**CFG)).to(DEVICE).eval()


class Counting:
    """A capture that counts: the real CUDA-graph capture on a GPU, else ``rerun_capture`` (replay = run again)."""

    def __init__(self, dg_mod, fail: bool = False):
        self.inner = dg_mod.cuda_capture if DEVICE == "cuda" else dg_mod.rerun_capture
        self.buckets: list[int] = []
        self.fail = fail

    def __call__(self, fn, inputs):
        if self.fail:
            raise RuntimeError("capture refused")
        self.buckets.append(inputs["input_ids"].shape[0])
        return self.inner(fn, inputs)


def new_kv(model, blocks=16, **kw):
    return PagedKV(model.kv_spec(block_size=T), blocks, device=DEVICE, **kw)


def prefill(model, kv, prompts):
    """Each prompt into its own row through the eager forward (reference attention), as the engine prefills."""
    rows = []
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setenv("MEMOS_REF_KERNELS", "reference")
        for prompt in prompts:
            seq = kv.new_sequence()
            cache = PagedCache(kv, owns_rows=False)
            cache.sequences = [seq]
            model(torch.tensor([prompt], device=DEVICE), cache, position_ids=torch.arange(len(prompt))[None].to(DEVICE))
            seq.set_token_ids(prompt)
            rows.append(seq)
    return rows


def eager_step(model, kv, rows, tokens):
    """The engine's eager decode step (reference attention): logits ``[B, V]``."""
    cache = PagedCache(kv, owns_rows=False)
    cache.sequences = rows
    ids = torch.tensor([[t] for t in tokens], device=DEVICE)
    positions = torch.tensor([[seq.num_tokens] for seq in rows], device=DEVICE)
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setenv("MEMOS_REF_KERNELS", "reference")
        return model(ids, cache, position_ids=positions)[:, -1]


def state(kv, rows):
    """What a step changes in the rows and the allocator (counts, tables, registered blocks, free blocks)."""
    seqs = [(s.num_tokens, list(s.layer_tokens), list(s.block_table), s.num_registered) for s in rows]
    return seqs, kv.allocator.num_available, dict(kv.allocator.hash_by_block)


PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4], [6, 6, 6]]
#: Rows decoded at each step: 3 rows (bucket 4), 3 rows, then rows 1 and 2 (bucket 2), then all three again (a
#: replay of bucket 4 at other lengths). Lengths go 6/15/3 -> 10/19/6: rows cross and fill blocks of 8.
STEPS = [[0, 1, 2], [0, 1, 2], [1, 2], [0, 1, 2]]


@pytest.fixture(scope="module")
def scenario(dg, model):
    """The same greedy decode eager and graphed from the same prefill, each path fed its own argmax."""
    dg_mod, decode_graph = dg
    eager_kv, graph_kv = new_kv(model), new_kv(model)
    eager_rows, graph_rows = prefill(model, eager_kv, PROMPTS), prefill(model, graph_kv, PROMPTS)
    capture = Counting(dg_mod)
    out = {"eager": [], "graph": [], "pool": [], "slots": [], "capture": capture}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMOS_REF_KERNELS", KERNELS)
        decoder = decode_graph.GraphedDecoder(model, graph_kv, buckets=(2, 4), max_context=32, capture=capture,
                                              enabled=True)  # fmt: skip
        fed = {"eager": [p[-1] for p in PROMPTS], "graph": [p[-1] for p in PROMPTS]}
        for rows in STEPS:
            want = eager_step(model, eager_kv, [eager_rows[r] for r in rows], [fed["eager"][r] for r in rows])
            seqs = [graph_rows[r] for r in rows]
            before = graph_kv.pool.segments[0].clone()
            got = decoder.step(seqs, [fed["graph"][r] for r in rows])
            out["pool"].append((before, graph_kv.pool.segments[0].clone()))
            out["slots"].append([seq.block_table[(seq.num_tokens - 1) // T] * T + (seq.num_tokens - 1) % T
                                 for seq in seqs])  # fmt: skip
            out["eager"].append(want)
            out["graph"].append(got)
            for i, r in enumerate(rows):  # the token fed this step recorded as the engine does, then the next
                for path, seq, logits in (("eager", eager_rows[r], want), ("graph", graph_rows[r], got)):
                    seq.set_token_ids([fed[path][r]], start=seq.num_tokens - 1)
                    fed[path][r] = int(logits[i].argmax())
    out.update(decoder=decoder, eager_kv=eager_kv, graph_kv=graph_kv, eager_rows=eager_rows, graph_rows=graph_rows)
    return out


def test_greedy_decode_through_the_graphs_equals_the_eager_forward(scenario):
    for rows, want, got in zip(STEPS, scenario["eager"], scenario["graph"]):
        assert got.shape == want.shape == (len(rows), CFG["vocab_size"])
        assert torch.equal(got.argmax(-1), want.argmax(-1))  # the same greedy tokens
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_the_cache_after_equals_the_eager_paths(scenario):
    """Counts, layer counts, block tables, registered prefix blocks and free blocks as the eager path left them;
    the K/V in the pool within rounding (even layer 0's differ by a few ulps: the graph's projections multiply a
    padded batch of 4 rows, the eager one 3, and the GEMM blocks its sums by shape)."""
    assert state(scenario["graph_kv"], scenario["graph_rows"]) == state(scenario["eager_kv"], scenario["eager_rows"])
    assert [s.num_tokens for s in scenario["graph_rows"]] == [len(p) + sum(i in r for r in STEPS)
                                                             for i, p in enumerate(PROMPTS)]  # fmt: skip
    assert any(s.num_registered > len(p) // T for s, p in zip(scenario["graph_rows"], PROMPTS))  # a block filled
    mine, theirs = scenario["graph_kv"].pool.segments[0], scenario["eager_kv"].pool.segments[0]
    assert torch.allclose(mine, theirs, atol=1e-5)


def test_padding_rows_write_no_pool_slot(scenario):
    """Three rows in bucket 4: the pool after the step differs from before only at the three rows' new slots
    (every layer, K and V); the padding row (slot -1, length 0) wrote nothing."""
    for rows, (before, after), slots in zip(STEPS, scenario["pool"], scenario["slots"]):
        changed = (before != after).any(dim=(1, 2, 3, 5))  # [N, T]: a slot any layer, K or V, or head changed
        written = torch.zeros_like(changed)
        for slot in slots:
            written[slot // T, slot % T] = True
        assert torch.equal(changed, written), (rows, slots)
    assert scenario["capture"].buckets.count(4) == 1  # 3 rows ran in bucket 4: a padding row was there


def test_one_capture_per_bucket_across_steps_of_different_lengths(scenario):
    stats = scenario["decoder"].graphs.stats
    assert scenario["capture"].buckets == [4, 2]  # captured at the first use of each bucket only
    assert stats.by_bucket == {4: 1, 2: 1} and stats.replays == len(STEPS) and stats.eager == 0
    assert stats.invalidations == 0


def test_mark_written_by_kernel_does_writes_bookkeeping_without_the_store(model):
    """``StepBatch.mark_written_by_kernel``: every layer counted, the rows' full blocks registered (as after the
    eager path's last layer write), nothing stored; all layers or none; a layer is counted once per step."""
    kv = new_kv(model)
    seq = kv.new_sequence()
    seq.advance(list(range(7)))
    before = kv.pool.segments[0].clone()
    step = StepBatch.reserve([seq], 1)
    assert seq.layer_tokens == [7, 7] and seq.num_tokens == 8
    step.mark_written_by_kernel([1])
    assert seq.layer_tokens == [7, 8] and step.written == [False, True] and seq.num_registered == 0
    with pytest.raises(StateError, match="layer 1 already wrote this step"):
        step.mark_written_by_kernel()  # layer 1 twice: refused before layer 0 is counted
    assert step.written == [False, True] and seq.layer_tokens == [7, 8]
    seq.set_token_ids([7], start=7)
    step.mark_written_by_kernel([0])
    assert seq.layer_tokens == [8, 8] and step.complete and seq.num_registered == 1  # finish(): block registered
    assert torch.equal(kv.pool.segments[0], before)  # nothing stored
    other = StepBatch.reserve([seq], 1)
    with pytest.raises(StateError, match="written once per step"):
        other.mark_written_by_kernel([0, 0])
    seq.layer_tokens[0] = 0  # the row changed since the step was prepared
    with pytest.raises(StateError, match="changed since this step was prepared"):
        other.mark_written_by_kernel()
    assert other.written == [False, False]


def rows_of(kv, lengths):
    """Rows holding ``lengths`` tokens (bookkeeping only: no forward needed to refuse a step)."""
    rows = []
    for n in lengths:
        seq = kv.new_sequence()
        seq.advance([(i * 5) % CFG["vocab_size"] for i in range(n)])
        rows.append(seq)
    return rows


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("MEMOS_REF_KERNELS", KERNELS)
    return monkeypatch


def test_each_refusal_names_expected_and_actual_and_leaves_the_rows(dg, model, interpret):
    _, decode_graph = dg
    make = decode_graph.GraphedDecoder
    with pytest.raises(ConfigError, match="expected a float pool, got a quantized one"):
        make(model, new_kv(model, quant=PerTokenInt8()))
    with pytest.raises(DTypeError, match=r"pool's torch\.float64, got torch\.float32"):
        make(model, PagedKV(model.config.kv_spec(torch.float64, T), 8, device=DEVICE))
    kv = new_kv(model)
    decoder = make(model, kv, max_context=16, capture=Counting(dg[0], fail=True), enabled=True)
    rows = rows_of(kv, [8, 3])  # row 0 at a block boundary: a step would reserve a new block

    def refused(error, match, rows=rows, tokens=(1, 2), decoder=decoder):
        snap = state(kv, rows)
        with pytest.raises(error, match=match):
            decoder.step(rows, list(tokens))
        assert state(kv, rows) == snap

    refused(InvalidArgumentError, r"tokens: expected ints in \[0, 64\), got \[1, 64\]", tokens=(1, 64))
    refused(ShapeError, r"expected one per row \(2\), got 3", tokens=(1, 2, 3))
    refused(InvalidArgumentError, "at least one row", rows=[], tokens=())
    refused(RuntimeError, "capture refused")  # a failure after the rows were reserved: rolled back
    long_rows = rows_of(kv, [16])
    refused(ShapeError, "would hold 17 tokens after this step, past the graphs' max_context 16", rows=long_rows,
            tokens=(1,))  # fmt: skip
    assert not decoder.supports(long_rows) and decoder.supports(rows)
    other = rows_of(new_kv(model), [2])
    refused(ConfigError, "sequences of this decoder's PagedKV", rows=other, tokens=(1,))
    interpret.setenv("MEMOS_REF_KERNELS", "reference")
    refused(BackendUnavailableError, "expected the Triton kernels on .* MEMOS_REF_KERNELS=reference")
    assert not decoder.supports(rows)
    interpret.setenv("MEMOS_REF_KERNELS", KERNELS)
    doubled = copy.deepcopy(model)
    moved = make(doubled, kv, capture=Counting(dg[0], fail=True), enabled=True)
    doubled.double()  # the model now computes in fp64 over an fp32 pool
    refused(DTypeError, r"pool's torch\.float32, got torch\.float64", decoder=moved)
    kv.grow(4)  # the pool grew: a second segment the kernels cannot read through one tensor
    refused(ConfigError, r"expected a pool in 1 segment \(the kernels read one tensor\), got 2")
    assert decoder.graphs.stats.captures == 0


def test_a_model_with_a_sliding_window_is_refused_past_it(dg, model, interpret):
    _, decode_graph = dg
    windowed = LlamaForward(LlamaConfig(**CFG, sliding_window=8)).to(DEVICE).eval()
    kv = new_kv(windowed)
    decoder = decode_graph.GraphedDecoder(windowed, kv, capture=Counting(dg[0], fail=True), enabled=True)
    rows = rows_of(kv, [8])
    snap = state(kv, rows)
    with pytest.raises(ConfigError, match="sequence of 9 tokens exceeds the model's sliding window of 8"):
        decoder.step(rows, [1])
    assert state(kv, rows) == snap and decoder.supports(rows_of(kv, [7]))


def test_weights_moved_to_new_tensors_drop_every_graph(dg, model, interpret):
    """A graph replays the weights' addresses: weights replaced by new tensors (``model.to``, a reload by
    assignment) are captured again, and the replayed step reads the new weights."""
    mine = copy.deepcopy(model)
    kv = new_kv(mine)
    capture = Counting(dg[0])
    decoder = dg[1].GraphedDecoder(mine, kv, buckets=(1,), max_context=16, capture=capture, enabled=True)
    (row,) = rows_of(kv, [3])
    decoder.step([row], [1])
    decoder.step([row], [2])
    assert capture.buckets == [1] and decoder.graphs.stats.invalidations == 0
    with torch.no_grad():
        for p in mine.parameters():
            p.data = p.data * 2  # new tensors
    got = decoder.step([row], [3])
    assert capture.buckets == [1, 1] and decoder.graphs.stats.invalidations == 1
    twin_kv = new_kv(mine)  # the same history eagerly: the old weights for tokens 1 and 2, the new ones for 3
    (twin,) = rows_of(twin_kv, [3])
    for weights, token in ((model, 1), (model, 2)):
        eager_step(weights, twin_kv, [twin], [token])
    want = eager_step(mine, twin_kv, [twin], [3])
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), float((got - want).abs().max())


def engine_outputs(model, kv, mode, decode_graphs=None):
    requests = [Request(prompt=p, max_new_tokens=n) for p, n in zip(PROMPTS, (4, 3, 5))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMOS_REF_KERNELS", mode)
        engine = Engine(model, kv, max_batch=4, decode_graphs=decode_graphs)
        for request in requests:
            engine.submit(request)
        engine.run(max_steps=50)
    assert not any(r.failed for r in requests), [r.error for r in requests]
    return [r.output for r in requests]


def test_the_engine_with_graphs_gives_the_same_outputs_as_without(dg, model):
    """Three requests of different lengths and budgets: the decode steps replay their buckets' graphs (3 rows in
    bucket 4, then 2 and 1 as requests finish) and every request's tokens equal the eager engine's."""
    want = engine_outputs(model, new_kv(model), "reference")
    kv = new_kv(model)
    capture = Counting(dg[0])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMOS_REF_KERNELS", KERNELS)
        decoder = dg[1].GraphedDecoder(model, kv, buckets=(1, 2, 4), max_context=32, capture=capture, enabled=True)
    assert engine_outputs(model, kv, KERNELS, decoder) == want
    stats = decoder.graphs.stats  # decode steps of 3, 3, 2 and 1 rows (requests of 4, 3 and 5 tokens)
    assert capture.buckets == [4, 2, 1] and stats.replays == 4 and stats.eager == 0


def test_the_engine_runs_eagerly_what_the_graphs_do_not_support(dg, model):
    """With the kernels off (MEMOS_REF_KERNELS=reference) the decoder refuses every step: the engine runs the
    eager forward and gives the same tokens; a decoder over another pool or model, or not a decoder, is refused."""
    want = engine_outputs(model, new_kv(model), "reference")
    kv = new_kv(model)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMOS_REF_KERNELS", KERNELS)
        decoder = dg[1].GraphedDecoder(model, kv, capture=Counting(dg[0], fail=True), enabled=True)
        elsewhere = dg[1].GraphedDecoder(model, new_kv(model), enabled=True)
        other_model = dg[1].GraphedDecoder(copy.deepcopy(model), kv, enabled=True)
    assert engine_outputs(model, kv, "reference", decoder) == want
    assert decoder.graphs.stats.replays == 0 and decoder.graphs.stats.captures == 0
    with pytest.raises(ConfigError, match="over another PagedKV"):
        Engine(model, kv, decode_graphs=elsewhere)
    with pytest.raises(ConfigError, match="over another model"):
        Engine(model, kv, decode_graphs=other_model)
    with pytest.raises(ArgumentTypeError):
        Engine(model, kv, decode_graphs=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="host syncs inside a capture are refused only on a GPU")
def test_the_captured_forward_never_syncs_the_host(dg, model):
    kv = new_kv(model)
    (row,) = rows_of(kv, [5])
    decoder = dg[1].GraphedDecoder(model, kv, buckets=(1,), max_context=32)
    decoder.step([row], [1])  # captured for real
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            decoder.graphs.run([kv.pool.segments[0]], **decoder.graphs.static_inputs(1))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_step_function_launches_unvalidated_kernels_and_reads_no_value(dg, model, interpret):
    """``GraphedDecoder.forward`` (what is captured): one ``write_kv`` and one ``paged_decode_attention`` per layer,
    unvalidated, planned for the table's capacity (W × T), and no Python value read from any tensor — a read
    (``item``, ``int``, ``bool``, ``tolist``) would synchronize the host inside the graph."""
    from memos_kernels import triton_paged

    calls = []
    for name in ("write_kv", "paged_decode_attention"):
        real = getattr(triton_paged, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("validate"), kwargs.get("max_seq_len")))
            return _real(*args, **kwargs)

        interpret.setattr(triton_paged, name, spy)
    kv = new_kv(model)
    decoder = dg[1].GraphedDecoder(model, kv, max_context=20, enabled=False)  # the step function, uncaptured
    rows = rows_of(kv, [5, 9])
    batch = StepBatch.reserve(rows, 1)
    tables = torch.full((2, decoder.width), -1, device=DEVICE)  # as the bucket's buffer holds them: W columns
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    ids = torch.tensor([1, 2], device=DEVICE)
    inputs = dict(input_ids=ids, positions=batch.seq_lens - 1, slot_mapping=batch.slot_mapping, block_tables=tables,
                  seq_lens=batch.seq_lens)  # fmt: skip

    def read(*args, **kwargs):
        raise AssertionError("a Python value was read from a tensor inside the step")

    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "__int__", "__bool__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, read)
        logits = decoder.forward(**inputs)
    assert logits.shape == (2, CFG["vocab_size"]) and bool(torch.isfinite(logits).all())
    capacity = 3 * T  # max_context 20: 3 blocks of 8 in every table
    assert calls == [("write_kv", False, None), ("paged_decode_attention", False, capacity)] * CFG["num_layers"]
