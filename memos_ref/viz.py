"""A picture of the pool: one cell per block, coloured by owner, so sharing and waste can be seen.

* white — free;
* grey, hatched — cached (held by nobody, kept for prefix reuse, evictable);
* a colour per sequence — a block held by that sequence alone (lighter if partly filled);
* dark red, label = refcount — a block shared by several sequences.

``snapshot(kv)`` captures the state; ``draw(snapshot)`` draws it with a legend of these colours;
``draw_steps(snapshots)`` draws a whole trace as small multiples in one static matplotlib figure (what a headless
run, an HTML export or a reader on GitHub sees); ``stepper(snapshots)`` gives an ipywidgets slider over the same
snapshots for a live kernel (notebook 04 uses both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memos_ref.paged.allocator import BlockState
from memos_ref.paged.store import PagedKV

__all__ = ["PoolSnapshot", "draw", "draw_steps", "legend_handles", "snapshot", "stepper"]


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


FREE_COLOUR, CACHED_COLOUR, SHARED_COLOUR = "white", "#cccccc", "#8b0000"


def _owner_colours(owners: list[int]) -> dict[int, Any]:
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab10")
    return {owner: palette(i % 10) for i, owner in enumerate(owners)}


def _owners(snaps: list[PoolSnapshot]) -> list[int]:
    return sorted({h[0] for snap in snaps for h in snap.holders if len(h) == 1})


def legend_handles(owners: list[int], max_owners: int = 6) -> list[Any]:
    """The legend entries of a pool drawing: free, cached, shared (label = refcount), one per owning sequence."""
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=FREE_COLOUR, edgecolor="black", label="free"),
        Patch(facecolor=CACHED_COLOUR, edgecolor="black", hatch="///", label="cached (no holder, evictable)"),
        Patch(facecolor=SHARED_COLOUR, edgecolor="black", label="shared (number = refcount)"),
    ]
    colours = _owner_colours(owners)
    for owner in owners[:max_owners]:
        handles.append(Patch(facecolor=colours[owner], edgecolor="black", label=f"seq {owner} only (pale = part full)"))
    if len(owners) > max_owners:
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"… {len(owners) - max_owners} more sequences"))
    return handles


def draw(
    snap: PoolSnapshot,
    ax: Any = None,
    columns: int | None = None,
    *,
    legend: bool = True,
    colours: dict[int, Any] | None = None,
) -> Any:
    """Draw a snapshot as a grid, one cell per block, with a legend (``legend=False`` leaves it to the caller);
    returns the matplotlib axes. ``colours`` fixes sequence colours across several drawings."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = len(snap.states)
    columns = columns or min(n, 16)
    rows = math.ceil(n / columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(columns * 0.5 + 1, rows * 0.5 + 0.8))
    owners = _owners([snap])
    colour_of = colours if colours is not None else _owner_colours(owners)
    for block in range(n):
        r, c = divmod(block, columns)
        x, y = c, rows - 1 - r
        state, holders = snap.states[block], snap.holders[block]
        face, hatch, label = FREE_COLOUR, None, ""
        alpha = 1.0
        if state == BlockState.CACHED:
            face, hatch = CACHED_COLOUR, "///"
        elif len(holders) > 1:
            face, label = SHARED_COLOUR, str(snap.refcounts[block])
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
    ax.set_title(snap.caption, fontsize=9)
    if legend:
        ax.legend(
            handles=legend_handles(owners), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False
        )
    return ax


def draw_steps(snapshots: list[PoolSnapshot], columns: int | None = None, per_row: int = 2) -> Any:
    """Every snapshot of a trace in one static figure (small multiples, one shared legend, the same colour for a
    sequence in every panel); returns the figure. This is the picture that survives a headless run."""
    import matplotlib.pyplot as plt

    if not snapshots:
        from memos_ref.errors import InvalidArgumentError

        raise InvalidArgumentError("draw_steps needs at least one snapshot")
    owners = _owners(snapshots)
    colours = _owner_colours(owners)
    n = len(snapshots)
    cols = min(per_row, n)
    rows = math.ceil(n / cols)
    width = columns or min(len(snapshots[0].states), 16)
    height = math.ceil(len(snapshots[0].states) / width)
    size = (cols * (width * 0.28 + 0.4), rows * (height * 0.28 + 0.6))
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    for ax, snap in zip(axes.flat, snapshots):
        draw(snap, ax=ax, columns=columns, legend=False, colours=colours)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles = legend_handles(owners)
    per_line = min(4, len(handles))
    fig.legend(handles=handles, loc="lower center", ncol=per_line, fontsize=7, frameon=False)
    legend_lines = math.ceil(len(handles) / per_line)
    fig.tight_layout(rect=(0, min(0.5, (legend_lines * 0.22 + 0.1) / size[1]), 1, 1))
    return fig


def stepper(snapshots: list[PoolSnapshot], columns: int | None = None) -> Any:
    """An ipywidgets slider stepping through ``snapshots`` in a live kernel (it starts on the last one).

    A widget's drawing exists only while a kernel runs it: a headless run (nbmake, nbconvert) or a notebook viewed
    on GitHub shows no picture for it. Draw the trace with :func:`draw_steps` too, for the static copy."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    colours = _owner_colours(_owners(snapshots))

    def show(step: int) -> None:
        draw(snapshots[step], columns=columns, colours=colours)
        plt.show()

    slider = widgets.IntSlider(value=len(snapshots) - 1, min=0, max=len(snapshots) - 1, description="step")
    return widgets.interactive(show, step=slider)
