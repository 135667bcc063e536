"""Train the shipped byte-level Llama on the Python standard library: ``python -m memos_ref.model.train``.

Seeded and CPU-only; the defaults finish in well under 30 minutes on 2 cores. The result is written in
transformers format (``config.json`` + ``model.safetensors``) with a ``training_report.json`` holding the
held-out bits per byte beside the unigram baseline. The committed weights came from the default command;
CI never retrains.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from memos_ref.model.corpus import heldout_text, training_documents, unigram_bits_per_byte
from memos_ref.model.evaluate import bits_per_byte
from memos_ref.model.tokenizer import ByteTokenizer

__all__ = ["main", "model_config", "train"]

DEFAULT_OUT = Path(__file__).parent / "assets"


def model_config(tok: ByteTokenizer, *, hidden: int = 256, layers: int = 4, heads: int = 8, kv_heads: int = 2):
    """The shipped architecture: a small Llama with grouped-query attention (8 query heads, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3 + 63) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )


def _token_stream(tok: ByteTokenizer) -> torch.Tensor:
    ids: list[int] = []
    for doc in training_documents():
        ids.extend(tok.encode(doc, add_bos=True, add_eos=True))
    return torch.tensor(ids, dtype=torch.long)  # [N]


def train(
    *,
    out: Path = DEFAULT_OUT,
    steps: int = 1700,
    batch_size: int = 4,
    seq_len: int = 1024,
    lr: float = 2e-3,
    seed: int = 0,
    threads: int = 2,
    max_minutes: float = 30.0,
) -> dict:
    """Train, evaluate on the held-out text, save; return the training report."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tok = ByteTokenizer()
    stream = _token_stream(tok)
    config = model_config(tok)
    model = LlamaForCausalLM(config)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    losses: list[float] = []
    done = 0
    bar = tqdm(range(steps), desc="train", unit="step")
    for step in bar:
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=gen)
        window = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])  # [B, S+1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        # transformers shifts the labels itself: position i is scored on predicting token i+1.
        loss = model(input_ids=window, labels=window).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        done = step + 1
        bar.set_postfix(loss=f"{loss.item():.3f}", bpb=f"{loss.item() / math.log(2):.2f}")
        if (time.perf_counter() - started) / 60 > max_minutes:
            bar.write(f"time budget of {max_minutes} min reached at step {done}; stopping")
            break
    train_minutes = (time.perf_counter() - started) / 60
    model.eval()
    heldout = heldout_text()
    bpb = bits_per_byte(lambda ids: model(input_ids=ids).logits, heldout)
    unigram = unigram_bits_per_byte(training_documents(), heldout)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    report = {
        "command": "python -m memos_ref.model.train",
        "seed": seed,
        "steps": done,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens_seen": done * batch_size * seq_len,
        "train_tokens_available": int(stream.numel()),
        "lr": lr,
        "train_minutes": round(train_minutes, 2),
        "final_train_loss_bpb_mean_last_50": round(sum(losses[-50:]) / len(losses[-50:]) / math.log(2), 4),
        "heldout_bits_per_byte": round(bpb, 4),
        "unigram_bits_per_byte": round(unigram, 4),
        "heldout_bytes": len(heldout.encode("utf-8")),
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the shipped one)")
    parser.add_argument("--steps", type=int, default=1700)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-minutes", type=float, default=30.0)
    args = parser.parse_args(argv)
    report = train(
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        max_minutes=args.max_minutes,
    )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
