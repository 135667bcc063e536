"""Attention's sliding window on a single-query (decode) step (issue 30: a mutant that ignores the window when only
one query is asked survived, because the oracle tests use several queries and the family tests' contexts never
outgrow the window on a decode step). The oracle is written out here: softmax over exactly the last W keys."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from memos_ref import attention
from memos_ref.attention import (
    attend_sequences,
    attend_step,
    dense_attention,
    gather_kv,
    paged_attention,
    write_step,
)
from memos_ref.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    ConfigError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
)
from memos_ref.paged import PagedKV
from memos_ref.paged.step import StepBatch
from memos_ref.quant import FP8E4M3, KIVI, PerTokenInt8
from memos_ref.spec import KVSpec


def _oracle_last_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [Hq, 1, D] at the newest position sees keys max(0, S - W) .. S - 1, in float64, one head at a time."""
    hq, _, d = q.shape
    h, s, _ = k.shape
    lo = 0 if window is None else max(0, s - window)
    out = torch.empty(hq, 1, d, dtype=torch.float64)
    for j in range(hq):
        kv = j // (hq // h)
        logits = (k[kv, lo:].double() @ q[j, 0].double()) / math.sqrt(d)
        out[j, 0] = logits.softmax(0) @ v[kv, lo:].double()
    return out


@pytest.mark.parametrize("s, window", [(9, 4), (9, 8), (9, 9), (9, 12), (2, 1), (17, 1)])
def test_a_decode_step_never_attends_beyond_the_window(s, window):
    """One query at the newest position sees exactly the last ``window`` keys: at s > W the older keys have no
    weight (W = s - 1 drops exactly one key, W = 1 sees only itself); at W >= s it sees every key."""
    gen = torch.Generator().manual_seed(s * 100 + window)
    q = torch.randn(4, 1, 8, generator=gen)
    k, v = torch.randn(2, s, 8, generator=gen), torch.randn(2, s, 8, generator=gen)
    got = dense_attention(q, k, v, sliding_window=window)
    torch.testing.assert_close(got.double(), _oracle_last_query(q, k, v, window), atol=1e-5, rtol=1e-5)


