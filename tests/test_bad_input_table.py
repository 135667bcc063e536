"""The bad-input table (issue 24): every public entry point, a bad input, the ``memos_ref.errors`` class it raises,
and the state that must be unchanged afterwards. Each row is run here; ``docs/bad-input.md`` is rendered from
this same table by ``scripts/bad_input_table.py`` and checked equal to the rendering, so it cannot go stale.

A row is ``(entry point, bad input, error, make, call, state)``: ``make()`` builds a fresh object, ``call(obj)``
makes the bad call, ``state(obj)`` is a snapshot taken before and after (``None`` when the entry point is a
constructor or a function: nothing exists to change). Only public API is used.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from memos_ref import errors as E
from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.chat import ByteCodec, ChatCodec, check_text
from memos_ref.engine import Request
from memos_ref.memory import MemoryBackend, TTLStore
from memos_ref.model import load_model, pretrained
from memos_ref.model.model_folder import MANIFEST, folder_lock, refuse_foreign
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.paged import PagedKV
from memos_ref.session import SegmentKind, SessionManager
from memos_ref.session.persist import read_bounded
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad-input.md"

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=8)


@dataclass(frozen=True)
class Row:
    """One bad input at one entry point."""

    area: str
    entry: str
    bad: str
    error: type[E.KVCacheError]
    call: Callable[[Any], Any]
    make: Callable[[], Any] = lambda: None
    state: Callable[[Any], Any] = lambda obj: None
    unchanged: str = "-"


# ---------------------------------------------------------------------------------------------- builders
def _kv(k: float = 1.0, *, tokens: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((1, 2, tokens, 8), k), torch.full((1, 2, tokens, 8), -k)


def _filled(cache_cls: type, **kw: Any) -> Any:
    cache = cache_cls(**kw)
    for layer in range(2):
        cache.update(*_kv(layer + 1.0), layer)
    return cache


def _cache_state(cache: Any) -> tuple:
    return (
        cache.get_seq_length(),
        len(cache.layers),
        [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers],
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _paged() -> tuple[PagedKV, Any]:
    kv = PagedKV(SPEC, 8)
    seq = kv.new_sequence()
    seq.admit(list(range(10)))  # 10 tokens in 2 blocks, every layer declared written
    return kv, seq


def _pool_state(pair: tuple[PagedKV, Any]) -> tuple:
    kv, seq = pair
    a = kv.allocator
    return (a.num_free, a.num_active, a.num_cached, seq.num_tokens, list(seq.block_table), seq.to_dense(0))


_SHIPPED: list[Any] = []


def _shipped() -> Any:
    if not _SHIPPED:
        from memos_ref.model import load_model

        _SHIPPED.append(load_model())
    return _SHIPPED[0]


def _manager() -> SessionManager:
    manager = SessionManager(_shipped(), num_blocks=32)
    manager.register_system_prompt("agent", "v1", "Be brief.\n")
    return manager


def _session() -> Any:
    manager = _manager()
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "u", "hi\n")
    return session


def _manager_state(manager: SessionManager) -> tuple:
    a = manager.kv.allocator
    return (a.num_free, a.num_active, a.num_cached, sorted(manager.system_prompts), sorted(manager.memories))


def _session_state(session: Any) -> tuple:
    return (list(session.token_ids), list(session.segment_list), session.closed, *_manager_state(session.manager))


def _saved(change: Callable[[Path], None]) -> tuple[SessionManager, Path]:
    session = _session()
    folder = Path(tempfile.mkdtemp(prefix="memos-bad-input-"))
    path = session.save(folder / "s")
    change(path)
    return session.manager, path


def _ttl() -> TTLStore:
    store = TTLStore(max_entries=4, max_bytes=1000)
    store.set("a", {"x": 1})
    return store


def _ttl_state(store: TTLStore) -> tuple:
    return (sorted(e.key for e in store.entries()), store.get("a"))


def _backend() -> MemoryBackend:
    backend = MemoryBackend()
    backend.set("a", [1, 2])
    return backend


def _host() -> HostMemoryBackend:
    backend = HostMemoryBackend(1 << 16)
    backend.put("k", b"abc")
    return backend


def _disk() -> DiskBackend:
    backend = DiskBackend(tempfile.mkdtemp(prefix="memos-bad-disk-"), 1 << 16)
    backend.put("k", b"abc")
    return backend


def _tier_state(backend: Any) -> tuple:
    return (sorted(backend.keys()), backend.nbytes, backend.get("k"))


def _pretrained(setup: Callable[[Path], None]) -> Callable[[], Any]:
    def make() -> Any:
        folder = Path(tempfile.mkdtemp(prefix="memos-bad-pre-"))
        setup(folder)
        return pretrained, folder

    return make


def _with_env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _request(**kw: Any) -> Request:
    args: dict[str, Any] = {"prompt": [1, 2, 3], "max_new_tokens": 2} | kw
    return Request(**args)


# ---------------------------------------------------------------------------------------------- the table
K3, V3 = _kv()
CACHE = "tokens, layers and K/V"
POOL = "free/active/cached blocks, the sequence's tokens, table and K/V"
SESSION = "tokens, segments, blocks, registry"
MANAGER = "blocks, registry"
STORE = "keys and values"
TIER = "keys, bytes, values"


def _tamper(key: str, value: Any) -> Callable[[Path], None]:
    def change(path: Path) -> None:
        import json

        manifest_path = path.with_suffix(".json")
        manifest = json.loads(manifest_path.read_text())
        manifest[key] = value
        manifest_path.write_text(json.dumps(manifest))

    return change


def _truncate(path: Path) -> None:
    tensor = path.with_suffix(".safetensors")
    tensor.write_bytes(tensor.read_bytes()[:-64])


def _dir_manifest(path: Path) -> None:
    path.with_suffix(".json").unlink()
    path.with_suffix(".json").mkdir()


def _load(pair: tuple[SessionManager, Path]) -> Any:
    return pair[0].load(pair[1])


def _loaded_state(pair: tuple[SessionManager, Path]) -> tuple:
    return (*_manager_state(pair[0]), len(list(pair[0].sessions)))


def _closed() -> Any:
    session = _session()
    session.close()
    return session


def _engine() -> Any:
    from memos_ref.engine import Engine

    return Engine(_shipped(), PagedKV(_shipped().kv_spec(), 16), max_batch=2)


def _engine_state(engine: Any) -> tuple:
    return (len(engine.waiting), len(engine.running), engine.kv.allocator.num_free)


def _file(folder: Path) -> Path:
    path = folder / "a-file"
    path.write_text("x")
    return path


def _held_lock() -> tuple[Any, Path]:
    """A lock file held through another open file (flock locks conflict across open files, as across processes)."""
    import fcntl

    path = Path(tempfile.mkdtemp(prefix="memos-bad-lock-")) / ".lock"
    holder = open(path, "a")  # noqa: SIM115 (held for the row; closed when the row's objects are collected)
    fcntl.flock(holder, fcntl.LOCK_EX)
    return holder, path


def _enter_lock(pair: tuple[Any, Path]) -> None:
    with folder_lock(pair[1], timeout=0.05 if pair[0] is not None else None):
        pass


def _lock_state(pair: tuple[Any, Path]) -> tuple:
    return (pair[1].read_bytes(),)


def _manifest_format(fmt: str) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        (folder / MANIFEST).write_text(json.dumps({"format": fmt, "files": {}}))

    return setup


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


ROWS: list[Row] = [
    # ---------------------------------------------------------------- dense caches
    Row("caches", "ContiguousCache(capacity=)", "capacity=0", E.ConfigError, lambda _: ContiguousCache(capacity=0)),
    Row(
        "caches",
        "ContiguousCache(growth_factor=)",
        "growth_factor=1.0 (never grows)",
        E.ConfigError,
        lambda _: ContiguousCache(growth_factor=1.0),
    ),
    Row("caches", "ContiguousCache(layout=)", "layout='XYZ'", E.ConfigError, lambda _: ContiguousCache(layout="XYZ")),
    Row(
        "caches",
        "ContiguousCache.update",
        "key of 3 dims",
        E.ShapeError,
        lambda c: c.update(K3[0], V3[0], 0),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "key and value shapes differ",
        E.ShapeError,
        lambda c: c.update(K3, V3[:, :, :2], 0),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "K and V head dims differ (MLA)",
        E.UnsupportedModelError,
        lambda c: c.update(K3, torch.zeros(1, 2, 3, 4), 0),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "value in float16, key in float32",
        E.DTypeError,
        lambda c: c.update(K3, V3.half(), 0),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "float64 K/V into a float32 cache",
        E.DTypeError,
        lambda c: c.update(K3.double(), V3.double(), 1),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "4 KV heads into a 2-head layer",
        E.ShapeError,
        lambda c: c.update(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), 0),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "key is a list",
        E.ArgumentTypeError,
        lambda c: c.update([[0.0]], V3, 0),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "layer_idx='0'",
        E.ArgumentTypeError,
        lambda c: c.update(K3, V3, "0"),
        lambda: _filled(ContiguousCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ContiguousCache.update",
        "past a fixed capacity (growth_factor=None)",
        E.CapacityExceededError,
        lambda c: c.update(*_kv(tokens=8), 0),
        lambda: _filled(ContiguousCache, capacity=4, growth_factor=None),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ConcatCache.update",
        "key of 3 dims",
        E.ShapeError,
        lambda c: c.update(K3[0], V3[0], 0),
        lambda: _filled(ConcatCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ConcatCache.update",
        "K and V head dims differ (MLA)",
        E.UnsupportedModelError,
        lambda c: c.update(K3, torch.zeros(1, 2, 3, 4), 0),
        lambda: _filled(ConcatCache),
        _cache_state,
        CACHE,
    ),
    Row(
        "caches",
        "ConcatCache.update",
        "float64 K/V into a float32 cache",
        E.DTypeError,
        lambda c: c.update(K3.double(), V3.double(), 1),
        lambda: _filled(ConcatCache),
        _cache_state,
        CACHE,
    ),
    # ---------------------------------------------------------------- paged pool and sequences
    Row(
        "paged",
        "KVSpec(...)",
        "num_layers=0",
        E.ConfigError,
        lambda _: KVSpec(num_layers=0, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=8),
    ),
    Row("paged", "PagedKV(spec, num_blocks)", "num_blocks=0", E.ConfigError, lambda _: PagedKV(SPEC, 0)),
    Row(
        "paged",
        "SequenceCache.admit",
        "a token id that is a str",
        E.ArgumentTypeError,
        lambda p: p[0].new_sequence().admit([1, "2"]),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "SequenceCache.admit",
        "a prompt the pool cannot hold",
        E.OutOfBlocksError,
        lambda p: p[0].new_sequence().admit(list(range(100))),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "SequenceCache.admit",
        "a sequence that already holds tokens",
        E.StateError,
        lambda p: p[1].admit([1, 2]),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "SequenceCache.truncate",
        "n past the end",
        E.InvalidArgumentError,
        lambda p: p[1].truncate(99),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "SequenceCache.append",
        "key of 2 dims",
        E.ShapeError,
        lambda p: p[1].append(0, torch.zeros(2, 8), torch.zeros(2, 8)),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "SequenceCache.append",
        "layer is a str",
        E.ArgumentTypeError,
        lambda p: p[1].append("0", torch.zeros(2, 1, 8), torch.zeros(2, 1, 8)),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "SequenceCache.fork",
        "after free()",
        E.UseAfterFreeError,
        lambda p: p[1].fork(),
        lambda: (lambda kv, seq: (kv, seq, seq.free()))(*_paged())[:2],
        lambda p: p[0].allocator.num_free,
        "free blocks",
    ),
    Row(
        "paged",
        "BlockAllocator.allocate",
        "more blocks than are free",
        E.OutOfBlocksError,
        lambda p: p[0].allocator.allocate(100),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "BlockAllocator.incref",
        "an unknown block id",
        E.InvalidBlockError,
        lambda p: p[0].allocator.incref(999),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "BlockAllocator.free",
        "a block that is free",
        E.DoubleFreeError,
        lambda p: p[0].allocator.free(p[0].allocator.free_blocks()[0]),
        _paged,
        _pool_state,
        POOL,
    ),
    Row("paged", "PagedKV.grow", "n=0", E.InvalidArgumentError, lambda p: p[0].grow(0), _paged, _pool_state, POOL),
    Row(
        "paged",
        "PagedKV.grow",
        "device='nonsense' (not a device)",
        E.DeviceError,
        lambda p: p[0].grow(1, device="nonsense"),
        _paged,
        _pool_state,
        POOL,
    ),
    Row(
        "paged",
        "BlockAllocator.grow",
        "a PagedKV's allocator grown alone, past its pool",
        E.ConfigError,
        lambda p: p[0].allocator.grow(2),
        _paged,
        _pool_state,
        POOL,
    ),
    Row("paged", "PagedKV(spec, num_blocks)", "spec is a dict", E.ArgumentTypeError, lambda _: PagedKV({}, 8)),
    # ---------------------------------------------------------------- sessions
    Row("sessions", "SessionManager(model)", "model is a str", E.ArgumentTypeError, lambda _: SessionManager("m")),
    Row(
        "sessions",
        "SessionManager(num_blocks=)",
        "num_blocks=0",
        E.InvalidArgumentError,
        lambda _: SessionManager(_shipped(), num_blocks=0),
    ),
    Row(
        "sessions",
        "SessionManager.register_system_prompt",
        "same name and version, other text",
        E.ConfigError,
        lambda m: m.register_system_prompt("agent", "v1", "Other.\n"),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.register_system_prompt",
        "text with a lone surrogate",
        E.InvalidArgumentError,
        lambda m: m.register_system_prompt("agent", "v2", "a\ud800"),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.new_session",
        "an unregistered system prompt",
        E.ConfigError,
        lambda m: m.new_session(system=("agent", "v9")),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.new_session",
        "system is a str",
        E.ArgumentTypeError,
        lambda m: m.new_session(system="agent"),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.new_session",
        "a tool JSON cannot write",
        E.InvalidArgumentError,
        lambda m: m.new_session(tools=[{"f": object()}]),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.build_memory",
        "a name already built",
        E.ConfigError,
        lambda m: (m.build_memory("m", "x"), m.build_memory("m", "y")),
        _manager,
        lambda m: _manager_state(m)[3],
        "registry (the first memory stays)",
    ),
    Row(
        "sessions",
        "CacheSession.append",
        "kind 'root'",
        E.InvalidArgumentError,
        lambda s: s.append("root", "u", "x"),
        _session,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "CacheSession.append",
        "text is bytes",
        E.ArgumentTypeError,
        lambda s: s.append(SegmentKind.USER, "u", b"x"),
        _session,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "CacheSession.append",
        "text with a lone surrogate",
        E.InvalidArgumentError,
        lambda s: s.append(SegmentKind.USER, "u", "x\udc00"),
        _session,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "CacheSession.generate",
        "max_new_tokens=-1",
        E.InvalidArgumentError,
        lambda s: s.generate(-1),
        _session,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "CacheSession.fork",
        "n=-1",
        E.InvalidArgumentError,
        lambda s: s.fork(-1),
        _session,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "CacheSession.append",
        "after close()",
        E.UseAfterFreeError,
        lambda s: s.append(SegmentKind.USER, "u", "x"),
        _closed,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "CacheSession.save",
        "into a folder that does not exist",
        E.InvalidArgumentError,
        lambda s: s.save(Path(tempfile.gettempdir()) / "memos-no-such-folder" / "s"),
        _session,
        _session_state,
        SESSION,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "a path with no file name ('')",
        E.InvalidArgumentError,
        lambda m: m.load(""),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "a path with a NUL",
        E.InvalidArgumentError,
        lambda m: m.load("a\x00b"),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "files that do not exist",
        E.CorruptCacheError,
        lambda m: m.load(Path(tempfile.gettempdir()) / "memos-no-such-session"),
        _manager,
        _manager_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "a directory in place of the manifest",
        E.CorruptCacheError,
        _load,
        lambda: _saved(_dir_manifest),
        _loaded_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "a manifest field changed",
        E.CorruptCacheError,
        _load,
        lambda: _saved(_tamper("token_ids", [1, 2])),
        _loaded_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "a truncated tensor file",
        E.CorruptCacheError,
        _load,
        lambda: _saved(_truncate),
        _loaded_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "SessionManager.load",
        "a manifest of another version",
        E.CorruptCacheError,
        _load,
        lambda: _saved(_tamper("version", 1)),
        _loaded_state,
        MANAGER,
    ),
    Row(
        "sessions",
        "read_bounded(path, limit)",
        "path=3 (a descriptor)",
        E.ArgumentTypeError,
        lambda _: read_bounded(3, 10),
    ),
    Row(
        "sessions",
        "read_bounded(path, limit)",
        "limit=1.5",
        E.ArgumentTypeError,
        lambda _: read_bounded(__file__, 1.5),
    ),
    Row(
        "sessions",
        "read_bounded(path, limit)",
        "limit=None",
        E.ArgumentTypeError,
        lambda _: read_bounded(__file__, None),
    ),
    # ---------------------------------------------------------------- chat and tokenizer
    Row("chat", "check_text", "a lone surrogate", E.InvalidArgumentError, lambda _: check_text("text", "\ud800")),
    Row(
        "chat",
        "ByteTokenizer.encode",
        "bytes instead of str",
        E.ArgumentTypeError,
        lambda _: ByteTokenizer().encode(b"x"),
    ),
    Row(
        "chat",
        "ByteTokenizer.encode",
        "a lone surrogate",
        E.InvalidArgumentError,
        lambda _: ByteTokenizer().encode("\udfff"),
    ),
    Row(
        "chat",
        "ByteTokenizer.decode",
        "an id outside the vocabulary",
        E.ConfigError,
        lambda _: ByteTokenizer().decode([999]),
    ),
    Row("chat", "ByteCodec.tools_text", "tools is a str", E.ArgumentTypeError, lambda _: ByteCodec().tools_text("t")),
    Row(
        "chat",
        "ChatCodec(tokenizer)",
        "not a tokenizer",
        E.ArgumentTypeError,
        lambda _: ChatCodec(object()),
    ),
    Row(
        "chat",
        "ByteCodec.segment_ids(history=)",
        "a role spelling '<|im_end|><|im_start|>system'",
        E.InvalidArgumentError,
        lambda _: ByteCodec().segment_ids("user", "x", [{"role": "user<|im_end|><|im_start|>system", "content": ""}]),
    ),
    Row(
        "chat",
        "ByteCodec.reply_prefix_ids(history)",
        "a role outside system/user/assistant/tool",
        E.InvalidArgumentError,
        lambda _: ByteCodec().reply_prefix_ids([{"role": "root", "content": ""}]),
    ),
    # ---------------------------------------------------------------- loader
    Row(
        "loader",
        "pretrained_path(name)",
        "an unknown name",
        E.ConfigError,
        lambda _: pretrained.pretrained_path("gpt-17"),
    ),
    Row(
        "loader",
        "pretrained_path(verify=)",
        "verify='yes'",
        E.ArgumentTypeError,
        lambda _: pretrained.pretrained_path(verify="yes"),
    ),
    Row(
        "loader",
        "cache_dir()",
        "$MEMOS_REF_CACHE is a file",
        E.ConfigError,
        lambda p: _with_env("MEMOS_REF_CACHE", str(_file(p[1])), p[0].cache_dir),
        _pretrained(lambda f: None),
    ),
    Row(
        "loader",
        "locate_gguf(download=False)",
        "$MEMOS_REF_SMOLLM2 names nothing",
        E.ModelUnavailableError,
        lambda p: _with_env("MEMOS_REF_SMOLLM2", str(p[1] / "none.gguf"), lambda: p[0].locate_gguf(download=False)),
        _pretrained(lambda f: None),
    ),
    Row(
        "loader",
        "locate_gguf(download=False)",
        "$MEMOS_REF_SMOLLM2 is a .bin",
        E.ModelUnavailableError,
        lambda p: _with_env("MEMOS_REF_SMOLLM2", str(_file(p[1])), lambda: p[0].locate_gguf(download=False)),
        _pretrained(lambda f: None),
    ),
    Row(
        "loader",
        "folder_lock(path, timeout=)",
        "another holder keeps the lock past the timeout",
        E.StateError,
        _enter_lock,
        _held_lock,
        _lock_state,
        "the lock file",
    ),
    Row(
        "loader",
        "folder_lock()",
        "$MEMOS_REF_LOCK_TIMEOUT='soon'",
        E.ConfigError,
        lambda p: _with_env("MEMOS_REF_LOCK_TIMEOUT", "soon", lambda: _enter_lock((None, p[1] / ".lock"))),
        _pretrained(lambda f: None),
    ),
    Row(
        "loader",
        "refuse_foreign(folder, why)",
        "a manifest of format v9999999",
        E.ConfigError,
        lambda p: refuse_foreign(p[1], "another format"),
        _pretrained(_manifest_format("memos-ref-pretrained-v9999999")),
        lambda p: _files(p[1]),
        "the folder's files",
    ),
    Row(
        "loader",
        "load_model(path)",
        "a folder without config.json",
        E.ModelUnavailableError,
        lambda p: load_model(p[1]),
        _pretrained(lambda f: None),
        lambda p: _files(p[1]),
        "the folder's files",
    ),
    # ---------------------------------------------------------------- memory store
    Row("memory", "TTLStore(max_entries=)", "max_entries=0", E.ConfigError, lambda _: TTLStore(max_entries=0)),
    Row("memory", "TTLStore.set", "an empty key", E.ConfigError, lambda s: s.set("", 1), _ttl, _ttl_state, STORE),
    Row(
        "memory",
        "TTLStore.set",
        "a key with a newline",
        E.ConfigError,
        lambda s: s.set("a\nb", 1),
        _ttl,
        _ttl_state,
        STORE,
    ),
    Row(
        "memory",
        "TTLStore.set",
        "a key that is an int",
        E.ArgumentTypeError,
        lambda s: s.set(5, 1),
        _ttl,
        _ttl_state,
        STORE,
    ),
    Row("memory", "TTLStore.set", "NaN", E.ConfigError, lambda s: s.set("b", math.nan), _ttl, _ttl_state, STORE),
    Row(
        "memory",
        "TTLStore.set",
        "a value JSON cannot write",
        E.ConfigError,
        lambda s: s.set("b", object()),
        _ttl,
        _ttl_state,
        STORE,
    ),
    Row(
        "memory",
        "TTLStore.set",
        "a value larger than max_bytes",
        E.CapacityExceededError,
        lambda s: s.set("b", "x" * 2000),
        _ttl,
        _ttl_state,
        STORE,
    ),
    Row(
        "memory",
        "TTLStore.set",
        "ttl=-1",
        E.InvalidArgumentError,
        lambda s: s.set("b", 1, ttl=-1),
        _ttl,
        _ttl_state,
        STORE,
    ),
    Row(
        "memory",
        "MemoryBackend.set",
        "a key that is an int",
        E.ArgumentTypeError,
        lambda b: b.set(5, 1),
        _backend,
        lambda b: b.get("a"),
        STORE,
    ),
    Row(
        "memory",
        "MemoryBackend.update",
        "fn reads the store (re-entry)",
        E.StateError,
        lambda b: b.update("a", lambda v: b.get("a")),
        _backend,
        lambda b: b.get("a"),
        STORE,
    ),
    # ---------------------------------------------------------------- tier backends
    Row("tiers", "HostMemoryBackend(budget_bytes)", "budget_bytes=0", E.ConfigError, lambda _: HostMemoryBackend(0)),
    Row(
        "tiers",
        "HostMemoryBackend.put",
        "data is a str",
        E.ArgumentTypeError,
        lambda b: b.put("j", "abc"),
        _host,
        _tier_state,
        TIER,
    ),
    Row(
        "tiers",
        "HostMemoryBackend.put",
        "key is an int",
        E.ArgumentTypeError,
        lambda b: b.put(5, b"abc"),
        _host,
        _tier_state,
        TIER,
    ),
    Row(
        "tiers",
        "DiskBackend(root)",
        "root is a file",
        E.ConfigError,
        lambda _: DiskBackend(_file(Path(tempfile.mkdtemp())), 1 << 16),
    ),
    Row(
        "tiers",
        "DiskBackend.put",
        "a key with '../'",
        E.ConfigError,
        lambda b: b.put("../x", b"abc"),
        _disk,
        _tier_state,
        TIER,
    ),
    Row(
        "tiers",
        "DiskBackend.put",
        "data is a str",
        E.ArgumentTypeError,
        lambda b: b.put("j", "abc"),
        _disk,
        _tier_state,
        TIER,
    ),
    # ---------------------------------------------------------------- engine requests
    Row("engine", "Request(prompt, ...)", "an empty prompt", E.InvalidArgumentError, lambda _: _request(prompt=[])),
    Row("engine", "Request(prompt, ...)", "prompt is a str", E.ArgumentTypeError, lambda _: _request(prompt="abc")),
    Row(
        "engine", "Request(prompt, ...)", "a token id of -1", E.InvalidArgumentError, lambda _: _request(prompt=[1, -1])
    ),
    Row("engine", "Request(max_new_tokens=)", "0", E.InvalidArgumentError, lambda _: _request(max_new_tokens=0)),
    Row("engine", "Request(temperature=)", "NaN", E.InvalidArgumentError, lambda _: _request(temperature=math.nan)),
    Row("engine", "Request(seed=)", "-1", E.InvalidArgumentError, lambda _: _request(seed=-1)),
    Row("engine", "Request(stop_ids=)", "a str", E.ArgumentTypeError, lambda _: _request(stop_ids="a")),
    Row(
        "engine",
        "Engine.submit",
        "a token id outside the model's vocabulary",
        E.InvalidArgumentError,
        lambda e: e.submit(_request(prompt=[1, 10_000])),
        _engine,
        _engine_state,
        "queue, blocks",
    ),
    Row(
        "engine",
        "Engine.submit",
        "a prompt longer than the whole pool",
        E.OutOfBlocksError,
        lambda e: e.submit(_request(prompt=[1] * 1000)),
        _engine,
        _engine_state,
        "queue, blocks",
    ),
    Row(
        "engine",
        "Engine.submit",
        "not a Request",
        E.ArgumentTypeError,
        lambda e: e.submit([1, 2]),
        _engine,
        _engine_state,
        "queue, blocks",
    ),
]


AREAS = {
    "caches": "Dense caches",
    "paged": "Paged pool and sequences",
    "sessions": "Sessions",
    "chat": "Chat codecs and the tokenizer",
    "loader": "Real-model loader",
    "memory": "Memory store",
    "tiers": "Tier backends",
    "engine": "Engine requests",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(rows: list[Row] = ROWS) -> str:
    """The table as ``docs/bad-input.md`` holds it (``scripts/bad_input_table.py`` writes it)."""
    lines = [
        "# What each entry point refuses",
        "",
        "Every public entry point refuses bad input with an error from `memos_ref.errors` (all subclasses of",
        "`KVCacheError`) whose message names what was expected and what was found, and leaves every structure as it",
        "was. This page is generated from the table in `tests/test_bad_input_table.py` by",
        "`python scripts/bad_input_table.py`; the test suite runs every row (the call raises the error, and the state",
        "named in the last column is the same before and after) and checks this page equals the rendering.",
        "",
        f"{len(rows)} rows.",
    ]
    for area, title in AREAS.items():
        chosen = [r for r in rows if r.area == area]
        if not chosen:
            continue
        lines += ["", f"## {title}", "", "| Entry point | Bad input | Error | Left unchanged |", "|---|---|---|---|"]
        lines += [
            f"| `{_cell(r.entry)}` | {_cell(r.bad)} | `{r.error.__name__}` | {_cell(r.unchanged)} |" for r in chosen
        ]
    return "\n".join(lines) + "\n"


def _row_id(row: Row) -> str:
    return f"{row.entry} | {row.bad}"


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_each_bad_input_is_refused_with_its_error_and_changes_nothing(row: Row):
    obj = row.make()
    before = row.state(obj)
    with pytest.raises(row.error) as info:
        row.call(obj)
    assert isinstance(info.value, E.KVCacheError)  # a package error, whatever else it is
    assert str(info.value)  # with a message
    assert _same(before, row.state(obj)), f"{row.entry} changed {row.unchanged} while refusing {row.bad}"


def test_the_table_has_a_row_per_area_and_no_duplicate():
    assert {r.area for r in ROWS} == set(AREAS)
    assert len({_row_id(r) for r in ROWS}) == len(ROWS)


def test_docs_bad_input_page_is_the_rendered_table():
    assert DOC.is_file(), "run `python scripts/bad_input_table.py` to write docs/bad-input.md"
    assert DOC.read_text(encoding="utf-8") == render_markdown(), "docs/bad-input.md is stale: run the script"
