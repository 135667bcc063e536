"""CUDA-graph capture of the decode step (issue 25 item 5), its bookkeeping checked on the CPU: a fake capture
records each capture and replays by running the step again into the same output buffer, so bucket choice,
padding rows, static buffers reused, one capture per bucket and invalidation are exact counts; the package's
decode step (``attention_step``: every layer's write and decode) through the graphs equals the reference."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_modules

from memos_ref.attention_reference import paged_attention
from memos_ref.errors import InvalidArgumentError, ShapeError

(dg,) = kernel_modules("decode_graphs")  # the whole file skips without Triton (raises in CI)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: ``replay()`` runs the step on the captured buffers into the
    captured output tensor (a real graph replays into the same addresses)."""

    def __init__(self, fn, inputs, log):
        self.fn, self.inputs, self.log = fn, inputs, log
        self.out = fn(**inputs)

    def replay(self):
        self.log.append({k: v.clone() for k, v in self.inputs.items()})
        self.out.copy_(self.fn(**self.inputs))


@pytest.fixture
def replays():
    return []


def fake_capture(log):
    def capture(fn, inputs):
        graph = FakeGraph(fn, inputs, log)
        return graph, graph.out

    return capture


def row_sum(x, lens, tables):
    """A step that depends on every input row: x summed with its length and first table column."""
    return x.sum(-1) + lens.to(x.dtype) + tables[:, 0].to(x.dtype)