def test_the_keys_outside_the_window_cannot_change_a_decode_step():
    """Replacing every key and value older than the window leaves the decode step's output bit-identical."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(4, 1, 8, generator=gen)
    k, v = torch.randn(2, 12, 8, generator=gen), torch.randn(2, 12, 8, generator=gen)
    k2, v2 = k.clone(), v.clone()
    k2[:, :7], v2[:, :7] = 100.0, -100.0  # positions 0..6 are outside a window of 5 over 12 keys
    a = dense_attention(q, k, v, sliding_window=5)
    assert torch.equal(a, dense_attention(q, k2, v2, sliding_window=5))
    assert not torch.allclose(dense_attention(q, k, v), dense_attention(q, k2, v2))  # without the window it would


def test_a_paged_decode_step_honours_the_window_per_sequence():
    """paged_attention with one query per row and a window: each row's output is the oracle over its own last W
    tokens, for rows longer and shorter than the window."""
    gen = torch.Generator().manual_seed(3)
    block, h, hq, d, window = 4, 2, 4, 8, 6
    lens = [11, 3, 6]
    cache_k = torch.randn(12, h, block, d, generator=gen)
    cache_v = torch.randn(12, h, block, d, generator=gen)
    tables = torch.tensor([[5, 0, 9], [7, -1, -1], [2, 11, -1]])
    query = torch.randn(len(lens), hq, 1, d, generator=gen)
    out = paged_attention(query, cache_k, cache_v, tables, torch.tensor(lens), sliding_window=window)
    for i, n in enumerate(lens):
        ids = [int(b) for b in tables[i] if b >= 0]
        k = torch.cat([cache_k[b] for b in ids], dim=1)[:, :n]  # [H, n, D]
        v = torch.cat([cache_v[b] for b in ids], dim=1)[:, :n]
        want = _oracle_last_query(query[i], k, v, window)
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ attend_sequences (issue 30)
SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=8, num_q_heads=4)
LENS = (10, 21)  # rows of 2 and 3 blocks: the shorter row's table is padded


def _oracle(q, k, v, *, scale=None, mask=None, sliding_window=None, softcap=None, sinks=None):
    """q [Hq, Q, D] at the newest positions over k, v [H, S, D], written out in float64 one (head, query, key) at a
    time: mask [1 or Hq, Q, S] bool (True = may attend) or float (added); a query that may see no key gets zeros."""
    hq, nq, d = q.shape
    h, s, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(hq, nq, d, dtype=torch.float64)
    for j in range(hq):
        kv = j // (hq // h)
        for i in range(nq):
            p = s - nq + i
            logits, keep = [], []
            for t in range(s):
                x = float(q[j, i].double() @ k[kv, t].double()) * scale
                if softcap is not None:
                    x = math.tanh(x / softcap) * softcap
                ok = t <= p and (sliding_window is None or t > p - sliding_window)
                if mask is not None:
                    m = mask[j if mask.shape[0] > 1 else 0, i, t]
                    if m.dtype == torch.bool:
                        ok = ok and bool(m)
                    else:
                        x += float(m)
                if ok:
                    logits.append(x)
                    keep.append(t)
            if not keep:
                continue
            top = max(logits + ([float(sinks[j])] if sinks is not None else []))
            w = [math.exp(x - top) for x in logits]
            den = sum(w) + (math.exp(float(sinks[j]) - top) if sinks is not None else 0.0)
            for x, t in zip(w, keep, strict=True):
                out[j, i] += (x / den) * v[kv, t].double()
    return out


def _sequences(kind: str):
    """Two rows (LENS tokens) in a float pool of one segment, of two segments, or a per-token int8 pool; the rows'
    blocks interleave so each table is out of order."""
    kw = {"quant": PerTokenInt8()} if kind == "int8" else {"segments": 2} if kind == "segments" else {}
    kv = PagedKV(SPEC, 12, prefix_caching=False, **kw)
    gen = torch.Generator().manual_seed(5)
    seqs = [kv.new_sequence() for _ in LENS]
    for step in range(max(LENS)):
        for seq, n in zip(seqs, LENS, strict=True):
            if step < n:
                k, v = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
                seq.append(0, k, v)
    return kv, seqs


def _features(nq: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(nq)
    per_row = torch.rand(2, 1, nq, max(LENS), generator=gen) > 0.3  # [B, 1, Q, K]: each row its own pattern
    per_row[:, :, :, 0] = True
    per_row[1, :, :, 1] = False
    shared = torch.randn(1, 4, nq, max(LENS), generator=gen)  # [1, Hq, Q, K] float, one for every row
    return {
        "plain": {},
        "scale": {"scale": 0.3},
        "bool_mask_per_row": {"mask": per_row},
        "float_mask_shared": {"mask": shared},
        "window": {"sliding_window": 3},
        "softcap": {"softcap": 0.5},
        "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    }


@pytest.mark.parametrize("kind", ["float", "segments", "int8"])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("feature", list(_features(1)))
def test_attend_sequences_equals_attention_over_each_rows_own_tokens(monkeypatch, kind, nq, feature):
    """Each row's newest ``nq`` queries attend over exactly its own tokens (read back with ``to_dense``) with the
    scale, mask (per row, or one for every row), window, softcap and sinks asked for, in any pool layout."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    _, seqs = _sequences(kind)
    opts = _features(nq)[feature]
    query = torch.randn(2, 4, nq, 8, generator=torch.Generator().manual_seed(9))
    got = attend_sequences(query, seqs, 0, **opts)
    assert got.shape == (2, 4, nq, 8)
    for i, (seq, n) in enumerate(zip(seqs, LENS, strict=True)):
        k, v = seq.to_dense(0)
        row = dict(opts)
        if "mask" in opts:
            row["mask"] = opts["mask"][i if opts["mask"].shape[0] > 1 else 0, :, :, :n]
        torch.testing.assert_close(got[i].double(), _oracle(query[i], k, v, **row), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, kernel_calls", [("float", 1), ("segments", 0), ("int8", 0)])
def test_only_a_plain_decode_step_of_a_one_segment_float_pool_goes_to_paged_decode(monkeypatch, kind, kernel_calls):
    """The switch: a decode step (one query per row) with no mask, window, softcap or sinks over a float pool of one
    segment is handed to ``paged_decode`` (the call a kernel replaces) once for the whole batch, with the pool's
    own K and V views; a prefill chunk, a feature, a segmented or a quantized pool never is."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    _, seqs = _sequences(kind)
    calls = []
    real = attention.paged_decode

    def spy(query, key_cache, value_cache, tables, lens, **kw):
        calls.append((query.shape, key_cache.data_ptr(), value_cache.data_ptr(), tables.tolist(), lens.tolist()))
        return real(query, key_cache, value_cache, tables, lens, **kw)

    monkeypatch.setattr(attention, "paged_decode", spy)
    gen = torch.Generator().manual_seed(1)
    attend_sequences(torch.randn(2, 4, 1, 8, generator=gen), seqs, 0)
    assert len(calls) == kernel_calls
    if kernel_calls:
        view = seqs[0].pool.layer_view(0)
        shape, k_ptr, v_ptr, tables, lens = calls[0]
        assert shape == (2, 4, 8) and (k_ptr, v_ptr) == (view[:, 0].data_ptr(), view[:, 1].data_ptr())
        assert lens == list(LENS) and tables == [s.block_table + [-1] * (3 - s.num_blocks) for s in seqs]
    calls.clear()
    for nq, opts in ((3, {}), (1, {"sliding_window": 4}), (1, {"softcap": 1.0}), (1, {"scale": 0.5})):
        attend_sequences(torch.randn(2, 4, nq, 8, generator=gen), seqs, 0, **opts)
    assert len(calls) == (kernel_calls if kind == "float" else 0)  # only the scale-only decode step: it is plain


def test_a_decode_step_hands_paged_decode_its_tables_and_lengths_on_the_pools_device(monkeypatch):
    """On a pool that is not on the CPU (``meta`` here, a GPU in use) the block tables and lengths handed to the
    decode kernel live on the pool's device, where the kernel reads them."""
    kv = PagedKV(SPEC, 8, device="meta", prefix_caching=False)
    seq = kv.new_sequence()
    seq.append(0, torch.empty(2, 9, 8, device="meta"), torch.empty(2, 9, 8, device="meta"))
    seen = []

    def spy(query, key_cache, value_cache, tables, lens, **kw):
        seen.append((tables.device.type, lens.device.type, key_cache.device.type))
        return torch.empty(query.shape, device=query.device)

    monkeypatch.setattr(attention, "paged_decode", spy)
    out = attend_sequences(torch.empty(1, 4, 1, 8, device="meta"), [seq], 0)
    assert seen == [("meta", "meta", "meta")] and out.shape == (1, 4, 1, 8)


def test_attend_sequences_refuses_bad_arguments_by_name():
    """A non-tensor query, no sequences, a query whose batch is not the number of sequences, and (on a pool read
    row by row) a mask that is not 4-D or is shorter than the longest row: each a specific error naming the
    argument, expected vs actual."""
    _, seqs = _sequences("int8")
    q = torch.randn(2, 4, 1, 8)
    with pytest.raises(ArgumentTypeError, match=r"^query: expected Tensor, got list"):
        attend_sequences([[0.0]], seqs, 0)
    with pytest.raises(InvalidArgumentError) as info:
        attend_sequences(q, [], 0)
    assert str(info.value) == "sequences: expected at least one sequence, got none"
    for bad in (torch.randn(3, 4, 1, 8), torch.randn(2, 4, 8)):
        with pytest.raises(ShapeError) as info:
            attend_sequences(bad, seqs, 0)
        assert str(info.value) == f"query: expected [2, q_heads, queries, head_dim], got {tuple(bad.shape)}"
    for bad in (torch.zeros(2, 1, 21), torch.zeros(2, 1, 1, 20)):
        with pytest.raises(ShapeError) as info:
            attend_sequences(q, seqs, 0, mask=bad)
        assert str(info.value) == f"mask: expected [batch, heads, queries, >= 21], got {tuple(bad.shape)}"
    mask = torch.zeros(2, 1, 1, 21)  # exactly as long as the longest row: accepted
    assert attend_sequences(q, seqs, 0, mask=mask).shape == (2, 4, 1, 8)


# ----------------------------------------------------------------------- the kernel path, with stand-in kernels
SPEC2 = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=8, num_q_heads=4)
SPEC2_16 = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16, num_q_heads=4)


