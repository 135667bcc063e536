"""The on-device bash script: preflight, build, run, measure, one ``results.json``.

:func:`deploy_script` writes it (``python -m memos_edge.build_config ... --write-deploy deploy.sh``). In order:

0. **preflight**, before any build, each failure one line (``preflight: ...``) and exit 1: ``trtllm-build`` on
   ``PATH`` (pip puts it in ``~/.local/bin``: README4Jetson exports it), ``tensorrt_llm`` importable at 0.12.x,
   ``examples/run.py`` found — ``TRTLLM_DIR`` if set, else the container's ``/opt/TensorRT-LLM``
   (``dustynv/tensorrt_llm:0.12-r36.4.0``), else a source checkout (``$PWD`` or ``~/TensorRT-LLM``) — and
   ``gptSessionBenchmark`` found, or the stated fallback to ``run.py --run_profiling``; ``MemAvailable``
   against what the plan puts in memory and ``MemAvailable + SwapFree`` against what the build needs; the power
   mode recorded (``REQUIRE_MAXN=yes`` makes anything but MAXN a failure). ``/proc/meminfo``, ``nvpmodel -q``
   and one ``tegrastats`` line are saved for ``results.json``;
1. MAX-N clocks, asked first (``MAXN=yes|no`` answers);
2. the ``reuse`` build, then NVIDIA's ``safe`` one; each build's exit status is kept and its log classified
   (:func:`memos_edge.device_logs.classify_build`: out of memory, refused by a rule with the line quoted, tool
   missing, wrong path) — only ``refused`` says something about sm_87;
3. one ``run.py`` run with ``--run_profiling``, the reference prompt's ids and ``--output_csv``;
4. ``gptSessionBenchmark`` (NVIDIA's tool for its 35.9 tok/s) when found;
5. :mod:`memos_edge.device_logs` (embedded: the same source tested here) reads the logs into ``results.json``.
"""

from __future__ import annotations

import inspect
import json
import shlex
from typing import Any

from memos_edge import device_logs
from memos_edge.build_spec import BuildConfig, build_command, run_command, variants
from memos_edge.plan import Plan

__all__ = ["CONTAINER_IMAGE", "CONTAINER_TRTLLM", "deploy_script", "plan_summary"]

#: jetson-containers' TensorRT-LLM 0.12 image for JetPack 6 (L4T r36.4), its source tree in /opt/TensorRT-LLM
CONTAINER_IMAGE = "dustynv/tensorrt_llm:0.12-r36.4.0"
CONTAINER_TRTLLM = "/opt/TensorRT-LLM"


def plan_summary(p: Plan) -> dict[str, Any]:
    """What the script carries of a plan: the KV it passes, the bound, and the memory the preflight checks —
    ``need_run_kib`` (everything the plan puts in memory after the OS: runtime, weights, page cache, KV budget)
    and ``need_build_kib`` (the builder holds the checkpoint's weights and the engine it writes, plus a CUDA
    context: 2 × weights + the runtime term, an estimate)."""
    terms = {t["name"]: t["bytes"] for t in p.memory_terms}
    after_os = sum(b for name, b in terms.items() if name not in ("carve_outs", "os_desktop"))
    return {
        "model": p.model,
        "device": p.device,
        "weights": p.weights,
        "kv_dtype": p.kv_dtype,
        "kv_tokens": p.kv_tokens,
        "tokens_per_block": p.tokens_per_block,
        "decode_bound_batch1": p.decode_tokens_per_s_bound.get(f"batch1_ctx{min(1024, p.kv_tokens)}"),
        "need_run_kib": (after_os + p.kv_budget_bytes) // 1024,
        "need_build_kib": (2 * p.weight_bytes + p.runtime_bytes) // 1024,
    }


