"""``bench cluster``: a KV tier shared by OS processes on a private Redis Cluster (3 masters, 3 replicas).

* Cross-process prefix sharing: process A serves an agent with a long system prompt and publishes its blocks
  (``Engine(publish_to="cluster")``); process B, a separate OS process with its own engine and pool, serves
  another agent with the same prefix: its prefix lookup reloads A's blocks from the cluster. B's tokens are
  compared with a single-process run (B again on a fresh pool without a tier), and B's time to first token with
  the tier against that recompute.
* Prefill/decode disaggregation: a prefill process publishes a prompt's blocks and a manifest; a decode process
  reads the manifest, adopts the blocks into its own pool and decodes; tokens against a single process's; bytes
  moved, the time to move them, the decode process's time to first token.
* Failover: a master is killed while an engine serves requests through the tier: requests lost, wrong tokens,
  and the misses and dropped writes counted in the failover window.
* A slot range migrated (``ASK``, then ``MOVED``) and a master SIGSTOPped then SIGCONTed while requests run
  (:mod:`memos_ref.bench.cluster_faults`): the same figures, and the slowest tier call against its timeout.
* Throughput of block reads and writes (32 KiB blocks, pipelined per node), interleaved rounds, min-max.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from memos_ref.bench.cluster_throughput import throughput

__all__ = [
    "ServeProcess",
    "human",
    "plot",
    "render_markdown",
    "run",
    "serve_role",
    "throughput",
]  # torch is imported lazily

SYSTEM_LINE = "You are a careful agent. Tools: search(query), read(url), write(path, text). Answer briefly. "
SYSTEM = SYSTEM_LINE * 6  # ~580 tokens: the bench's and the tests' shared system prompt


def _prompt(tail: str, tok: Any, repeat: int = 6) -> list[int]:
    return [tok.bos_id, *tok.encode(SYSTEM_LINE * repeat + tail)]


_MODEL: dict[str, Any] = {}  # the shipped model, loaded once per process


def _stack(
    url: str,
    namespace: str,
    *,
    tier: bool = True,
    num_blocks: int = 256,
    timeout: float = 0.5,
    model_path: str | None = None,
) -> tuple:
    from memos_ref.engine import Engine
    from memos_ref.model import load_model, model_fingerprint
    from memos_ref.paged import PagedKV
    from memos_ref.tiering.cluster import ClusterTierBackend
    from memos_ref.tiering.manager import TierManager
    from memos_ref.tiering.store import Tier, TierStore

    name = model_path or "shipped"
    model = _MODEL.get(name) or _MODEL.setdefault(name, load_model(model_path))
    spec, fp = model.kv_spec(block_size=16), model_fingerprint(model)
    kv = PagedKV(spec, num_blocks, fingerprint=fp)
    backend = None
    if tier:
        backend = ClusterTierBackend(url, fingerprint=fp, namespace=namespace, timeout=timeout)
        TierManager(kv, TierStore([Tier(backend)], spec=spec, fingerprint=fp), reload="always")
    return model, kv, backend, Engine(model, kv, publish_to="cluster" if tier else None), spec, fp


def _serve(engine: Any, prompt: list[int], new: int) -> dict[str, Any]:
    from memos_ref.engine import Request

    req = engine.submit(Request(prompt, max_new_tokens=new))
    engine.run()
    if req.failed:
        raise req.error  # type: ignore[misc]
    s = req.stats
    return {"output": req.output, "reused": s.reused_tokens, "computed": s.computed_tokens, "ttft_s": s.ttft_s}


def serve_role(
    role: str, url: str, namespace: str, tail: str, new: int, repeat: int = 6, model_path: str | None = None
) -> dict[str, Any]:
    """One process's part (run in a fresh interpreter by :class:`ServeProcess`):

    * ``serve``: warm up, serve ``SYSTEM + tail`` through the cluster tier (publishing what it prefills), then the
      same prompt on a fresh pool without a tier (the single-process recompute reference).
    * ``prefill``: prefill ``SYSTEM + tail`` (one token), publish its blocks and manifest.
    * ``decode``: read the manifest, adopt the blocks, decode ``new`` tokens; then the single-process reference.

    The system prompt is ``SYSTEM_LINE * repeat`` (6: ~580 tokens; the notebook uses 3). ``model_path``: a model
    folder the package's forward loads (SmolLM2's, say; the byte tokenizer's ids are valid ids of its vocabulary),
    or None for the shipped model.
    """
    from memos_ref.model.tokenizer import ByteTokenizer
    from memos_ref.tiering.cluster_manifest import (
        check_disaggregable,
        manifest_name,
        publish_manifest,
        read_manifest,
        verify_chain,
    )

    tok = ByteTokenizer()
    prompt = _prompt(tail, tok, repeat)
    _, kv, backend, engine, spec, fp = _stack(url, namespace, model_path=model_path)
    check_disaggregable(kv)
    _serve(engine, [tok.bos_id, *tok.encode("warm up " * 20)], 1)  # warm the forward (not published: no tail)
    out: dict[str, Any] = {"pid": os.getpid(), "prompt_tokens": len(prompt)}
    if role == "prefill":
        got = _serve(engine, prompt, 1)
        t = spec.block_size
        keys = [h.hex() for h in kv.prefix_cache.hashes(prompt[: (len(prompt) - 1) // t * t])]
        out |= {"first_token": got["output"][0], "published_blocks": engine.tier_counts["published_blocks"]}
        out["manifest"] = publish_manifest(backend, prompt, keys, spec=spec, fingerprint=fp)
        return out
    if role == "decode":
        name = manifest_name(prompt, fp)
        started = time.perf_counter()
        manifest = read_manifest(backend, name, spec=spec, fingerprint=fp)
        if manifest is None:
            raise RuntimeError(f"manifest {name} not found")
        t = spec.block_size
        verify_chain(manifest, kv.prefix_cache.hashes(manifest.token_ids[: (len(manifest.token_ids) - 1) // t * t]))
        found = backend.read_ahead(manifest.block_keys)
        out["move_s"] = time.perf_counter() - started
        out["blocks_moved"] = found
        prompt = manifest.token_ids
    elif role != "serve":
        raise ValueError(f"unknown role {role!r}")
    shared = _serve(engine, prompt, new)
    out |= {"tiered": shared, "tier_counts": dict(engine.tier_counts)}
    out["bytes_moved"] = engine.kv.tier_manager.store.stats()["cluster"].get("swap_in_bytes", 0)
    _, _, _, alone, _, _ = _stack(url, namespace, tier=False, model_path=model_path)
    _serve(alone, [tok.bos_id, *tok.encode("warm up " * 20)], 1)
    out["recompute"] = _serve(alone, prompt, new)
    return out


def load_shared_model() -> None:
    """Load the shipped model into this process's cache, and import what an engine needs (transformers, through
    the engine's cache): what :class:`ServeProcess` does while it waits for its role."""
    import memos_ref.engine
    import memos_ref.hf  # noqa: F401 - imported by the first Engine; here it overlaps the wait
    from memos_ref.model import load_model

    _MODEL.get("shipped") or _MODEL.setdefault("shipped", load_model())