class FakeKernels:
    """Stands in for ``memos_kernels.triton_paged``: records each launch and its keyword arguments; the float
    kernels compute the torch reference from exactly the arguments they are handed (a dropped or wrong argument
    changes the output), the quantized ones return zeros. ``fail`` names a wrapper that raises RuntimeError."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail

    def _record(self, name: str, kw: dict) -> None:
        self.calls.append((name, kw))
        if self.fail == name:
            raise RuntimeError("boom")

    def launches(self, name: str) -> list[dict]:
        return [kw for n, kw in self.calls if n == name]

    def write_kv(self, key, value, slots, key_cache, value_cache, *, validate=None):
        self._record("write_kv", {"validate": validate})
        t = key_cache.shape[2]
        for i, s in enumerate(slots.tolist()):
            key_cache[s // t, :, s % t], value_cache[s // t, :, s % t] = key[i], value[i]

    def write_kv_int8(self, key, value, slots, *, validate=None, **pool_args):
        self._record("write_kv_int8", {"validate": validate})

    def paged_decode_attention(self, query, key_cache, value_cache, tables, lens, **kw):
        self._record("paged_decode_attention", kw)
        if kw.get("quant") is not None:
            return torch.zeros_like(query)
        return paged_attention(query[:, :, None], key_cache, value_cache, tables, lens, scale=kw.get("scale"))[:, :, 0]

    def paged_prefill_attention(self, query, key_cache, value_cache, tables, lens, qlens, **kw):
        self._record("paged_prefill_attention", {**kw, "query_lens": qlens.tolist()})
        return paged_attention(query, key_cache, value_cache, tables, lens, query_lens=qlens, scale=kw.get("scale"))

    def paged_decode_attention_kivi_packed(self, query, blocks, tables, lens, **kw):
        self._record("paged_decode_attention_kivi_packed", kw)
        return torch.zeros_like(query)


def _kernel_pool(kind: str) -> PagedKV:
    if kind == "kivi":
        return PagedKV(SPEC2_16, 12, quant=KIVI(bits=4, group_size=16), residual_tokens=16, prefix_caching=False)
    quant = {"plain": {}, "int8": {"quant": PerTokenInt8()}, "fp8": {"quant": FP8E4M3()}}[kind]
    return PagedKV(SPEC2, 12, prefix_caching=False, **quant)


def _kernel_step(monkeypatch, kind: str, n: int, *, scale=None, fake=None, hq: int = 4):
    """Rows of LENS tokens on both layers, then one step of ``n`` new tokens per row through write_step and
    attend_step under MEMOS_REF_KERNELS=interpret with the stand-in kernels: (fake, step, rows, queries, outputs)."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    fake = fake or FakeKernels()
    monkeypatch.setattr(attention, "_triton", lambda: fake)
    kv = _kernel_pool(kind)
    d = kv.pool.spec.head_dim
    gen = torch.Generator().manual_seed(11)
    seqs = [kv.new_sequence() for _ in LENS]
    for seq, length in zip(seqs, LENS, strict=True):
        for layer in range(2):
            seq.append(layer, torch.randn(2, length, d, generator=gen), torch.randn(2, length, d, generator=gen))
    step = StepBatch.reserve(seqs, n)
    queries, outs = [], []
    for layer in range(2):
        k, v = torch.randn(2, 2, n, d, generator=gen), torch.randn(2, 2, n, d, generator=gen)
        write_step(step, layer, k, v)
        queries.append(torch.randn(2, hq, n, d, generator=gen))
        outs.append(attend_step(queries[-1], step, layer, scale=scale))
    return fake, step, seqs, queries, outs


@pytest.mark.parametrize("n", [1, 3])
def test_a_float_pool_step_runs_the_kernels_once_per_layer_with_the_asked_scale(monkeypatch, n):
    """A float pool's step writes with ``write_kv`` and attends with the decode kernel (one query per row) or the
    prefill kernel (a chunk): outputs equal the oracle over each row's tokens at the asked scale; the kernel is
    told the longest row, and the step's values are validated at its first layer only."""
    fake, step, seqs, queries, outs = _kernel_step(monkeypatch, "plain", n, scale=0.3)
    for layer in range(2):
        for i, seq in enumerate(seqs):
            k, v = seq.to_dense(layer)
            want = _oracle(queries[layer][i], k, v, scale=0.3)
            torch.testing.assert_close(outs[layer][i].double(), want, atol=1e-5, rtol=1e-5)
    assert [kw["validate"] for kw in fake.launches("write_kv")] == [None, False]
    if n == 1:
        launches = fake.launches("paged_decode_attention")
        assert [kw["validate"] for kw in launches] == [None, False]
        assert all(kw["scale"] == 0.3 and kw["max_seq_len"] == max(LENS) + 1 for kw in launches)
        assert all(kw["step_memo"] is step.notes for kw in launches)  # the plan made at layer 0 is reused
    else:
        launches = fake.launches("paged_prefill_attention")
        assert [kw["validate"] for kw in launches] == [None, False]
        assert all(kw["scale"] == 0.3 and kw["query_lens"] == [n, n] for kw in launches)
    assert len(fake.calls) == 4


@pytest.mark.parametrize("kind", ["int8", "fp8", "kivi"])
def test_a_quantized_decode_step_hands_its_kernel_scale_longest_row_and_validates_once(monkeypatch, kind):
    """A streaming int8 / fp8 or a KIVI pool's decode step launches its kernel once per layer with the asked scale,
    the longest row's length, and value checks at the first layer only (int8 writes with write_kv_int8 alike)."""
    if kind == "kivi":
        pytest.importorskip("triton")
    fake, step, *_ = _kernel_step(monkeypatch, kind, 1, scale=0.3)
    name = "paged_decode_attention_kivi_packed" if kind == "kivi" else "paged_decode_attention"
    launches = fake.launches(name)
    assert [kw["validate"] for kw in launches] == [None, False]
    assert all(kw["scale"] == 0.3 and kw["max_seq_len"] == max(LENS) + 1 for kw in launches)
    if kind != "kivi":
        assert all(kw["quant"] == kind for kw in launches)
    if kind == "int8":
        assert [kw["validate"] for kw in fake.launches("write_kv_int8")] == [None, False]
    assert step.notes["path"] == kind


@pytest.mark.parametrize(
    "kind, n, fail, what",
    [
        ("plain", 1, "write_kv", "write_kv"),
        ("plain", 1, "paged_decode_attention", "paged_decode_attention"),
        ("plain", 3, "paged_prefill_attention", "paged_prefill_attention"),
        ("int8", 1, "write_kv_int8", "write_kv_int8"),
        ("int8", 1, "paged_decode_attention", "paged_decode_attention(quant='int8')"),
        ("kivi", 1, "paged_decode_attention_kivi_packed", "paged_decode_attention_kivi"),
    ],
)
def test_a_failing_kernel_is_named_in_a_backend_error(monkeypatch, kind, n, fail, what):
    """A kernel that raises (a Triton compile or launch error) surfaces as BackendUnavailableError naming the
    kernel, the original error and the way around it."""
    if kind == "kivi":
        pytest.importorskip("triton")
    with pytest.raises(BackendUnavailableError) as info:
        _kernel_step(monkeypatch, kind, n, fake=FakeKernels(fail=fail))
    assert str(info.value) == (
        f"the Triton kernel {what} failed (RuntimeError: boom); MEMOS_REF_KERNELS=reference runs the torch "
        "reference instead"
    )


def test_an_int8_kernel_write_refuses_values_it_cannot_encode_naming_the_layer(monkeypatch):
    """write_kv_int8 cannot refuse a NaN itself: the pool checks first, names the layer, and nothing is launched."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    fake = FakeKernels()
    monkeypatch.setattr(attention, "_triton", lambda: fake)
    kv = _kernel_pool("int8")
    seq = kv.new_sequence()
    step = StepBatch.reserve([seq], 1)
    ok = torch.randn(1, 2, 1, 8)
    write_step(step, 0, ok, ok)
    bad = ok.clone()
    bad[0, 1, 0, 3] = float("nan")
    with pytest.raises(InvalidArgumentError, match="layer 1 "):
        write_step(step, 1, bad, ok)
    assert len(fake.launches("write_kv_int8")) == 1


def test_a_query_group_the_kernels_cannot_take_runs_the_reference(monkeypatch):
    """Query heads that are not a multiple of the KV heads never reach a kernel: the reference refuses them."""
    fake = FakeKernels()
    with pytest.raises(ShapeError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        _kernel_step(monkeypatch, "plain", 1, fake=fake, hq=3)
    assert fake.launches("paged_decode_attention") == []


def _decode_inputs():
    """One decode query per row over a float pool's layer 0 (rows of LENS tokens): query [B, Hq, D], caches,
    tables and lengths, and each row's dense K/V."""
    kv, seqs = _sequences("float")
    view = kv.pool.layer_view(0)
    tables = torch.tensor([s.block_table + [-1] * (3 - s.num_blocks) for s in seqs])
    query = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(4))
    return query, view[:, 0], view[:, 1], tables, torch.tensor(LENS), [s.to_dense(0) for s in seqs]


