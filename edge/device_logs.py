"""Read what TensorRT-LLM v0.12's tools print on the Jetson, and write ``results.json`` from a deploy run.

Standard library only: the generated ``deploy.sh`` embeds this file's source and runs it with the device's
``python3`` (``python3 - <<'PY'``), so the parser tested here is the one that runs there. The formats, from
TensorRT-LLM's v0.12 sources:

* ``benchmarks/cpp/gptSessionBenchmark.cpp`` (rank 0, after the timed runs)::

      printf("[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) %.2f tokensPerSec "
             "%.2f generation_time(ms) %.2f generationTokensPerSec %.2f gpu_peak_mem(gb) %.2f\\n", ...)

  and, when a run hits out-of-memory, ``"[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms)
  N/A tokensPerSec N/A\\n"``. ``tokensPerSec`` is ``batch × output_length`` over the whole latency (context phase
  included), ``generationTokensPerSec`` over the generation phase only (NVIDIA's "Decode (token/s)").
* ``examples/run.py --run_profiling`` (10 iterations)::

      print(f"batch_size: {len(batch_input_ids)}, avg latency of {ite} iterations: : "
            f"{tensorrt_llm.profiler.elapsed_time_in_sec('tmp') / ite} sec")

  a Python float's ``str`` (``0.25``, ``1.5e-05``).

A figure that cannot be read becomes ``{"error": why, "log": path}`` in ``results.json``, never ``null``.
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys

__all__ = ["classify_build", "collect", "parse_benchmark", "parse_run_profiling", "read_meminfo"]

MAX_LOG = 8 * 2**20  # bytes read from any log: the tail when longer
_FLOAT = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan"
_BENCH = re.compile(
    r"\[BENCHMARK\] batch_size (\d+) input_length (\d+) output_length (\d+) latency\(ms\) (N/A|" + _FLOAT + r")"
    r" tokensPerSec (N/A|"
    + _FLOAT
    + r")(?: generation_time\(ms\) ("
    + _FLOAT
    + r") generationTokensPerSec ("
    + _FLOAT
    + r") gpu_peak_mem\(gb\) ("
    + _FLOAT
    + r"))?"
)
_RUN = re.compile(r"batch_size: (\d+), avg latency of (\d+) iterations: : (" + _FLOAT + r") sec")
_OOM = re.compile(
    r"out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation|std::bad_alloc|MemoryError|"
    r"Cannot allocate memory|\bKilled\b|oom-kill",
    re.I,
)
_MISSING = re.compile(
    r"command not found|No module named|ModuleNotFoundError|ImportError|cannot open shared object", re.I
)
_PATH = re.compile(r"No such file or directory|FileNotFoundError|does not exist", re.I)
_REFUSED = re.compile(
    r"AssertionError|ValueError|NotImplementedError|RuntimeError|TypeError|\[TRT-LLM\] \[E\]|\[E\]|"
    r"doesn't work|does not work|not supported|unsupported|is not allowed|Error:",
)


def _read(path: str) -> str:
    """A log's text ("" when absent), bounded: only the last ``MAX_LOG`` bytes of a longer one."""
    if not os.path.isfile(path):
        return ""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - MAX_LOG))
        return fh.read().decode("utf-8", errors="replace")


def parse_benchmark(text: str) -> list[dict]:
    """Every ``[BENCHMARK]`` line of gptSessionBenchmark's output: lengths, ``latency_ms``, ``tokens_per_sec``,
    ``generation_time_ms``, ``generation_tokens_per_sec``, ``gpu_peak_mem_gb`` — or ``oom: True`` for its
    out-of-memory line (``N/A``)."""
    out = []
    for m in _BENCH.finditer(text):
        rec = {"batch_size": int(m[1]), "input_length": int(m[2]), "output_length": int(m[3])}
        if m[4] == "N/A" or m[5] == "N/A":
            rec["oom"] = True
        elif m[6] is None:
            rec["error"] = "a [BENCHMARK] line without generationTokensPerSec"
        else:
            rec.update(latency_ms=float(m[4]), tokens_per_sec=float(m[5]), generation_time_ms=float(m[6]),
                       generation_tokens_per_sec=float(m[7]), gpu_peak_mem_gb=float(m[8]))  # fmt: skip
        out.append(rec)
    return out


def parse_run_profiling(text: str) -> list[dict]:
    """Every ``run.py --run_profiling`` latency line: ``batch_size``, ``iterations``, ``avg_latency_s``."""
    return [
        {"batch_size": int(m[1]), "iterations": int(m[2]), "avg_latency_s": float(m[3])} for m in _RUN.finditer(text)
    ]


