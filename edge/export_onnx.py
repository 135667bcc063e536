"""An ONNX graph of one paged decode step of the shipped model (or any package-loaded Llama), for ``trtexec``.

``python -m memos_edge.export_onnx [--model PATH] --out decode.onnx [--blocks 64] [--max-blocks 16] [--batch 1]``

Inputs (explicit paged KV, the layout of the pool: ``[blocks, L, 2, H, T, D]``):

* ``input_ids [B, 1]`` — the new token of each sequence;
* ``positions [B]`` — its position (= tokens already cached);
* ``kv_pool [N, L, 2, H, T, D]`` — the paged memory;
* ``block_tables [B, max_blocks]`` — each sequence's blocks (padding: any valid id; masked by length);
* ``seq_lens [B]`` — tokens already cached per sequence.

Outputs: ``logits [B, V]`` and ``new_kv [B, L, 2, H, D]`` — the new token's keys and values, which the runtime
writes into slot ``block_tables[b, pos // T] · T + pos % T`` (the graph does not update the pool in place).
Attention inside the graph gathers the sequence's blocks through its block table and masks positions past its
length, so one graph serves any mix of lengths up to ``max_blocks · T``.

**Paged addressing, not paged attention.** The graph reads the pool through the block table with one gather that
densifies ``max_blocks · T`` slots per layer per step, then runs ordinary attention over them: the memory layout is
paged, the compute is not. A paged-attention kernel (TensorRT-LLM's attention plugin, XQA) reads the blocks in
place; TensorRT has no such op in ONNX, so this graph is a portable check of the layout and the numbers, not a
fast decode path.

The opset is pinned to 20 (:data:`OPSET`, TensorRT 10.3's ceiling on JetPack 6.1); weights over
:data:`EXTERNAL_DATA_BYTES` go to an external data file beside the graph (protobuf's 2 GB limit).

On the device: ``trtexec --onnx=decode.onnx --saveEngine=decode.plan --fp16 --skipInference`` (TensorRT 10 on
JetPack 6.1). Without ``--skipInference`` trtexec feeds random values to every input, block tables and lengths
included, which index out of the pool; to time it, give real inputs with ``--loadInputs``. TensorRT is not
installed here, so only onnxruntime runs the graph in the tests (:func:`onnx_generate` runs a whole greedy
generation through it, feeding ``new_kv`` back into the pool).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memos_ref.errors import BackendUnavailableError, ConfigError
from memos_ref.model.llama import LlamaForward, apply_rope, rope_cos_sin

__all__ = [
    "EXTERNAL_DATA_BYTES",
    "OPSET",
    "PagedDecodeStep",
    "example_inputs",
    "export",
    "main",
    "onnx_generate",
    "run_onnx",
]

#: ONNX opset of the exported graph: TensorRT 10.3 (JetPack 6.1) parses up to opset 20.
OPSET = 20
#: Graphs whose weights exceed this many bytes keep them in an external data file (protobuf's limit is 2 GB).
EXTERNAL_DATA_BYTES = 1_500_000_000


class PagedDecodeStep(nn.Module):
    """One decode step over an explicit paged KV pool (see the module docstring)."""

    def __init__(self, model: LlamaForward, block_size: int) -> None:
        super().__init__()
        self.model, self.block_size = model, block_size
        cfg = model.config
        self.hq, self.hkv, self.d, self.theta = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, 1]
        positions: torch.Tensor,  # [B]
        kv_pool: torch.Tensor,  # [N, L, 2, H, T, D]
        block_tables: torch.Tensor,  # [B, M]
        seq_lens: torch.Tensor,  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, m = block_tables.shape
        t, hq, hkv, d = self.block_size, self.hq, self.hkv, self.d
        group = hq // hkv
        x = self.model.model.embed_tokens(input_ids)  # [B, 1, hidden]
        cos, sin = rope_cos_sin(positions[:, None], d, self.theta)  # [B, 1, D]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        blocks = kv_pool[block_tables.reshape(-1)]  # [B·M, L, 2, H, T, D]
        layers = kv_pool.shape[1]
        blocks = blocks.reshape(b, m, layers, 2, hkv, t, d).permute(0, 2, 3, 4, 1, 5, 6)  # [B, L, 2, H, M, T, D]
        cached = blocks.reshape(b, layers, 2, hkv, m * t, d)  # [B, L, 2, H, M·T, D]
        valid = torch.arange(m * t)[None, :] < seq_lens[:, None]  # [B, M·T]
        neg = torch.finfo(torch.float32).min
        bias = torch.where(valid, 0.0, neg)[:, None, None, :]  # [B, 1, 1, M·T]
        new_kv = []
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            y = layer.input_layernorm(x)
            q = apply_rope(attn.q_proj(y).view(b, 1, hq, d).transpose(1, 2), cos, sin)  # [B, Hq, 1, D]
            k = apply_rope(attn.k_proj(y).view(b, 1, hkv, d).transpose(1, 2), cos, sin)  # [B, Hkv, 1, D]
            v = attn.v_proj(y).view(b, 1, hkv, d).transpose(1, 2)  # [B, Hkv, 1, D]
            new_kv.append(torch.stack([k[:, :, 0], v[:, :, 0]], dim=1))  # [B, 2, Hkv, D]
            keys = torch.cat([cached[:, i, 0], k], dim=2)  # [B, Hkv, M·T + 1, D]
            values = torch.cat([cached[:, i, 1], v], dim=2)
            qg = q.reshape(b, hkv, group, d)  # [B, Hkv, G, D]
            scores = (qg @ keys.transpose(-1, -2)).float() / math.sqrt(d)  # [B, Hkv, G, M·T + 1]
            scores = torch.cat([scores[..., :-1] + bias, scores[..., -1:]], dim=-1)  # the new token always sees itself
            out = scores.softmax(-1).to(values.dtype) @ values  # [B, Hkv, G, D]
            x = x + attn.o_proj(out.reshape(b, 1, hq * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.model.lm_head(self.model.model.norm(x))[:, 0]  # [B, V]
        return logits, torch.stack(new_kv, dim=1)  # [B, V], [B, L, 2, Hkv, D]


def example_inputs(
    model: LlamaForward, *, batch: int = 1, blocks: int = 64, max_blocks: int = 16, block_size: int = 16
):
    spec = model.kv_spec(block_size=block_size)
    return (
        torch.zeros((batch, 1), dtype=torch.long),
        torch.zeros((batch,), dtype=torch.long),
        torch.zeros((blocks, *spec.block_shape), dtype=spec.dtype),
        torch.zeros((batch, max_blocks), dtype=torch.long),
        torch.zeros((batch,), dtype=torch.long),
    )


def export(
    model: LlamaForward,
    out: str | Path,
    *,
    batch: int = 1,
    blocks: int = 64,
    max_blocks: int = 16,
    block_size: int = 16,
    external_data: bool | None = None,
) -> Path:
    """Export the decode step with ``torch.onnx.export(dynamo=True)`` at opset :data:`OPSET`. Batch, pool size and
    table width are fixed at export (TensorRT builds for fixed profiles anyway); export again for other sizes.
    ``external_data`` (default: weights over :data:`EXTERNAL_DATA_BYTES`) writes the weights beside the graph."""
    try:
        import onnxscript  # noqa: F401 - the dynamo exporter needs it
    except ImportError as exc:
        raise BackendUnavailableError("ONNX export needs onnx and onnxscript: pip install 'memos-ref[edge]'") from exc
    if max_blocks > blocks:
        raise ConfigError(f"max_blocks {max_blocks} exceeds the pool's {blocks} blocks")
    step = PagedDecodeStep(model, block_size).eval()
    args = example_inputs(model, batch=batch, blocks=blocks, max_blocks=max_blocks, block_size=block_size)
    out = Path(out)
    with torch.no_grad():
        torch.onnx.export(
            step,
            args,
            str(out),
            dynamo=True,
            input_names=["input_ids", "positions", "kv_pool", "block_tables", "seq_lens"],
            output_names=["logits", "new_kv"],
            opset_version=OPSET,
            external_data=_weight_bytes(model) > EXTERNAL_DATA_BYTES if external_data is None else external_data,
        )
    return out


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_onnx(path: str | Path, *inputs: torch.Tensor) -> list[Any]:
    """Run the graph in onnxruntime on the CPU."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise BackendUnavailableError("onnxruntime is not installed: pip install 'memos-ref[edge]'") from exc
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: x.numpy() for n, x in zip(names, inputs)})


