"""The device check (issue 25 item 4): one run for a 15-minute GPU lease, at most 6 minutes, that fails loudly.

``python -m memos_kernels.gpu_check --out DIR`` (``scripts/gpu_check.sh``, ``make gpu-check``) runs four phases,
each in its own process under a hard time budget (a hang, a crash or an illegal address ends that phase, never
the run):

1. ``env`` — versions (Python, torch, Triton, pytest), the device and whether nvcc and ninja exist;
2. ``correctness`` — every kernel file's ``check_*`` and the kernels on the package's real shapes (Llama-3-8B
   geometry: 32 query / 8 KV heads × 128, fp16, 16-token blocks) against the torch references, each row written
   to ``correctness.jsonl`` as soon as it is known;
3. ``tests`` — the kernel test files in parallel pytest processes (``--continue-on-collection-errors``, one
   JUnit file each); without pytest, each kernel file's checks instead (the fallback is named in the summary);
4. ``bench`` — the host time per layer before the first launch, a device-to-device copy, then decode at 8k
   context (batch 1, 8, 64) and a prefill chunk, each timed with ``do_bench`` and ``do_bench_cudagraph``, with
   GB/s (TFLOP/s) and the fraction of the measured copy, then a 32-layer decode step (every layer's write and
   decode) eager beside its CUDA-graph replay (:mod:`memos_kernels.decode_graphs`, batch 1 and 8), then the
   package forward's whole decode step eager beside ``memos_ref.decode_graph.GraphedDecoder``'s replay (a child
   process, ``forward_graph_rows``), every row appended to ``bench.jsonl`` as measured.

The whole output is one JSON (stdout and ``DIR/gpu_check.json``); the exit status is non-zero on any wrong
result, failed test, phase error or timeout. ``--dry-run`` runs the same phases in Triton's interpreter on the
CPU with tiny shapes (CI runs it; under 2 minutes). Without a GPU and without ``--dry-run`` nothing is measured:
``{"gpu": false, "skipped": ...}``, exit 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BUDGET_S", "DRY_BUDGET_S", "FA2_H100_TFLOPS", "GOALS", "main", "run_checks", "run_phase"]

#: Seconds per phase on a GPU (360 in all: 6 minutes) and in the dry run (CPU, interpreter).
BUDGET_S = {"env": 30, "correctness": 90, "tests": 150, "bench": 90}
DRY_BUDGET_S = {"env": 15, "correctness": 40, "tests": 40, "bench": 25}  # 2 minutes at most
#: FlashAttention-2's published forward throughput on an H100 (Dao 2023, "up to 335 TFLOPs/s"): the prefill goal
#: is half of it.
FA2_H100_TFLOPS = 335.0
GOALS = {
    "decode_8k_copy_fraction_batch_ge_8": 0.8,
    "decode_8k_copy_fraction_batch_1": 0.5,
    "prefill_fraction_of_fa2_h100": 0.5,
    "host_us_per_layer": 30.0,
}
TEST_FILES = ["tests/test_kernels.py", "tests/test_kernels_matrix.py", "tests/test_kernel_bounds.py",
              "tests/test_kernels_layout.py", "tests/test_kernel_path.py", "tests/test_cuda_kernel.py",
              "tests/test_kernels_prefill.py", "tests/test_kernels_graphs.py",
              "tests/test_decode_graph.py"]  # fmt: skip
#: Left to CI: the ahead-of-time register check compiles the launch planner's set under CI's Triton and the
#: device's 3.6 (tests/test_kernels_triton36.py) without a GPU; here it would spend the tests phase compiling.
NOT_ON_DEVICE = "not compiles_for_a_real_gpu"
DRY_TESTS = ["tests/test_kernels_layout.py::test_check_result_rejects_nan_and_excess",
             "tests/test_kernel_bounds.py::test_copy_kernel_copies_nothing_for_a_pair_outside_the_pool"]  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent


def _append(path: Path, row: dict[str, Any]) -> None:
    """One JSON line, flushed to disk at once (a timeout later keeps it)."""
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            rows.append({"error": "truncated line"})
    return rows


# ---------------------------------------------------------------------------------------------- phases
def phase_env(out: Path, dry: bool) -> int:
    """Versions and the device."""
    import platform

    info: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "triton", "pytest"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # report, do not fail: the summary is the point
            info[name] = f"unavailable: {type(exc).__name__}"
    import torch

    info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (interpreter)"
    if torch.cuda.is_available():
        info["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(0))
    info["nvcc"] = shutil.which("nvcc")
    info["ninja"] = shutil.which("ninja")
    (out / "env.json").write_text(json.dumps(info))
    return 0


def _shapes(dry: bool) -> dict[str, Any]:
    """The package's real shapes on a GPU (Llama-3-8B geometry, fp16); tiny fp32 ones in the interpreter."""
    import torch

    if dry:
        return dict(kv_heads=2, group=2, head_dim=16, block_size=16, dtype=torch.float32, lens=[37, 16, 1], tol=1e-4)
    return dict(kv_heads=8, group=4, head_dim=128, block_size=16, dtype=torch.float16, lens=[8192, 1000, 1], tol=5e-3)


