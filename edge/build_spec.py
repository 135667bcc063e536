"""The build configuration of a TensorRT-LLM engine for a Jetson, from the planner's numbers: :class:`BuildConfig`
(checked before anything runs on the device), the exact ``trtllm-build`` and run commands in two dialects, the
runtime settings, and the safe variant. The command line and the deploy script are in
:mod:`memos_edge.build_config` and :mod:`memos_edge.deploy`, which build on this module."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from memos_edge.plan import Plan

from memos_ref.errors import ConfigError

__all__ = ["BuildConfig", "build_command", "make_config", "run_command", "runtime_config", "variants"]

DIALECTS = ("v0.12", "latest")


VARIANTS = ("reuse", "safe")
PLUGIN_DTYPES = ("float16", "bfloat16", "float32", "auto")


@dataclass(frozen=True)
class BuildConfig:
    """One engine build and its run. ``variant`` ``reuse``: paged context FMHA, block reuse (our prefix sharing on
    the device) and chunked context; ``safe``: NVIDIA's Jetson recipe (``README4Jetson.md``: ``trtllm-build
    --checkpoint_dir ... --gemm_plugin float16``, everything else default — no paged context FMHA)."""

    checkpoint_dir: str
    engine_dir: str
    dtype: str
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    context_chunk: int | None
    kv_cache_free_gpu_memory_fraction: float
    max_tokens_in_paged_kv_cache: int
    kv_dtype: str
    variant: str = "reuse"
    use_mmap: bool = True

    @property
    def paged_context_fmha(self) -> bool:
        return self.variant == "reuse"

    @property
    def block_reuse(self) -> bool:
        return self.variant == "reuse"

    def check(self) -> None:
        """Refuse what TensorRT-LLM 0.12 would refuse on the device (or build into a wrong engine)."""
        t = self.tokens_per_block
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.dtype not in PLUGIN_DTYPES:
            raise ConfigError(f"plugin dtype must be one of {PLUGIN_DTYPES}, got {self.dtype!r}")
        if t < 1 or t & (t - 1):
            raise ConfigError(f"tokens_per_block must be a power of two (TensorRT-LLM's KV cache manager), got {t}")
        if self.max_seq_len < self.max_input_len:
            raise ConfigError(f"max_seq_len {self.max_seq_len} is below max_input_len {self.max_input_len}")
        if self.kv_dtype == "fp8":
            raise ConfigError("FP8 KV cache needs sm_89+; Orin is sm_87: use int8 or fp16")
        if self.kv_dtype == "int8" and self.variant == "reuse":
            # tensorrt_llm/builder.py build(): "Paged Context FMHA doesn't work with int8 kv cache currently."
            # (the attention plugin asserts the same); block reuse and chunked context need paged context FMHA
            raise ConfigError(
                "INT8 KV cache cannot use paged context FMHA (TensorRT-LLM 0.12 builder.py refuses it), so no block "
                "reuse and no chunked context either: use variant 'safe' with int8 KV, or fp16 KV for 'reuse'"
            )
        if self.context_chunk is not None:
            if not self.paged_context_fmha:
                raise ConfigError(
                    f"chunked context ({self.context_chunk}) needs paged context FMHA: variant 'reuse' with fp16 KV"
                )
            if self.context_chunk % t:
                raise ConfigError(
                    f"a context chunk of {self.context_chunk} tokens is not a multiple of tokens_per_block {t}"
                )
            if self.max_num_tokens < self.context_chunk:
                raise ConfigError(f"max_num_tokens {self.max_num_tokens} is below the context chunk")
        elif self.max_num_tokens < self.max_input_len:
            raise ConfigError(
                f"max_num_tokens {self.max_num_tokens} < max_input_len {self.max_input_len}: without chunked context "
                f"a whole prompt is one step; raise max_num_tokens (or chunk the context: variant 'reuse', fp16 KV)"
            )
        if self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    def check_checkpoint(self, ckpt: dict[str, Any]) -> None:
        """The plugins' dtype must be the checkpoint's (or ``auto``) and the KV dtype what the checkpoint was
        calibrated for: TensorRT-LLM builds the plugins in the dtype it is given, whatever the weights are."""
        ck_dtype = ckpt.get("dtype")
        if self.dtype != "auto" and ck_dtype != self.dtype:
            raise ConfigError(
                f"the plugins would be built in {self.dtype} but the checkpoint is {ck_dtype}: pass --dtype {ck_dtype}"
                " (or auto)"
            )
        kv_algo = (ckpt.get("quantization") or {}).get("kv_cache_quant_algo")
        if (kv_algo == "INT8") != (self.kv_dtype == "int8"):
            raise ConfigError(
                f"the checkpoint's kv_cache_quant_algo is {kv_algo} but the plan's KV is {self.kv_dtype}: export with"
                f" {'--kv-int8' if self.kv_dtype == 'int8' else 'no --kv-int8'} or plan --kv-dtype to match"
            )


def make_config(
    p: Plan,
    checkpoint_dir: str,
    engine_dir: str,
    *,
    dtype: str = "float16",
    batch: int = 1,
    max_input_len: int | None = None,
    max_seq_len: int | None = None,
    context_chunk: int | None = None,
    kv_fraction: float = 0.9,
    variant: str = "reuse",
) -> BuildConfig:
    """A build configuration from a plan: the largest sequence that fits ``batch`` rows, by default."""
    if not p.feasible:
        raise ConfigError(f"{p.model} does not fit {p.device}: {p.why_infeasible}")
    fits = p.max_context_by_batch.get(batch)
    if fits is None:
        fits = min((p.blocks // batch) * p.tokens_per_block, max(p.max_context_by_batch.values(), default=0))
    seq = max_seq_len or fits
    if seq <= 0:
        raise ConfigError(f"{p.model} leaves no room for KV on {p.device} ({p.free_bytes / 2**30:.2f} GiB free)")
    if seq > fits:
        raise ConfigError(f"max_seq_len {seq} x batch {batch} does not fit: at most {fits} tokens per row")
    inp = max_input_len or max(p.tokens_per_block, seq // 2)
    chunk = context_chunk
    tokens = (chunk or inp) + batch  # one context (or chunk) plus a decode token for every row
    cfg = BuildConfig(
        checkpoint_dir=checkpoint_dir,
        engine_dir=engine_dir,
        dtype=dtype,
        max_batch_size=batch,
        max_input_len=inp,
        max_seq_len=seq,
        max_num_tokens=tokens,
        tokens_per_block=p.tokens_per_block,
        context_chunk=chunk,
        kv_cache_free_gpu_memory_fraction=kv_fraction,
        max_tokens_in_paged_kv_cache=p.kv_tokens,
        kv_dtype=p.kv_dtype,
        variant=variant,
        use_mmap=p.use_mmap,
    )
    cfg.check()
    return cfg


def build_command(cfg: BuildConfig, dialect: str = "v0.12") -> list[str]:
    """``trtllm-build`` arguments for the configuration, in one of the two dialects."""
    if dialect not in DIALECTS:
        raise ConfigError(f"dialect must be one of {DIALECTS}, got {dialect!r}")
    cfg.check()
    kv = ["--paged_kv_cache", "enable"] if dialect == "v0.12" else ["--kv_cache_type", "paged"]
    cmd = [
        "trtllm-build",
        "--checkpoint_dir", cfg.checkpoint_dir,
        "--output_dir", cfg.engine_dir,
        "--gemm_plugin", cfg.dtype,
        "--gpt_attention_plugin", cfg.dtype,
        *kv,
        "--tokens_per_block", str(cfg.tokens_per_block),
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
        *(["--use_paged_context_fmha", "enable"] if cfg.paged_context_fmha else []),
        "--max_batch_size", str(cfg.max_batch_size),
        "--max_input_len", str(cfg.max_input_len),
        "--max_seq_len", str(cfg.max_seq_len),
        "--max_num_tokens", str(cfg.max_num_tokens),
    ]  # fmt: skip
    return cmd


def runtime_config(cfg: BuildConfig) -> dict[str, Any]:
    """Runtime settings: the KV pool fraction, block reuse (our prefix sharing), chunked context."""
    return {
        "kv_cache_free_gpu_memory_fraction": cfg.kv_cache_free_gpu_memory_fraction,
        "enable_block_reuse": cfg.block_reuse,
        "enable_chunked_context": cfg.context_chunk is not None and cfg.paged_context_fmha,
        "max_tokens_in_paged_kv_cache": cfg.max_tokens_in_paged_kv_cache,
        "tokens_per_block": cfg.tokens_per_block,
    }


def run_command(cfg: BuildConfig, tokenizer_dir: str, prompt: str, max_output_len: int = 128) -> list[str]:
    """``examples/run.py`` arguments (TensorRT-LLM v0.12) for one prompt with the runtime settings."""
    rt = runtime_config(cfg)
    cmd = [
        "python3", "examples/run.py",
        "--engine_dir", cfg.engine_dir,
        "--tokenizer_dir", tokenizer_dir,
        "--max_output_len", str(max_output_len),
        "--kv_cache_free_gpu_memory_fraction", str(rt["kv_cache_free_gpu_memory_fraction"]),
        # the planner's KV budget, passed (examples/utils.py add_common_args: --max_tokens_in_paged_kv_cache)
        "--max_tokens_in_paged_kv_cache", str(rt["max_tokens_in_paged_kv_cache"]),
        *(["--kv_cache_enable_block_reuse"] if rt["enable_block_reuse"] else []),
        *(["--use_mmap"] if cfg.use_mmap else []),  # README4Jetson: run.py ... --use_mmap (no host copy)
        "--input_text", prompt,
    ]  # fmt: skip
    if rt["enable_chunked_context"]:
        cmd.append("--enable_chunked_context")
    return cmd


def variants(cfg: BuildConfig) -> list[BuildConfig]:
    """The builds to try on the device, in order: ``reuse`` (when the KV dtype allows it) then ``safe`` —
    whether paged context FMHA builds on sm_87 is the first thing the device tells (issue 16 item 3)."""
    out = []
    if cfg.kv_dtype != "int8":
        out.append(replace(cfg, variant="reuse", engine_dir=f"{cfg.engine_dir}-reuse"))
    tokens = max(cfg.max_num_tokens, cfg.max_input_len + cfg.max_batch_size)  # no chunking: a whole prompt per step
    out.append(
        replace(cfg, variant="safe", context_chunk=None, max_num_tokens=tokens, engine_dir=f"{cfg.engine_dir}-safe")
    )
    for v in out:
        v.check()
    return out
