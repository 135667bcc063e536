#!/usr/bin/env bash
# The one device check (issue 25 item 4): `python -m memos_kernels.gpu_check` (kernels/gpu_check.py) with the
# machine's own Python. Four phases, each in its own process under a hard budget (env 30 s, correctness 90 s,
# tests 150 s in parallel pytest processes, benchmark 90 s: 6 minutes at most); ONE JSON on stdout (and
# $GPU_CHECK_OUT/gpu_check.json); exit status non-zero on any wrong result, failed test, phase error or timeout.
# Arguments pass through: --dry-run runs the same phases in Triton's interpreter on the CPU (CI); --only PHASE...
# Without a GPU (and without --dry-run) it measures nothing and prints {"gpu": false, "skipped": ...}, exit 0.
#
# PYTHON (default python3) is the image's Python (e.g. torch 2.11+cu130, Triton 3.6); the checkout goes on
# PYTHONPATH (memos_kernels is the kernels/ folder), nothing is installed. Without pytest the tests phase runs each
# kernel file's checks instead; GPU_CHECK_PYTEST_DIR may name a folder holding pytest and its pure-Python
# dependencies, appended to PYTHONPATH. Logs and JSON lines go to GPU_CHECK_OUT (default $OUT, else a temp dir).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LOGS="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d)}}"
mkdir -p "$LOGS"
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
ln -s "$ROOT/kernels" "$SHIM/memos_kernels"
export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ -n "${GPU_CHECK_PYTEST_DIR:-}" ] && ! "$PY" -c "import pytest" 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$GPU_CHECK_PYTEST_DIR"  # after the image's own packages: only what it lacks
fi
cd "$ROOT" && exec "$PY" -m memos_kernels.gpu_check --out "$LOGS" "$@"