def run_checks(dry: bool, device: str) -> list[tuple[str, Callable[[], tuple[float, float]]]]:
    """``(name, check)`` pairs, each check returning ``(max_abs_err, tolerance)``: every kernel file's
    ``check_*`` and the real-shape decode, prefill and KIVI cases."""
    import torch
    from memos_kernels import copy_blocks, kivi_decode, paged_decode, paged_prefill, write_kv

    def wrap(fn: Callable[..., Any], **kw: Any) -> Callable[[], tuple[float, float]]:
        def call() -> tuple[float, float]:
            r = fn(device, **kw)
            return r.max_abs_err, r.tolerance

        return call

    checks = [("check_paged_decode", wrap(paged_decode.check_paged_decode)),
              ("check_paged_decode[int8]", wrap(paged_decode.check_paged_decode, quant="int8")),
              ("check_paged_prefill", wrap(paged_prefill.check_paged_prefill)),
              ("check_kivi_decode[4]", wrap(kivi_decode.check_kivi_decode, bits=4)),
              ("check_kivi_decode[2]", wrap(kivi_decode.check_kivi_decode, bits=2)),
              ("check_write_kv", wrap(write_kv.check_write_kv)),
              ("check_write_kv_int8", wrap(write_kv.check_write_kv_int8)),
              ("check_copy_blocks", wrap(copy_blocks.check_copy_blocks))]  # fmt: skip
    if device == "cpu" or torch.cuda.get_device_capability() >= (8, 9):
        checks.append(("check_write_kv_fp8", wrap(write_kv.check_write_kv_fp8)))
    s = _shapes(dry)

    def real_decode() -> tuple[float, float]:
        q, pool, tables, lens = paged_decode.random_paged_case(
            0, s["lens"], kv_heads=s["kv_heads"], group=s["group"], block_size=s["block_size"],
            head_dim=s["head_dim"], dtype=s["dtype"], device=device,
        )  # fmt: skip
        got = paged_decode.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens)
        want = paged_decode.paged_decode_reference(q, pool[:, 0], pool[:, 1], tables, lens)
        return float((got.float() - want.float()).abs().max()), s["tol"]

    def real_prefill() -> tuple[float, float]:
        lens = [x for x in s["lens"] if x >= 16][:2]
        _, pool, tables, seq = paged_decode.random_paged_case(
            1, lens, kv_heads=s["kv_heads"], group=s["group"], block_size=s["block_size"], head_dim=s["head_dim"],
            dtype=s["dtype"], device=device,
        )  # fmt: skip
        chunk = 16 if dry else 128
        g = torch.Generator().manual_seed(2)
        q = torch.randn(len(lens), s["kv_heads"] * s["group"], chunk, s["head_dim"], generator=g)
        q = q.to(device=device, dtype=s["dtype"])
        qlens = torch.tensor([chunk, chunk - 5], device=device)
        got = paged_prefill.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, seq, qlens)
        want = paged_prefill.paged_prefill_reference(q, pool[:, 0], pool[:, 1], tables, seq, qlens)
        return float((got.float() - want.float()).abs().max()), s["tol"]

    def real_kivi() -> tuple[float, float]:
        lens = [70, 9] if dry else [4096, 33]
        q, pool, tables, seq = paged_decode.random_paged_case(
            3, lens, kv_heads=s["kv_heads"], group=s["group"], block_size=32, head_dim=s["head_dim"], device=device
        )
        blocks = kivi_decode.random_kivi_blocks(3, pool.shape[0], kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                                                staged=(int(tables[0, 1]),), device=device)  # fmt: skip
        got = kivi_decode.paged_decode_attention_kivi_packed(q, blocks, tables, seq)
        want = kivi_decode.paged_decode_kivi_reference(q, blocks, tables, seq)
        return float((got - want).abs().max()), 1e-3

    return [*checks, ("decode_real_shape", real_decode), ("prefill_real_shape", real_prefill),
            ("kivi_real_shape", real_kivi)]  # fmt: skip


