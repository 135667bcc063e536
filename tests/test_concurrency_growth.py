"""Pool growth beside lock-free readers (issue 24 item 1).

Copy-on-write (``SequenceCache``), the tier copies (``tiering/swap.py``) and attention read blocks through
``BlockPool.block`` / ``copy_block`` / ``gather`` without the allocator lock, while ``PagedKV.grow`` adds a
segment under it. The old pool published a segment in two steps (``_starts`` then ``segments``): a reader between
them got block 3's data for block 7 (two old segments) or ``AssertionError: unreachable`` (one).

The deterministic test here pauses the growing thread at *every line* it runs inside ``memos_ref/paged/pool.py``
(a ``sys.settrace`` hook), and at each pause reads every old block, copies blocks and gathers a table from
the main thread, checking them against the values written — so any half-published state, whatever the order of
the steps, is seen. The stateful test interleaves growth with fork, copy-on-write, tier swap-out/in and free
across threads and compares every sequence with a dense oracle after every step.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from memos_ref.errors import OutOfBlocksError
from memos_ref.paged import BlockPool, PagedKV
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)
POOL_FILE = "memos_ref/paged/pool.py"
WAIT_S = 30.0  # bound on every wait: a stuck thread fails the test, never hangs it


class LineStepper:
    """Runs ``fn`` in a thread that stops before every line it executes in ``file`` (``pool.py``; or any of several
    files); :meth:`pauses` yields at each stop (the thread is frozen there) and resumes it when the caller asks
    for the next one."""

    def __init__(self, fn: Callable[[], object], file: str | tuple[str, ...] = POOL_FILE) -> None:
        self.fn, self.file = fn, file
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: object = None
        self.where: str = ""

    def _trace(self, frame, event, arg):  # the sys.settrace signature
        if not frame.f_code.co_filename.replace("\\", "/").endswith(self.file):
            return None  # no line events outside the pool
        if event == "line":
            self.where = f"{frame.f_code.co_name}:{frame.f_lineno}"
            self.paused.set()
            if not self.resume.wait(WAIT_S):
                raise TimeoutError("the reader never resumed the growing thread")
            self.resume.clear()
        return self._trace

    def _run(self) -> None:
        sys.settrace(self._trace)
        try:
            self.result = self.fn()
        except BaseException as exc:  # reported by pauses()
            self.error = exc
        finally:
            sys.settrace(None)
            self.done.set()
            self.paused.set()

    def pauses(self):
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        stops = 0
        while True:
            assert self.paused.wait(WAIT_S), "the growing thread neither paused nor finished"
            self.paused.clear()
            if self.done.is_set():
                break
            stops += 1
            yield self.where
            self.resume.set()
        thread.join(WAIT_S)
        if self.error is not None:
            raise self.error
        assert stops > 0, "the tracer never stopped inside pool.py"


def _filled_pool(num_blocks: int, segments: int) -> BlockPool:
    """A pool whose block ``b`` holds the value ``b + 1`` everywhere (0 would be a fresh block's value)."""
    pool = BlockPool(SPEC, num_blocks, segments=segments)
    for b in range(num_blocks):
        pool.block(b).fill_(b + 1)
    return pool


def _read_everything(pool: BlockPool, old: int, scratch: int) -> None:
    """Every lock-free read a reader may do while the pool grows, checked against the values written."""
    n = pool.num_blocks
    assert n in (old, old + 4), n
    assert sum(seg.shape[0] for seg in pool.segments) == n
    for b in reversed(range(old)):  # the last first: with 2 old segments the old code read block 3 for block 7
        got = pool.block(b)
        assert bool((got == b + 1).all()), f"block({b}) read block {int(got.flatten()[0]) - 1}'s data"
    table = torch.tensor(list(range(old - 1, -1, -1)))  # every old block, across the segments, backwards
    k, v = pool.gather(1, table, old * SPEC.block_size)
    want = torch.arange(old, 0, -1, dtype=torch.float32).repeat_interleave(SPEC.block_size)  # [S]
    assert torch.equal(k[0, :, 0], want) and torch.equal(v[1, :, 3], want)
    for src in range(old - 1):  # the copy of copy-on-write, between segments (scratch is the last old block)
        pool.copy_block(src, scratch)
        assert bool((pool.block(scratch) == src + 1).all()), f"copy_block({src}) copied another block"
    pool.block(scratch).fill_(scratch + 1)


@pytest.mark.parametrize("old_segments", [1, 2, 3])
def test_a_reader_never_sees_a_half_published_segment(old_segments):
    """The growing thread is paused at every line of ``BlockPool.grow``; at each pause every old block reads back
    its own data (old code: block 7 -> block 3's data with 2 segments, AssertionError with 1)."""
    old = 8
    pool = _filled_pool(old, old_segments)
    scratch = old - 1  # the copies' destination, restored after each pause
    stepper = LineStepper(lambda: pool.grow(4))
    for _ in stepper.pauses():
        _read_everything(pool, old, scratch)
    assert stepper.result == range(old, old + 4)
    _read_everything(pool, old, scratch)
    assert len(pool.segments) == old_segments + 1 and bool((pool.block(old + 3) == 0).all())


def test_copy_on_write_while_paged_kv_grows_copies_the_right_block():
    """A forked sequence's copy-on-write (allocation under the allocator lock, copy outside it) runs while
    ``PagedKV.grow`` is paused at each line inside the pool, holding the allocator lock; the reads the sequence
    does without the lock (to_dense, the pool's block copy) give the oracle's values."""
    kv = PagedKV(SPEC, 8, segments=2, prefix_caching=False)
    seq = kv.new_sequence()
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(2, SPEC.num_kv_heads, 52, SPEC.head_dim, generator=g) for _ in range(SPEC.num_layers)]
    for layer in range(SPEC.num_layers):
        seq.append(layer, dense[layer][0], dense[layer][1])  # 52 tokens: blocks 0..6, the tail half full
    child = seq.fork()
    tail = seq.block_table[-1]
    stepper = LineStepper(lambda: kv.grow(4))
    for _ in stepper.pauses():
        for s in (seq, child):
            for layer in range(SPEC.num_layers):
                k, v = s.to_dense(layer)
                assert torch.equal(k, dense[layer][0]) and torch.equal(v, dense[layer][1])
        kv.pool.copy_block(tail, 7)  # what copy-on-write does with the private block it was given
        assert torch.equal(kv.pool.block(7), kv.pool.block(tail))
    # after the growth: the fork writes into its shared tail, so it copies it first; both still match the oracle
    extra = torch.randn(2, SPEC.num_kv_heads, 1, SPEC.head_dim, generator=g)
    for layer in range(SPEC.num_layers):
        child.append(layer, extra[0], extra[1])
    assert child.block_table[-1] != tail
    for layer in range(SPEC.num_layers):
        k, v = child.to_dense(layer)
        assert torch.equal(k, torch.cat([dense[layer][0], extra[0]], 1))
        assert torch.equal(seq.to_dense(layer)[0], dense[layer][0])
    kv.check()