class ServeProcess:
    """A fresh OS process for :func:`serve_role`, started now: it imports the package and loads the model at once
    (overlapping whatever this process does meanwhile), then waits for its role on stdin. :meth:`serve` sends it
    and returns the JSON result; the process has exited by then (killed on a timeout or a failure)."""

    _CODE = (
        "import json, sys; from memos_ref.bench.cluster import load_shared_model, serve_role; load_shared_model(); "
        "args = json.loads(sys.stdin.readline()); print(json.dumps(serve_role(*args)))"
    )

    def __init__(self, timeout: float = 300) -> None:
        self.timeout = timeout
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", self._CODE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def serve(
        self,
        role: str,
        url: str,
        namespace: str,
        tail: str,
        new: int,
        repeat: int = 6,
        model_path: str | None = None,
    ) -> dict[str, Any]:
        """Run ``serve_role(role, url, namespace, tail, new, repeat, model_path)`` in the process; its result."""
        args = json.dumps([role, url, namespace, tail, new, repeat, model_path])
        try:
            out, err = self.process.communicate(args + "\n", self.timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise RuntimeError(f"{role} process did not finish within {self.timeout} s") from None
        if self.process.returncode != 0:
            raise RuntimeError(f"{role} process failed: {err[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        """End the process if it still runs (a notebook or bench that failed before :meth:`serve`)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def _spawn(
    role: str, url: str, namespace: str, tail: str, new: int, repeat: int = 6, timeout: float = 300
) -> dict[str, Any]:
    """Run :func:`serve_role` in a separate OS process; its JSON result."""
    return ServeProcess(timeout).serve(role, url, namespace, tail, new, repeat)


def cross_process(
    url: str,
    namespace: str,
    new: int = 8,
    *,
    a_here: bool = False,
    b_process: ServeProcess | None = None,
    repeat: int = 6,
    model_path: str | None = None,
) -> dict[str, Any]:
    """A then B, two OS processes sharing the cluster tier (see the module docstring). ``a_here``: A is this
    process (one interpreter fewer, as the notebook does); ``b_process``: B's process, started earlier (else now);
    ``repeat``: the system prompt's length in :data:`SYSTEM_LINE` s; ``model_path``: another model's folder
    (SmolLM2's), else the shipped model."""
    tail_a, b_process = " User A: plan a trip.", b_process or ServeProcess()  # B loads while A serves
    try:
        if a_here:
            a = serve_role("serve", url, namespace, tail_a, new, repeat, model_path)
        else:
            a = ServeProcess().serve("serve", url, namespace, tail_a, new, repeat, model_path)
        b = b_process.serve("serve", url, namespace, " User B: summarise a paper.", new, repeat, model_path)
    finally:
        b_process.close()
    return {
        "a": a,
        "b": b,
        "cross_process_reused_tokens": b["tiered"]["reused"],
        "prefill_tokens_saved": b["recompute"]["computed"] - b["tiered"]["computed"],
        "tokens_identical": b["tiered"]["output"] == b["recompute"]["output"]
        and a["tiered"]["output"] == a["recompute"]["output"],
        "ttft_shared_s": b["tiered"]["ttft_s"],
        "ttft_recompute_s": b["recompute"]["ttft_s"],
        "distinct_pids": a["pid"] != b["pid"],
    }


def disaggregated(
    url: str, namespace: str, new: int = 8, *, repeat: int = 6, prefill_here: bool = False
) -> dict[str, Any]:
    """A prefill process and a decode process (see the module docstring); the decode process starts with the
    prefill one (its imports and model load overlap), and gets its prompt once the prefill one has published.
    ``repeat``: the system prompt's length in :data:`SYSTEM_LINE` s; ``prefill_here``: the prefill process is this
    one (one interpreter fewer)."""
    decode = ServeProcess()  # loads while the prefill process runs; decodes after it has published
    try:
        if prefill_here:
            p = serve_role("prefill", url, namespace, " User C: write a haiku.", 1, repeat)
        else:
            p = _spawn("prefill", url, namespace, " User C: write a haiku.", 1, repeat)
        d = decode.serve("decode", url, namespace, " User C: write a haiku.", new, repeat)
    finally:
        decode.close()
    return {
        "prefill": p,
        "decode": d,
        "disaggregated_tokens_identical": d["tiered"]["output"] == d["recompute"]["output"]
        and d["tiered"]["output"][0] == p["first_token"],
        "bytes_moved": d["bytes_moved"],
        "move_s": d["move_s"],
        "decode_ttft_s": d["tiered"]["ttft_s"],
        "decode_ttft_recompute_s": d["recompute"]["ttft_s"],
        "reused_tokens": d["tiered"]["reused"],
    }


def failover(cluster: Any, namespace: str, requests: int = 6, new: int = 4, timeout: float = 0.3) -> dict[str, Any]:
    """Publish ``requests`` prompts through the tier, kill a master, then serve them again on a fresh pool while
    the replica is promoted (and once more after): requests lost, wrong tokens, misses and dropped writes counted."""
    from memos_ref.engine import Request
    from memos_ref.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prompts = [[tok.bos_id, *tok.encode(f"Agent {i} notes: " + SYSTEM[: 60 + 20 * i])] for i in range(requests)]
    _, _, _, writer, _, _ = _stack(cluster.url, namespace, timeout=timeout)
    expected = [_serve(writer, p, new)["output"] for p in prompts]  # published through the tier
    victim = cluster.master_ports()[0]
    healed = threading.Event()
    window: list[float] = []

    def watch() -> None:  # the failover window: from the kill until the cluster is whole without the victim
        while not healed.is_set() and time.monotonic() - killed < 60:
            if cluster.failed_over(victim):
                window.append(time.monotonic() - killed)
                healed.set()
            time.sleep(0.05)

    first = _stack(cluster.url, namespace, timeout=timeout)  # round 0 is ready (its client holds the slot map)
    first[2].client  # noqa: B018 - connect now: round 0's reads start the moment the master dies, under any load
    cluster.kill(victim)
    killed = time.monotonic()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    served, totals, probe = [], Counter(), os.urandom(4096)
    for r in range(50):  # a fresh pool each round (so it reads the tier), until the cluster has healed
        _, _, backend, engine, _, _ = first if r == 0 else _stack(cluster.url, namespace, timeout=timeout)
        for i, p in enumerate(prompts):
            # another agent's new blocks, written meanwhile: those on the dead master's slots are dropped
            stored = backend.put_many({f"probe-{r}-{i}-{j}": probe for j in range(6)})
            totals["probe_writes"] += len(stored)
            totals["probe_dropped"] += len(stored) - sum(stored.values())
            req = engine.submit(Request(p, max_new_tokens=new))
            engine.run()
            served.append((req, p))
        totals["tier_errors"] += engine.tier_counts["tier_errors"]  # a tier call that raised into the engine
        stats = backend.stats()
        totals.update({k: v for k, v in stats.items() if isinstance(v, int) and k not in ("blocks", "bytes")})
        totals["slowest_call_us"] = max(totals["slowest_call_us"], round(stats["slowest_call_s"] * 1e6))
        backend.close()
        if healed.is_set():
            break
    healed.set()
    watcher.join()
    window_s = window[0] if window else None
    stats = dict(totals)
    stats["slowest_call_s"] = totals["slowest_call_us"] / 1e6
    exp = {tuple(p): e for p, e in zip(prompts, expected)}
    return {
        "requests": len(served),
        "requests_lost": sum(r.failed or not r.finished for r, _ in served),
        "failover_wrong_kv": sum(r.output != exp[tuple(p)] for r, p in served),
        "tier_errors": stats.get("tier_errors", 0),
        "failover_misses": stats.get("misses", 0) + stats.get("read_ahead_misses", 0),
        "failover_dropped_writes": stats.get("dropped_puts", 0),
        "probe_writes": stats.get("probe_writes", 0),
        "probe_dropped": stats.get("probe_dropped", 0),
        "errors_by_kind": {k[7:]: v for k, v in stats.items() if k.startswith("errors_")},
        "failover_window_s": window_s,
        "slowest_call_s": stats["slowest_call_s"],
        "timeout_s": timeout,
    }


def fault_prompts(requests: int) -> list[list[int]]:
    """The fault runs' prompts: ``requests`` agents' notes of 60-(40 + 20 * requests) characters of the system
    prompt (4-8 full blocks each)."""
    from memos_ref.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return [[tok.bos_id, *tok.encode(f"Agent {i} notes: " + SYSTEM[: 60 + 20 * i])] for i in range(requests)]


def migration(cluster: Any, namespace: str, requests: int = 3, new: int = 3, timeout: float = 0.2) -> dict[str, Any]:
    """A slot range migrated while requests run (:func:`~memos_ref.bench.cluster_faults.migrate_slots_mid_run`)."""
    from memos_ref.bench.cluster_faults import migrate_slots_mid_run

    load_shared_model()
    return migrate_slots_mid_run(_MODEL["shipped"], cluster, namespace, fault_prompts(requests), new, timeout)


def hung_node(
    cluster: Any, namespace: str, requests: int = 3, new: int = 3, timeout: float = 0.2, pause_s: float = 5.0
) -> dict[str, Any]:
    """A master SIGSTOPped, then SIGCONTed, while requests run
    (:func:`~memos_ref.bench.cluster_faults.hung_node_mid_run`)."""
    from memos_ref.bench.cluster_faults import hung_node_mid_run

    load_shared_model()
    model = _MODEL["shipped"]
    return hung_node_mid_run(model, cluster, namespace, fault_prompts(requests), new, timeout, pause_s)


def run(quick: bool = False, progress: bool = False) -> dict[str, Any]:
    """Every part on a private cluster (and a 1-master one for the throughput baseline). ``quick``: the same parts
    and fields at smaller sizes — a 3-line (~290-token) system prompt, 2 new tokens, 2 requests per fault round, a
    2 s SIGSTOP, 3 throughput rounds of 16 blocks, process A and the prefill process in this one — so the whole
    run takes seconds, not minutes."""
    from memos_ref.tiering.cluster_server import ClusterServer

    new, repeat, requests = (2, 3, 2) if quick else (16, 6, 6)
    pause_s, rounds, blocks = (2.0, 3, 16) if quick else (5.0, 7, 128)
    with ClusterServer() as cluster:
        # --quick: A and the prefill process are this one (it loads the model for the faults anyway); B and the
        # decode process are separate OS processes either way
        cp = cross_process(cluster.url, "bench-xp", new, repeat=repeat, a_here=quick)
        dis = disaggregated(cluster.url, "bench-pd", new, repeat=repeat, prefill_here=quick)
        with ClusterServer(1, 0) as single:
            tput = throughput({1: single.url, 3: cluster.url}, rounds, blocks)
        mig = migration(cluster, "bench-mig", requests, new, timeout=0.5)
        stop = hung_node(cluster, "bench-stop", requests, new, timeout=0.3, pause_s=pause_s)
        cluster.wait_healthy(60)
        fo = failover(cluster, "bench-fo", requests if quick else 8, new)
    summary = {
        "cross_process_reused_tokens": cp["cross_process_reused_tokens"],
        "prefill_tokens_saved": cp["prefill_tokens_saved"],
        "tokens_identical": cp["tokens_identical"],
        "ttft_shared_ms": cp["ttft_shared_s"] * 1e3,
        "ttft_recompute_ms": cp["ttft_recompute_s"] * 1e3,
        "disaggregated_tokens_identical": dis["disaggregated_tokens_identical"],
        "disaggregated_bytes_moved": dis["bytes_moved"],
        "disaggregated_move_ms": dis["move_s"] * 1e3,
        "decode_ttft_ms": dis["decode_ttft_s"] * 1e3,
        "decode_ttft_recompute_ms": dis["decode_ttft_recompute_s"] * 1e3,
        "requests_lost": fo["requests_lost"],
        "failover_wrong_kv": fo["failover_wrong_kv"],
        "failover_misses": fo["failover_misses"],
        "failover_dropped_writes": fo["failover_dropped_writes"],
        "failover_requests": fo["requests"],
        "failover_window_s": fo["failover_window_s"],
        "slowest_call_s": fo["slowest_call_s"],
        **{k: v for k, v in tput.items() if k.startswith(("read_", "write_"))},
    }
    for name, r in (("migration", mig), ("sigstop", stop)):  # the fault rows: lost, wrong, misses, slowest call
        keys = ("requests", "requests_lost", "wrong_kv", "misses", "dropped_writes", "slowest_call_s")
        for k in (*keys, "slowest_round_trip_s", "timeout_s"):
            summary[f"{name}_{k}"] = r[k]
    results = [
        {"part": "cross_process", **{k: v for k, v in cp.items() if k not in ("a", "b")}},
        {"part": "disaggregated", **{k: v for k, v in dis.items() if k not in ("prefill", "decode")}},
        {"part": "throughput", **tput},
        {"part": "migration", **mig},
        {"part": "sigstop", **stop},
        {"part": "failover", **fo},
    ]
    config = {"quick": quick, "masters": 3, "replicas": 1, "node_timeout_ms": 1000, "block_size": 16, "new_tokens": new}
    config |= {"system_prompt_lines": repeat, "fault_requests": requests, "sigstop_s": pause_s}
    config |= {"a_and_prefill_in_bench_process": quick}
    from memos_ref.bench.common import envelope

    return envelope("cluster", config, results, summary)


def render_markdown(result: dict[str, Any]) -> str:
    """The summary as a Markdown table (for the README)."""
    s = result["summary"]

    def cell(v: Any) -> str:
        if isinstance(v, list):
            return "–".join(cell(x) for x in v)
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    rows = [(k, cell(v)) for k, v in s.items()]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def human(report: dict[str, Any]) -> str:
    s = report["summary"]
    from memos_ref.bench.common import format_table

    return format_table([{"figure": k, "value": v} for k, v in s.items()], ["figure", "value"])


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(["shared tier", "recompute"], [s["ttft_shared_ms"], s["ttft_recompute_ms"]])
    ax.set_ylabel("time to first token (ms)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