def phase_correctness(out: Path, dry: bool) -> int:
    """Every check, one row each (``ok``: within tolerance; an exception is a failed row)."""
    from memos_kernels.timing import stopwatch  # torch: imported by the phases only

    device = "cpu" if dry else "cuda"
    failed = 0
    for name, check in run_checks(dry, device):
        t0 = stopwatch()
        try:
            err, tol = check()
            row = {"name": name, "max_abs_err": err, "tolerance": tol, "ok": err <= tol}  # NaN: not ok
        except Exception as exc:
            row = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row["seconds"] = round(stopwatch() - t0, 3)
        failed += not row["ok"]
        _append(out / "correctness.jsonl", row)
    return 1 if failed else 0


def phase_tests(out: Path, dry: bool) -> int:
    """The kernel tests in parallel pytest processes (each under the phase's budget), or the fallback."""
    from memos_kernels.timing import stopwatch  # torch: imported by the phases only

    try:
        import pytest  # noqa: F401
    except ImportError:
        rc = phase_correctness(out, dry) if not (out / "correctness.jsonl").exists() else 0
        rows = _read_jsonl(out / "correctness.jsonl")
        ok = rc == 0 and rows and all(r.get("ok") for r in rows)
        (out / "tests.json").write_text(json.dumps({"pytest": "absent", "fallback": "each kernel file's checks",
                                                    "checks": len(rows), "ok": bool(ok)}))  # fmt: skip
        return 0 if ok else 1
    budget = float(os.environ.get("GPU_CHECK_TESTS_S", (DRY_BUDGET_S if dry else BUDGET_S)["tests"])) - 5
    groups = [[t] for t in DRY_TESTS] if dry else [[f] for f in TEST_FILES]
    procs = []
    for i, group in enumerate(groups):
        xml = out / f"tests_{i}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               "-k", NOT_ON_DEVICE, f"--junitxml={xml}", *group]  # fmt: skip
        log = (out / f"tests_{i}.log").open("w")
        procs.append((group, xml, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = stopwatch() + budget
    report: dict[str, Any] = {"pytest": __import__("pytest").__version__, "groups": []}
    bad = 0
    for group, xml, proc, log in procs:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - stopwatch()))
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            rc, timed_out = proc.wait(), True
        log.close()
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        failed: list[str] = []
        if xml.exists():
            root = ET.parse(xml).getroot()
            for suite in root.iter("testsuite"):
                for k in counts:
                    counts[k] += int(suite.get(k, 0))
            for case in root.iter("testcase"):
                if case.find("failure") is not None or case.find("error") is not None:
                    failed.append(f"{case.get('classname')}::{case.get('name')}")
        ok = rc == 0 and not timed_out and counts["tests"] > 0
        bad += not ok
        report["groups"].append({"files": group, "rc": rc, "timed_out": timed_out, **counts, "failed": failed[:20],
                                 "ok": ok})  # fmt: skip
    (out / "tests.json").write_text(json.dumps(report))
    return 1 if bad else 0