def test_bucket_choice():
    assert [dg.bucket_for(b, (1, 2, 4, 8)) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert dg.bucket_for(9, (1, 2, 4, 8)) is None  # past the largest: eager
    with pytest.raises(InvalidArgumentError, match="at least 1 row, got 0"):
        dg.bucket_for(0)


def test_one_capture_per_bucket_padding_rows_and_reused_buffers(replays):
    graphs = dg.DecodeGraphs(row_sum, buckets=(2, 4), widths={"tables": 3}, pad={"lens": 0, "tables": -1},
                             capture=fake_capture(replays), enabled=True)  # fmt: skip
    pool = torch.zeros(5)
    x = torch.arange(12.0).reshape(3, 4)
    lens, tables = torch.tensor([5, 6, 7]), torch.tensor([[1, 2], [3, 4], [5, 6]])
    got = graphs.run([pool], x=x, lens=lens, tables=tables)  # 3 rows: bucket 4
    assert torch.equal(got, row_sum(x, lens, tables))
    assert graphs.captured == (4,) and graphs.stats.captures == 1 and graphs.stats.replays == 1
    static = graphs.static_inputs(4)
    assert torch.equal(static["lens"], torch.tensor([5, 6, 7, 0]))  # padding row: length 0
    assert torch.equal(static["tables"], torch.tensor([[1, 2, -1], [3, 4, -1], [5, 6, -1], [-1, -1, -1]]))
    assert torch.equal(static["x"][3], torch.zeros(4))
    ptrs = {k: v.data_ptr() for k, v in static.items()}
    # 4 rows, a wider table: the same bucket, the same buffers, no new capture
    x4, lens4, tables4 = torch.ones(4, 4), torch.tensor([1, 2, 3, 4]), torch.arange(12).reshape(4, 3)
    got = graphs.run([pool], x=x4, lens=lens4, tables=tables4)
    assert torch.equal(got, row_sum(x4, lens4, tables4))
    assert {k: v.data_ptr() for k, v in graphs.static_inputs(4).items()} == ptrs
    assert graphs.stats.captures == 1 and graphs.stats.replays == 2
    # 1 row: bucket 2, its own capture; back to 3 rows: a replay of bucket 4, its padding rows reset
    graphs.run([pool], x=x[:1], lens=lens[:1], tables=tables[:1])
    got = graphs.run([pool], x=x[:3], lens=lens, tables=tables)
    assert torch.equal(got, row_sum(x, lens, tables))
    assert torch.equal(replays[-1]["tables"][:, 2], torch.tensor([-1, -1, -1, -1]))
    assert graphs.stats.by_bucket == {2: 1, 4: 1} and graphs.stats.replays == 4 and graphs.stats.eager == 0
    # 5 rows: past the largest bucket, eager
    x5 = torch.ones(5, 4)
    got = graphs.run([pool], x=x5, lens=torch.zeros(5, dtype=torch.long), tables=torch.zeros(5, 1, dtype=torch.long))
    assert torch.equal(got, torch.full((5,), 4.0)) and graphs.stats.eager == 1 and graphs.stats.captures == 2


def test_a_new_pool_or_shape_drops_every_graph(replays):
    graphs = dg.DecodeGraphs(row_sum, buckets=(4,), widths={"tables": 2}, capture=fake_capture(replays), enabled=True)
    x, lens, tables = torch.ones(2, 4), torch.tensor([1, 2]), torch.tensor([[0], [1]])
    pool = torch.zeros(8)
    graphs.run([pool], x=x, lens=lens, tables=tables)
    graphs.run([pool], x=x, lens=lens, tables=tables)
    assert graphs.stats.captures == 1 and graphs.stats.invalidations == 0
    grown = torch.zeros(16)  # the pool moved (grew into a new tensor)
    graphs.run([grown], x=x, lens=lens, tables=tables)
    assert graphs.stats.captures == 2 and graphs.stats.invalidations == 1
    graphs.run([grown[:8]], x=x, lens=lens, tables=tables)  # same address, another shape
    assert graphs.stats.captures == 3 and graphs.stats.invalidations == 2
    graphs.run([grown[:8]], x=torch.ones(2, 8), lens=lens, tables=tables)  # another head dim
    graphs.run([grown[:8]], x=x.double(), lens=lens, tables=tables)  # another dtype
    assert graphs.stats.captures == 5 and graphs.stats.invalidations == 4
    with pytest.raises(ShapeError, match="width 3 is past the graphs' static width 2"):
        graphs.run([grown[:8]], x=x, lens=lens, tables=torch.zeros(2, 3, dtype=torch.long))
    assert graphs.stats.captures == 5  # refused before anything changed
    graphs.invalidate()
    assert graphs.captured == () and graphs.stats.invalidations == 5


def test_disabled_runs_eagerly():
    calls = []

    def capture(fn, inputs):
        calls.append(1)
        raise AssertionError("no capture when disabled")

    graphs = dg.DecodeGraphs(row_sum, capture=capture, enabled=False)
    x = torch.ones(2, 3)
    assert torch.equal(graphs.run(x=x, lens=torch.tensor([1, 1]), tables=torch.zeros(2, 1)), torch.full((2,), 4.0))
    assert graphs.stats.eager == 1 and not calls


def decode_inputs(g, rows, lens, tables, layers, h, group, d, t):
    """One decode step's inputs: rows ``rows`` of ``tables`` at lengths ``lens`` (the new token is the last)."""
    inputs = dict(
        query=torch.randn(len(rows), layers, h * group, d, generator=g),
        key=torch.randn(len(rows), layers, h, d, generator=g),
        value=torch.randn(len(rows), layers, h, d, generator=g),
        block_tables=tables[rows],
        seq_lens=torch.tensor(lens),
    )
    inputs["slot_mapping"] = torch.tensor([int(tables[r, (ln - 1) // t]) * t + (ln - 1) % t
                                           for r, ln in zip(rows, lens)])  # fmt: skip
    return {k: v.to(DEVICE) for k, v in inputs.items()}


STEPS = (([0, 1, 2], [9, 20, 3]), ([1, 2], [21, 4]), ([0, 1, 2], [10, 22, 5]))


def run_steps(capture, replays_expected):
    layers, h, group, t, d, n = 2, 1, 2, 8, 16, 12
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(n, h, t, d, generator=g).to(DEVICE), torch.randn(n, h, t, d, generator=g).to(DEVICE))
             for _ in range(layers)]  # fmt: skip
    eager_pools = [(k.clone(), v.clone()) for k, v in pools]
    graphs = dg.DecodeGraphs(dg.attention_step(pools), buckets=(2, 4), widths={"block_tables": 4}, capture=capture,
                             enabled=True)  # fmt: skip
    eager = dg.attention_step(eager_pools)
    tables = torch.tensor([[0, 1, -1], [2, 3, 4], [5, -1, -1]])
    for rows, lens in STEPS:
        inputs = decode_inputs(g, rows, lens, tables, layers, h, group, d, t)
        got = graphs.run([x for kv in pools for x in kv], **inputs).clone()
        want = eager(**inputs)
        assert torch.allclose(got, want, atol=1e-5)
        for layer, (kc, vc) in enumerate(pools):
            ref = paged_attention(inputs["query"][:, layer, :, None].cpu(), kc.cpu(), vc.cpu(),
                                  inputs["block_tables"].cpu(), inputs["seq_lens"].cpu())[:, :, 0]  # fmt: skip
            assert torch.allclose(got[:, layer].cpu(), ref, atol=1e-5)
    for (k, v), (ek, ev) in zip(pools, eager_pools):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    assert graphs.stats.by_bucket == {4: 1, 2: 1} and graphs.stats.replays == replays_expected


def test_the_decode_step_through_the_graphs_equals_the_reference(replays):
    """Two layers, 3 rows in bucket 4, then 2 rows in bucket 2 and 3 rows again (a replay): each step writes
    its K/V through the slots and attends; the padding row writes nothing (slot -1) and the pool equals the
    eager step's."""
    run_steps(fake_capture(replays), 3)
    assert len(replays) == 3


@pytest.mark.skipif(DEVICE != "cuda", reason="a real CUDA graph needs a GPU (the bookkeeping is tested above)")
def test_a_real_cuda_graph_replays_the_decode_step():
    run_steps(None, 3)


def test_forward_graph_rows_keep_what_the_child_measured_and_name_its_failure(monkeypatch):
    """The device check's ``decode_forward_graph`` rows come from a child process (``python -m
    memos_ref.decode_graph``): each JSON line it printed is a row; a child that exits non-zero (or is killed at its
    time limit) without a failing row of its own adds one naming the failure; no time left runs nothing."""
    import subprocess

    ok_row = '{"row": "decode_forward_graph", "batch": 1, "ok": true}'
    calls = []

    def finished(rc, stdout, stderr=""):
        def run(cmd, **kw):
            calls.append((cmd, kw["timeout"], kw["env"]["MEMOS_REF_KERNELS"]))
            return subprocess.CompletedProcess(cmd, rc, stdout, stderr)

        return run

    monkeypatch.setattr(subprocess, "run", finished(0, f"a library's print\n{ok_row}\n"))
    assert dg.forward_graph_rows(True, 30) == [{"row": "decode_forward_graph", "batch": 1, "ok": True}]
    assert calls[-1][0][-2:] == ["memos_ref.decode_graph", "--dry-run"] and calls[-1][1:] == (30, "interpret")
    monkeypatch.setattr(subprocess, "run", finished(1, ok_row + "\n", "Traceback ... CUDA error"))
    rows = dg.forward_graph_rows(False, 30)
    assert rows[0]["ok"] and rows[1] == {"row": "decode_forward_graph", "rc": 1, "error": "Traceback ... CUDA error",
                                         "ok": False}  # fmt: skip
    assert calls[-1][2] == "triton" and "--dry-run" not in calls[-1][0]

    def killed(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=(ok_row + "\n").encode())

    monkeypatch.setattr(subprocess, "run", killed)
    rows = dg.forward_graph_rows(False, 12)
    assert rows[0]["ok"] and not rows[1]["ok"] and rows[1]["error"] == "timed out after 12 s" and rows[1]["rc"] == 124
    n = len(calls)
    assert dg.forward_graph_rows(False, 4) == [
        {"row": "decode_forward_graph", "error": "no time left in the bench phase (4 s)", "ok": False}
    ]
    assert len(calls) == n
