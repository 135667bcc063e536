"""Triton kernels against the reference (memos_ref.attention), in Triton's interpreter on the CPU (natively on a
GPU when there is one). Outputs are poisoned beforehand so that anything left unwritten shows."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import kernel_modules

from memos_ref.attention import gather_kv, paged_attention
from memos_ref.errors import ConfigError, DTypeError, InvalidArgumentError, ShapeError

(tk,) = kernel_modules("triton_paged")  # the whole file skips without Triton (raises in CI)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_MODE = "triton" if DEVICE == "cuda" else "interpret"  # never interpret once Triton is imported compiled
FP8_OK = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def make_case(seed, lens, h=2, group=4, t=16, d=32, dtype=torch.float32):
    """Query, one layer's pool [N, 2, H, T, D], shuffled non-contiguous block tables and lengths, on DEVICE."""
    from memos_kernels.paged_decode import random_paged_case

    return random_paged_case(seed, lens, kv_heads=h, group=group, block_size=t, head_dim=d, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize(
    "lens,group,t,split",
    [
        ([1], 1, 16, None),
        ([17, 16, 33], 4, 16, None),
        ([200, 5, 64], 8, 8, 3),  # many splits, GQA 8
        ([0, 40], 4, 32, 1),  # an empty sequence, one block per split
        ([130], 1, 128, 1),
        ([77, 1], 2, 64, 2),
    ],
)
def test_paged_decode_matches_reference(lens, group, t, split):
    q, pool, tables, seq_lens = make_case(len(lens) + t, lens, group=group, t=t)
    got = tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, seq_lens, blocks_per_split=split)
    want = paged_attention(q[:, :, None].cpu(), pool[:, 0].cpu(), pool[:, 1].cpu(), tables.cpu(), seq_lens.cpu())
    assert torch.allclose(got.cpu(), want[:, :, 0], atol=1e-5, rtol=1e-4)
    assert not torch.isnan(got).any()


def test_paged_decode_fp16():
    q, pool, tables, seq_lens = make_case(3, [45, 9], dtype=torch.float16)
    got = tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, seq_lens).float().cpu()
    want = paged_attention(
        q.float()[:, :, None].cpu(), pool[:, 0].float().cpu(), pool[:, 1].float().cpu(), tables.cpu(), seq_lens.cpu()
    )
    assert torch.allclose(got, want[:, :, 0], atol=2e-3)


@pytest.mark.parametrize("t", [8, 32])
def test_write_kv_scatters_and_skips(t):
    g = torch.Generator().manual_seed(t)
    pool = torch.full((6, 2, 2, t, 16), float("nan"))  # poisoned
    key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    slots = torch.tensor([0, t + 3, -1, 5 * t + t - 1, 2 * t])
    want = pool.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[s // t, 0, :, s % t] = key[i]
            want[s // t, 1, :, s % t] = value[i]
    pool = pool.to(DEVICE)
    tk.write_kv(key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), pool[:, 0], pool[:, 1])  # strided views
    assert torch.equal(pool.cpu().nan_to_num(123.0), want.nan_to_num(123.0))  # written where asked, nowhere else


def test_write_kv_into_the_real_pool_layout():
    from memos_ref.paged import PagedKV
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    kv = PagedKV(spec, 8, device=DEVICE)
    seq = kv.new_sequence()
    slots = torch.as_tensor(seq.reserve(20), device=DEVICE)
    key, value = torch.randn(20, 2, 16, device=DEVICE), torch.randn(20, 2, 16, device=DEVICE)
    view = kv.pool.layer_view(1)  # [N, 2, H, T, D], strided: the layer axis is skipped
    tk.write_kv(key, value, slots, view[:, 0], view[:, 1])
    seq.layer_tokens = [20, 20, 20]
    k, v = seq.to_dense(1)
    assert torch.equal(k, key.transpose(0, 1)) and torch.equal(v, value.transpose(0, 1))


def test_copy_blocks():
    pool = torch.randn(6, 3, 2, 2, 8, 16, device=DEVICE)
    before = pool.clone()
    tk.copy_blocks(pool, torch.tensor([[0, 3], [2, 5]], device=DEVICE))
    assert torch.equal(pool[3], before[0]) and torch.equal(pool[5], before[2]) and torch.equal(pool[1], before[1])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        tk.copy_blocks(pool, torch.tensor([[0, 3], [3, 4]], device=DEVICE))


def test_preconditions_are_checked():
    q, pool, tables, seq_lens = make_case(0, [10])
    with pytest.raises(ConfigError, match="power of two"):
        tk.paged_decode_attention(q, pool[:, 0, :, :12], pool[:, 1, :, :12], tables, seq_lens)
    with pytest.raises(ShapeError, match="multiple of KV heads"):
        tk.paged_decode_attention(q[:, :3], pool[:, 0], pool[:, 1], tables, seq_lens)
    with pytest.raises(DTypeError, match="does not match"):
        tk.paged_decode_attention(q.half(), pool[:, 0], pool[:, 1], tables, seq_lens)
    with pytest.raises(ShapeError, match="seq_lens"):
        tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, seq_lens[:0])
    k, _v = gather_kv(pool[:, 0].cpu(), pool[:, 1].cpu(), tables[0].cpu(), 10)
    assert k.shape == (2, 10, 32)


