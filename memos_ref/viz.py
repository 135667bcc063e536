"""A picture of the pool: one cell per block, coloured by owner, so sharing and waste can be seen.

* white — free;
* grey, hatched — cached (held by nobody, kept for prefix reuse, evictable);
* a colour per sequence — a block held by that sequence alone (lighter if partly filled);
* dark red, label = refcount — a block shared by several sequences.

``snapshot(kv)`` captures the state; ``draw(snapshot)`` draws it; ``stepper(snapshots)`` gives an ipywidgets
slider over a list of snapshots (notebook 04 steps through a trace with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memos_ref.paged.allocator import BlockState
from memos_ref.paged.store import PagedKV

__all__ = ["PoolSnapshot", "draw", "snapshot", "stepper"]


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool at one moment: per block its state, refcount, holders, fill; and a caption."""

    states: tuple[int, ...]
    refcounts: tuple[int, ...]
    holders: tuple[tuple[int, ...], ...]
    filled: tuple[int, ...]
    block_size: int
    caption: str = ""


def snapshot(kv: PagedKV, caption: str = "") -> PoolSnapshot:
    """Capture the allocator state and which live sequences hold each block."""
    n, t = kv.allocator.num_blocks, kv.spec.block_size
    holders: list[list[int]] = [[] for _ in range(n)]
    filled = [0] * n
    for seq in kv.sequences.values():
        for i, block in enumerate(seq.block_table):
            holders[block].append(seq.seq_id)
            filled[block] = max(filled[block], min(t, seq.num_tokens - i * t))
    return PoolSnapshot(
        tuple(int(s) for s in kv.allocator.state),
        tuple(kv.allocator.refcount),
        tuple(tuple(h) for h in holders),
        tuple(filled),
        t,
        caption,
    )


def draw(snap: PoolSnapshot, ax: Any = None, columns: int | None = None) -> Any:
    """Draw a snapshot as a grid; returns the matplotlib axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(snap.states)
    columns = columns or min(n, 16)
    rows = math.ceil(n / columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(columns * 0.5 + 1, rows * 0.5 + 0.8))
    palette = plt.get_cmap("tab10")
    owners = sorted({h[0] for h in snap.holders if len(h) == 1})
    colour_of = {owner: palette(i % 10) for i, owner in enumerate(owners)}
    for block in range(n):
        r, c = divmod(block, columns)
        x, y = c, rows - 1 - r
        state, holders = snap.states[block], snap.holders[block]
        face, hatch, label = "white", None, ""
        alpha = 1.0
        if state == BlockState.CACHED:
            face, hatch = "#cccccc", "///"
        elif len(holders) > 1:
            face, label = "#8b0000", str(snap.refcounts[block])
        elif len(holders) == 1:
            face = colour_of[holders[0]]
            alpha = 0.35 + 0.65 * snap.filled[block] / snap.block_size
        ax.add_patch(
            Rectangle((x, y), 0.92, 0.92, facecolor=face, edgecolor="black", hatch=hatch, alpha=alpha, linewidth=0.6)
        )
        if label:
            ax.text(x + 0.46, y + 0.46, label, ha="center", va="center", color="white", fontsize=8)
    ax.set_xlim(-0.1, columns)
    ax.set_ylim(-0.1, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    legend = ", ".join(f"seq {o}" for o in owners[:6])
    ax.set_title(f"{snap.caption}\n{legend}{' …' if len(owners) > 6 else ''}".strip(), fontsize=9)
    return ax


def stepper(snapshots: list[PoolSnapshot], columns: int | None = None) -> Any:
    """An ipywidgets slider stepping through ``snapshots`` (starts on the last one, so it renders headless)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    def show(step: int) -> None:
        draw(snapshots[step], columns=columns)
        plt.show()

    slider = widgets.IntSlider(value=len(snapshots) - 1, min=0, max=len(snapshots) - 1, description="step")
    return widgets.interactive(show, step=slider)
