"""Metrics exposition and the pool picture reflect the real state of the paged memory."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from memos_ref.errors import InvalidArgumentError
from memos_ref.metrics import PagedMetrics
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec
from memos_ref.viz import draw, draw_steps, snapshot, stepper

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, block_size=8)


def _metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_exposition_matches_the_allocator_and_prefix_cache():
    kv = PagedKV(SPEC, 16)
    metrics = PagedMetrics(kv)
    a = kv.new_sequence()
    a.reserve(20, list(range(20)))
    a.mark_written()  # 3 blocks, 2 full and registered
    a.free()  # 2 cached + 1 free
    b = kv.start_from_prefix([*range(20), 99])  # reuses 16 tokens
    b.reserve(5, [1] * 5)
    b.mark_written()
    values = _metrics(metrics.exposition())
    assert values["memos_kv_blocks_total"] == 16
    assert values["memos_kv_blocks_active"] == kv.allocator.num_active == 3
    assert values["memos_kv_blocks_cached"] == 0 and values["memos_kv_blocks_free"] == 13
    assert values["memos_kv_prefix_hit_tokens_total"] == 16
    assert values["memos_kv_prefix_query_tokens_total"] == 21
    assert values["memos_kv_slot_utilization"] == 21 / 24
    assert values["memos_kv_allocate_seconds_count"] >= 1


def test_snapshot_and_drawing():
    kv = PagedKV(SPEC, 12)
    a = kv.new_sequence()
    a.reserve(12, list(range(12)))
    a.mark_written()
    b = a.fork()
    b.reserve(1, [5])  # copy-on-write of the shared tail
    b.mark_written()
    snap = snapshot(kv, "test")
    shared = [blk for blk, h in enumerate(snap.holders) if len(h) == 2]
    assert shared == [a.block_table[0]] and snap.refcounts[shared[0]] == 2
    assert snap.filled[b.block_table[1]] == 5
    ax = draw(snap)
    assert len(ax.patches) == 12
    assert stepper([snap, snap]) is not None


def _forked_pool() -> PagedKV:
    kv = PagedKV(SPEC, 12)
    a = kv.new_sequence()
    a.reserve(12, list(range(12)))
    a.mark_written()
    b = a.fork()
    b.reserve(1, [5])
    b.mark_written()
    return kv


def test_drawing_has_a_legend_naming_every_colour():
    snap = snapshot(_forked_pool(), "legend")
    ax = draw(snap)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[:3] == ["free", "cached (no holder, evictable)", "shared (number = refcount)"]
    owners = sorted({h[0] for h in snap.holders if len(h) == 1})
    assert len(owners) == 2 and labels[3:] == [f"seq {o} only (pale = part full)" for o in owners]
    assert draw(snap, legend=False).get_legend() is None


def test_draw_steps_is_static_with_one_panel_per_snapshot_and_one_legend():
    kv = _forked_pool()
    steps = [snapshot(kv, f"step {i}") for i in range(3)]
    fig = draw_steps(steps, per_row=2)
    panels = [ax for ax in fig.axes if ax.patches]
    assert [ax.get_title() for ax in panels] == ["step 0", "step 1", "step 2"]
    assert all(len(ax.patches) == 12 for ax in panels) and len(fig.legends) == 1
    with pytest.raises(InvalidArgumentError):
        draw_steps([])


def test_draw_steps_cell_inches_sets_the_block_size_for_book_width():
    """One block is cell_inches wide: 12 blocks in 12 columns, one panel per row, plus the 0.4-inch margin."""
    kv = _forked_pool()
    steps = [snapshot(kv, f"step {i}") for i in range(3)]
    fig = draw_steps(steps, columns=12, per_row=1, cell_inches=0.5)
    assert tuple(fig.get_size_inches()) == (12 * 0.5 + 0.4, 3 * (1 * 0.5 + 0.6))
    assert tuple(draw_steps(steps, columns=12, per_row=1).get_size_inches()) == (12 * 0.28 + 0.4, 3 * (0.28 + 0.6))
    for bad in (0.0, 5.0):
        with pytest.raises(InvalidArgumentError):
            draw_steps(steps, cell_inches=bad)


# ------------------------------------------------------------------ the three concept diagrams, from real structures
def _arrows(ax):
    return [c for c in ax.get_children() if type(c).__name__ == "Annotation" and c.arrow_patch is not None]


def test_kv_attention_diagram_reads_the_real_cache():
    import matplotlib

    matplotlib.use("Agg")
    from memos_ref.caches import ContiguousCache
    from memos_ref.errors import InvalidArgumentError
    from memos_ref.viz import draw_kv_attention

    cache, x = ContiguousCache(num_layers=1), torch.zeros(1, 1, 5, 4)
    cache.update(x, x, 0)
    ax = draw_kv_attention(cache, new_tokens=1)
    assert len(_arrows(ax)) == 5  # the new query reads every cached key
    labels = [t.get_text() for t in ax.texts]
    assert "k4" in labels and "v0" in labels and "q4" in labels
    with pytest.raises(InvalidArgumentError):
        draw_kv_attention(cache, new_tokens=6)


def test_block_table_and_fork_diagrams_follow_the_allocator():
    import matplotlib

    matplotlib.use("Agg")
    from memos_ref.hf import PagedCache
    from memos_ref.model import ByteTokenizer, load_model
    from memos_ref.viz import draw_block_table, draw_fork

    model, tok = load_model(), ByteTokenizer()
    kv = PagedKV(model.kv_spec(block_size=16), num_blocks=12)
    parent = PagedCache(kv)
    with torch.no_grad():
        model(tok("# tools: search, read_file, write_file\nimport os\n"), parent)  # 50 tokens: 4 blocks
    table = list(parent.sequences[0].block_table)
    ax = draw_block_table(table, 50, 16, kv.allocator.num_blocks)
    assert len(_arrows(ax)) == len(table) == 4 and "L3\n2/16" in [t.get_text() for t in ax.texts]
    child = parent.fork()
    with torch.no_grad():
        model(tok("def run():\n", add_bos=False), child)  # the child's first write copies the tail
    p_table, c_table = list(parent.sequences[0].block_table), list(child.sequences[0].block_table)
    ax = draw_fork(p_table, c_table, kv.allocator.refcount)
    labels = [t.get_text() for t in ax.texts]
    shared = [b for b in p_table if b in c_table]
    assert len(shared) == 3 and all(f"#{b}\nref 2" in labels for b in shared)  # 3 full blocks shared
    assert len(_arrows(ax)) == len(p_table) + len(c_table)