@pytest.mark.parametrize("mode, launches", [("reference", 0), ("interpret", 1)])
def test_paged_decode_is_the_oracle_at_the_asked_scale_through_kernel_or_reference(monkeypatch, mode, launches):
    """paged_decode launches the decode kernel only when MEMOS_REF_KERNELS allows it (once, with every argument)
    and otherwise runs the reference; either way each row is the oracle over its own tokens at the asked scale."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
    fake = FakeKernels()
    monkeypatch.setattr(attention, "_triton", lambda: fake)
    query, kc, vc, tables, lens, dense = _decode_inputs()
    out = attention.paged_decode(query, kc, vc, tables, lens, scale=0.3)
    assert len(fake.launches("paged_decode_attention")) == launches
    for i, (k, v) in enumerate(dense):
        want = _oracle(query[i][:, None], k, v, scale=0.3)[:, 0]
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)


def test_paged_decode_refuses_bad_arguments_by_name():
    """Each argument that is not a tensor is named; a query that is not one decode step [B, Hq, D] is refused."""
    args = dict(
        zip(("query", "key_cache", "value_cache", "block_tables", "seq_lens"), _decode_inputs()[:5], strict=True)
    )
    for name in args:
        with pytest.raises(ArgumentTypeError, match=rf"^{name}: expected Tensor, got int"):
            attention.paged_decode(**{**args, name: 7})
    bad = args["query"][:, :, None]
    with pytest.raises(ShapeError) as info:
        attention.paged_decode(**{**args, "query": bad})
    assert str(info.value) == f"query: expected [batch, q_heads, head_dim] (one decode step), got {tuple(bad.shape)}"


class _Pool:
    """A duck-typed pool as step_path sees it (the attention layer is below quant): on a (pretend) GPU."""

    def __init__(self, name: str, group_size: int = 16, streaming: bool = True) -> None:
        self.spec = SPEC2_16
        self.device = torch.device("cuda", 1)
        self.segments = [None]
        self.quantized = True
        self.streaming = streaming
        self.scheme = type("Scheme", (), {"name": name, "group_size": group_size})()


@pytest.mark.parametrize("capability, path", [((8, 6), "reference"), ((8, 9), "fp8"), ((9, 0), "fp8")])
def test_an_fp8_pool_takes_the_fp8_kernel_only_on_sm89_or_newer(monkeypatch, capability, path):
    """Triton's e4m3 needs sm_89+: an fp8 pool on an older GPU runs the reference; the capability asked is that of
    the pool's own GPU."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "triton")
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    step = type("Step", (), {"notes": {}, "pool": _Pool("fp8_e4m3")})()
    assert attention.step_path(step) == path
    assert asked == [torch.device("cuda", 1)]


@pytest.mark.parametrize("group, path", [(16, "kivi"), (1, "kivi"), (0, "reference"), (48, "reference")])
def test_a_kivi_pool_takes_the_kivi_kernel_only_for_a_power_of_two_group_dividing_the_block(monkeypatch, group, path):
    """The KIVI kernel reads groups of a power-of-two size that divide the block; any other pool runs the
    reference (and a group of 0 never divides anything)."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "triton")
    step = type("Step", (), {"notes": {}, "pool": _Pool("kivi4", group_size=group)})()
    assert attention.step_path(step) == path


@pytest.mark.parametrize(
    "hq, h, t, d, launches",
    [(1, 1, 8, 8, 1), (32, 16, 8, 8, 1), (4, 2, 4, 16, 0), (4, 2, 8, 24, 0)],
)
def test_paged_decode_launches_the_kernel_only_inside_its_launch_set(monkeypatch, hq, h, t, d, launches):
    """In the interpreter the kernels take powers of two, block sizes 8-128 and whole query groups (one head, or
    16 KV heads of head dim 8, included); outside that set even an explicit kernel mode runs the reference
    instead of failing mid-generation, and every row is the oracle either way."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    fake = FakeKernels()
    monkeypatch.setattr(attention, "_triton", lambda: fake)
    gen = torch.Generator().manual_seed(hq + t + d)
    cache_k, cache_v = torch.randn(5, h, t, d, generator=gen), torch.randn(5, h, t, d, generator=gen)
    tables, lens = torch.tensor([[3, 1], [4, -1]]), torch.tensor([t + 3, t - 1])
    query = torch.randn(2, hq, d, generator=gen)
    out = attention.paged_decode(query, cache_k, cache_v, tables, lens)
    assert len(fake.launches("paged_decode_attention")) == launches
    for i, n in enumerate(lens.tolist()):
        ids = [b for b in tables[i].tolist() if b >= 0]
        k, v = torch.cat([cache_k[b] for b in ids], dim=1)[:, :n], torch.cat([cache_v[b] for b in ids], dim=1)[:, :n]
        torch.testing.assert_close(out[i].double(), _oracle(query[i][:, None], k, v)[:, 0], atol=1e-5, rtol=1e-5)


