#!/usr/bin/env bash
# The one device check (issue 18 item 7): on a machine with a CUDA GPU, run the kernel tests on the GPU (the full
# hidden-shape matrix: MEMOS_REF_FULL_KERNELS=1), then the kernel benchmark, and print ONE JSON summary on stdout.
# Without a GPU it measures nothing and prints {"gpu": false, "skipped": ...}, exit 0.
#
# It uses the machine's own Python (PYTHON, default python3: e.g. torch 2.11+cu130, Triton 3.6, transformers 5.17),
# not the project's venv; the checkout is put on PYTHONPATH (memos_kernels is the kernels/ folder), nothing is
# installed. Time: tests at most GPU_CHECK_TEST_S (300 s), benchmark at most GPU_CHECK_BENCH_S (170 s) — under 8
# minutes in all. Logs and the benchmark's JSON go to GPU_CHECK_OUT (default $OUT when set, else a temp dir).
# What the image's Python needs: torch with CUDA and Triton for the kernels (importing memos_kernels does not import
# transformers); pytest for the tests — when it lacks pytest, GPU_CHECK_PYTEST_DIR names a folder holding pytest and
# its pure-Python dependencies (pytest, _pytest, pluggy, iniconfig, packaging), appended to PYTHONPATH. The summary
# reports the pytest it found. tests/test_kernel_path.py (the forward and engine on the kernels) and one test of
# test_kernels.py also import transformers (memos_ref.hf): with a transformers older than the package wants they
# fail alone and are named in the summary; the other kernel tests do not need it.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
TEST_S="${GPU_CHECK_TEST_S:-300}"
BENCH_S="${GPU_CHECK_BENCH_S:-170}"
LOGS="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d)}}"
mkdir -p "$LOGS"
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
ln -s "$ROOT/kernels" "$SHIM/memos_kernels"
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled Triton on the GPU; the tests never switch to the interpreter
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "${GPU_CHECK_PYTEST_DIR:-}" ] && ! "$PY" -c "import pytest" 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$GPU_CHECK_PYTEST_DIR"  # after the image's own packages: only what it lacks
fi

summary() {  # summary <gpu> <reason>: the one JSON on stdout, from the logs written so far
  GPU="$1" REASON="$2" LOGS="$LOGS" "$PY" - <<'EOF'
import json, os, platform, re

logs = os.environ["LOGS"]
out = {"gpu": os.environ["GPU"] == "1", "python": platform.python_version()}
if os.environ["REASON"]:
    out["skipped"] = os.environ["REASON"]
for name in ("torch", "triton", "transformers", "pytest"):
    try:
        out[name] = __import__(name).__version__
    except Exception as exc:  # report, do not fail: the summary is the point
        out[name] = f"unavailable: {type(exc).__name__}"
try:
    import torch
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
except Exception:
    out["device"] = None
for phase in ("import", "tests", "bench"):
    path = os.path.join(logs, f"{phase}.rc")
    if os.path.exists(path):
        out[f"{phase}_rc"] = int(open(path).read().strip() or -1)
tests = os.path.join(logs, "tests.log")
if os.path.exists(tests):
    text = open(tests).read()
    counts = {k: len(re.findall(rf" {k.upper()}( |$)", text, re.M)) for k in ("passed", "failed", "skipped", "error")}
    out["tests"] = {**counts, "failed_names": re.findall(r"^(\S+::\S+) FAILED", text, re.M)[:20],
                    "timed_out": out.get("tests_rc") == 124}
bench = os.path.join(logs, "bench.json")
if os.path.exists(bench) and os.path.getsize(bench):
    try:
        out["bench"] = json.loads(open(bench).read().strip().splitlines()[-1])["summary"]
    except Exception as exc:
        out["bench"] = {"error": f"unreadable bench.json: {exc}"}
out["logs"] = logs
print(json.dumps(out))
EOF
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  summary 0 "no CUDA device (or no torch) for $PY: nothing measured; run this on a GPU machine"
  exit 0
fi

"$PY" -c "import sys, memos_kernels.triton_paged, memos_kernels.bench
assert 'transformers' not in sys.modules, 'memos_kernels imported transformers'" >"$LOGS/import.log" 2>&1
echo $? >"$LOGS/import.rc"

if "$PY" -c "import pytest" 2>/dev/null; then
  (cd "$ROOT" && MEMOS_REF_FULL_KERNELS=1 timeout "$TEST_S" "$PY" -m pytest -v -p no:cacheprovider \
    tests/test_kernels.py tests/test_kernels_layout.py tests/test_cuda_kernel.py tests/test_kernel_path.py \
    tests/test_kernels_matrix.py \
    >"$LOGS/tests.log" 2>&1)
  echo $? >"$LOGS/tests.rc"
else
  echo "pytest is not installed for $PY: carry it (pure Python) and name its folder in GPU_CHECK_PYTEST_DIR" >"$LOGS/tests.log"
  echo 127 >"$LOGS/tests.rc"
fi

(cd "$ROOT" && timeout "$BENCH_S" "$PY" -m memos_kernels.bench --json >"$LOGS/bench.json" 2>"$LOGS/bench.log")
echo $? >"$LOGS/bench.rc"

summary 1 ""
