"""Issue 28 item 1: what TensorRT-LLM v0.12's tools really print, parsed by the code deploy.sh embeds.

The captured-format lines below are produced with the tools' own format strings, copied from TensorRT-LLM's sources
(read with the search tools; gptSessionBenchmark.cpp of the v0.12 line, with --gpu_weights_percent, and
examples/run.py):

* ``benchmarks/cpp/gptSessionBenchmark.cpp``, rank 0 after the timed runs::

      printf("[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) %.2f tokensPerSec "
             "%.2f generation_time(ms) %.2f generationTokensPerSec %.2f gpu_peak_mem(gb) %.2f\\n",
             batchSize, maxInputLength, maxNewTokens, averageLatency, tokensPerSec, avgGenerationTime,
             generationTokensPerSec, peakMemGB);

  and on out of memory: ``"[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) N/A
  tokensPerSec N/A\\n"``;
* ``examples/run.py`` with ``--run_profiling``::

      print(f"batch_size: {len(batch_input_ids)}, avg latency of {ite} iterations: : "
            f"{tensorrt_llm.profiler.elapsed_time_in_sec('tmp') / ite} sec")

The deploy scripts before issue 28 searched for ``generation_tokens_per_second``, which gptSessionBenchmark never
prints, and ``[0-9.]+`` for run.py's float, which misses ``1.5e-05``.
"""

from __future__ import annotations

import json

import pytest
from memos_edge.device_logs import classify_build, collect, parse_benchmark, parse_run_profiling, read_meminfo

BENCH_FMT = (
    "[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) %.2f tokensPerSec "
    "%.2f generation_time(ms) %.2f generationTokensPerSec %.2f gpu_peak_mem(gb) %.2f\n"
)
BENCH_OOM_FMT = "[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) N/A tokensPerSec N/A\n"


def run_py_line(batch: int, ite: int, elapsed: float) -> str:
    """run.py's line, by its own f-string."""
    return f"batch_size: {batch}, avg latency of {ite} iterations: : {elapsed / ite} sec"


def test_gpt_session_benchmark_line_is_read():
    # NVIDIA's Llama-3-8B INT4 row: 128 in / 128 out, 35.9 tok/s decode; the other figures are consistent with it
    line = BENCH_FMT % (1, 128, 128, 3656.123, 35.0098, 3565.18, 35.9029, 6.9012)
    got = parse_benchmark("[TensorRT-LLM][INFO] Loaded engine\nBenchmarking done. Iteration: 17\n" + line)
    assert got == [{"batch_size": 1, "input_length": 128, "output_length": 128, "latency_ms": 3656.12,
                    "tokens_per_sec": 35.01, "generation_time_ms": 3565.18, "generation_tokens_per_sec": 35.9,
                    "gpu_peak_mem_gb": 6.9}]  # fmt: skip
    assert "generation_tokens_per_second" not in line  # the label the old scripts searched for


def test_gpt_session_benchmark_oom_line_is_an_oom_not_a_number():
    text = BENCH_OOM_FMT % (8, 1024, 512) + BENCH_FMT % (1, 128, 128, 10.0, 12800.0, 9.0, 14222.22, 1.0)
    got = parse_benchmark(text)
    assert got[0] == {"batch_size": 8, "input_length": 1024, "output_length": 512, "oom": True}
    assert got[1]["generation_tokens_per_sec"] == 14222.22


@pytest.mark.parametrize("elapsed", [2.5, 0.000152, 31.41592653589793, 1e-7])
def test_run_py_profiling_line_is_read(elapsed):
    text = "Input [Text 0]: ...\n" + run_py_line(1, 10, elapsed) + "\n"
    [got] = parse_run_profiling(text)
    assert got == {"batch_size": 1, "iterations": 10, "avg_latency_s": elapsed / 10}  # exactly: Python's repr
    assert ("e-" in str(elapsed / 10)) == (elapsed < 1e-3)  # the exponent form the old [0-9.]+ cut short