def test_generation_through_the_kernels_equals_the_reference(monkeypatch):
    """The package's forward over a PagedCache: decode steps through the Triton kernel (interpreter here)
    give the same tokens as the reference."""
    from memos_ref import ops
    from memos_ref.hf import PagedCache
    from memos_ref.model import load_model
    from memos_ref.paged import PagedKV

    model = load_model().to(DEVICE)
    ids = torch.tensor([list(b"def quantize(x, scale):\n    return ")], device=DEVICE)
    outs = {}
    for mode in ("reference", KERNEL_MODE):
        monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
        assert ops.use_kernels(torch.device(DEVICE)) == (mode == KERNEL_MODE)
        outs[mode] = model.generate(ids, 12, PagedCache(PagedKV(model.kv_spec(block_size=16), 16, device=DEVICE)))
    assert torch.equal(outs["reference"], outs[KERNEL_MODE])
    monkeypatch.setenv("MEMOS_REF_KERNELS", "sideways")
    with pytest.raises(ConfigError, match="MEMOS_REF_KERNELS"):
        ops.kernel_mode()


@pytest.mark.parametrize("lens,qlens,t", [([20, 5], [4, 5], 16), ([70], [33], 8), ([16, 1], [0, 1], 32)])
def test_paged_prefill_matches_reference(lens, qlens, t):
    q4, pool, tables, seq_lens = make_case(sum(lens), lens, t=t)
    g = torch.Generator().manual_seed(7)
    query = torch.randn(len(lens), q4.shape[1], max(qlens), 32, generator=g).to(DEVICE)
    qlens_t = torch.tensor(qlens, device=DEVICE)
    got = tk.paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, seq_lens, qlens_t)
    want = paged_attention(query.cpu(), pool[:, 0].cpu(), pool[:, 1].cpu(), tables.cpu(), seq_lens.cpu(),
                           query_lens=qlens_t.cpu())  # fmt: skip
    assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-4)


