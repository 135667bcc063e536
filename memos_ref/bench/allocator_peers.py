"""``bench allocator``'s peer contenders: vLLM v1's ``BlockPool`` and nano-vllm's ``BlockManager``, loaded from
their own sources (:mod:`memos_ref.bench.peers`) and driven as their schedulers drive them.

Each peer hashes with its own default scheme, and vLLM runs a second time with the package's chained BLAKE2b so
the cost of hashing is visible apart from the cost of bookkeeping:

* ``vllm`` — vLLM's default ``prefix_caching_hash_algo="sha256"``: ``hash_block_tokens(sha256, parent, tokens,
  None)``, SHA-256 over the pickle of ``(parent_hash, token_ids, extra_keys)``, with ``NONE_HASH`` from
  ``init_none_hash`` (vLLM 0.33's ``vllm/utils/hashing.py`` and ``kv_cache_utils.py``, unmodified);
* ``vllm_shared_hash`` — the same ``BlockPool`` fed the package's chained BLAKE2b-128 (what ``ours`` computes);
* ``nanovllm`` — nano-vllm's own ``xxh64`` over the numpy bytes of a block (``BlockManager.compute_hash``).

A trace is ``(system_ids, new_tokens, decoded)`` from ``bench.allocator``; a runner takes
``(num_blocks, trace, rounds)`` and returns ``{"seconds": cpu_seconds}``.
"""

from __future__ import annotations

import inspect
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memos_ref.bench.peers import import_with_stubs
from memos_ref.paged.prefix import iter_block_hashes

__all__ = ["BLOCK", "nanovllm_contender", "vllm_contender"]

BLOCK = 16
_clock = time.process_time  # CPU seconds of this process, as bench.allocator times every contender
_EXTRA = b"\x00"  # the extra key of an empty fingerprint and no salt (what PrefixCache(alloc, 16) mixes in)
Runner = Callable[[int, Any, int], dict[str, Any]]


class _VllmRequest:
    """What ``BlockPool.cache_full_blocks`` reads of a vLLM ``Request``."""

    def __init__(self, token_ids: list[int]) -> None:
        self.all_token_ids = token_ids
        self.block_hashes: list[Any] = []
        self.lora_request = None


def _cbor2_stand_in() -> types.ModuleType:
    """vLLM's hashing module imports ``cbor2`` at the top; its default ``sha256`` does not use it."""
    module = types.ModuleType("cbor2")

    def dumps(*args: Any, **kwargs: Any) -> bytes:
        raise RuntimeError("cbor2 stand-in: install cbor2 to use vLLM's *_cbor hashes")

    module.dumps = dumps  # type: ignore[attr-defined]
    return module


