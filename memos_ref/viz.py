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

from memos_ref.errors import InvalidArgumentError
from memos_ref.paged.allocator import BlockState
from memos_ref.paged.store import PagedKV

__all__ = [
    "PoolSnapshot",
    "draw",
    "draw_block_table",
    "draw_fork",
    "draw_kv_attention",
    "draw_steps",
    "legend_handles",
    "snapshot",
    "stepper",
]


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


def draw_steps(
    snapshots: list[PoolSnapshot], columns: int | None = None, per_row: int = 2, *, cell_inches: float = 0.28
) -> Any:
    """Every snapshot of a trace in one static figure (small multiples, one shared legend, the same colour for a
    sequence in every panel); returns the figure. This is the picture that survives a headless run.
    ``cell_inches`` is one block's side: raise it (and lower ``per_row``) for a figure read at book width."""
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
    if not 0.05 <= cell_inches <= 2.0:
        from memos_ref.errors import InvalidArgumentError

        raise InvalidArgumentError(f"cell_inches={cell_inches!r}: expected 0.05..2.0 (inches per block)")
    size = (cols * (width * cell_inches + 0.4), rows * (height * cell_inches + 0.6))
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


# ------------------------------------------------------------------------------------------- concept diagrams
def _box(ax: Any, x: float, y: float, text: str, colour: str, width: float = 0.9, height: float = 0.8) -> Any:
    import matplotlib.patches as mpatches

    patch = mpatches.FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.02", fc=colour, ec="black", lw=0.8)
    ax.add_patch(patch)
    ax.text(x + width / 2, y + height / 2, text, ha="center", va="center", fontsize=9)
    return patch


def _arrow(ax: Any, start: tuple[float, float], end: tuple[float, float], colour: str = "black") -> Any:
    return ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": colour, "lw": 1.0})


def draw_kv_attention(cache: Any, layer: int = 0, new_tokens: int = 1, ax: Any = None) -> Any:
    """Where the cached K/V enter attention, from a real cache (anything with ``get_seq_length``): the
    ``past`` cached keys and values (grey) and this step's new ones (orange) are read by the new token's query;
    the new K/V are appended to the cache. Returns the axes (one arrow per key the query reads)."""
    import matplotlib.pyplot as plt

    total = int(cache.get_seq_length(layer))
    past = total - new_tokens
    if not 0 <= past <= total:
        raise InvalidArgumentError(f"new_tokens={new_tokens}: expected 0..{total} (the tokens the cache holds)")
    shown = list(range(total)) if total <= 12 else [*range(4), -1, *range(total - 7, total)]
    ax = ax or plt.subplots(figsize=(max(6.0, 0.75 * len(shown) + 2), 3.2))[1]
    for col, pos in enumerate(shown):
        if pos < 0:
            ax.text(col + 0.45, 1.4, "…", ha="center", fontsize=14)
            continue
        colour = "#f4a261" if pos >= past else "#d9d9d9"
        _box(ax, col, 2.0, f"k{pos}", colour)
        _box(ax, col, 0.2, f"v{pos}", colour)
        _arrow(ax, (len(shown) + 0.9, 1.4), (col + 0.45, 2.0), "#1d3557")
    _box(ax, len(shown) + 0.9, 1.0, f"q{total - 1}", "#a8dadc", width=1.0)
    ax.text(-0.2, 3.05, f"cached: {past} tokens (grey), this step: {new_tokens} (orange, appended)", fontsize=9)
    ax.set_xlim(-0.3, len(shown) + 2.2)
    ax.set_ylim(0, 3.4)
    ax.axis("off")
    ax.set_title("attention at a decode step: the new query reads every cached key; its weights mix the values")
    return ax


def draw_block_table(block_table: list[int], num_tokens: int, block_size: int, num_blocks: int, ax: Any = None) -> Any:
    """A block table mapping logical blocks (a sequence's, top) to physical blocks of the pool (bottom), from
    a real ``SequenceCache``'s ``block_table``; the last logical block shows how full it is. One arrow per
    logical block."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(max(6.0, 0.8 * num_blocks), 3.0))[1]
    used = set(block_table)
    for physical in range(num_blocks):
        _box(ax, physical, 0.2, f"#{physical}", "#8ecae6" if physical in used else "white")
    offset = (num_blocks - len(block_table)) / 2
    for logical, physical in enumerate(block_table):
        filled = min(block_size, num_tokens - logical * block_size)
        _box(ax, offset + logical, 2.2, f"L{logical}\n{filled}/{block_size}", "#ffb703")
        _arrow(ax, (offset + logical + 0.45, 2.2), (physical + 0.45, 1.0))
    ax.text(-0.2, 3.15, f"logical blocks of one sequence ({num_tokens} tokens)", fontsize=9)
    ax.text(-0.2, -0.25, f"physical blocks of the pool (table = {block_table})", fontsize=9)
    ax.set_xlim(-0.3, num_blocks + 0.2)
    ax.set_ylim(-0.5, 3.4)
    ax.axis("off")
    return ax


def draw_fork(parent_table: list[int], child_table: list[int], refcounts: Any, ax: Any = None) -> Any:
    """Copy-on-write after a fork, from the two real block tables and the allocator's refcounts: blocks both
    tables list are shared (dark red, label = refcount); the child's block that differs is its private copy
    of the partly filled tail (green). One arrow per table entry."""
    import matplotlib.pyplot as plt

    blocks = sorted(set(parent_table) | set(child_table))
    x = {b: i for i, b in enumerate(blocks)}
    ax = ax or plt.subplots(figsize=(max(6.0, 1.1 * len(blocks) + 2), 3.4))[1]
    for b in blocks:
        shared = b in parent_table and b in child_table
        colour = "#9d0208" if shared else ("#95d5b2" if b in child_table else "#8ecae6")
        label = f"#{b}\nref {int(refcounts[b])}" if shared else f"#{b}"
        _box(ax, x[b] * 1.1 + 1.2, 1.3, label, colour)
        if shared:
            ax.texts[-1].set_color("white")
    for row, (name, table) in enumerate((("parent", parent_table), ("child", child_table))):
        y = 2.9 if row == 0 else -0.3
        ax.text(0.0, y + 0.3, name, fontsize=10, fontweight="bold")
        for b in table:
            end_y = 2.1 if row == 0 else 1.3
            _arrow(ax, (x[b] * 1.1 + 1.65, y + (0 if row == 0 else 0.6)), (x[b] * 1.1 + 1.65, end_y))
    ax.set_xlim(-0.2, len(blocks) * 1.1 + 1.6)
    ax.set_ylim(-0.6, 3.6)
    ax.axis("off")
    ax.set_title("fork shares every block; the first write copies only the partly filled tail")
    return ax
