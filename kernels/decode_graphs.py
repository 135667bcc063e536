"""Optional CUDA-graph capture of a decode step at fixed batch buckets: the bookkeeping, and the step the device
check measures.

A decode step launches a few kernels per layer (the K/V write, the split decode, the reduce when there are several
splits) and each launch costs host time — Python validation, planning, Triton's launcher — of the order of the
GPU's own attention time at small batches. A CUDA graph records the step's launches once and replays them with one
call. It replays *addresses*, so everything the step reads must sit in static buffers: :class:`DecodeGraphs` keeps,
per batch bucket, one set of static inputs (a step of ``b`` rows runs in the smallest bucket ``>= b``; the rows
past ``b`` are padding that reads and writes nothing), captures the step the first time a bucket is used, and
replays it afterwards after copying the real rows in.

What a captured graph depends on beyond its bucket is its :class:`GraphKey`: the tensors the step reads besides
its inputs (the pool: address, shape, strides, dtype, device) and the inputs' element types and trailing shapes.
A different key (the pool grew into a new tensor, a model with other heads) drops every graph and buffer: the
next step captures again. Block tables are sized once for the longest context (``widths``): a wider table is a
``ShapeError`` naming both widths, never a silent truncation.

The step function must read only its keyword inputs and the key's tensors, write only its output and the pool,
and give the same result when run twice on the same inputs (the capture runs it for warm-up: Triton compiles
outside the graph). :func:`attention_step` is the package's decode step of that shape: every layer's K/V write and
decode attention, one split planned for the table's capacity, so a sequence of any length replays one graph.

Without a GPU, :class:`DecodeGraphs` takes a ``capture`` function (tests pass a fake that records captures and
replays); with ``enabled=False`` or a batch past the largest bucket it runs the step eagerly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from memos_ref.errors import ConfigError, InvalidArgumentError, ShapeError

__all__ = [
    "DEFAULT_BUCKETS",
    "PAD",
    "DecodeGraphs",
    "GraphKey",
    "GraphStats",
    "Replayable",
    "attention_step",
    "bench_step_graphs",
    "bucket_for",
    "cuda_capture",
    "forward_graph_rows",
    "rerun_capture",
]

#: Batch sizes a graph is captured for (a step of ``b`` rows runs in the smallest bucket ``>= b``).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)

#: What padding rows (and table columns past a row's width) hold: a length of 0 attends to nothing, slot -1 is
#: not written, block id -1 is never read.
PAD: dict[str, int | float] = {"seq_lens": 0, "slot_mapping": -1, "block_tables": -1}

StepFn = Callable[..., torch.Tensor]


class Replayable(Protocol):
    """A captured graph: ``replay()`` runs its launches again on the same buffers."""

    def replay(self) -> None: ...


CaptureFn = Callable[[StepFn, dict[str, torch.Tensor]], tuple[Replayable, torch.Tensor]]


def bucket_for(batch: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int | None:
    """The smallest bucket ``>= batch``, or ``None`` when ``batch`` is past the largest (the step runs eagerly)."""
    if batch < 1:
        raise InvalidArgumentError(f"batch: expected at least 1 row, got {batch}")
    return next((b for b in sorted(buckets) if b >= batch), None)


def _describe(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass(frozen=True)
class GraphKey:
    """What every captured graph depends on besides its bucket: the tensors the step reads that are not inputs
    (address, shape, strides, dtype, device of each) and each input's element type, trailing shape and device."""

    tensors: tuple[tuple[Any, ...], ...]
    inputs: tuple[tuple[str, torch.dtype, tuple[int, ...], torch.device], ...]

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], inputs: Mapping[str, torch.Tensor],
           widths: Mapping[str, int]) -> GraphKey:  # fmt: skip
        """The key of a step reading ``tensors`` with ``inputs`` (widths: the static sizes of dim 1)."""
        rest = []
        for name, t in sorted(inputs.items()):
            trailing = tuple(t.shape[1:])
            if name in widths:
                trailing = (widths[name], *trailing[1:])
            rest.append((name, t.dtype, trailing, t.device))
        return cls(tuple(_describe(t) for t in tensors), tuple(rest))


