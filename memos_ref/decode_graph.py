"""Whole-forward CUDA-graph decode for the package's Llama forward over a paged pool: :class:`GraphedDecoder`.

A decode step of the package forward (``LlamaForward`` over a ``PagedCache``) does host work between its launches:
per layer about a dozen torch ops (norms, projections, RoPE, the MLP) and two Triton launches (the K/V write, the
decode), each with its Python and launcher cost. At small batches that host time is most of the step. A CUDA graph
records the step's launches once and replays them with one call — but it replays *addresses*: the step must read
only static buffers and do no host bookkeeping inside. So the step is split in two:

* **on the host, outside the graph** — ``StepBatch.reserve(rows, 1)`` reserves every row's next slot (a new block
  when a row crosses one, the copy of a shared tail) and builds the slot mapping, block tables and lengths; after
  the replay ``StepBatch.mark_written_by_kernel()`` counts every layer written and the rows register their full
  blocks, as the eager path's last layer does; on any failure every row is rolled back to where it was;
* **on the device, in the graph** — :meth:`GraphedDecoder.forward`, a pure function
  ``(input_ids [B], positions [B], slot_mapping [B], block_tables [B, W], seq_lens [B]) -> logits [B, V]``: the
  embedding, RoPE from the positions tensor, every layer through the model's own modules with ``write_kv`` and
  ``paged_decode_attention`` (unvalidated: the kernels mask every index; the split plan made for the table's
  capacity ``W × T``, so one graph serves every length), the final norm and the LM head. No host sync, no Python
  value read from a tensor.

Buckets, static buffers, padding rows (length 0, slot -1: they read and write nothing) and invalidation (another
pool tensor) are :class:`memos_kernels.decode_graphs.DecodeGraphs`'; weights moved to new tensors
(``model.to(...)``) drop every graph too. What the graph cannot do is refused with a specific error before any row
changes (:meth:`GraphedDecoder.check`): a quantized or multi-segment (grown) pool, a model computing in another
dtype than the pool's, no kernels on the pool's device, a geometry outside the kernels' launch set, a context past
``max_context`` or past the model's sliding window. ``Engine(decode_graphs=...)`` asks
:meth:`GraphedDecoder.supports` and runs the eager forward otherwise.

The logits differ from the eager forward's by rounding only: the eager decode plans its splits for the step's
longest row, the graph for the table's capacity, so the softmax partials are summed in another order.
``python -m memos_ref.decode_graph`` times both (:func:`bench_forward_graphs`, the device check's
``decode_forward_graph`` rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from memos_kernels.decode_graphs import DEFAULT_BUCKETS, CaptureFn, DecodeGraphs, rerun_capture
from memos_kernels.launch_plan import check_launchable

from memos_ref import attention
from memos_ref.errors import (
    BackendUnavailableError,
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    KVCacheError,
    ShapeError,
    check_index,
    check_type,
)
from memos_ref.model.llama import LlamaConfig, LlamaForward
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.step import StepBatch, rollback
from memos_ref.paged.store import PagedKV

__all__ = ["GraphedDecoder", "bench_forward_graphs", "check_serves", "main"]


def _kernels() -> Any:
    """``memos_kernels.triton_paged`` (Triton's interpreter switched on first under ``MEMOS_REF_KERNELS=interpret``,
    as :mod:`memos_ref.attention` does); looked up at each launch so a test's spy sees the calls."""
    if attention.kernel_mode() == "interpret":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from memos_kernels import triton_paged

    return triton_paged