def vllm_contender(src: Path, hashing: str = "own") -> Runner:
    """vLLM v1's BlockPool, driven as KVCacheManager drives it for one full-attention group: block hashes
    computed once per request (at arrival, then as blocks fill), the longest cached prefix found hash by hash
    (at most ``len - 1`` tokens), ``touch`` on hits, ``get_new_blocks``, ``cache_full_blocks`` and, at the end,
    ``free_blocks`` of the table in reverse order. ``hashing="own"``: vLLM's default SHA-256 (pickle);
    ``"shared"``: the package's chained BLAKE2b."""
    if hashing not in ("own", "shared"):
        raise ValueError(f"hashing: expected 'own' or 'shared', got {hashing!r}")
    names = ["vllm.utils.hashing", "vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool"]
    mods = import_with_stubs(src, "vllm", names, extra={"cbor2": _cbor2_stand_in()})
    utils, BlockPool = mods["vllm.v1.core.kv_cache_utils"], mods["vllm.v1.core.block_pool"].BlockPool
    params = inspect.signature(BlockPool.__init__).parameters
    tuple_keys = not hasattr(utils, "make_block_hash_with_group_id")  # older vLLM: BlockHash(hash, tokens, extra)
    touch_groups = "blocks" in inspect.signature(BlockPool.touch).parameters and tuple_keys
    sha256 = mods["vllm.utils.hashing"].sha256
    utils.init_none_hash(sha256)
    hash_block_tokens = utils.hash_block_tokens

    def key(block_hash: bytes, tokens: list[int]) -> Any:
        return utils.BlockHash(block_hash, tuple(tokens), None) if tuple_keys else block_hash

    def chain_of(prompt: list[int]) -> list[Any]:
        if hashing == "shared":
            chain = iter_block_hashes(prompt, BLOCK, _EXTRA)
            return [key(h, prompt[i * BLOCK : (i + 1) * BLOCK]) for i, h in enumerate(chain)]
        out: list[Any] = []
        parent = None
        for i in range(len(prompt) // BLOCK):
            parent = hash_block_tokens(sha256, parent, prompt[i * BLOCK : (i + 1) * BLOCK], None)
            out.append(parent)
        return out

    def next_hash(parent: Any, tokens: list[int]) -> Any:
        if hashing == "shared":
            parent_bytes = (parent.hash_value if tuple_keys else parent) if parent is not None else b""
            return key(next(iter_block_hashes(tokens, BLOCK, _EXTRA, parent_bytes)), tokens)
        return hash_block_tokens(sha256, parent, tokens, None)

    def run(num_blocks: int, trace: Any, rounds: int) -> dict[str, Any]:
        system_ids, new_tokens, decoded = trace
        kwargs: dict[str, Any] = {"enable_caching": True}
        if "hash_block_size" in params:
            kwargs["hash_block_size"] = BLOCK
        pool = BlockPool(num_blocks + 1, **kwargs)  # vLLM keeps block 0 as its null block
        history = [list(system_ids) for _ in new_tokens]
        started = _clock()
        for r in range(rounds):
            live = []
            for a, own in enumerate(new_tokens):
                prompt = history[a] + own[r]
                req = _VllmRequest(list(prompt))
                req.block_hashes = chain_of(prompt)
                hit = []
                for bh in req.block_hashes[: (len(prompt) - 1) // BLOCK]:
                    got = pool.get_cached_block(bh, [0])
                    if not got:
                        break
                    hit.append(got[0])
                pool.touch((hit,) if touch_groups else hit)
                blocks = hit + pool.get_new_blocks(-(-len(prompt) // BLOCK) - len(hit))
                pool.cache_full_blocks(req, blocks, len(hit), len(prompt) // BLOCK, BLOCK, 0)
                live.append((req, blocks, decoded[a][r]))
            for step in range(len(decoded[0][r])):
                for req, blocks, tokens in live:
                    ids = req.all_token_ids
                    ids.append(tokens[step])
                    n = len(ids)
                    if n > len(blocks) * BLOCK:
                        blocks.extend(pool.get_new_blocks(1))
                    if n % BLOCK == 0:  # a block filled: hash it (once) and cache it
                        parent = req.block_hashes[-1] if req.block_hashes else None
                        req.block_hashes.append(next_hash(parent, ids[n - BLOCK : n]))
                        pool.cache_full_blocks(req, blocks, n // BLOCK - 1, n // BLOCK, BLOCK, 0)
            for a, (req, blocks, _) in enumerate(live):
                history[a] = req.all_token_ids
                pool.free_blocks(reversed(blocks))
        return {"seconds": _clock() - started}

    return run


def _xxhash_stand_in() -> types.ModuleType:
    """A stand-in for the ``xxhash`` package (its ``xxh64`` interface over BLAKE2b, 8-byte digests)."""
    import hashlib

    class xxh64:  # the name nano-vllm calls
        def __init__(self) -> None:
            self._h = hashlib.blake2b(digest_size=8)

        def update(self, data: bytes) -> None:
            self._h.update(data)

        def intdigest(self) -> int:
            return int.from_bytes(self._h.digest(), "little")

    module = types.ModuleType("xxhash")
    module.xxh64 = xxh64  # type: ignore[attr-defined]
    return module


def nanovllm_contender(src: Path) -> tuple[Runner, str]:
    """nano-vllm's BlockManager, driven as its scheduler drives it: ``can_allocate`` + ``allocate`` for a
    prompt, ``hash_blocks`` after each step, ``append_token`` + ``may_append`` per decoded token, ``deallocate``
    at the end. Returns the runner and the hash it uses."""
    try:
        import xxhash  # noqa: F401

        hashing, extra = "xxhash.xxh64 (nano-vllm's own)", {}
    except ImportError:
        hashing, extra = "BLAKE2b 8-byte stand-in for xxhash (package absent)", {"xxhash": _xxhash_stand_in()}
    names = ["nanovllm.sampling_params", "nanovllm.engine.sequence", "nanovllm.engine.block_manager"]
    mods = import_with_stubs(src, "nanovllm", names, extra=extra)
    Sequence = mods["nanovllm.engine.sequence"].Sequence
    BlockManager = mods["nanovllm.engine.block_manager"].BlockManager

    def run(num_blocks: int, trace: Any, rounds: int) -> dict[str, Any]:
        system_ids, new_tokens, decoded = trace
        Sequence.block_size = BLOCK
        mgr = BlockManager(num_blocks, BLOCK)
        history = [list(system_ids) for _ in new_tokens]
        started = _clock()
        for r in range(rounds):
            live = []
            for a, own in enumerate(new_tokens):
                seq = Sequence(history[a] + own[r])
                cached = mgr.can_allocate(seq)
                mgr.allocate(seq, cached)
                seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
                mgr.hash_blocks(seq)
                seq.num_cached_tokens += seq.num_scheduled_tokens
                live.append((seq, decoded[a][r]))
            for step in range(len(decoded[0][r])):
                for seq, tokens in live:
                    seq.append_token(tokens[step])
                    mgr.may_append(seq)
                    seq.num_scheduled_tokens = 1
                    mgr.hash_blocks(seq)
                    seq.num_cached_tokens += 1
            for a, (seq, _) in enumerate(live):
                history[a] = list(seq.token_ids)
                mgr.deallocate(seq)
        return {"seconds": _clock() - started}

    return run, hashing