def test_paged_decode_keeps_ragged_groups_and_unlike_caches_off_the_kernel(monkeypatch):
    """3 query heads over 2 KV heads never reach the kernel (the reference refuses them by name); K and V caches of
    different strides (not one pool's pair) run the reference, which reads them correctly."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    fake = FakeKernels()
    monkeypatch.setattr(attention, "_triton", lambda: fake)
    query, kc, vc, tables, lens, dense = _decode_inputs()
    with pytest.raises(ShapeError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        attention.paged_decode(query[:, :3], kc, vc, tables, lens)
    own_v = vc.contiguous()  # the same values, its own layout
    assert own_v.stride() != kc.stride()
    out = attention.paged_decode(query, kc, own_v, tables, lens)
    assert fake.launches("paged_decode_attention") == []
    for i, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[i].double(), _oracle(query[i][:, None], k, v)[:, 0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the torch reference (issue 30)
def _qkv(hq: int, nq: int, h: int, s: int, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(hq, nq, d, generator=gen),
        torch.randn(h, s, d, generator=gen),
        torch.randn(h, s, d, generator=gen),
    )


@pytest.mark.parametrize(
    "hq, nq, h, opts",
    [
        (4, 2, 2, {}),  # two queries: the first must not see the newest key
        (4, 2, 2, {"scale": 0.25}),
        (4, 3, 2, {"per_head_mask": True}),  # [Hq, Q, S], a different pattern per query head
        (2, 2, 1, {"shared_mask": True}),  # [Q, S] over one KV head
        (4, 1, 2, {"sliding_window": 9}),  # a window as long as the context: every key
    ],
)
def test_dense_attention_equals_the_written_out_oracle(hq, nq, h, opts):
    """Causal GQA attention of the newest queries, with the scale asked for and masks per query head or shared,
    is the float64 oracle."""
    q, k, v = _qkv(hq, nq, h, 9, seed=nq + h)
    opts = dict(opts)
    gen = torch.Generator().manual_seed(3)
    if opts.pop("per_head_mask", False):
        opts["mask"] = torch.rand(hq, nq, 9, generator=gen) > 0.4
        opts["mask"][:, :, 0] = True
    if opts.pop("shared_mask", False):
        opts["mask"] = torch.rand(nq, 9, generator=gen) > 0.4
        opts["mask"][:, 0] = True
    want = _oracle(
        q,
        k,
        v,
        **{**opts, "mask": opts["mask"][None] if "mask" in opts and opts["mask"].ndim == 2 else opts.get("mask")},
    )
    torch.testing.assert_close(dense_attention(q, k, v, **opts).double(), want, atol=1e-5, rtol=1e-5)


def test_dense_attention_keeps_half_precision_values_and_runs_on_the_inputs_device():
    """bfloat16 inputs give a bfloat16 result close to the oracle; on another device (``meta`` here, a GPU in use)
    every intermediate — positions, mask, sinks — lives with the inputs."""
    q, k, v = (x.to(torch.bfloat16) for x in _qkv(4, 2, 2, 6))
    out = dense_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _oracle(q, k, v), atol=3e-2, rtol=3e-2)
    q, k, v = (torch.empty(x.shape, device="meta") for x in _qkv(4, 2, 2, 6))
    mask, sinks = torch.rand(2, 6) > 0.5, torch.zeros(4)  # on the host: moved to the inputs' device
    for opts in ({}, {"sliding_window": 3}, {"mask": mask}, {"mask": mask.float()}, {"sinks": sinks}):
        assert dense_attention(q, k, v, **opts).shape == (4, 2, 8)


def test_a_non_finite_key_is_never_silently_dropped():
    """With no mask and no window, an infinite key makes the output NaN (a poisoned cache shows), not a quiet zero."""
    q, k, v = _qkv(4, 1, 2, 5)
    k[0, 2] = float("inf")
    assert torch.isnan(dense_attention(q, k, v)).any()


def test_dense_attention_refuses_bad_arguments_by_name():
    """Non-tensors are named; q, k, v of the wrong ranks or unlike shapes, and ragged query groups, are refused with
    the shapes that were given; so is a mask of a shape that fits neither the queries nor the heads."""
    q, k, v = _qkv(4, 2, 2, 6)
    for name, args in (("k", (q, "x", v)), ("v", (q, k, "x"))):
        with pytest.raises(ArgumentTypeError, match=rf"^{name}: expected Tensor, got str"):
            dense_attention(*args)
    with pytest.raises(ArgumentTypeError, match=r"^mask: expected Tensor, got str"):
        dense_attention(q, k, v, mask="x")
    bad = [(q, k, v[:, :5]), (q, k[None], v[None]), (q[None], k, v), (q[..., None], k, v)]
    for a, b, c in bad:
        with pytest.raises(ShapeError) as info:
            dense_attention(a, b, c)
        assert str(info.value) == (
            f"expected q [Hq, Q, D] and k, v [H, S, D] of one D, got {tuple(a.shape)}, {tuple(b.shape)}, "
            f"{tuple(c.shape)}"
        )
    with pytest.raises(ShapeError) as info:
        dense_attention(q[:3], k, v)
    assert str(info.value) == "query heads (3) must be a multiple of KV heads (2)"
    with pytest.raises(ShapeError) as info:
        dense_attention(q, k, v, mask=torch.zeros(3, 2, 6))
    assert str(info.value) == "attention mask: expected [2, 6], [1, 2, 6] or [4, 2, 6] (queries, keys), got (3, 2, 6)"


def _raw_pool(h: int = 2, t: int = 8, d: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(6, h, t, d, generator=gen), torch.randn(6, h, t, d, generator=gen)


def _rows(cache_k, cache_v, tables, lens):
    out = []
    for i, n in enumerate(lens.tolist()):
        ids = [b for b in tables[i].tolist() if b >= 0]
        out.append(
            (torch.cat([cache_k[b] for b in ids], dim=1)[:, :n], torch.cat([cache_v[b] for b in ids], dim=1)[:, :n])
        )
    return out


@pytest.mark.parametrize("nq, lens", [(2, [13, 13]), (2, [13, 10]), (1, [13, 10])])
def test_paged_attention_of_full_rows_is_the_oracle_at_the_asked_scale(nq, lens):
    """Rows that each hold every query (the batched path): causal within the new tokens, each row over its own
    length, at the asked scale — the float64 oracle per row; a ragged query group is refused by name."""
    cache_k, cache_v = _raw_pool()
    tables, lens = torch.tensor([[4, 1], [0, 5]]), torch.tensor(lens)
    query = torch.randn(2, 4, nq, 8, generator=torch.Generator().manual_seed(nq))
    out = paged_attention(query, cache_k, cache_v, tables, lens, scale=0.4)
    for i, (k, v) in enumerate(_rows(cache_k, cache_v, tables, lens)):
        torch.testing.assert_close(out[i].double(), _oracle(query[i], k, v, scale=0.4), atol=1e-5, rtol=1e-5)
    with pytest.raises(ShapeError) as info:
        paged_attention(query[:, :3], cache_k, cache_v, tables, lens)
    assert str(info.value) == "query heads (3) must be a multiple of KV heads (2)"


def test_paged_attention_runs_on_the_caches_device():
    """Caches on another device (``meta`` here, a GPU in use) with host block tables and lengths: the rows' length
    masks are moved to the caches' device."""
    kc = torch.empty(6, 2, 8, 8, device="meta")
    out = paged_attention(
        torch.empty(2, 4, 1, 8, device="meta"), kc, kc, torch.tensor([[4, 1], [0, -1]]), torch.tensor([13, 6])
    )
    assert out.shape == (2, 4, 1, 8) and out.device.type == "meta"