class _GraphAttention:
    """What the model's attention layers see in place of a ``PagedCache`` inside the graph: ``attend`` writes the
    layer's K/V with ``write_kv`` and attends with ``paged_decode_attention``, reading only the step's tensors."""

    def __init__(self, pool: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 workspace: Any, kernels: Any) -> None:  # fmt: skip
        self.pool, self.slots, self.tables, self.lens, self.workspace = pool, slots, tables, lens, workspace
        self.capacity = tables.shape[1] * pool.shape[4]  # W × T: one split plan for every length
        self.kernels = kernels  # memos_kernels.triton_paged

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        """``query [B, Hq, 1, D]``, ``key, value [B, H, 1, D]`` -> ``[B, Hq, 1, D]`` (as ``PagedCache.attend``)."""
        h, d = key.shape[1], key.shape[3]
        kv = self.pool[:, layer]  # [N, 2, H, T, D]
        k = key.transpose(1, 2).reshape(-1, h, d)  # [B, H, D], as StepBatch.write hands write_kv
        v = value.transpose(1, 2).reshape(-1, h, d)
        self.kernels.write_kv(k, v, self.slots, kv[:, 0], kv[:, 1], validate=False)
        out = self.kernels.paged_decode_attention(query[:, :, 0], kv[:, 0], kv[:, 1], self.tables, self.lens,
                                                  max_seq_len=self.capacity, workspace=self.workspace,
                                                  validate=False)  # fmt: skip
        return out[:, :, None]