def test_allocator_counts_read_during_a_growth_are_consistent():
    """``num_active`` / ``num_available`` combine several counters; read lock-free (the tier manager's watermark
    check does) while the allocator grows, the old properties saw the new free blocks before the new block count:
    ``num_active`` went negative. A reader started at every line of the growth now gets the counts of before or
    of after (it waits for the growth's lock), never a mix."""
    kv = PagedKV(SPEC, 8, prefix_caching=False)
    seq = kv.new_sequence()
    seq.append(0, torch.ones(2, 20, 4), torch.ones(2, 20, 4))  # 3 blocks held
    a = kv.allocator
    seen: list[tuple[int, int]] = []
    readers = []

    def read() -> None:
        seen.append((a.num_active, a.num_available))

    kv.pool.grow(4)  # the storage first, as PagedKV.grow does (the allocator cannot outgrow it); its half is stepped
    # every line of the growth: the allocator's and its free lists' (memos_ref/paged/free_list.py)
    stepper = LineStepper(lambda: a.grow(4), ("memos_ref/paged/allocator.py", "memos_ref/paged/free_list.py"))
    for _ in stepper.pauses():
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(0.02)  # lock-free: done at once, at the paused state; locked: waits for the growth
        readers.append(reader)
    for reader in readers:
        reader.join(WAIT_S)
    assert len(seen) == len(readers) > 0
    assert set(seen) <= {(3, 5), (3, 9)}, sorted(set(seen))
    read()
    assert seen[-1] == (3, 9)
    seq.free()