@dataclass
class GraphStats:
    """Counts kept by :class:`DecodeGraphs`: graphs captured, replays, eager steps, invalidations, and the
    captures per bucket."""

    captures: int = 0
    replays: int = 0
    eager: int = 0
    invalidations: int = 0
    by_bucket: dict[int, int] = field(default_factory=dict)


def cuda_capture(fn: StepFn, inputs: dict[str, torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
    """Capture ``fn(**inputs)`` in a CUDA graph: two warm-up runs on a side stream (Triton compiles and autotunes
    outside the graph), then the capture; returns the graph and its output buffer."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(**inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(**inputs)
    return graph, out


class DecodeGraphs:
    """A decode step ``fn(**inputs) -> Tensor [B, ...]`` replayed from a CUDA graph per batch bucket.

    ``inputs`` are tensors whose first dim is the batch; ``widths`` fixes dim 1 of some (block tables: the
    longest context's blocks); ``pad`` is what padding rows and columns hold (default :data:`PAD`, 0 for other
    inputs). ``tensors`` (at each :meth:`run`) are what the step reads besides its inputs — the pool — and key the
    graphs (:class:`GraphKey`). ``capture`` defaults to :func:`cuda_capture`; ``enabled`` defaults to whether a
    GPU is present."""

    def __init__(
        self,
        fn: StepFn,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        widths: Mapping[str, int] | None = None,
        pad: Mapping[str, int | float] | None = None,
        capture: CaptureFn | None = None,
        enabled: bool | None = None,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ConfigError(f"buckets: expected batch sizes >= 1, got {tuple(buckets)}")
        self.fn = fn
        self.buckets = tuple(sorted(set(buckets)))
        self.widths = dict(widths or {})
        self.pad = {**PAD, **(pad or {})}
        self.capture = capture or cuda_capture
        self.enabled = torch.cuda.is_available() if enabled is None else enabled
        self.stats = GraphStats()
        self._key: GraphKey | None = None
        self._static: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, tuple[Replayable, torch.Tensor]] = {}

    # ------------------------------------------------------------------ state
    @property
    def captured(self) -> tuple[int, ...]:
        """The buckets holding a captured graph now."""
        return tuple(sorted(self._graphs))

    def static_inputs(self, bucket: int) -> dict[str, torch.Tensor]:
        """The static input buffers of ``bucket`` (the same tensors at every replay)."""
        return self._static[bucket]

    def invalidate(self) -> None:
        """Drop every captured graph and static buffer (the next step captures again)."""
        if self._graphs or self._static:
            self.stats.invalidations += 1
        self._graphs.clear()
        self._static.clear()
        self._key = None

    # ------------------------------------------------------------------ a step
    def run(self, tensors: Sequence[torch.Tensor] = (), **inputs: torch.Tensor) -> torch.Tensor:
        """One step over ``inputs`` (batch ``b`` on dim 0): replayed from the bucket's graph (captured first if
        needed; every graph dropped first when :class:`GraphKey` changed), or eager when disabled or ``b`` is past
        the largest bucket. Returns the step's output for the ``b`` real rows."""
        if not inputs:
            raise InvalidArgumentError("inputs: a step needs at least one batched tensor")
        batch = {t.shape[0] for t in inputs.values()}
        if len(batch) != 1:
            raise ShapeError(f"inputs: expected one batch size on dim 0, got {sorted(batch)}")
        (b,) = batch
        for name, width in self.widths.items():
            got = inputs[name].shape[1] if name in inputs and inputs[name].ndim > 1 else None
            if got is not None and got > width:
                raise ShapeError(f"{name}: width {got} is past the graphs' static width {width}; size them for the "
                                 f"longest context")  # fmt: skip
        bucket = bucket_for(b, self.buckets) if self.enabled else None
        if bucket is None:
            self.stats.eager += 1
            return self.fn(**inputs)
        key = GraphKey.of(tensors, inputs, self.widths)
        if key != self._key:
            self.invalidate()
            self._key = key
        static = self._static.get(bucket)
        if static is None:
            static = self._static[bucket] = self._allocate(bucket, inputs)
        self._fill(static, inputs, b)
        if bucket not in self._graphs:
            self._graphs[bucket] = self.capture(self.fn, static)
            self.stats.captures += 1
            self.stats.by_bucket[bucket] = self.stats.by_bucket.get(bucket, 0) + 1
        graph, out = self._graphs[bucket]
        graph.replay()
        self.stats.replays += 1
        return out[:b]

    def _allocate(self, bucket: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        static = {}
        for name, t in inputs.items():
            shape = [bucket, *t.shape[1:]]
            if name in self.widths:
                shape[1] = self.widths[name]
            static[name] = torch.full(shape, self.pad.get(name, 0), dtype=t.dtype, device=t.device)
        return static

    def _fill(self, static: dict[str, torch.Tensor], inputs: Mapping[str, torch.Tensor], b: int) -> None:
        """Copy the real rows in; padding rows (and columns past a narrower table) hold :attr:`pad`."""
        for name, t in inputs.items():
            buf = static[name]
            fill = self.pad.get(name, 0)
            if t.ndim > 1 and t.shape[1] < buf.shape[1]:
                buf[:b, t.shape[1] :].fill_(fill)
                buf[:b, : t.shape[1]].copy_(t)
            else:
                buf[:b].copy_(t)
            if b < buf.shape[0]:
                buf[b:].fill_(fill)


# ---------------------------------------------------------------------------------------------- the step
def attention_step(
    pools: Sequence[tuple[torch.Tensor, torch.Tensor]], *, scale: float | None = None, workspace: Any = None
) -> StepFn:
    """The package's decode step over ``pools`` (one ``(key_cache, value_cache)`` per layer, ``[N, H, T, D]``):
    for every layer, ``write_kv`` of its new K/V at the step's slots, then ``paged_decode_attention`` of its
    query. Inputs: ``query [B, L, Hq, D]``, ``key``/``value [B, L, H, D]``, ``slot_mapping [B]``,
    ``block_tables [B, W]``, ``seq_lens [B]``; output ``[B, L, Hq, D]``. The split plan is made for the table's
    capacity (``W × T`` tokens), not this step's longest row, so one graph serves every length; nothing is
    validated on the host (the kernels mask every index)."""
    from memos_kernels.decode_launch import DecodeWorkspace
    from memos_kernels.paged_decode import paged_decode_attention
    from memos_kernels.write_kv import write_kv

    if not pools:
        raise InvalidArgumentError("pools: expected one (key_cache, value_cache) per layer, got none")
    # One workspace per batch size: a graph replays the partials' addresses, so a bucket's buffers must never be
    # regrown (freed) by a step of another size, as the device's shared workspace would be.
    workspaces: dict[int, Any] = {}

    def step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        capacity = block_tables.shape[1] * pools[0][0].shape[2]
        ws = workspace or workspaces.setdefault(query.shape[0], DecodeWorkspace(query.device))
        out = torch.empty_like(query)
        for layer, (kc, vc) in enumerate(pools):
            write_kv(key[:, layer], value[:, layer], slot_mapping, kc, vc, validate=False)
            paged_decode_attention(query[:, layer], kc, vc, block_tables, seq_lens, scale=scale,
                                   max_seq_len=capacity, out=out[:, layer], validate=False,
                                   workspace=ws)  # fmt: skip
        return out

    return step


# ---------------------------------------------------------------------------------------------- benchmark
class _Rerun:
    """The CPU stand-in for a captured graph (the device check's dry run): ``replay()`` runs the step again on
    the captured buffers into the captured output."""

    def __init__(self, fn: StepFn, inputs: dict[str, torch.Tensor]) -> None:
        self.fn, self.inputs = fn, inputs
        self.out = fn(**inputs)

    def replay(self) -> None:
        self.out.copy_(self.fn(**self.inputs))


def rerun_capture(fn: StepFn, inputs: dict[str, torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
    """A capture without a GPU: :class:`_Rerun` (the bookkeeping runs, nothing is recorded)."""
    graph = _Rerun(fn, inputs)
    return graph, graph.out


def bench_step_graphs(device: str, *, layers: int = 32, batches: Sequence[int] = (1, 8), context: int = 4096,
                      kv_heads: int = 8, group: int = 4, head_dim: int = 128, block_size: int = 16,
                      dtype: torch.dtype = torch.float16) -> list[dict[str, Any]]:  # fmt: skip
    """The decode step of ``layers`` layers (:func:`attention_step`) eager and replayed from its bucket's graph
    (:class:`DecodeGraphs`, the input copies included), at each batch: milliseconds (``do_bench`` medians on a
    GPU, one wall-clock call on the CPU), the speed-up, captures and replays, and the largest difference between
    the two outputs (``ok`` when within fp16 rounding and captured once)."""
    shape = dict(layers=layers, context=context, kv_heads=kv_heads, group=group, head_dim=head_dim,
                 block_size=block_size, dtype=dtype)  # fmt: skip
    return [_bench_one(device, batch, **shape) for batch in batches]


def _bench_one(device: str, batch: int, *, layers: int, context: int, kv_heads: int, group: int, head_dim: int,
               block_size: int, dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    from memos_kernels.timing import bench_ms  # the one timer of kernels/

    per = -(-context // block_size)
    gen = torch.Generator(device=device).manual_seed(batch)
    pool = torch.randn(batch * per, layers, 2, kv_heads, block_size, head_dim, device=device, dtype=dtype,
                       generator=gen)  # fmt: skip
    tables = torch.randperm(batch * per, device=device, generator=gen).view(batch, per)
    last = context - 1  # the step writes token `last` of every row and attends over `context` tokens
    inputs = dict(
        query=torch.randn(batch, layers, kv_heads * group, head_dim, device=device, dtype=dtype, generator=gen),
        key=torch.randn(batch, layers, kv_heads, head_dim, device=device, dtype=dtype, generator=gen),
        value=torch.randn(batch, layers, kv_heads, head_dim, device=device, dtype=dtype, generator=gen),
        slot_mapping=tables[:, last // block_size] * block_size + last % block_size,
        block_tables=tables,
        seq_lens=torch.full((batch,), context, device=device),
    )
    step = attention_step([(pool[:, i, 0], pool[:, i, 1]) for i in range(layers)])
    graphs = DecodeGraphs(step, widths={"block_tables": per}, enabled=True,
                          capture=None if device == "cuda" else rerun_capture)  # fmt: skip
    row: dict[str, Any] = {"row": "decode_step_graph", "batch": batch, "layers": layers, "context": context}
    try:
        want = step(**inputs)
        got = graphs.run([pool], **inputs)
        row["max_abs_err"] = float((got.float() - want.float()).abs().max())
        row["eager_ms"] = bench_ms(lambda: step(**inputs), device)
        row["graph_ms"] = bench_ms(lambda: graphs.run([pool], **inputs), device)
        row["speedup"] = row["eager_ms"] / max(row["graph_ms"], 1e-9)
        row.update(captures=graphs.stats.captures, replays=graphs.stats.replays)
        row["ok"] = row["max_abs_err"] <= 2e-3 and graphs.stats.captures == 1
    except Exception as exc:  # a capture refused on the device: reported, and the check fails loudly
        row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
    return row


def forward_graph_rows(dry: bool, seconds: float) -> list[dict[str, Any]]:
    """The device check's ``decode_forward_graph`` rows: the whole package forward's decode step eager beside its
    CUDA-graph replay (``memos_ref.decode_graph.GraphedDecoder``: embedding, every layer's matmuls, writes and
    attention, LM head). That is a memos_ref module and this package imports nothing of memos_ref but its errors,
    so it runs as ``python -m memos_ref.decode_graph`` in a child process, killed after ``seconds``; each row as
    the child printed it (one per batch, as measured), or one naming the child's failure."""
    cmd = [sys.executable, "-m", "memos_ref.decode_graph", *(["--dry-run"] if dry else [])]
    env = {**os.environ, "MEMOS_REF_KERNELS": "interpret" if dry else "triton"}
    if seconds < 5:
        return [{"row": "decode_forward_graph", "error": f"no time left in the bench phase ({seconds:.0f} s)",
                 "ok": False}]  # fmt: skip
    try:
        root = Path(__file__).resolve().parent.parent  # the checkout (the device check puts it on PYTHONPATH)
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=seconds)
        out, err, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, rc = f"timed out after {seconds:.0f} s", 124
    rows = []
    for line in out.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a library's own print
    if rc and not any(not r.get("ok", False) for r in rows):  # the child failed without a row saying why
        rows.append({"row": "decode_forward_graph", "rc": rc, "error": err[-500:], "ok": False})
    return rows