_PREFLIGHT = r"""
# 0. preflight: before any build, each failure one line
: > "$OUT/preflight.txt"
fail() { echo "preflight: $*" | tee -a "$OUT/preflight.txt" >&2; exit 1; }
note() { echo "preflight: $*" | tee -a "$OUT/preflight.txt"; }
command -v trtllm-build > /dev/null 2>&1 || fail "trtllm-build is not on PATH: pip installs it in ~/.local/bin \
(export PATH=\$HOME/.local/bin:\$PATH, as README4Jetson does), or run inside __IMAGE__"
TRTLLM_VERSION=$(python3 -c 'import tensorrt_llm; print(tensorrt_llm.__version__)' 2> /dev/null | tail -n 1) \
  || fail "python3 cannot import tensorrt_llm: install the v0.12.0-jetson wheel or run inside __IMAGE__"
case "$TRTLLM_VERSION" in
  0.12.*) note "tensorrt_llm $TRTLLM_VERSION" ;;
  *) fail "tensorrt_llm '$TRTLLM_VERSION' found; this script is for 0.12.x (v0.12.0-jetson)" ;;
esac
CONTAINER_TRTLLM=${CONTAINER_TRTLLM:-__CONTAINER__}
if [ -n "${TRTLLM_DIR:-}" ]; then
  LAYOUT=given
  [ -f "$TRTLLM_DIR/examples/run.py" ] || fail "TRTLLM_DIR=$TRTLLM_DIR has no examples/run.py"
elif [ -f "$CONTAINER_TRTLLM/examples/run.py" ]; then
  LAYOUT=container; TRTLLM_DIR=$CONTAINER_TRTLLM
elif [ -f "$PWD/examples/run.py" ]; then
  LAYOUT=source; TRTLLM_DIR=$PWD
elif [ -f "$HOME/TensorRT-LLM/examples/run.py" ]; then
  LAYOUT=source; TRTLLM_DIR=$HOME/TensorRT-LLM
else
  fail "examples/run.py not found in $CONTAINER_TRTLLM (container), $PWD or ~/TensorRT-LLM (source checkout): \
set TRTLLM_DIR to a v0.12.0-jetson checkout"
fi
note "layout $LAYOUT: $TRTLLM_DIR"
BENCH=${GPT_SESSION_BENCHMARK:-}
if [ -z "$BENCH" ]; then
  for c in "$TRTLLM_DIR/cpp/build/benchmarks/gptSessionBenchmark" "$(command -v gptSessionBenchmark || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then BENCH=$c; break; fi
  done
fi
if [ -n "$BENCH" ]; then
  TPS_SOURCE=gptSessionBenchmark; note "gptSessionBenchmark: $BENCH"
else
  TPS_SOURCE="run.py --run_profiling"
  note "no gptSessionBenchmark (build_wheel.py --benchmarks builds it): tokens/s from run.py --run_profiling \
instead, end to end with the context phase"
fi
MEMINFO=${MEMINFO:-/proc/meminfo}
cp "$MEMINFO" "$OUT/meminfo.txt" 2> /dev/null || fail "cannot read $MEMINFO"
avail=$(awk '/^MemAvailable:/ {print $2}' "$MEMINFO")
swap=$(awk '/^SwapFree:/ {print $2}' "$MEMINFO")
[ -n "$avail" ] || fail "no MemAvailable in $MEMINFO"
if [ "$avail" -lt "$NEED_RUN_KIB" ] && [ "${MEMORY_CHECK:-strict}" != warn ]; then
  fail "MemAvailable $((avail / 1024)) MiB < the $((NEED_RUN_KIB / 1024)) MiB the plan puts in memory (runtime, \
weights, page cache, KV): close programs, or re-plan with --meminfo $OUT/meminfo.txt (MEMORY_CHECK=warn goes on)"
fi
if [ $((avail + ${swap:-0})) -lt "$NEED_BUILD_KIB" ] && [ "${MEMORY_CHECK:-strict}" != warn ]; then
  fail "MemAvailable + SwapFree $(((avail + ${swap:-0}) / 1024)) MiB < the $((NEED_BUILD_KIB / 1024)) MiB the \
build needs (2 x weights + runtime): add swap (sudo fallocate -l 8G /swapfile; sudo mkswap /swapfile; \
sudo swapon /swapfile)"
fi
note "memory: MemAvailable $((avail / 1024)) MiB, SwapFree $((${swap:-0} / 1024)) MiB; plan needs \
$((NEED_RUN_KIB / 1024)) MiB to run, $((NEED_BUILD_KIB / 1024)) MiB to build"
if [ -z "${POWER_MODE:-}" ]; then
  POWER_MODE=$(nvpmodel -q 2> /dev/null | tr -s '[:space:]' ' ' || true)
fi
if [ -z "$POWER_MODE" ]; then
  POWER_MODE="unknown: no nvpmodel here (in a container, pass the host's nvpmodel -q as -e POWER_MODE)"
fi
echo "$POWER_MODE" > "$OUT/nvpmodel.txt"
case "$POWER_MODE" in
  *MAXN*) note "power mode: $POWER_MODE" ;;
  *) if [ "${REQUIRE_MAXN:-no}" = yes ]; then fail "power mode is not MAXN: $POWER_MODE"; fi
     note "power mode: $POWER_MODE (NVIDIA measured at MAXN)" ;;
esac
(timeout 3 tegrastats --interval 1000 2> /dev/null || true) | head -n 1 > "$OUT/tegrastats.txt" || true
"""