def _in_a_fresh_thread(fn):
    """fn() run in a new thread (its own, still empty, scratch buffers); its result or its exception."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as exc:
            box["exc"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def test_reused_gathers_share_pages_grow_by_doubling_and_never_touch_an_unreused_result():
    """gather_kv(reuse=True) fills this thread's scratch: a second gather of the same size lands in the same pages,
    a larger one grows the buffer to at least twice its size (an empty one allocates nothing), a first use in
    inference mode still gives buffers usable outside it; a gather without reuse owns its result, which later
    reused gathers never overwrite."""
    cache_k, cache_v = _raw_pool()
    table = torch.tensor([4, 1, 0])

    def scenario():
        with torch.inference_mode():
            gather_kv(cache_k, cache_v, table, 9, reuse=True)  # the first buffers are made in inference mode
        empty = gather_kv(cache_k, cache_v, table, 0, reuse=True)
        k1, v1 = gather_kv(cache_k, cache_v, table, 10, reuse=True)  # 2 blocks, as the first
        ptrs = (k1.data_ptr(), v1.data_ptr())
        fitted = (k1.untyped_storage().nbytes(), v1.untyped_storage().nbytes())  # the first size, kept
        k2, v2 = gather_kv(cache_k, cache_v, table, 16, reuse=True)
        same = (k2.data_ptr(), v2.data_ptr()) == ptrs
        k3, v3 = gather_kv(cache_k, cache_v, table, 17, reuse=True)  # 3 blocks: grown
        sizes = (k3.untyped_storage().nbytes(), v3.untyped_storage().nbytes())
        own_k, own_v = gather_kv(cache_k, cache_v, table, 17)
        snapshot = (own_k.clone(), own_v.clone())
        gather_kv(cache_v, cache_k, table, 17, reuse=True)  # K and V swapped into the scratch
        kept = torch.equal(own_k, snapshot[0]) and torch.equal(own_v, snapshot[1])
        return empty, same and fitted == (2 * 2 * 8 * 8 * 4,) * 2, sizes, kept, (own_k, own_v)

    empty, same, sizes, kept, (own_k, own_v) = _in_a_fresh_thread(scenario)
    assert [x.numel() for x in empty] == [0, 0] and same and kept
    block_bytes = 2 * 8 * 8 * 4  # [H, T, D] float32
    assert sizes == (4 * block_bytes, 4 * block_bytes)  # 2 blocks, then 3: doubled to 4
    want_k = torch.cat([cache_k[b] for b in (4, 1, 0)], dim=1)[:, :17]
    assert torch.equal(own_k, want_k) and torch.equal(own_v, torch.cat([cache_v[b] for b in (4, 1, 0)], dim=1)[:, :17])
    k, v = _in_a_fresh_thread(lambda: gather_kv(cache_k, cache_v, table, 0, reuse=True))
    assert k.untyped_storage().nbytes() == 0 and v.untyped_storage().nbytes() == 0


# ------------------------------------------------------------------------------ attend_step and the switch
def _reference_step(kind: str, n: int):
    """Rows of LENS tokens (both layers) in a float pool of one segment, one of two segments whose rows live in
    the second, or a per-token int8 pool; then a step of ``n`` new tokens with layer 0 written: (step, rows)."""
    if kind == "segments":
        kv = PagedKV(SPEC2, 1, prefix_caching=False)
        kv.grow(11)  # every row's blocks come from the second segment
    else:
        kv = PagedKV(SPEC2, 12, prefix_caching=False, **({"quant": PerTokenInt8()} if kind == "int8" else {}))
    gen = torch.Generator().manual_seed(21)
    seqs = [kv.new_sequence() for _ in LENS]
    for seq, length in zip(seqs, LENS, strict=True):
        for layer in range(2):
            seq.append(layer, torch.randn(2, length, 8, generator=gen), torch.randn(2, length, 8, generator=gen))
    step = StepBatch.reserve(seqs, n)
    write_step(step, 0, torch.randn(2, 2, n, 8, generator=gen), torch.randn(2, 2, n, 8, generator=gen))
    return step, seqs


@pytest.mark.parametrize("kind", ["float", "segments", "int8"])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("feature", list(_features(1)))
def test_attend_step_equals_attention_over_each_rows_own_tokens(monkeypatch, kind, nq, feature):
    """A prepared step's queries attend over each row's own tokens (the step's new ones included) with the scale,
    mask, window, softcap and sinks asked for, in any pool layout (the reference: MEMOS_REF_KERNELS=reference)."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    step, seqs = _reference_step(kind, nq)
    opts = _features(nq)[feature]
    if "mask" in opts:  # the mask spans the step's longest row
        opts = {"mask": torch.cat([opts["mask"], opts["mask"][..., -nq:]], dim=-1)}
    query = torch.randn(2, 4, nq, 8, generator=torch.Generator().manual_seed(9))
    got = attend_step(query, step, 0, **opts)
    for i, (seq, n) in enumerate(zip(seqs, LENS, strict=True)):
        k, v = seq.to_dense(0)
        row = dict(opts)
        if "mask" in opts:
            row["mask"] = opts["mask"][i if opts["mask"].shape[0] > 1 else 0, :, :, : n + nq]
        torch.testing.assert_close(got[i].double(), _oracle(query[i], k, v, **row), atol=1e-5, rtol=1e-5)


def test_attend_step_refuses_a_query_that_is_not_the_steps(monkeypatch):
    """attend_step names a non-tensor query, and refuses one whose batch, rank or query count is not the step's,
    saying what it expected."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    step, _ = _reference_step("float", 1)
    with pytest.raises(ArgumentTypeError, match=r"^query: expected Tensor, got str"):
        attend_step("q", step, 0)
    for bad in (torch.randn(3, 4, 1, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 1), torch.randn(1, 4, 1, 8)):
        with pytest.raises(ShapeError) as info:
            attend_step(bad, step, 0)
        assert str(info.value) == f"query: expected [2, q_heads, 1, head_dim], got {tuple(bad.shape)}"


@pytest.mark.parametrize("opts", [{"sliding_window": 4}, {"softcap": 1.0}, {"mask": "trivial"}, {"dtype": "half"}])
def test_a_decode_step_with_a_feature_or_another_dtype_skips_the_kernel(monkeypatch, opts):
    """A decode step with a window or softcap, or whose query dtype is not the pool's, runs the reference (the
    kernels have none of these); an all-True bool mask is no mask at all and keeps the kernel."""
    fake = FakeKernels()
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    monkeypatch.setattr(attention, "_triton", lambda: fake)
    step, seqs = _reference_step("float", 1)
    query = torch.randn(2, 4, 1, 8, generator=torch.Generator().manual_seed(2))
    if opts.get("mask") == "trivial":
        opts = {"mask": torch.ones(2, 1, 1, max(LENS) + 1, dtype=torch.bool)}
    if opts.get("dtype") == "half":
        # the reference refuses mixed dtypes by name; the kernel was never asked
        with pytest.raises(DTypeError, match="expected one dtype"):
            attend_step(query.double(), step, 0)
        assert fake.launches("paged_decode_attention") == []
        return
    got = attend_step(query, step, 0, **opts)
    assert len(fake.launches("paged_decode_attention")) == (1 if "mask" in opts else 0)
    for i, seq in enumerate(seqs):
        k, v = seq.to_dense(0)
        want = _oracle(query[i], k, v, **{key: val for key, val in opts.items() if key != "mask"})
        torch.testing.assert_close(got[i].double(), want, atol=1e-5, rtol=1e-5)


class _RaisingTriton:
    def __call__(self):
        raise BackendUnavailableError("Triton is not installed")


@pytest.mark.parametrize(
    "mode, device, triton_ok, want",
    [
        ("reference", "cuda", True, False),
        ("interpret", "cpu", True, True),
        ("triton", "cuda", True, True),
        ("auto", "cuda", True, True),
        ("auto", "cuda", False, False),
        ("auto", "cpu", True, False),
    ],
)
def test_use_kernels_follows_the_mode_and_the_device(monkeypatch, mode, device, triton_ok, want):
    """reference: never; interpret: always; triton: CUDA tensors; auto: CUDA tensors when Triton imports."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
    monkeypatch.setattr(attention, "_triton", (lambda: FakeKernels()) if triton_ok else _RaisingTriton())
    assert attention.use_kernels(torch.device(device)) is want