def test_a_build_log_is_classified():
    assert classify_build("engine built", 0) == {"class": "ok", "line": ""}
    missing = classify_build("deploy.sh: line 30: trtllm-build: command not found", 127)
    assert missing == {"class": "tool_missing", "line": "deploy.sh: line 30: trtllm-build: command not found"}
    assert classify_build("ModuleNotFoundError: No module named 'tensorrt_llm'", 1)["class"] == "tool_missing"
    oom = classify_build("[TensorRT-LLM] loading weights\nKilled", 137)
    assert oom == {"class": "out_of_memory", "line": "Killed"}
    cuda = "[TRT] [E] 2: [virtualMemoryBuffer.cpp::resizePhysical::140] Error Code 2: OutOfMemory (out of memory)"
    assert classify_build(cuda, 1) == {"class": "out_of_memory", "line": cuda}
    # builder.py's rule (v0.12): the quoted line is the log's own
    rule = "AssertionError: Paged Context FMHA doesn't work with int8 kv cache currently."
    refused = classify_build(f"[TensorRT-LLM] [I] Set gemm_plugin to float16.\nTraceback (most recent call last):\n"
                             f'  File "builder.py", line 540, in build\n{rule}\n', 1)  # fmt: skip
    assert refused == {"class": "refused", "line": rule}
    path = classify_build("FileNotFoundError: [Errno 2] No such file or directory: 'ckpt/config.json'", 1)
    assert path["class"] == "wrong_path" and "ckpt/config.json" in path["line"]
    assert classify_build("something odd\nlast words", 3) == {"class": "unclassified", "line": "last words"}


def test_meminfo_is_read():
    text = "MemTotal:       64349016 kB\nMemAvailable:   60000000 kB\nHugePages_Total:       0\nbad line\n"
    assert read_meminfo(text) == {"MemTotal": 64349016, "MemAvailable": 60000000, "HugePages_Total": 0}


def _env(out, **kw):
    return {"VARIANTS": "reuse safe", "VARIANT": "safe", "TPS_SOURCE": "gptSessionBenchmark", "REFERENCE": "",
            "OUT": str(out), **kw}  # fmt: skip


def test_an_unreadable_figure_is_an_error_with_the_log_path_never_null(tmp_path):
    (tmp_path / "build-reuse.rc").write_text("1\n")
    (tmp_path / "build-reuse.log").write_text("AssertionError: Paged Context FMHA is not supported on sm_87\n")
    (tmp_path / "build-safe.rc").write_text("0\n")
    (tmp_path / "build-safe.log").write_text("ok\n")
    (tmp_path / "bench.log").write_text("Benchmarking done.\n[BENCHMARK] something else\n")
    (tmp_path / "run.log").write_text("batch_size: 1, avg latency of 10 iterations: : garbage sec\n")
    res = collect(str(tmp_path), _env(tmp_path))
    for key in ("generation_tokens_per_second", "tokens_per_second", "gpu_peak_mem_gb", "run_avg_latency_s",
                "run_py_tokens_per_second"):  # fmt: skip
        assert isinstance(res[key], dict) and res[key]["error"], key
        assert res[key]["log"].endswith(".log"), key
    assert res["generation_tokens_per_second"]["log"] == str(tmp_path / "bench.log")
    assert None not in json.loads(json.dumps(res)).values()
    assert res["builds"][0]["class"] == "refused" and "sm_87" in res["builds"][0]["line"]
    # the same folder with real lines: numbers
    (tmp_path / "bench.log").write_text(BENCH_FMT % (1, 128, 128, 3600.0, 35.56, 3500.0, 36.57, 7.0))
    (tmp_path / "run.log").write_text(run_py_line(1, 10, 2.5))
    res = collect(str(tmp_path), _env(tmp_path))
    assert (res["generation_tokens_per_second"], res["tokens_per_second"], res["gpu_peak_mem_gb"]) == (36.57, 35.56,
                                                                                                     7.0)  # fmt: skip
    assert res["run_avg_latency_s"] == 0.25
    # no benchmark binary: the stated fallback, and the benchmark figures say why they are absent
    res = collect(str(tmp_path), _env(tmp_path, TPS_SOURCE="run.py --run_profiling"))
    assert "run_py_tokens_per_second" in res["generation_tokens_per_second"]["error"]
    oom = collect(str(tmp_path), _env(tmp_path, VARIANT="failed"))
    assert "no engine built" in oom["run_avg_latency_s"]["error"]