def onnx_generate(
    path: str | Path, model: LlamaForward, prompts: list[list[int]], steps: int, *, blocks: int, block_size: int = 16
) -> list[list[int]]:
    """Greedy generation run entirely through the ONNX decode step in onnxruntime: each prompt token, then each
    generated one, goes through the graph, and its ``new_kv`` is written into the pool at slot
    ``block_tables[b, pos // T] · T + pos % T`` — the runtime's side of the contract. One row per graph batch
    row; the prompts must have equal lengths (a fixed-batch graph). Returns the generated ids per row."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    batch, width = shapes["block_tables"]
    if len(prompts) != batch or len({len(p) for p in prompts}) != 1:
        raise ConfigError(f"the graph takes {batch} prompts of one length, got lengths {[len(p) for p in prompts]}")
    total = len(prompts[0]) + steps
    need = -(-total // block_size)
    if need > width or need * batch > blocks:
        raise ConfigError(f"{total} tokens need {need} blocks per row: the graph has {width} per row, {blocks} in all")
    spec = model.kv_spec(block_size=block_size)
    pool = torch.zeros((blocks, *spec.block_shape), dtype=spec.dtype)  # [N, L, 2, H, T, D]
    tables = torch.zeros((batch, width), dtype=torch.long)  # padding: block 0, masked by the length
    tables[:, :need] = torch.arange(batch * need).view(batch, need)  # row b owns blocks b·need ... b·need + need - 1
    current = [p[0] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for pos in range(total - 1):
        lens = torch.full((batch,), pos, dtype=torch.long)
        logits, new_kv = session.run(None, {"input_ids": torch.tensor([[t] for t in current]).numpy(),
                                            "positions": lens.numpy(), "kv_pool": pool.numpy(),
                                            "block_tables": tables.numpy(), "seq_lens": lens.numpy()})  # fmt: skip
        new_kv = torch.from_numpy(new_kv)  # [B, L, 2, H, D]
        for b in range(batch):
            pool[tables[b, pos // block_size], :, :, :, pos % block_size] = new_kv[b]
        nxt = torch.from_numpy(logits).argmax(-1).tolist()
        for b in range(batch):
            if pos + 1 < len(prompts[b]):
                current[b] = prompts[b][pos + 1]
            else:
                out[b].append(nxt[b])
                current[b] = nxt[b]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_edge.export_onnx", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the shipped model)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--max-blocks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    from memos_ref.model import load_model

    path = export(
        load_model(args.model),
        args.out,
        batch=args.batch,
        blocks=args.blocks,
        max_blocks=args.max_blocks,
        block_size=args.block_size,
    )
    print(f"wrote {path}; on the device: trtexec --onnx={path} --saveEngine=decode.plan --fp16 --skipInference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