def host_us_per_layer(calls: int = 300) -> dict[str, float]:
    """Host time of one layer's decode call before its launch (validation, planning, argument packing), in µs:
    the wrapper with its kernels replaced by no-ops, as the package's forward calls it (``step_memo``): the step's
    first layer (``validate=None``: the values checked on the CPU, and the plan made) and every other layer
    (``validate=False``, the step's plan reused); and a call without the memo (``unplanned_layer_us``: checked
    and planned every layer). CPU tensors, 8 × 32/8 heads × 128, 8k. The fastest of ten batches (and the median
    batch, ``*_median_us``)."""
    import torch
    from memos_kernels import paged_decode as pd
    from memos_kernels.timing import stopwatch  # torch: imported by the phases only

    class NoLaunch:
        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return lambda *a, **k: None

    saved = pd.decode_split_kernel, pd.decode_reduce_kernel
    pd.decode_split_kernel = pd.decode_reduce_kernel = NoLaunch()  # type: ignore[assignment]
    try:
        q = torch.zeros(8, 32, 128, dtype=torch.float16)
        pool = torch.zeros(1024, 2, 8, 16, 128, dtype=torch.float16)
        tables = torch.arange(8 * 512).reshape(8, 512) % 1024
        lens, out = torch.full((8,), 8192), torch.empty_like(q)
        res = {}
        kc, vc, notes = pool[:, 0], pool[:, 1], {}
        for key, validate, memo in (("first_layer_us", None, "fresh"), ("other_layers_us", False, notes),
                                    ("unplanned_layer_us", False, None)):  # fmt: skip

            def call(v: bool | None = validate, m: Any = memo) -> None:
                pd.paged_decode_attention(q, kc, vc, tables, lens, max_seq_len=8192, out=out, validate=v,
                                          step_memo={} if m == "fresh" else m)  # fmt: skip

            for _ in range(20):
                call()
            per_batch = []  # ten batches: the fastest is the least disturbed by other load on the host
            for _ in range(10):
                t0 = stopwatch()
                for _ in range(max(1, calls // 10)):
                    call()
                per_batch.append((stopwatch() - t0) / max(1, calls // 10) * 1e6)
            res[key] = round(min(per_batch), 1)
            res[key.replace("_us", "_median_us")] = round(sorted(per_batch)[5], 1)
        return res
    finally:
        pd.decode_split_kernel, pd.decode_reduce_kernel = saved


def _device_case(batch: int, context: int, s: dict[str, Any], device: str) -> tuple[Any, Any, Any, Any]:
    """A decode case made on the device (a host-made 8k × 64 pool would take the phase's budget): query, one
    layer's pool ``[N, 2, H, T, D]``, shuffled tables and the lengths."""
    import torch

    per = -(-context // s["block_size"])
    gen = torch.Generator(device=device).manual_seed(batch)
    pool = torch.randn(batch * per, 2, s["kv_heads"], s["block_size"], s["head_dim"], device=device,
                       dtype=s["dtype"], generator=gen)  # fmt: skip
    tables = torch.randperm(batch * per, device=device, generator=gen).view(batch, per)
    q = torch.randn(batch, s["kv_heads"] * s["group"], s["head_dim"], device=device, dtype=s["dtype"], generator=gen)
    return q, pool, tables, torch.full((batch,), context, device=device)


def phase_bench(out: Path, dry: bool) -> int:
    """Host time, copy bandwidth, decode at 8k (batch 1, 8, 64) and a prefill chunk: one row each, appended as
    measured; a decode or prefill row whose output is wrong fails the phase."""
    import torch
    from memos_kernels import paged_decode, paged_prefill
    from memos_kernels.timing import best_ms, device_timings, stopwatch  # torch: imported by the phases only

    started = stopwatch()
    path = out / "bench.jsonl"
    _append(path, {"row": "host", **host_us_per_layer(50 if dry else 300)})
    device = "cpu" if dry else "cuda"
    nbytes = (1 << 20) if dry else (1 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = device_timings(lambda: dst.copy_(src), device)
    src = dst = torch.empty(0, device=device)  # free the 2 GiB before the kernels run
    copy_gbps = 2 * nbytes / (best_ms(t) / 1e3) / 1e9
    _append(path, {"row": "copy", "bytes": 2 * nbytes, **t, "gbps": copy_gbps})
    s = _shapes(dry)
    context = 64 if dry else 8192
    bad = 0
    for batch in (1, 2) if dry else (1, 8, 64):
        q, pool, tables, lens = _device_case(batch, context, s, device)
        out_t = torch.empty_like(q)

        def call(q=q, pool=pool, tables=tables, lens=lens, out_t=out_t) -> torch.Tensor:
            return paged_decode.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, out=out_t)

        call()
        mine = pool[tables[0]]  # the first sequence's blocks, checked on their own (no copy of the whole pool)
        local = torch.arange(tables.shape[1], device=device)[None]
        want = paged_decode.paged_decode_reference(q[:1], mine[:, 0], mine[:, 1], local, lens[:1])
        err = float((out_t[:1].float() - want.float()).abs().max())
        kv = batch * context * s["kv_heads"] * s["head_dim"] * 2 * pool.element_size()
        t = device_timings(call, device)
        best = best_ms(t)
        row = {"row": "decode", "batch": batch, "context": context, "kv_bytes": kv, **t,
               "gbps": kv / (best / 1e3) / 1e9, "max_abs_err": err, "ok": err <= s["tol"]}  # fmt: skip
        row["copy_fraction"] = row["gbps"] / copy_gbps
        bad += not row["ok"]
        _append(path, row)
    chunk, ctx = (16, 48) if dry else (512, 4096)
    _, pool, tables, lens = paged_decode.random_paged_case(
        7, [ctx], kv_heads=s["kv_heads"], group=s["group"], block_size=s["block_size"], head_dim=s["head_dim"],
        dtype=s["dtype"], device=device,
    )  # fmt: skip
    q = torch.randn(1, s["kv_heads"] * s["group"], chunk, s["head_dim"], device=device).to(s["dtype"])
    qlens = torch.tensor([chunk], device=device)
    call = lambda: paged_prefill.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, lens, qlens)  # noqa: E731
    got = call()
    err = float((got.float() - paged_prefill.paged_prefill_reference(q, pool[:, 0], pool[:, 1], tables, lens,
                                                                      qlens).float()).abs().max())  # fmt: skip
    t = device_timings(call, device)
    seen = sum(ctx - chunk + j + 1 for j in range(chunk))  # causal: keys each query sees
    flops = 4 * q.shape[1] * s["head_dim"] * seen
    best = best_ms(t)
    tflops = flops / (best / 1e3) / 1e12
    row = {"row": "prefill", "chunk": chunk, "context": ctx, **t, "tflops": tflops, "fa2_h100_tflops": FA2_H100_TFLOPS,
           "fa2_fraction": tflops / FA2_H100_TFLOPS, "max_abs_err": err, "ok": err <= s["tol"]}  # fmt: skip
    bad += not row["ok"]
    _append(path, row)
    from memos_kernels.decode_graphs import bench_step_graphs  # the 32-layer step, eager and from a CUDA graph

    shape = {k: s[k] for k in ("kv_heads", "group", "head_dim", "block_size", "dtype")}
    for row in bench_step_graphs(device, **shape, **(dict(layers=2, batches=(1, 2), context=64) if dry else {})):
        bad += not row["ok"]
        _append(path, row)
    from memos_kernels.decode_graphs import forward_graph_rows  # the whole forward's step, in a child process

    budget = float(os.environ.get("GPU_CHECK_TESTS_S", (DRY_BUDGET_S if dry else BUDGET_S)["bench"]))
    for row in forward_graph_rows(dry, budget - (stopwatch() - started) - 5):
        bad += not row.get("ok", False)
        _append(path, row)
    return 1 if bad else 0


PHASES: dict[str, Callable[[Path, bool], int]] = {
    "env": phase_env, "correctness": phase_correctness, "tests": phase_tests, "bench": phase_bench,
}  # fmt: skip


# ---------------------------------------------------------------------------------------------- driver
def run_phase(name: str, out: Path, dry: bool, budget_s: float) -> dict[str, Any]:
    """Run one phase in a child process under ``budget_s``: its exit status, time and whether it timed out."""
    from memos_kernels.timing import stopwatch  # torch: imported by the phases only

    env = dict(os.environ)
    if dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "memos_kernels.gpu_check", "--phase", name, "--out", str(out)]
    cmd += ["--dry-run"] if dry else []
    env["GPU_CHECK_TESTS_S"] = str(budget_s)  # the tests phase shares its budget among its processes
    t0 = stopwatch()
    with (out / f"{name}.log").open("w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=budget_s
            ).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = 124, True
    log_tail = (out / f"{name}.log").read_text()[-1500:]
    res = {"rc": rc, "seconds": round(stopwatch() - t0, 1), "budget_s": budget_s, "timed_out": timed_out}
    if rc:
        res["log_tail"] = log_tail
    return res


def _goals(bench: list[dict[str, Any]]) -> dict[str, Any]:
    """Each goal with what was measured (``None`` where no row came back) and whether it is met."""
    dec = {r["batch"]: r.get("copy_fraction") for r in bench if r.get("row") == "decode"}
    pre = next((r.get("fa2_fraction") for r in bench if r.get("row") == "prefill"), None)
    host = next((r.get("other_layers_us") for r in bench if r.get("row") == "host"), None)
    big = [v for b, v in dec.items() if b >= 8 and v is not None]
    measured = {"decode_8k_copy_fraction_batch_ge_8": min(big) if big else None,
                "decode_8k_copy_fraction_batch_1": dec.get(1), "prefill_fraction_of_fa2_h100": pre,
                "host_us_per_layer": host}  # fmt: skip
    return {k: {"goal": g, "measured": measured[k],
                "met": None if measured[k] is None else (measured[k] <= g if k == "host_us_per_layer"
                                                         else measured[k] >= g)}
            for k, g in GOALS.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The command line: ``--phase NAME`` runs one phase (the driver's children); otherwise every phase, then
    the one JSON. Exit status 0 only when every phase passed."""
    ap = argparse.ArgumentParser(prog="python -m memos_kernels.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or os.environ.get("OUT") or "gpu_check_out")
    ap.add_argument("--dry-run", action="store_true", help="the same phases in Triton's interpreter on the CPU")
    ap.add_argument("--phase", choices=sorted(PHASES))
    ap.add_argument("--only", nargs="*", choices=sorted(PHASES), help="run these phases only")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every phase's budget (a slow host)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase:
        return PHASES[args.phase](out, args.dry_run)
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    summary: dict[str, Any] = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                               "dry_run": args.dry_run, "gpu": gpu, "logs": str(out)}  # fmt: skip
    for name in ("torch", "triton", "pytest"):  # what the device's Python lacks shows before any GPU run
        try:
            summary[name] = __import__(name).__version__
        except ImportError:
            summary[name] = "unavailable"
    if not args.dry_run and not gpu:
        summary["skipped"] = "no CUDA device (or no torch) for this Python: nothing measured; run on a GPU machine"
        print(json.dumps(summary))
        return 0
    for stale in ("correctness.jsonl", "bench.jsonl", "tests.json", "env.json"):
        (out / stale).unlink(missing_ok=True)
    budgets = DRY_BUDGET_S if args.dry_run else BUDGET_S
    phases = {}
    for name in args.only or list(PHASES):
        phases[name] = run_phase(name, out, args.dry_run, budgets[name] * args.budget_scale)
    summary["phases"] = phases
    if (out / "env.json").exists():
        summary["env"] = json.loads((out / "env.json").read_text())
    summary["correctness"] = _read_jsonl(out / "correctness.jsonl")
    if (out / "tests.json").exists():
        summary["tests"] = json.loads((out / "tests.json").read_text())
    summary["bench"] = _read_jsonl(out / "bench.jsonl")
    summary["goals"] = _goals(summary["bench"])
    summary["ok"] = all(p["rc"] == 0 for p in phases.values()) and all(
        r.get("ok", True) for r in summary["correctness"] + summary["bench"]
    )
    text = json.dumps(summary)
    (out / "gpu_check.json").write_text(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