def test_the_triton_mode_on_cpu_tensors_and_an_unknown_mode_are_refused_by_name(monkeypatch):
    """MEMOS_REF_KERNELS=triton with CPU tensors says to use interpret; an unknown mode lists the valid ones."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "triton")
    with pytest.raises(ConfigError) as info:
        attention.use_kernels(torch.device("cpu"))
    assert str(info.value) == "MEMOS_REF_KERNELS=triton needs CUDA tensors; use interpret on the CPU"
    monkeypatch.setenv("MEMOS_REF_KERNELS", "gpu")
    with pytest.raises(ConfigError) as info:
        attention.kernel_mode()
    assert str(info.value) == f"MEMOS_REF_KERNELS must be one of {attention.MODES}, got 'gpu'"


class _Bare:
    """A duck-typed pool whose scheme and self may lack the optional attributes step_path reads."""

    def __init__(self, scheme: dict, **attrs) -> None:
        self.spec, self.device, self.segments, self.quantized = SPEC2_16, torch.device("cpu"), [None], True
        self.scheme = type("Scheme", (), scheme)()
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    "scheme, attrs, path",
    [
        ({}, {}, "reference"),  # a scheme with no name
        ({"name": "int8_token"}, {}, "reference"),  # not said to be streaming: it may stage
        ({"name": "int8_token"}, {"streaming": True}, "int8"),
        ({"name": "kivi2"}, {}, "reference"),  # no group size
        ({"name": "int8_tensor", "group_size": 16}, {"streaming": True}, "reference"),  # a group, but not KIVI
    ],
)
def test_step_path_reads_only_what_a_pool_says(monkeypatch, scheme, attrs, path):
    """A pool's missing attributes mean 'no': no name, not streaming, no group size — the reference."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    step = type("Step", (), {"notes": {}, "pool": _Bare(scheme, **attrs)})()
    assert attention.step_path(step) == path