def deploy_script(
    cfg: BuildConfig,
    tokenizer_dir: str,
    prompt: str,
    dialect: str = "v0.12",
    *,
    plan_summary: dict[str, Any] | None = None,
    reference: str = "reference.json",
) -> str:
    """A bash script for the device (``bash -n`` and ``shellcheck`` clean; see the module docstring). The
    memory checks use ``plan_summary``'s ``need_run_kib``/``need_build_kib`` (:func:`plan_summary`); without
    them they compare with 0 and the preflight says so."""
    tries = variants(cfg)
    summary = dict(plan_summary or {"kv_tokens": cfg.max_tokens_in_paged_kv_cache})
    need_run, need_build = int(summary.get("need_run_kib", 0)), int(summary.get("need_build_kib", 0))
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by `python -m memos_edge.build_config` for TensorRT-LLM {dialect} on Jetson Orin (JetPack 6.1).",
        f"# Run in the container {CONTAINER_IMAGE} (the source tree is {CONTAINER_TRTLLM}) or a v0.12.0-jetson",
        "# checkout (TRTLLM_DIR). MAXN=yes|no skips the question; OUT (default results) receives the logs and",
        "# results.json. edge/README.md: the five commands from a flashed JetPack 6.1 device.",
        "set -euo pipefail",
        "OUT=${OUT:-results}",
        f"REFERENCE=${{REFERENCE:-{shlex.quote(reference)}}}",
        f"NEED_RUN_KIB={need_run}",
        f"NEED_BUILD_KIB={need_build}",
        'mkdir -p "$OUT"',
        _PREFLIGHT.replace("__IMAGE__", CONTAINER_IMAGE).replace("__CONTAINER__", CONTAINER_TRTLLM).rstrip(),
        *([] if need_run else ['note "no plan given: the memory figures above are not checked"']),
        "",
        "# 1. MAX-N clocks, as NVIDIA measured (README4Jetson: sudo nvpmodel -m 0; sudo jetson_clocks)",
        "CLOCKS=unchanged",
        "answer=n",
        'if [ "${MAXN:-ask}" = yes ]; then',
        "  answer=y",
        'elif [ "${MAXN:-ask}" = ask ] && [ -t 0 ]; then',
        '  read -r -p "Set MAX-N clocks now (sudo nvpmodel -m 0 && sudo jetson_clocks)? [y/N] " answer',
        "fi",
        'if [ "$answer" = y ] || [ "$answer" = Y ]; then',
        "  sudo nvpmodel -m 0 && sudo jetson_clocks && CLOCKS=maxn",
        "fi",
        "",
        "# 2. build: the reuse engine, else NVIDIA's defaults; each log is classified in results.json",
        "VARIANT=failed",
        "ENGINE=",
        "VARIANTS=",
        "build_variant() {",
        "  local name=$1 engine=$2 rc=0",
        "  shift 2",
        '  VARIANTS="$VARIANTS $name"',
        '  "$@" > "$OUT/build-$name.log" 2>&1 || rc=$?',
        '  echo "$rc" > "$OUT/build-$name.rc"',
        '  if [ "$rc" = 0 ]; then VARIANT=$name; ENGINE=$engine; fi',
        "}",
    ]
    for i, v in enumerate(tries):
        call = f"build_variant {v.variant} {shlex.quote(v.engine_dir)} {shlex.join(build_command(v, dialect))}"
        lines.append(call if i == 0 else f'if [ "$VARIANT" = failed ]; then {call}; fi')
    lines += ['echo "built: $VARIANT"', ""]
    for v in tries:
        run = shlex.join(run_command(v, tokenizer_dir, prompt)).replace(
            "examples/run.py", '"$TRTLLM_DIR"/examples/run.py', 1
        )
        lines += [f"run_{v.variant}() {{", f'  {run} "$@"', "}"]
    lines += [
        "",
        "# 3. run: greedy tokens against the reference when reference.json is here; run.py's own timing",
        "RUN_NS=0",
        'if [ "$VARIANT" != failed ]; then',
        "  extra=()",
        '  if [ -f "$REFERENCE" ]; then',
        '    python3 -c \'import json, sys; print(",".join(map(str, json.load(open(sys.argv[1]))["tokens"]'
        '["prompt"])))\' "$REFERENCE" > "$OUT/prompt.csv"',
        '    extra=(--input_file "$OUT/prompt.csv" --output_csv "$OUT/out.csv")',
        "  fi",
        "  start=$(date +%s%N)",
        '  "run_$VARIANT" "${extra[@]}" --run_profiling > "$OUT/run.log" 2>&1 || echo "run failed: $OUT/run.log" >&2',
        "  RUN_NS=$(( $(date +%s%N) - start ))",
        "  # 4. tokens/s the way NVIDIA measured its 35.9 (gptSessionBenchmark, CUDA graphs, 128 in / 128 out)",
        '  if [ -n "$BENCH" ]; then',
        '    "$BENCH" --engine_dir "$ENGINE" --batch_size 1 --input_output_len 128,128 --enable_cuda_graph \\',
        '      > "$OUT/bench.log" 2>&1 || echo "gptSessionBenchmark failed: $OUT/bench.log" >&2',
        "  fi",
        "fi",
        "",
        "# 5. the KV pool's lines (case-insensitive) and one results.json to bring back",
        'grep -ihE "paged kv cache|tokens per block|max tokens in paged kv|allocated .*kv|kv cache" "$OUT"/*.log '
        '> "$OUT/kv_lines.txt" || true',
        "cat > \"$OUT/plan.json\" <<'JSON'",
        json.dumps(summary),
        "JSON",
        "export OUT REFERENCE VARIANT VARIANTS CLOCKS POWER_MODE RUN_NS LAYOUT TRTLLM_DIR TRTLLM_VERSION TPS_SOURCE",
        "python3 - <<'PY'",
        inspect.getsource(device_logs).rstrip(),
        "PY",
        'echo "bring back: $OUT/results.json and $OUT/*.log"',
        "",
    ]
    return "\n".join(lines)
