"""Validation and launch planning once per step, not per layer (issue 25 item 5): ``DecodeStepLaunch`` checks and
plans a decode step with its first layer's arguments, then each layer only launches. Oracles: the wrapper
``paged_decode_attention`` (the same kernels must receive exactly the same arguments, and give the same output),
and call counts of the planning functions."""

from __future__ import annotations

import pytest
import torch
from conftest import kernel_modules

from memos_ref.errors import InvalidBlockError, ShapeError

ds, pd = kernel_modules("decode_step", "paged_decode")  # the whole file skips without Triton (raises in CI)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYERS, H, GROUP, T, D = 3, 2, 2, 8, 16


def case(seed: int = 0, lens=(19, 7, 0)):
    g = torch.Generator().manual_seed(seed)
    n = 12
    pool = torch.randn(n, LAYERS, 2, H, T, D, generator=g).to(DEVICE)  # [N, L, 2, H, T, D]: layer views
    tables = torch.randperm(n, generator=g)[: 3 * len(lens)].view(len(lens), 3).to(DEVICE)
    queries = [torch.randn(len(lens), H * GROUP, D, generator=g).to(DEVICE) for _ in range(LAYERS)]
    return pool, tables, torch.tensor(lens, device=DEVICE), queries


@pytest.mark.parametrize("tokens_per_split", [None, 8], ids=["one split", "three splits"])
def test_each_layer_equals_the_wrapper(tokens_per_split):
    pool, tables, lens, queries = case()
    step = pd.decode_step_launch(queries[0], pool[:, 0, 0], pool[:, 0, 1], tables, lens,
                               tokens_per_split=tokens_per_split)  # fmt: skip
    assert step.plan.num_splits == (1 if tokens_per_split is None else 3)
    for layer in range(LAYERS):
        got = step.launch(queries[layer], pool[:, layer, 0], pool[:, layer, 1])
        want = pd.paged_decode_attention(queries[layer], pool[:, layer, 0], pool[:, layer, 1], tables, lens,
                                         tokens_per_split=tokens_per_split)  # fmt: skip
        assert torch.allclose(got, want, atol=1e-6)
        assert torch.equal(got[2], torch.zeros(H * GROUP, D, device=DEVICE))  # length 0: zeros


class Recorder:
    """Stands in for a jitted kernel: records each launch's grid, arguments and options."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))

        return launch


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and (
            a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)  # fmt: skip
    return a == b


@pytest.mark.parametrize("tokens_per_split", [None, 8])
def test_the_kernels_get_exactly_the_wrappers_arguments(monkeypatch, tokens_per_split):
    split, reduce = Recorder(), Recorder()
    monkeypatch.setattr(pd, "decode_split_kernel", split)
    monkeypatch.setattr(pd, "decode_reduce_kernel", reduce)
    pool, tables, lens, queries = case(1)
    out_a = torch.empty_like(queries[1])
    step = pd.decode_step_launch(queries[0], pool[:, 0, 0], pool[:, 0, 1], tables, lens, scale=0.3,
                               tokens_per_split=tokens_per_split)  # fmt: skip
    step.launch(queries[1], pool[:, 1, 0], pool[:, 1, 1], out=out_a)
    pd.paged_decode_attention(queries[1], pool[:, 1, 0], pool[:, 1, 1], tables, lens, scale=0.3, out=out_a,
                              tokens_per_split=tokens_per_split)  # fmt: skip
    for rec in (split, reduce):
        assert len(rec.calls) == (2 if rec is split or tokens_per_split else 0)
        if rec.calls:
            (grid_a, args_a, kw_a), (grid_b, args_b, kw_b) = rec.calls
            assert grid_a == grid_b and kw_a == kw_b and len(args_a) == len(args_b)
            assert all(_same(a, b) for a, b in zip(args_a, args_b)), [
                i for i, (a, b) in enumerate(zip(args_a, args_b)) if not _same(a, b)
            ]


def test_checks_and_planning_run_once_per_step(monkeypatch):
    """Four layers: the wrapper's checks and planning (``validate_decode_inputs``, ``decode_bounds``,
    ``plan_decode``, ``check_cache``) run once, at the step's plan; the layers only launch."""
    counts = {}
    for mod, names in ((ds, ("validate_decode_inputs", "decode_bounds", "plan_decode", "check_cache", "dot_flags")),):
        for name in names:
            real = getattr(mod, name)

            def counted(*a, _real=real, _name=name, **k):
                counts[_name] = counts.get(_name, 0) + 1
                return _real(*a, **k)

            monkeypatch.setattr(mod, name, counted)
    split = Recorder()
    monkeypatch.setattr(pd, "decode_split_kernel", split)
    pool, tables, lens, queries = case(2)
    step = pd.decode_step_launch(queries[0], pool[:, 0, 0], pool[:, 0, 1], tables, lens)
    for layer in range(LAYERS):
        step.launch(queries[layer], pool[:, layer, 0], pool[:, layer, 1])
    assert counts == dict.fromkeys(counts, 1) and len(counts) == 5
    assert len(split.calls) == LAYERS


