"""Golden build and run commands, refused combinations, and the pool-layout bridge's round trips."""

from __future__ import annotations

import pytest
import torch
from memos_edge.build_config import BuildConfig, build_command, deploy_script, make_config, run_command, runtime_config
from memos_edge.layout import (
    export_edge_llm,
    export_trtllm_blocks,
    granularities,
    import_edge_llm,
    import_trtllm_blocks,
)
from memos_edge.plan import plan

from memos_ref.errors import ConfigError
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec


def test_golden_commands_for_llama3_on_agx_orin():
    p = plan("llama-3-8b", "orin-agx-64gb", weights="int4")
    cfg = make_config(p, "ckpt", "engine", batch=4, max_seq_len=4096, max_input_len=2048, context_chunk=512)
    assert " ".join(build_command(cfg, "v0.12")) == (
        "trtllm-build --checkpoint_dir ckpt --output_dir engine --gemm_plugin float16 --gpt_attention_plugin "
        "float16 --paged_kv_cache enable --tokens_per_block 128 --remove_input_padding enable --context_fmha enable "
        "--use_paged_context_fmha enable --max_batch_size 4 --max_input_len 2048 --max_seq_len 4096 "
        "--max_num_tokens 516"
    )
    latest = build_command(cfg, "latest")
    assert "--kv_cache_type" in latest and "--paged_kv_cache" not in latest
    assert " ".join(run_command(cfg, "tok", "hi")) == (
        "python3 examples/run.py --engine_dir engine --tokenizer_dir tok --max_output_len 128 "
        f"--kv_cache_free_gpu_memory_fraction 0.9 --max_tokens_in_paged_kv_cache {p.kv_tokens} "
        "--kv_cache_enable_block_reuse --use_mmap --input_text hi --enable_chunked_context"
    )
    rt = runtime_config(cfg)
    assert (
        rt["enable_block_reuse"] and rt["tokens_per_block"] == 128 and rt["max_tokens_in_paged_kv_cache"] == p.kv_tokens
    )
    script = deploy_script(cfg, "tok", "hi")
    assert script.startswith("#!/usr/bin/env bash") and "trtllm-build" in script and "KV" in script


def test_impossible_combinations_are_refused():
    base = dict(
        checkpoint_dir="c", engine_dir="e", dtype="float16", max_batch_size=1, max_input_len=1024, max_seq_len=2048,
        max_num_tokens=2048, tokens_per_block=64, context_chunk=None, kv_cache_free_gpu_memory_fraction=0.9,
        max_tokens_in_paged_kv_cache=10_000, kv_dtype="fp16",
    )  # fmt: skip
    BuildConfig(**base).check()
    for change, message in [
        ({"tokens_per_block": 48}, "power of two"),
        ({"tokens_per_block": 0}, "power of two"),
        ({"max_seq_len": 512}, "below max_input_len"),
        ({"context_chunk": 100}, "not a multiple of tokens_per_block"),
        ({"max_num_tokens": 512}, "without chunked context"),
        ({"kv_dtype": "fp8"}, "sm_87"),
    ]:
        with pytest.raises(ConfigError, match=message):
            BuildConfig(**{**base, **change}).check()
    p = plan("llama-2-7b", "orin-nx-16gb", weights="int4")
    with pytest.raises(ConfigError, match="does not fit"):
        make_config(p, "c", "e", batch=8, max_seq_len=4096)
    with pytest.raises(ConfigError, match="does not fit orin-nano-8gb"):
        make_config(plan("llama-3-8b", "orin-nano-8gb", weights="fp16"), "c", "e")
    with pytest.raises(ConfigError, match="dialect"):
        build_command(BuildConfig(**base), "v0.9")


SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)


def filled(kv: PagedKV, n: int):
    seq = kv.new_sequence()
    g = torch.Generator().manual_seed(n)
    for layer in range(SPEC.num_layers):
        k = torch.randn(2, n, 8, generator=g)
        seq.append(layer, k, k * 2, list(range(n)) if layer == 0 else None)
    return seq


@pytest.mark.parametrize("n", [1, 16, 37, 130])
def test_round_trips(n):
    kv = PagedKV(SPEC, 32)
    seq = filled(kv, n)
    want = [seq.to_dense(layer) for layer in range(SPEC.num_layers)]
    blocks = export_trtllm_blocks(seq)
    assert tuple(blocks.shape) == (-(-n // 16), *SPEC.block_shape)
    back = import_trtllm_blocks(PagedKV(SPEC, 32), blocks, list(range(n)))
    pages = export_edge_llm(seq)
    assert tuple(pages[0].shape) == (2, -(-n // 128), 128, 2, 8)
    again = import_edge_llm(PagedKV(SPEC, 32), pages, list(range(n)))
    for layer in range(SPEC.num_layers):
        for other in (back, again):
            k, v = other.to_dense(layer)
            assert torch.equal(k, want[layer][0]) and torch.equal(v, want[layer][1])
    assert float(pages[0][:, :, :].reshape(2, -1, 2, 8)[:, n:].abs().sum()) == 0.0  # zero padding


def test_byte_formulas():
    kv = PagedKV(SPEC, 4)
    g = granularities(SPEC)
    block = kv.pool.block(0)
    assert g["block"] == block.nbytes == SPEC.bytes_per_block
    assert g["layer_slab"] == block[0].nbytes and g["kernel_page"] == block[0, 0].nbytes
    l2 = KVSpec(num_layers=32, num_kv_heads=32, head_dim=128, block_size=64, dtype=torch.float16)
    assert granularities(l2)["layer_slab"] == 2**20  # the Jetson plan's "1 MiB block" for Llama-2-7B
    with pytest.raises(Exception, match="blocks must be"):
        import_trtllm_blocks(kv, torch.zeros(1, 2, 2, 2, 16, 8), [0])