# ---------------------------------------------------------------------------------------------- stateful, threaded
TIER_SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, block_size=8)
FP = "growth-fuzz"
PROMPTS = [[p] * 8 + [p + 1] * 8 + [p + 2] * 8 for p in (10, 20, 30)]  # 3 blocks each, shared by the workers


def _values(ids: list[int], start: int, layer: int) -> torch.Tensor:
    """The oracle: K of token ``t`` at position ``p`` in ``layer`` is ``[1000 t + p + layer / 4, -(...)]``, V its
    negation — a function of (token, position, layer) only, so any reused or reloaded block must hold it."""
    pos = torch.arange(start, start + len(ids), dtype=torch.float32)
    base = torch.tensor(ids, dtype=torch.float32) * 1000 + pos + 0.25 * layer  # [n]
    return torch.stack([base, -base], dim=-1)[None]  # [H=1, n, D=2]


def _append(seq, ids: list[int]) -> None:
    start = seq.num_tokens
    for layer in range(TIER_SPEC.num_layers):
        k = _values(ids, start, layer)
        seq.append(layer, k, -k, ids)


def _check(seq, tokens: list[int]) -> None:
    """Every layer of ``seq`` equals the dense oracle of ``tokens``."""
    assert seq.num_tokens == len(tokens)
    for layer in range(TIER_SPEC.num_layers):
        k, v = seq.to_dense(layer)
        want = _values(tokens, 0, layer)
        assert torch.equal(k, want) and torch.equal(v, -want), f"layer {layer} of {seq} differs from the oracle"


def _worker(kv: PagedKV, seed: int, steps: int, errors: list[BaseException]) -> None:
    """Seeded ops on this worker's own sequences — start from a (device or tier) prefix, append (copy-on-write of
    a forked tail), fork, truncate, free — each followed by a check of every sequence against the oracle."""
    rng = random.Random(seed)
    live: list[tuple[object, list[int]]] = []
    try:
        for _ in range(steps):
            op = rng.choice(["start", "start", "append", "append", "fork", "truncate", "free"])
            try:
                if op == "start" or not live:
                    prompt = rng.choice(PROMPTS) + [rng.randrange(1, 5) for _ in range(rng.randrange(1, 12))]
                    seq = kv.start_from_prefix(prompt)
                    live.append((seq, prompt[: seq.num_tokens]))  # the reused prefix, checked below
                    _check(seq, live[-1][1])
                    _append(seq, prompt[seq.num_tokens :])
                    live[-1] = (seq, list(prompt))
                elif op == "append":
                    i = rng.randrange(len(live))
                    seq, tokens = live[i]
                    more = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 10))]
                    _append(seq, more)
                    live[i] = (seq, tokens + more)
                elif op == "fork":
                    seq, tokens = rng.choice(live)
                    live.append((seq.fork(), list(tokens)))
                elif op == "truncate":
                    i = rng.randrange(len(live))
                    seq, tokens = live[i]
                    n = rng.randrange(0, len(tokens) + 1)
                    seq.truncate(n)
                    live[i] = (seq, tokens[:n])
                else:
                    seq, _ = live.pop(rng.randrange(len(live)))
                    seq.free()
            except OutOfBlocksError:
                if live:
                    live.pop(0)[0].free()  # make room; the failed op changed nothing (checked below)
            for seq, tokens in live:
                _check(seq, tokens)
            if len(live) > 4:
                live.pop(0)[0].free()
    except BaseException as exc:  # reported by the test
        errors.append(exc)
    finally:
        for seq, _ in live:
            seq.free()