def test_prefill_is_one_tiled_causal_launch(monkeypatch):
    """Chunked prefill of float caches (issue 18 item 1): ONE launch of the tiled prefill kernel over a grid of
    (sequence, KV head, query tile) — not a decode row per query — equal to the reference: GQA 3 in fp16, a chunk
    crossing blocks over a cached prefix, a row that is all chunk, a row without queries."""
    from memos_kernels import paged_prefill as pp

    class Launches:
        def __init__(self, kernel):
            self.kernel, self.grids = kernel, []

        def __getitem__(self, grid):
            self.grids.append(grid)
            return self.kernel[grid]

    def no_rows(*args, **kwargs):
        raise AssertionError("float prefill must not fall back to decode rows")

    launches = Launches(pp.prefill_kernel)
    monkeypatch.setattr(pp, "prefill_kernel", launches)
    monkeypatch.setattr(pp, "paged_decode_attention", no_rows)
    lens, qlens = [37, 9, 4], [21, 9, 0]
    _, pool, tables, seq_lens = make_case(5, lens, h=2, group=3, t=8, dtype=torch.float16)
    g = torch.Generator().manual_seed(8)
    query = torch.randn(3, 6, 21, 32, generator=g).half().to(DEVICE)
    qlens_t = torch.tensor(qlens, device=DEVICE)
    got = pp.paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, seq_lens, qlens_t)
    qb, _, _ = pp.prefill_config(3, 8, 32, torch.float16)
    assert launches.grids == [(3, 2, -(-21 // qb))]
    want = pp.paged_prefill_reference(query.float(), pool[:, 0].float(), pool[:, 1].float(), tables, seq_lens, qlens_t)
    assert torch.allclose(got.float(), want, atol=2e-3)
    assert torch.equal(got[1:, :, 9:], torch.zeros_like(got[1:, :, 9:]))  # zeros past each row's queries
    with pytest.raises(ShapeError, match="sequence 1: 10 queries but 9 tokens"):
        pp.paged_prefill_attention(
            query, pool[:, 0], pool[:, 1], tables, seq_lens, torch.tensor([1, 10, 0], device=DEVICE)
        )


@pytest.mark.parametrize(
    "scheme", ["int8", pytest.param("fp8", marks=pytest.mark.skipif(not FP8_OK, reason="fp8 kernels: sm_89+"))]
)
def test_dequantizing_decode_reads_the_quantized_pool(scheme):
    """The kernel reads the quantized pool's payload directly; the oracle is the reference attention over the
    pool's own dequantized blocks."""
    from memos_ref.paged import PagedKV
    from memos_ref.quant import FP8E4M3, PerTokenInt8
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    scheme_obj = PerTokenInt8() if scheme == "int8" else FP8E4M3()
    kv = PagedKV(spec, 24, quant=scheme_obj, prefix_caching=False, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    seqs = []
    for n in (37, 5, 64):
        seq = kv.new_sequence()
        for layer in range(2):
            x = (torch.randn(2, n, 32, generator=g) * 3).to(DEVICE)
            seq.append(layer, x, x.flip(-1))
        seqs.append(seq)
    layer = 1
    p = kv.pool.payload
    codes = p["codes"][:, layer]  # [N, 2, H, T, D]
    scales = p["scale"][:, layer]  # int8: [N, 2, H, T]; fp8: [N, 2, H]
    tables = torch.full((3, 4), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, : s.num_blocks] = torch.tensor(s.block_table)
    tables = tables.to(DEVICE)
    lens = torch.tensor([s.num_tokens for s in seqs], device=DEVICE)
    q = torch.randn(3, 8, 32, generator=g).to(DEVICE)
    got = tk.paged_decode_attention(
        q, codes[:, 0], codes[:, 1], tables, lens, quant=scheme, key_scale=scales[:, 0], value_scale=scales[:, 1]
    )
    blocks = kv.pool.read_blocks(torch.arange(24, device=DEVICE), layer)  # dequantized [N, 2, H, T, D]
    want = paged_attention(q[:, :, None], blocks[:, 0], blocks[:, 1], tables, lens)[:, :, 0]
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ShapeError, match="needs key_scale"):
        tk.paged_decode_attention(q, codes[:, 0], codes[:, 1], tables, lens, quant=scheme)


def test_write_kv_int8_matches_the_quantized_pool():
    from memos_ref.paged import PagedKV
    from memos_ref.quant import PerTokenInt8
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    ref = PagedKV(spec, 8, quant=PerTokenInt8(), prefix_caching=False, device=DEVICE)
    mine = PagedKV(spec, 8, quant=PerTokenInt8(), prefix_caching=False, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    key, value = (torch.randn(40, 2, 32, generator=g) * 4).to(DEVICE), torch.randn(40, 2, 32, generator=g).to(DEVICE)
    slots = torch.cat([torch.arange(0, 20), torch.tensor([-1]), torch.arange(48, 67)]).to(DEVICE)
    ref.pool.write(1, slots, key, value)
    p = mine.pool.payload
    tk.write_kv_int8(
        key, value, slots, p["codes"][:, 1, 0], p["codes"][:, 1, 1], p["scale"][:, 1, 0], p["scale"][:, 1, 1]
    )
    r = ref.pool.payload
    assert torch.equal(p["scale"], r["scale"])  # the scales are bit-identical
    diff = (p["codes"].int() - r["codes"].int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01  # only exact .5 ties may differ


def test_kernel_benchmark_json_contract():
    """``python -m memos_kernels.bench --json``: on a GPU the quick run measures (outputs checked against the
    reference, SDPA backend recorded); without one it prints a JSON that says ``"gpu": false`` and why — the
    interpreter's timings were reported as if they meant something before (issue 18 item 6)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--quick", "--no-extras"] if DEVICE == "cuda" else []
    done = subprocess.run(
        [sys.executable, "-m", "memos_kernels.bench", "--json", *args], capture_output=True, text=True, timeout=600,
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) >= {"bench", "version", "machine", "config", "results", "summary"}
    assert report["summary"]["gpu"] == (DEVICE == "cuda")
    if DEVICE == "cuda":  # pragma: no cover - needs a GPU
        assert report["summary"]["outputs_ok"] and report["summary"]["sdpa_backends"]
        assert all(r["bytes"] > r["kv_bytes"] > 0 and r["paged_ms"] > 0 for r in report["results"])
    else:
        assert report["results"] == [] and "no CUDA device" in report["summary"]["skipped"]


def test_kernel_benchmark_case_checks_its_output_and_counts_every_byte():
    """One benchmark case on the kernel's device (tiny, so the interpreter can run it): the output is checked
    against the reference, and the bytes add scales and split partials to the K/V."""
    from memos_kernels import bench
    from memos_kernels.paged_decode import paged_decode_attention

    shape = dict(batch=2, context=40, hq=4, hkv=2, d=32, block=16)
    row = bench.decode_case(paged_decode_attention, DEVICE, budget_ms=1.0, dtype="int8", **shape)
    assert row["output_ok"] and row["max_abs_err"] < 1e-3
    kv = 2 * 40 * 2 * 32 * 2
    assert row["bytes"] == bench.bytes_read(2, 40, 4, 2, 32, "int8", row["splits"]) > kv + 2 * 40 * 2 * 2 * 2


@pytest.mark.skipif(not FP8_OK, reason="fp8 kernels: sm_89+")
def test_write_kv_fp8_matches_the_quantized_pool():
    from memos_ref.paged import PagedKV
    from memos_ref.quant import FP8E4M3
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    ref = PagedKV(spec, 6, quant=FP8E4M3(), prefix_caching=False, device=DEVICE)
    mine = PagedKV(spec, 6, quant=FP8E4M3(), prefix_caching=False, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    key, value = (torch.randn(30, 2, 32, generator=g) * 5).to(DEVICE), torch.randn(30, 2, 32, generator=g).to(DEVICE)
    slots = torch.arange(30, device=DEVICE)
    ref.pool.write(0, slots, key, value)  # one write into fresh blocks: the scales fit every token
    p, r = mine.pool.payload, ref.pool.payload
    p["scale"].copy_(r["scale"])  # the scales the pool chose (growing them is the pool's job, not the kernel's)
    codes, scales = p["codes"][:, 0], p["scale"][:, 0]
    tk.write_kv_fp8(key, value, slots, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1])
    if DEVICE == "cuda":
        assert torch.equal(p["codes"], r["codes"])  # byte-identical fp8 codes
    else:
        # Triton 3.9's interpreter drops the carry when fp32 -> fp8 rounding overflows the mantissa (31.9 -> 16
        # instead of 32): every mismatch must be exactly that case, and nothing else may differ
        got = p["codes"].view(torch.float8_e4m3fn).float()
        want = r["codes"].view(torch.float8_e4m3fn).float()
        bad = p["codes"] != r["codes"]
        assert bool((got[bad] * 2 == want[bad]).all()) and bool((torch.log2(want[bad].abs()) % 1 == 0).all())
        assert float(bad.float().mean()) < 0.02


@pytest.mark.parametrize("capability", [87, 90])
def test_every_kernel_compiles_for_a_real_gpu_without_spills(capability):
    """The interpreter skips some compiler rules and says nothing of resources: compile each kernel ahead of time
    for Jetson Orin (sm_87) and Hopper (sm_90) with Triton's own compiler and ptxas (no GPU needed), with the
    run-time specializations, and fail on any spill (issue 18 item 4, issue 25: the set is the launch planner's,
    tests/test_kernels_plan.py). The default is its hot subset (head dim 128, every element type
    and kernel); MEMOS_REF_FULL_AOT=1 compiles every launch the package can make. Triton 3.6 (the device's):
    tests/test_kernels_triton36.py."""
    import json
    import subprocess
    import sys

    try:
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(capability).path  # noqa: B018 - raises when Triton ships no ptxas for this target
    except Exception as exc:  # pragma: no cover - depends on the Triton wheel
        pytest.skip(f"Triton's NVIDIA backend or its ptxas is unavailable here: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [str(capability)] + (["--full"] if os.environ.get("MEMOS_REF_FULL_AOT") == "1" else [])
    done = subprocess.run(
        [sys.executable, "-m", "memos_kernels.aot_check", *args], capture_output=True, text=True, env=env,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all("cubin" in r["stages"] and r["registers"] > 0 for r in report["resources"])
    names = {r["name"] for r in report["resources"]}
    assert any(n.startswith("decode_split_") and "_u8_" in n for n in names) == (capability >= 89)  # fp8: sm_89+
    assert report["hot_spills"] == [], report["hot_spills"]


def test_the_resource_check_flags_a_hot_spill():
    """The spill check can fail: every spilled configuration is reported (issue 25: any launch the package can
    make, not only the decode and write kernels), an unspilled one is not."""
    from memos_kernels.aot_check import Resources, format_table, spills

    rows = [Resources("decode_fp16_g4_t16_d128", 90, 255, 40, 56, 96, ("cubin",)),
            Resources("copy_blocks", 90, 255, 8, 8, 8, ("cubin",)),
            Resources("write_kv_t16_d128", 87, 20, 0, 0, 0, ("cubin",))]  # fmt: skip
    assert spills(rows) == ["decode_fp16_g4_t16_d128@sm_90", "copy_blocks@sm_90"]
    assert "| decode_fp16_g4_t16_d128 | sm_90 | 255 | 40 | 56 | 96 |" in format_table(rows)


def test_review_regressions():
    from memos_ref import ops

    # int32 slots are widened to 64-bit offsets
    pool = torch.zeros(4, 2, 2, 16, 32, device=DEVICE)
    key = torch.randn(3, 2, 32, device=DEVICE)
    tk.write_kv(key, key, torch.tensor([0, 17, 63], dtype=torch.int32, device=DEVICE), pool[:, 0], pool[:, 1])
    assert torch.equal(pool[1, 0, :, 1], key[1])
    # K and V views with different strides are refused (one offset serves both)
    q, pool2, tables, lens = make_case(0, [10])
    with pytest.raises(ShapeError, match="same strides"):
        tk.paged_decode_attention(q, pool2[:, 0], pool2[:, 1].contiguous(), tables, lens)
    # shapes outside the kernel's limits fall back to the reference, even when kernels are asked for
    os.environ["MEMOS_REF_KERNELS"] = KERNEL_MODE
    try:
        q48 = torch.randn(1, 4, 48, device=DEVICE)
        cache48 = torch.randn(3, 2, 2, 16, 48, device=DEVICE)
        tables, lens = torch.tensor([[0, 2]], device=DEVICE), torch.tensor([20], device=DEVICE)
        out = ops.paged_decode(q48, cache48[:, 0], cache48[:, 1], tables, lens)
        want = paged_attention(q48[:, :, None], cache48[:, 0], cache48[:, 1], tables, lens)
        assert torch.allclose(out, want[:, :, 0])
    finally:
        os.environ.pop("MEMOS_REF_KERNELS")


@pytest.mark.parametrize("bits,group,residual", [(4, 32, 64), (2, 32, 0), (4, 16, 96)])
def test_kivi_decode_reads_packed_blocks_and_the_residual(bits, group, residual):
    from memos_ref.paged import PagedKV
    from memos_ref.quant import KIVI
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
    kv = PagedKV(spec, 24, quant=KIVI(bits, group), residual_tokens=residual, staging_blocks=24, prefix_caching=False,
                 device=DEVICE)  # fmt: skip
    g = torch.Generator().manual_seed(bits + group)
    seqs = []
    for n in (150, 9, 64):
        seq = kv.new_sequence()
        for layer in range(2):
            x = (torch.randn(2, n, 32, generator=g) * 2).to(DEVICE)
            seq.append(layer, x, -x * 0.5)
        seqs.append(seq)
    assert (kv.pool.seals > 0 and kv.pool.staged_blocks > 0) or residual == 0  # both kinds of block are read
    tables = torch.full((3, 5), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, : s.num_blocks] = torch.tensor(s.block_table)
    tables = tables.to(DEVICE)
    lens = torch.tensor([s.num_tokens for s in seqs], device=DEVICE)
    q = torch.randn(3, 8, 32, generator=g).to(DEVICE)
    for layer in range(2):
        got = tk.paged_decode_attention_kivi(q, kv.pool, layer, tables, lens, blocks_per_split=2)
        blocks = kv.pool.read_blocks(torch.arange(24, device=DEVICE), layer)
        want = paged_attention(q[:, :, None], blocks[:, 0], blocks[:, 1], tables, lens)[:, :, 0]
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the script runs the whole device check itself")
def test_gpu_check_script_without_a_gpu(tmp_path):
    """``scripts/gpu_check.sh`` (issue 18 item 7) in its no-GPU mode: exit 0 and one JSON line saying
    ``"gpu": false`` and why, with the versions it found — it runs with any Python given as PYTHON."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    report = json.loads(lines[0])
    assert report["gpu"] is False and "no CUDA device" in report["skipped"]
    assert report["torch"] == torch.__version__ and report["logs"] == str(tmp_path)
    assert report["pytest"] == pytest.__version__  # what the device's Python lacks shows before any GPU run