def test_the_path_is_decided_once_per_step(monkeypatch):
    """Every layer of a step takes the path chosen at its first call, even if MEMOS_REF_KERNELS changes meanwhile."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "interpret")
    step, _ = _reference_step("float", 1)
    assert attention.step_path(step) == "plain"
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    assert attention.step_path(step) == "plain"


def test_paged_attention_refuses_bad_arguments_by_name():
    """Each non-tensor argument, a query that is not 4-D, caches of unlike shapes or another head dim, tables or
    lengths of another batch, non-integer indices and a mask that fits neither batch, queries nor the longest row:
    each refused naming the argument, expected vs actual."""
    cache_k, cache_v = _raw_pool()
    args = {
        "query": torch.randn(2, 4, 2, 8),
        "key_cache": cache_k,
        "value_cache": cache_v,
        "block_tables": torch.tensor([[4, 1], [0, 5]]),
        "seq_lens": torch.tensor([13, 10]),
    }
    for name in args:
        with pytest.raises(ArgumentTypeError, match=rf"^{name}: expected Tensor, got int"):
            paged_attention(**{**args, name: 3})
    bad = torch.randn(2, 4, 8)
    with pytest.raises(ShapeError) as info:
        paged_attention(**{**args, "query": bad})
    assert str(info.value) == "query: expected [batch, q_heads, queries, head_dim], got (2, 4, 8)"
    for k, v in ((cache_k, cache_v[:5]), (cache_k[..., :4], cache_v[..., :4]), (cache_k[0], cache_v[0])):
        with pytest.raises(ShapeError) as info:
            paged_attention(**{**args, "key_cache": k, "value_cache": v})
        assert str(info.value) == (
            f"key/value caches must both be [num_blocks, kv_heads, block_size, head_dim=8], got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    for tables, lens in (
        (args["block_tables"][:1], args["seq_lens"]),
        (args["block_tables"], args["seq_lens"][:1]),
        (args["block_tables"][0], args["seq_lens"]),
        (args["block_tables"][None], args["seq_lens"]),
    ):
        with pytest.raises(ShapeError) as info:
            paged_attention(**{**args, "block_tables": tables, "seq_lens": lens})
        assert str(info.value) == (
            f"block_tables [2, *] and seq_lens [2] expected, got {tuple(tables.shape)} and {tuple(lens.shape)}"
        )
    for name in ("block_tables", "seq_lens", "query_lens"):
        value = args.get(name, torch.tensor([2, 2])).float()
        with pytest.raises(ArgumentTypeError) as info:
            paged_attention(**{**args, name: value})
        assert str(info.value) == f"{name}: expected an integer tensor, got dtype torch.float32"
    for mask in (torch.zeros(2, 1, 2, 12), torch.zeros(3, 1, 2, 13), torch.zeros(2, 1, 1, 13), torch.zeros(1, 2, 13)):
        with pytest.raises(ShapeError) as info:
            paged_attention(**args, mask=mask)
        assert str(info.value) == (
            f"mask: expected [2, 1 or 4, 2, >= 13] (batch, heads, queries, keys), got {tuple(mask.shape)}"
        )
    with pytest.raises(ArgumentTypeError, match=r"^mask: expected Tensor, got str"):
        paged_attention(**args, mask="x")


def test_paged_attention_with_ragged_query_counts_fills_only_each_rows_queries():
    """query_lens: row b's first query_lens[b] rows are its newest tokens (the oracle over its own keys), the rows
    past them are zero, an empty row is all zero; more queries than tokens is refused by row."""
    cache_k, cache_v = _raw_pool(seed=4)
    tables, lens = torch.tensor([[4, 1], [0, 5], [2, -1]]), torch.tensor([13, 10, 0])
    query = torch.randn(3, 4, 3, 8, generator=torch.Generator().manual_seed(8))
    qlens = torch.tensor([3, 1, 0])
    out = paged_attention(query, cache_k, cache_v, tables, lens, query_lens=qlens, scale=0.5)
    rows = _rows(cache_k, cache_v, tables[:2], lens[:2])
    for i, (k, v) in enumerate(rows):
        n = int(qlens[i])
        torch.testing.assert_close(
            out[i, :, :n].double(), _oracle(query[i, :, :n], k, v, scale=0.5), atol=1e-5, rtol=1e-5
        )
        assert not out[i, :, n:].any()
    assert not out[2].any()
    with pytest.raises(ShapeError) as info:
        paged_attention(query, cache_k, cache_v, tables, torch.tensor([13, 2, 0]), query_lens=torch.tensor([3, 3, 0]))
    assert str(info.value) == "sequence 1: 3 queries but 2 tokens (and Q=3)"
    with pytest.raises(ShapeError) as info:
        paged_attention(query, cache_k, cache_v, tables, lens, query_lens=torch.tensor([4, 1, 0]))
    assert str(info.value) == "sequence 0: 4 queries but 13 tokens (and Q=3)"
    whole = paged_attention(
        query, cache_k, cache_v, tables, torch.tensor([13, 3, 0]), query_lens=torch.tensor([1, 3, 0])
    )
    (k, v) = _rows(cache_k, cache_v, tables[1:2], torch.tensor([3]))[0]  # a row whose queries are all its tokens
    torch.testing.assert_close(whole[1].double(), _oracle(query[1], k, v), atol=1e-5, rtol=1e-5)


def test_attention_options_are_checked_by_name_before_anything_is_computed():
    """scale, sliding_window, softcap and sinks of the wrong type or out of range are refused naming the option,
    expected vs actual; the smallest valid values (a window of 1, a tiny softcap, an int scale) are accepted."""
    q, k, v = _qkv(4, 1, 2, 5)
    type_errors = {
        "scale": ("x", "scale: expected int or float, got str ('x')"),
        "sliding_window": (2.0, "sliding_window: expected int, got float (2.0)"),
        "softcap": ("x", "softcap: expected int or float, got str ('x')"),
        "sinks": ([0.0] * 4, "sinks: expected Tensor, got list ([0.0, 0.0, 0.0, 0.0])"),
    }
    for name, (value, message) in type_errors.items():
        with pytest.raises(ArgumentTypeError) as info:
            dense_attention(q, k, v, **{name: value})
        assert str(info.value) == message
    with pytest.raises(ArgumentTypeError, match=r"^sliding_window: expected int, got bool"):
        dense_attention(q, k, v, sliding_window=True)
    for window in (0, -2):
        with pytest.raises(InvalidArgumentError) as info:
            dense_attention(q, k, v, sliding_window=window)
        assert str(info.value) == f"sliding_window: expected a positive int (keys kept), got {window}"
    for cap in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidArgumentError) as info:
            dense_attention(q, k, v, softcap=cap)
        assert str(info.value) == f"softcap: expected a positive float, got {cap}"
    with pytest.raises(ShapeError) as info:
        dense_attention(q, k, v, sinks=torch.zeros(2))
    assert str(info.value) == "sinks: expected one logit per query head [4], got (2,)"
    out = dense_attention(q, k, v, scale=1, sliding_window=1, softcap=1e-3)
    torch.testing.assert_close(
        out.double(), _oracle(q, k, v, scale=1, sliding_window=1, softcap=1e-3), atol=1e-5, rtol=1e-5
    )


def test_paged_attention_edge_batches_and_options():
    """An empty batch (with a mask) gives an empty result; a row with no tokens gets zeros while the others are
    the oracle; query_lens all equal to Q is the same as none, ragged ones leave the rows past them zero; bool
    indices, a 5-D mask and each bad option are refused by name."""
    cache_k, cache_v = _raw_pool(seed=6)
    q0 = torch.randn(0, 4, 2, 8)
    empty = paged_attention(
        q0, cache_k, cache_v, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long),
        mask=torch.zeros(1, 1, 2, 0),
    )  # fmt: skip
    assert empty.shape == (0, 4, 2, 8)
    tables, lens = torch.tensor([[4, 1], [0, 5]]), torch.tensor([13, 0])
    query = torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(6))
    out = paged_attention(query, cache_k, cache_v, tables, lens)
    (k, v), _ = _rows(cache_k, cache_v, tables, torch.tensor([13, 1]))
    torch.testing.assert_close(out[0].double(), _oracle(query[0], k, v), atol=1e-5, rtol=1e-5)
    assert not out[1].any()
    lens = torch.tensor([13, 10])
    full = paged_attention(query, cache_k, cache_v, tables, lens, query_lens=torch.tensor([2, 2]))
    torch.testing.assert_close(full, paged_attention(query, cache_k, cache_v, tables, lens), atol=1e-6, rtol=1e-6)
    ragged = paged_attention(query, cache_k, cache_v, tables, lens, query_lens=torch.tensor([2, 1]))
    assert not ragged[1, :, 1:].any()
    (_, _), (k, v) = _rows(cache_k, cache_v, tables, lens)
    torch.testing.assert_close(ragged[1, :, :1].double(), _oracle(query[1, :, :1], k, v), atol=1e-5, rtol=1e-5)
    with pytest.raises(ArgumentTypeError) as info:
        paged_attention(query, cache_k, cache_v, tables, lens.bool())
    assert str(info.value) == "seq_lens: expected an integer tensor, got dtype torch.bool"
    with pytest.raises(ShapeError, match=r"^mask: expected \[2, 1 or 4, 2, >= 13\]"):
        paged_attention(query, cache_k, cache_v, tables, lens, mask=torch.zeros(2, 1, 2, 13, 1))
    bad_options = (
        ({"scale": "x"}, ArgumentTypeError, "^scale: "),
        ({"sliding_window": 0}, InvalidArgumentError, "^sliding_window: "),
        ({"softcap": -1.0}, InvalidArgumentError, "^softcap: "),
        ({"sinks": torch.zeros(3)}, ShapeError, "^sinks: "),
    )
    no_rows = (q0, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    for opts, error, match in bad_options:
        for q, t, n in ((query, tables, lens), no_rows):  # refused even when no row would use the option
            with pytest.raises(error, match=match):
                paged_attention(q, cache_k, cache_v, t, n, **opts)


class _Stop(Exception):
    """Raised by a spy once it has seen what it looks for."""


def test_the_rows_gather_index_is_brought_to_the_caches_device():
    """Runs on the CPU: the caches on ``meta`` (standing in for a GPU), block tables and lengths on the host. The
    batched path's one ``index_select`` over the caches gets its index on the caches' device (a GPU cache refuses
    a host index; ``meta`` accepts one, so a spy on ``index_select`` is the witness, and it stops the call)."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.index_select:
                seen.append((args[0].device.type, args[2].device.type))
                raise _Stop
            return func(*args, **(kwargs or {}))

    cache_k, cache_v = (c.to("meta") for c in _raw_pool(seed=5))
    query = torch.empty(2, 4, 1, 8, device="meta")
    with Spy(), pytest.raises(_Stop):
        paged_attention(query, cache_k, cache_v, torch.tensor([[4, 1], [0, 5]]), torch.tensor([13, 10]))
    assert seen == [("meta", "meta")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: GPU caches with host block tables")
def test_paged_attention_of_gpu_caches_takes_host_block_tables():
    """GPU caches with block tables and lengths built on the host (the batched path: every row holds all its
    queries): the rows' gather index is brought to the caches' device (index_select on a GPU tensor refuses a
    host index; ``meta`` caches accept one, so the CPU cannot show it) and each row is the float64 oracle."""
    cache_k, cache_v = _raw_pool(seed=5)
    tables, lens = torch.tensor([[4, 1], [0, 5]]), torch.tensor([13, 10])
    query = torch.randn(2, 4, 1, 8, generator=torch.Generator().manual_seed(5))
    out = paged_attention(query.cuda(), cache_k.cuda(), cache_v.cuda(), tables, lens)
    assert out.device.type == "cuda"
    for i, (k, v) in enumerate(_rows(cache_k, cache_v, tables, lens)):
        torch.testing.assert_close(out[i].double().cpu(), _oracle(query[i], k, v), atol=1e-5, rtol=1e-5)