@pytest.mark.parametrize("seed", [0, 1])
def test_growth_fork_cow_swap_and_free_interleave_across_threads(seed):
    """Three workers (prefix starts that reload from the host tier, appends with copy-on-write of forked tails,
    forks, truncates, frees), a tier thread swapping cached blocks out, a growing thread adding segments (each of
    its lines in pool.py stretched) and a lock-free reader of fixed sequences' blocks, all at once. After every
    step each worker's sequences equal the dense oracle; at the end the invariants hold and every block is back
    (old pool: the reader got ``AssertionError: unreachable`` or another block's data)."""
    from memos_ref.tiering.backends import HostMemoryBackend
    from memos_ref.tiering.manager import TierManager
    from memos_ref.tiering.store import Tier, TierStore

    kv = PagedKV(TIER_SPEC, 16, segments=2, fingerprint=FP)
    store = TierStore([Tier(HostMemoryBackend(1 << 20))], spec=TIER_SPEC, fingerprint=FP)
    tm = TierManager(kv, store, high_watermark=0.3, low_watermark=0.1, min_residency_s=0.0, reload="always")
    errors: list[BaseException] = []
    done = threading.Event()

    def slow_pool_lines(frame, event, arg):  # the sys.settrace signature
        """Stretch every line the grower runs in pool.py, so lock-free readers land inside a growth often."""
        if not frame.f_code.co_filename.replace("\\", "/").endswith(POOL_FILE):
            return None
        if event == "line":
            time.sleep(0.001)
        return slow_pool_lines

    def grower() -> None:
        sys.settrace(slow_pool_lines)
        try:
            for _ in range(8):
                kv.grow(2)
                time.sleep(0.002)
        except BaseException as exc:
            errors.append(exc)
        finally:
            sys.settrace(None)

    # a reader's own sequences, never changed: it reads their blocks (both first segments) without any lock
    frozen = []
    for p in (40, 50):
        seq, tokens = kv.new_sequence(), [p] * 8 + [p + 1] * 8 + [p + 2] * 8 + [p + 3] * 8 + [p + 4] * 8
        _append(seq, tokens)
        frozen.append((seq, tokens))
    assert {b < 8 for seq, _ in frozen for b in seq.block_table} == {True, False}  # both segments

    def reader() -> None:
        t = TIER_SPEC.block_size
        try:
            while not done.is_set():
                for seq, tokens in frozen:
                    for i, b in enumerate(seq.block_table):
                        block = kv.pool.block(b)  # [L, 2, H, T, D]
                        for layer in range(TIER_SPEC.num_layers):
                            want = _values(tokens[i * t : (i + 1) * t], i * t, layer)
                            assert torch.equal(block[layer, 0], want), f"block({b}) holds another block's data"
                    _check(seq, tokens)
        except BaseException as exc:
            errors.append(exc)

    def swapper() -> None:
        try:
            while not done.is_set():
                tm.step()
                time.sleep(0.0005)
        except BaseException as exc:
            errors.append(exc)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per run
    try:
        workers = [threading.Thread(target=_worker, args=(kv, seed * 10 + i, 120, errors)) for i in range(3)]
        helpers = [threading.Thread(target=f) for f in (grower, swapper, reader)]
        for t in [*helpers, *workers]:
            t.start()
        for t in workers:
            t.join(WAIT_S * 4)
        done.set()
        for t in helpers:
            t.join(WAIT_S)
    finally:
        sys.setswitchinterval(old_interval)
    assert not any(t.is_alive() for t in [*workers, *helpers]), "a thread did not finish"
    if errors:
        raise errors[0]
    assert kv.pool.num_blocks == kv.allocator.num_blocks == 16 + 8 * 2
    assert len(kv.pool.segments) == 2 + 8
    for seq, tokens in frozen:
        _check(seq, tokens)
        seq.free()
    assert not kv.sequences, kv.sequences
    assert kv.allocator.num_active == 0, kv.allocator.stats()
    kv.check()
    assert tm.counts["swap_out_blocks"] > 0 and tm.counts["swap_in_blocks"] > 0, dict(tm.counts)