def test_a_layer_laid_out_otherwise_is_refused():
    pool, tables, lens, queries = case(3)
    step = pd.decode_step_launch(queries[0], pool[:, 0, 0], pool[:, 0, 1], tables, lens)
    with pytest.raises(ShapeError, match="query"):
        step.launch(queries[0].double(), pool[:, 0, 0], pool[:, 0, 1])
    with pytest.raises(ShapeError, match="query"):
        step.launch(queries[0][:2], pool[:, 0, 0], pool[:, 0, 1])
    other = pool[:, 0, 0].contiguous()  # the same shape, other strides
    with pytest.raises(ShapeError, match="caches"):
        step.launch(queries[0], other, other)
    with pytest.raises(ShapeError, match="out must be like the query"):
        step.launch(queries[0], pool[:, 0, 0], pool[:, 0, 1], out=torch.empty(2, H * GROUP, D, device=DEVICE))


def test_the_wrapper_plans_once_per_step_through_its_memo(monkeypatch):
    """``paged_decode_attention(..., step_memo=notes)`` (what the package's forward passes): the first layer
    plans (``validate=None``: the values checked on the CPU), the others reuse the plan; a new block table (the
    next step) plans again. Outputs equal the memo-less wrapper's."""
    planned = []
    real = ds.plan_decode

    def counted(*a, **k):
        planned.append(1)
        return real(*a, **k)

    monkeypatch.setattr(ds, "plan_decode", counted)
    pool, tables, lens, queries = case(4)
    notes: dict = {}
    for layer in range(LAYERS):
        got = pd.paged_decode_attention(queries[layer], pool[:, layer, 0], pool[:, layer, 1], tables, lens,
                                        validate=None if layer == 0 else False, step_memo=notes)  # fmt: skip
        want = pd.paged_decode_attention(queries[layer], pool[:, layer, 0], pool[:, layer, 1], tables, lens)
        assert torch.allclose(got, want, atol=1e-6)
    assert len(planned) == 1  # the memo-less calls plan in paged_decode itself, not counted here
    assert isinstance(notes["decode_step_launch"], ds.DecodeStepLaunch)
    pd.paged_decode_attention(queries[0], pool[:, 0, 0], pool[:, 0, 1], tables.clone(), lens, step_memo=notes)
    assert len(planned) == 2  # the next step's tables: planned again
    bad = tables.clone()
    bad[0, 0] = 99  # outside the pool: planned unchecked (the kernel masks), refused once the values are checked
    pd.paged_decode_attention(queries[0], pool[:, 0, 0], pool[:, 0, 1], bad, lens, step_memo=notes, validate=False)
    assert len(planned) == 3
    with pytest.raises(InvalidBlockError, match="block id 99"):
        pd.paged_decode_attention(queries[1], pool[:, 1, 0], pool[:, 1, 1], bad, lens, step_memo=notes,
                                  validate=True)  # fmt: skip
    assert len(planned) == 3  # the plan was reused; the check still ran
