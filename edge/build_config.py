"""The exact ``trtllm-build`` and run commands for a Jetson, from the planner's numbers.

``python -m memos_edge.build_config --model llama-3-8b --device orin-agx-64gb --checkpoint ckpt --engine engine
[--dialect v0.12|latest] [--batch 4] [--max-input-len 2048] [--context-chunk 512] [--json]``

Two dialects: ``v0.12`` (the only TensorRT-LLM release for Jetson, ``v0.12.0-jetson``: ``--paged_kv_cache
enable``) and ``latest`` (``--kv_cache_type paged``). The runtime settings map our memory onto TensorRT-LLM's:
``kv_cache_free_gpu_memory_fraction`` is the planner's KV fraction, ``enable_block_reuse`` is our prefix sharing
(TensorRT-LLM reuses full blocks of identical prefixes), ``tokens_per_block`` is our block size.
Impossible combinations are refused before anything runs on the device.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict
from pathlib import Path

from memos_edge.build_spec import (
    DIALECTS,
    BuildConfig,
    build_command,
    make_config,
    run_command,
    runtime_config,
    variants,
)
from memos_edge.deploy import deploy_script, plan_summary
from memos_edge.devices import PROFILES
from memos_edge.plan import Plan, plan

from memos_ref.errors import ConfigError

__all__ = [
    "BuildConfig",
    "build_command",
    "deploy_script",
    "main",
    "make_config",
    "run_command",
    "runtime_config",
    "variants",
]


def plan_for_build(args: argparse.Namespace) -> tuple[Plan, BuildConfig]:
    """The plan for the engine's own shapes (its ``max_batch_size`` and the larger variant's ``max_num_tokens``
    size the activations), and the build configuration from it."""

    def config(p: Plan) -> BuildConfig:
        return make_config(p, args.checkpoint, args.engine, dtype=args.dtype, batch=args.batch,
                           max_input_len=args.max_input_len, max_seq_len=args.max_seq_len,
                           context_chunk=args.context_chunk)  # fmt: skip

    first = config(plan(args.model, args.device, kv_dtype=args.kv_dtype, weights=args.weights))
    tokens = max(v.max_num_tokens for v in variants(first))
    p = plan(args.model, args.device, kv_dtype=args.kv_dtype, weights=args.weights, max_batch=args.batch,
             max_num_tokens=tokens)  # fmt: skip
    return p, config(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_edge.build_config", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", required=True, choices=sorted(PROFILES))
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--tokenizer", default="tokenizer")
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--kv-dtype", default="fp16")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--dialect", default="v0.12", choices=DIALECTS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-input-len", type=int)
    parser.add_argument("--max-seq-len", type=int)
    parser.add_argument("--context-chunk", type=int)
    parser.add_argument("--prompt", default="Write a Python function that reverses a string.")
    parser.add_argument("--write-deploy", metavar="FILE", help="also write the on-device bash script")
    parser.add_argument(
        "--reference",
        help="reference.json for the script's token comparison (default: CHECKPOINT/reference.json, where "
        "`export_trtllm --reference-prompt` writes it)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    p, cfg = plan_for_build(args)
    ckpt_config = Path(args.checkpoint) / "config.json"
    if ckpt_config.is_file():  # exported here: the plugins must follow its dtype, the KV its quantization
        try:
            cfg.check_checkpoint(json.loads(ckpt_config.read_text()))
        except ValueError as exc:
            raise ConfigError(f"{ckpt_config} is not valid JSON: {exc}") from None
    out = {
        "build": shlex.join(build_command(cfg, args.dialect)),
        "run": shlex.join(run_command(cfg, args.tokenizer, args.prompt)),
        "runtime": runtime_config(cfg),
        "config": asdict(cfg),
    }
    if args.write_deploy:
        path = Path(args.write_deploy)
        summary = plan_summary(p)
        reference = args.reference or str(Path(args.checkpoint) / "reference.json")
        path.write_text(
            deploy_script(cfg, args.tokenizer, args.prompt, args.dialect, plan_summary=summary, reference=reference)
        )
        path.chmod(0o755)
    print(json.dumps(out, indent=2) if args.json else f"{out['build']}\n\n{out['run']}\n\n{json.dumps(out['runtime'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
