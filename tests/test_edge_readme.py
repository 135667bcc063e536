"""Issue 28 items 3 and 7: edge/README.md's planner figures are generated from the planner (no stale number
outside the generated blocks), and its container checklist goes from a flashed JetPack 6.1 device to tokens/s in
at most five commands that the generated script understands."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from memos_edge.deploy import CONTAINER_IMAGE, CONTAINER_TRTLLM
from memos_edge.plan import calibration_table, plan
from memos_edge.report import LLAMA_BUILD, PLANS, SMOL_BUILD, fill, tables

REPO = Path(__file__).resolve().parents[1]
README = REPO / "edge" / "README.md"
_BLOCK = re.compile(r"<!-- generated: (\w+) -->\n(.*?)<!-- end: \1 -->", re.S)


def test_every_generated_block_equals_the_planner_now():
    text = README.read_text()
    names = _BLOCK.findall(text)
    assert sorted(name for name, _ in names) == sorted(tables())  # every table is in the README, once
    assert fill(text) == text, "regenerate: python -m memos_edge.report --write edge/README.md"
    page = (REPO / "docs" / "jetson.md").read_text()  # the book page carries two of the tables
    assert [name for name, _ in _BLOCK.findall(page)] == ["calibration", "blocks"]
    assert fill(page) == page, "regenerate: python -m memos_edge.report --write docs/jetson.md"


def _planner_numbers() -> set[str]:
    """Every figure the planner produces for the README's cases, as the README would print it."""
    out: set[str] = set()
    cases = [plan(m, d, weights=w) for m, d, w in PLANS]
    cases += [plan("smollm2-135m-instruct", d, weights="fp16", kv_dtype=kv, **SMOL_BUILD)
              for d in ("orin-nano-8gb", "orin-agx-64gb") for kv in ("fp16", "int8")]  # fmt: skip
    cases += [plan("llama-3-8b", "orin-agx-64gb", weights="int4", **LLAMA_BUILD)]
    for p in cases:
        for n in (p.kv_tokens, p.blocks):
            if n >= 1000:
                out |= {f"{n:,}", str(n)}
        for b in p.decode_tokens_per_s_bound.values():
            out |= {f"{b:.1f} tok/s", f"{b:.0f} tok/s"}
    for row in calibration_table():
        if isinstance(row["plan"], int):
            out |= {f"{row['plan']:,}", str(row["plan"])}
    return out


def test_no_planner_figure_is_typed_outside_the_generated_blocks():
    # the README once typed "about 400k tokens", 407552, 176000, 2524800 and "0.20 GiB of weights read
    # per token" (the planner said 0.25) in its prose
    prose = _BLOCK.sub("", README.read_text())
    stale = ["407552", "407,552", "400k", "176000", "176,000", "2524800", "2,524,800", "0.20 GiB"]
    assert [s for s in stale if s in prose] == []
    found = sorted(n for n in _planner_numbers() if re.search(rf"(?<![\d,.]){re.escape(n)}(?![\d,])", prose))
    assert found == [], f"planner figures typed by hand outside the generated blocks: {found}"


def test_the_container_checklist_is_five_commands_the_script_understands():
    text = README.read_text()
    block = text.split("<!-- checklist -->", 1)[1].split("<!-- end checklist -->", 1)[0]
    commands = [line.split("   # ")[0].strip() for line in block.splitlines() if line and not line.startswith("```")]
    assert 1 <= len(commands) <= 5, commands
    run = next(shlex.split(c) for c in commands if c.startswith("sudo docker run"))
    assert "--runtime" in run and run[run.index("--runtime") + 1] == "nvidia"
    assert "-v" in run and run[run.index("-v") + 1] == "~/memos:/work" and run[run.index("-w") + 1] == "/work"
    assert CONTAINER_IMAGE == "dustynv/tensorrt_llm:0.12-r36.4.0" and CONTAINER_IMAGE in run
    assert any(c == f"sudo docker pull {CONTAINER_IMAGE}" for c in commands)
    script = run[-1]
    assert run[-2] == "bash" and (REPO / "edge" / "jetson" / script).is_file()  # a shipped, generated script
    shipped = (REPO / "edge" / "jetson" / script).read_text()
    assert f"CONTAINER_TRTLLM=${{CONTAINER_TRTLLM:-{CONTAINER_TRTLLM}}}" in shipped and "LAYOUT=container" in shipped
    assert CONTAINER_TRTLLM == "/opt/TensorRT-LLM" and CONTAINER_TRTLLM in text
    assert any(c.startswith("rsync -a ckpt") and script in c for c in commands)
    assert commands[-1] == "cat ~/memos/results/results.json"
    assert "MAXN=no" in run[run.index("-e") + 1]  # the host set MAX-N in command 1; no sudo inside the container


def test_notebook_11_types_no_planner_figure_in_its_prose():
    # the notebook's numbers come from plan() in its code cells; its markdown names none of them
    # (it once typed: "2 GiB" OS, "1.5 GiB" runtime and "23,040 bytes of KV per token" were typed in the prose)
    import json

    nb = json.loads((REPO / "notebooks" / "11_edge_jetson.ipynb").read_text())
    prose = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert [s for s in ("2 GiB", "1.5 GiB", "23,040", "176,000", "407,552") if s in prose] == []
    found = sorted(n for n in _planner_numbers() if re.search(rf"(?<![\d,.]){re.escape(n)}(?![\d,])", prose))
    assert found == [], found
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")  # committed without outputs