class GraphedDecoder:
    """The package forward's decode step over ``kv``, replayed from a CUDA graph per batch bucket (see the module
    notes).

    Args:
        model: the package's :class:`~memos_ref.model.llama.LlamaForward` (the pool's geometry, on its device).
        kv: the paged memory, a single-segment float pool.
        buckets: batch sizes a graph is captured for (a step of ``b`` rows runs in the smallest bucket ``>= b``;
            past the largest, the step function runs uncaptured).
        max_context: the longest row (tokens after a step) the graphs serve; the block tables are sized for it
            once. Default: the whole pool's tokens.
        capture / enabled: as :class:`~memos_kernels.decode_graphs.DecodeGraphs` (``torch.cuda.CUDAGraph`` when
            a GPU is present; a test passes a fake capture, e.g. ``rerun_capture``).
    """

    def __init__(
        self,
        model: LlamaForward,
        kv: PagedKV,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_context: int | None = None,
        capture: CaptureFn | None = None,
        enabled: bool | None = None,
    ) -> None:
        check_type("model", model, LlamaForward)
        check_type("kv", kv, PagedKV)
        spec, cfg = kv.spec, model.config
        geometry = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if geometry != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
            raise ShapeError(f"model: expected the pool's layers, KV heads and head dim "
                             f"{(spec.num_layers, spec.num_kv_heads, spec.head_dim)}, got {geometry}")  # fmt: skip
        t = spec.block_size
        self.max_context = check_index("max_context", kv.allocator.num_blocks * t if max_context is None
                                       else max_context, lo=1)  # fmt: skip
        self.model, self.kv, self.width = model, kv, -(-self.max_context // t)
        self._params = list(model.parameters())
        self._weights = self._weight_ptrs()
        d = cfg.head_dim  # RoPE's inverse frequencies as rope_cos_sin makes them, moved to the device once
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self._inv_freq = inv_freq.to(kv.pool.device)
        self._workspaces: dict[int, Any] = {}  # per bucket: a graph replays its partials' addresses
        self.graphs = DecodeGraphs(self.forward, buckets=buckets, widths={"block_tables": self.width},
                                   capture=capture, enabled=enabled)  # fmt: skip
        self._check_pool_and_model()

    # ------------------------------------------------------------------ what the graph can do
    def _weight_ptrs(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self._params)

    def _check_pool_and_model(self) -> None:
        pool, spec = self.kv.pool, self.kv.spec
        if pool.quantized:
            scheme = getattr(pool.scheme, "name", type(pool).__name__)
            raise ConfigError(
                f"decode graphs: expected a float pool, got a quantized one ({scheme}); run the eager forward"
            )
        segments = len(pool.segments)
        if segments != 1:
            raise ConfigError(f"decode graphs: expected a pool in 1 segment (the kernels read one tensor), got "
                              f"{segments} (the pool grew); run the eager forward")  # fmt: skip
        weight = self.model.lm_head.weight
        if weight.dtype != spec.dtype:
            raise DTypeError(f"decode graphs: expected the model to compute in the pool's {spec.dtype}, got "
                             f"{weight.dtype}")  # fmt: skip
        if weight.device != pool.device:
            raise DeviceError(f"decode graphs: expected the model on the pool's device {pool.device}, got "
                              f"{weight.device}")  # fmt: skip
        if not attention.use_kernels(pool.device):
            raise BackendUnavailableError(
                f"decode graphs: expected the Triton kernels on {pool.device}, but MEMOS_REF_KERNELS="
                f"{attention.kernel_mode()} runs the torch reference there; run the eager forward"
            )
        cfg = self.model.config
        check_launchable("decode graphs", cfg.head_dim, spec.block_size, cfg.num_heads // cfg.num_kv_heads,
                         spec.dtype, pool.device)  # fmt: skip

    def check(self, rows: Sequence[SequenceCache], tokens: Sequence[int] | None = None) -> None:
        """Raise the specific error for a step of ``rows`` (taking ``tokens``) the graph cannot run, changing
        nothing: the pool and model (see the module notes), no rows, rows of another pool, a token count or id
        the model cannot take, a row past ``max_context`` or the model's sliding window after the step."""
        self._check_pool_and_model()
        if not rows:
            raise InvalidArgumentError("rows: a decode step needs at least one row, got none")
        pool = self.kv.pool
        if any(seq.pool is not pool for seq in rows):
            raise ConfigError("rows: expected sequences of this decoder's PagedKV, got one of another pool")
        if tokens is not None:
            if len(tokens) != len(rows):
                raise ShapeError(f"tokens: expected one per row ({len(rows)}), got {len(tokens)}")
            vocab = self.model.config.vocab_size
            if any(type(t) is not int or not 0 <= t < vocab for t in tokens):
                raise InvalidArgumentError(f"tokens: expected ints in [0, {vocab}), got {list(tokens)[:16]}")
        longest = max(seq.num_tokens for seq in rows) + 1
        if longest > self.max_context:
            raise ShapeError(f"a row would hold {longest} tokens after this step, past the graphs' max_context "
                             f"{self.max_context}; build the decoder with a larger max_context")  # fmt: skip
        window = self.model.config.sliding_window
        if window is not None and longest > window:
            raise ConfigError(f"sequence of {longest} tokens exceeds the model's sliding window of {window}; the "
                              f"forward implements full attention only")  # fmt: skip

    def supports(self, rows: Sequence[SequenceCache]) -> bool:
        """Whether :meth:`step` can run ``rows`` (:meth:`check` raises nothing)."""
        try:
            self.check(rows)
        except KVCacheError:
            return False
        return True

    # ------------------------------------------------------------------ a step
    def step(self, rows: Sequence[SequenceCache], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step: row ``i`` takes ``tokens[i]`` at its next position. Returns the logits ``[B, V]`` (a
        copy: the graph's output buffer is overwritten by the next replay). All rows or none: a refused step
        (:meth:`check`) or a failure part-way leaves every row as it was."""
        rows = list(rows)
        self.check(rows, tokens)
        weights = self._weight_ptrs()
        if weights != self._weights:  # the weights moved (model.to, a reload by assignment): capture again
            self.graphs.invalidate()
            self._weights = weights
        device = self.kv.pool.device
        with torch.inference_mode():
            ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
            batch = StepBatch.reserve(rows, 1)
            try:
                logits = self.graphs.run(
                    [self.kv.pool.segments[0]],
                    input_ids=ids,
                    positions=batch.seq_lens - 1,
                    slot_mapping=batch.slot_mapping,
                    block_tables=batch.block_tables,
                    seq_lens=batch.seq_lens,
                ).clone()
                batch.mark_written_by_kernel()
            except BaseException:
                for seq, start in zip(rows, batch.starts):
                    rollback(seq, start)
                raise
        return logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The step's device work, the function captured: ``input_ids, positions, slot_mapping, seq_lens [B]``,
        ``block_tables [B, W]`` -> logits ``[B, V]``; every layer's K/V written at ``slot_mapping``."""
        from memos_kernels.decode_launch import DecodeWorkspace  # imports Triton: after the interpreter switch

        model, kernels = self.model, _kernels()
        ws = self._workspaces.get(input_ids.shape[0])
        if ws is None:
            ws = self._workspaces[input_ids.shape[0]] = DecodeWorkspace(input_ids.device)
        attend = _GraphAttention(self.kv.pool.segments[0], slot_mapping, block_tables, seq_lens, ws, kernels)
        x = model.model.embed_tokens(input_ids[:, None])  # [B, 1, hidden]
        angles = positions[:, None].float()[..., None] * self._inv_freq  # [B, 1, D/2], as rope_cos_sin
        angles = torch.cat([angles, angles], dim=-1)  # [B, 1, D]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in model.model.layers:
            x = layer(x, cos, sin, None, attend, True)  # paged: the layer calls attend.attend(q, k, v, layer)
        return model.lm_head(model.model.norm(x))[:, 0]  # [B, V]


def check_serves(decoder: object, model: object, kv: object) -> GraphedDecoder:
    """``decoder`` as a :class:`GraphedDecoder` over exactly ``model`` and ``kv`` (what an engine serving them may
    replay): :class:`~memos_ref.errors.ArgumentTypeError` for anything else, :class:`ConfigError` when it was built
    over another model or memory (its graphs would read other weights or another pool)."""
    check_type("decode_graphs", decoder, GraphedDecoder)
    assert isinstance(decoder, GraphedDecoder)
    if decoder.model is not model or decoder.kv is not kv:
        which = "model" if decoder.model is not model else "PagedKV"
        raise ConfigError(f"decode_graphs: expected a GraphedDecoder over this engine's model and PagedKV, got one "
                          f"over another {which}")  # fmt: skip
    return decoder


# ---------------------------------------------------------------------------------------------- benchmark
#: The device check's model: Llama-shaped (TinyLlama-1.1B's widths, 16 layers, GQA 32/8 × 64), random weights.
BENCH_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=16, num_heads=32,
                    num_kv_heads=8, head_dim=64)  # fmt: skip
DRY_CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16)  # fmt: skip


def bench_forward_graphs(device: str, *, dry: bool = False, batches: Sequence[int] = (1, 8), context: int = 2048,
                         block_size: int = 16, on_row: Callable[[dict[str, Any]], None] | None = None,
                         ) -> list[dict[str, Any]]:  # fmt: skip
    """The package forward's decode step (``model(ids, PagedCache, position_ids)``, as the engine runs it) beside
    :meth:`GraphedDecoder.step` at each batch, rows of ``context - 1`` tokens (random K/V) taking their next:
    milliseconds per step (``do_bench`` medians on a GPU, one wall-clock call on the CPU; each call includes the
    step's host bookkeeping and rolling the rows back), the speed-up, captures, the largest logit difference and
    ``ok`` (within rounding, one capture, no uncaptured step). ``dry``: a 2-layer fp32 model and 40 tokens (the
    CPU's interpreter). ``on_row`` sees each row as soon as it is measured."""
    from memos_kernels.timing import bench_ms

    torch.manual_seed(0)
    config = LlamaConfig(**(DRY_CONFIG if dry else BENCH_CONFIG))  # type: ignore[arg-type]
    dtype = torch.float32 if dry else torch.float16
    context = min(context, 40) if dry else context
    with torch.device(device):  # random weights made on the device (a 1 B model's init takes a minute on a CPU)
        model = LlamaForward(config).to(dtype).eval()
    rows = []
    for batch in batches:
        rows.append(_bench_batch(model, device, batch, context, block_size, dry, bench_ms))
        if on_row is not None:
            on_row(rows[-1])
    return rows


class _EagerRows:
    """The eager forward's cache where transformers (so ``memos_ref.hf.PagedCache``) is unavailable: PagedCache's
    decode path — ``prepare_step`` reserves, ``attend`` writes and attends through :mod:`memos_ref.attention` —
    without its argument checks."""

    def __init__(self, rows: list[SequenceCache]) -> None:
        self.sequences, self.batch = rows, None

    def get_seq_length(self) -> int:
        return max(seq.num_tokens for seq in self.sequences)

    def prepare_step(self, b: int, n: int) -> StepBatch:
        self.batch = StepBatch.reserve(self.sequences, n)
        return self.batch

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        attention.write_step(self.batch, layer, key, value)  # type: ignore[arg-type]
        return attention.attend_step(query, self.batch, layer)  # type: ignore[arg-type]


def _eager_cache(kv: PagedKV, rows: list[SequenceCache]) -> tuple[Any, str]:
    try:
        from memos_ref.hf import PagedCache  # the engine's: borrowed rows of their own lengths
    except ImportError as exc:
        return _EagerRows(rows), f"StepBatch adapter (memos_ref.hf unavailable: {type(exc).__name__})"
    cache = PagedCache(kv, owns_rows=False)
    cache.sequences = rows
    return cache, "PagedCache"


def _bench_batch(model: LlamaForward, device: str, batch: int, context: int, block_size: int, dry: bool,
                 bench_ms: Any) -> dict[str, Any]:  # fmt: skip
    cfg = model.config
    row: dict[str, Any] = {"row": "decode_forward_graph", "batch": batch, "layers": cfg.num_layers,
                           "hidden": cfg.hidden_size, "context": context,
                           "dtype": str(model.lm_head.weight.dtype)}  # fmt: skip
    try:
        per = -(-context // block_size)
        kv = PagedKV(model.kv_spec(block_size), batch * per + 1, device=device, prefix_caching=False)
        kv.pool.segments[0].normal_()
        rows = [kv.new_sequence() for _ in range(batch)]
        for r, seq in enumerate(rows):
            seq.advance([(r + i) % cfg.vocab_size for i in range(context - 1)])
        tokens = [(7 * r + 3) % cfg.vocab_size for r in range(batch)]
        ids = torch.tensor(tokens, device=device)[:, None]
        cache, row["eager"] = _eager_cache(kv, rows)
        decoder = GraphedDecoder(model, kv, buckets=(batch,), max_context=context, enabled=True,
                                 capture=None if device == "cuda" else rerun_capture)  # fmt: skip

        def back() -> None:
            for seq in rows:
                rollback(seq, context - 1)

        def eager() -> torch.Tensor:
            with torch.inference_mode():
                out = model(ids, cache, position_ids=torch.full_like(ids, context - 1))[:, -1]
            back()
            return out

        def graphed() -> torch.Tensor:
            out = decoder.step(rows, tokens)
            back()
            return out

        want, got = eager().float(), graphed().float()
        err = float((got - want).abs().max())
        tol = (1e-4 if dry else 1e-2) * max(1.0, float(want.abs().max()))  # the splits' order, rounded
        row.update(max_abs_err=err, tolerance=tol, argmax_equal=bool(torch.equal(got.argmax(-1), want.argmax(-1))))
        row["eager_ms"] = bench_ms(eager, device)
        row["graph_ms"] = bench_ms(graphed, device)
        row["speedup"] = row["eager_ms"] / max(row["graph_ms"], 1e-9)
        stats = decoder.graphs.stats
        row.update(captures=stats.captures, replays=stats.replays)
        row["ok"] = err <= tol and stats.captures == 1 and stats.eager == 0
    except Exception as exc:  # a capture refused on the device, a missing dependency: reported, the check fails
        row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
    return row


def main(argv: list[str] | None = None) -> int:
    """``python -m memos_ref.decode_graph [--dry-run] [--batches 1 8]``: one JSON row per batch on stdout, each
    printed as soon as measured (the device check's bench phase reads them); exit 1 when a row is not ok."""
    ap = argparse.ArgumentParser(prog="python -m memos_ref.decode_graph", description=bench_forward_graphs.__doc__)
    ap.add_argument("--dry-run", action="store_true", help="a 2-layer fp32 model in Triton's interpreter (CPU)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, default=2048)
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("MEMOS_REF_KERNELS", "interpret")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cpu" if args.dry_run else "cuda"
    batches = args.batches or ((1, 2) if args.dry_run else (1, 8))
    rows = bench_forward_graphs(device, dry=args.dry_run, batches=batches, context=args.context,
                                on_row=lambda row: print(json.dumps(row), flush=True))  # fmt: skip
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