def classify_build(text: str, rc: int) -> dict:
    """Why a build failed, from its log and exit status: ``ok``, ``tool_missing`` (exit 126/127 or an import
    error), ``out_of_memory`` (exit 137 — the OOM killer — or an allocation failure), ``wrong_path`` (a file
    not found: the checkpoint or output folder), ``refused`` (the first
    error line, quoted: a rule of TensorRT-LLM's) or ``unclassified`` (the last line, quoted)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if rc == 0:
        return {"class": "ok", "line": ""}

    def first(rx: re.Pattern) -> str | None:
        return next((line for line in lines if rx.search(line)), None)

    if rc in (126, 127) or first(_MISSING):
        return {"class": "tool_missing", "line": first(_MISSING) or f"exit status {rc}"}
    if rc == 137 or first(_OOM):
        return {"class": "out_of_memory", "line": first(_OOM) or "exit status 137 (killed: the OOM killer)"}
    if first(_PATH):
        return {"class": "wrong_path", "line": first(_PATH)}
    if first(_REFUSED):
        return {"class": "refused", "line": first(_REFUSED)}
    return {"class": "unclassified", "line": lines[-1] if lines else f"exit status {rc}, empty log"}


def read_meminfo(text: str) -> dict:
    """``/proc/meminfo`` as ``{field: kB}`` (the fields that carry a number)."""
    out = {}
    for line in text.splitlines()[:200]:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name.strip()] = int(fields[0])
    return out


def _err(why: str, log: str) -> dict:
    return {"error": why, "log": log}


def _greedy(out: str, reference: str) -> dict:
    csv_path = os.path.join(out, "out.csv")
    if not os.path.isfile(reference):
        return _err(f"no reference.json at {reference!r}: copy the export's reference.json or set REFERENCE", csv_path)
    if not os.path.isfile(csv_path):
        return _err("run.py wrote no out.csv (see run.log)", os.path.join(out, "run.log"))
    with open(reference, encoding="utf-8") as fh:
        ref = json.load(fh)["tokens"]
    with open(csv_path, encoding="utf-8") as fh:
        got = [int(x) for row in csv.reader(fh) for x in row if x.strip()]
    got = got[len(ref["prompt"]) :] if got[: len(ref["prompt"])] == ref["prompt"] else got
    want, n = ref["greedy"], 0
    while n < min(len(got), len(want)) and got[n] == want[n]:
        n += 1
    return {"equal_prefix": n, "reference": len(want), "engine": got[: len(want)], "generated": len(got)}


def collect(out: str, env: dict) -> dict:
    """``results.json``'s content from the run's folder ``out`` and the script's variables ``env``."""
    join = os.path.join
    builds = []
    for variant in env.get("VARIANTS", "").split():
        log, rc_path = join(out, f"build-{variant}.log"), join(out, f"build-{variant}.rc")
        rc = int(_read(rc_path).strip() or -1)
        builds.append({"variant": variant, "rc": rc, "log": log, **classify_build(_read(log), rc)})
    built = env.get("VARIANT", "failed")
    bench_log, run_log = join(out, "bench.log"), join(out, "run.log")
    res = {
        "layout": env.get("LAYOUT", ""),
        "trtllm_dir": env.get("TRTLLM_DIR", ""),
        "trtllm_version": env.get("TRTLLM_VERSION", ""),
        "preflight": _read(join(out, "preflight.txt")).splitlines(),
        "builds": builds,
        "variant_built": built,
        "clocks": env.get("CLOCKS", ""),
        "power_mode": env.get("POWER_MODE", "").strip(),
        "meminfo": read_meminfo(_read(join(out, "meminfo.txt"))),
        "tegrastats": _read(join(out, "tegrastats.txt")).strip(),
        "plan": json.loads(_read(join(out, "plan.json")) or "{}"),
        "tokens_per_second_source": env.get("TPS_SOURCE", ""),
        "run_wall_ns": int(env.get("RUN_NS") or 0),
        "kv_lines": _read(join(out, "kv_lines.txt")).splitlines(),
        "greedy_vs_reference": _greedy(out, env.get("REFERENCE", "")),
    }
    no_engine = "no engine built: see builds[] for each variant's class and quoted line"
    runs = parse_run_profiling(_read(run_log))
    if built == "failed":
        res["run_avg_latency_s"] = _err(no_engine, run_log)
    elif runs:
        res["run_avg_latency_s"] = runs[-1]["avg_latency_s"]
    else:
        res["run_avg_latency_s"] = _err("no 'avg latency of N iterations' line (run.py --run_profiling)", run_log)
    keys = ("generation_tokens_per_second", "tokens_per_second", "gpu_peak_mem_gb")
    bench = parse_benchmark(_read(bench_log))
    good = [b for b in bench if "generation_tokens_per_sec" in b]
    if built == "failed":
        why = no_engine
    elif env.get("TPS_SOURCE") != "gptSessionBenchmark":
        why = "no gptSessionBenchmark on this device: see run_py_tokens_per_second (run.py --run_profiling)"
    elif good:
        why = ""
        res["benchmark"] = good[-1]
        res.update(zip(keys, (good[-1]["generation_tokens_per_sec"], good[-1]["tokens_per_sec"],
                              good[-1]["gpu_peak_mem_gb"])))  # fmt: skip
    elif any(b.get("oom") for b in bench):
        why = "gptSessionBenchmark ran out of memory ([BENCHMARK] ... N/A)"
    else:
        why = "no [BENCHMARK] line with generationTokensPerSec in the log"
    if why:
        res.update({key: _err(why, bench_log) for key in keys})
    # run.py's end-to-end rate: generated tokens (from out.csv) over the average latency, context phase included
    gen = res["greedy_vs_reference"].get("generated")
    lat = res["run_avg_latency_s"]
    if isinstance(lat, float) and gen and lat > 0:
        res["run_py_tokens_per_second"] = round(gen / lat, 2)
    else:
        res["run_py_tokens_per_second"] = _err("needs run.py's latency line and out.csv's generated tokens", run_log)
    return res


def main() -> int:
    """Write ``$OUT/results.json`` from the environment ``deploy.sh`` exports, and print it."""
    out = os.environ["OUT"]
    res = collect(out, dict(os.environ))
    path = os.path.join(out, "results.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=2)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
