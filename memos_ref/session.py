"""The semantic layer: sessions that know what their tokens are for an agent (seed 000 §3.4, §4.3, §6.3, §6.5).

A :class:`CacheSession` is one agent conversation over the shared paged memory. Its tokens are cut into
:class:`Segment` s — system prompt (name and version), tool descriptions (keyed by a hash of the tool set),
user and assistant turns, tool calls and results, injected memories, summaries — each a token range with its
blocks. A :class:`SessionManager` owns the memory, the model and the registry of system prompts and memories:

* the same system-prompt version (and tool set) in any session means the same blocks: sessions start from the
  prefix cache; a new version means new blocks, and the old ones become evictable when no session holds them;
* ``session.fork(n)`` gives n sub-agents everything so far, sharing blocks;
* ``session.compact(summary)`` builds the summarised session, switches to it atomically, then releases the old
  blocks (observable in ``session.events``);
* ``manager.build_memory(text)`` computes a memory's KV once (MemOS "activation memory");
  ``manager.new_session(memories=[...])`` starts a session *from* it — sharing its blocks, never writing them;
* ``session.save(path)`` / ``manager.load(path)``: safetensors + a JSON manifest with checksums, the model
  fingerprint and the KVSpec; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from memos_ref.chat import ByteCodec, ChatCodec, tool_lines
from memos_ref.errors import (
    ArgumentTypeError,
    ConfigError,
    CorruptCacheError,
    InvalidArgumentError,
    KVCacheError,
    ModelMismatchError,
    OutOfBlocksError,
    UseAfterFreeError,
    check_index,
    check_type,
)
from memos_ref.hf import PagedCache
from memos_ref.model.identity import fingerprint as model_identity
from memos_ref.paged.store import PagedKV
from memos_ref.spec import KVSpec

__all__ = ["CacheSession", "Memory", "Segment", "SegmentKind", "SessionManager"]

MANIFEST_VERSION = 2


class SegmentKind(StrEnum):
    SYSTEM = "system"
    TOOLS = "tools"
    MEMORY = "memory"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    SUMMARY = "summary"


_SEGMENT_KIND_VALUES = frozenset(kind.value for kind in SegmentKind)


@dataclass(frozen=True)
class Segment:
    """A token range ``[start, stop)`` of a session and what it is."""

    kind: SegmentKind
    seg_id: str
    start: int
    stop: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "seg_id": self.seg_id, "start": self.start, "stop": self.stop}


@dataclass(frozen=True)
class Memory:
    """A memory's KV, computed once and held by the manager; sessions start from it without writing it."""

    name: str
    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    cache: PagedCache
    messages: tuple[dict[str, Any], ...] = ()  # the chat history its segments render (a chat codec's)


def tool_set_key(tools: list[Any]) -> str:
    """Order-independent id of a tool set (tool sets are shared across sessions by this key); a tool is a
    string or a JSON-schema dict (keyed by its sorted-key JSON)."""
    return hashlib.sha256("\x00".join(tool_lines(tools)).encode()).hexdigest()[:12]


#: Largest session manifest read (bytes): room for about four million token ids.
MAX_MANIFEST_BYTES = 32 << 20
#: Largest safetensors header accepted in a session tensor file, beyond the tensor's own bytes.
MAX_TENSOR_HEADER_BYTES = 64 << 10
_MANIFEST_FIELDS = frozenset(
    {"format", "version", "fingerprint", "kv_spec", "token_ids", "segments", "sha256", "bytes", "manifest_sha256"}
)
_SEGMENT_FIELDS = frozenset({"kind", "seg_id", "start", "stop"})


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces, ASCII) of every manifest field but
    ``manifest_sha256`` itself."""
    return hashlib.sha256(_canonical_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def _read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; anything else (a FIFO, a device, a directory,
    a larger file, a file that grows while read) is refused with :class:`CorruptCacheError`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise CorruptCacheError(f"cannot open {path}: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise CorruptCacheError(f"{path} holds {info.st_size} bytes, more than the {limit} expected at most")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:
            raise CorruptCacheError(f"cannot read {path}: {exc}") from None
    if len(data) > limit:
        raise CorruptCacheError(f"{path} grew past {limit} bytes while being read")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_manifest(raw: bytes, where: Path, vocab_size: int) -> dict[str, Any]:
    """Parse and validate a session manifest; returns its fields plus ``spec`` (a :class:`KVSpec`) and
    ``segments`` as :class:`Segment` objects. Raises :class:`CorruptCacheError` naming the bad field."""

    def bad(what: str) -> CorruptCacheError:
        return CorruptCacheError(f"{where}: {what}")

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        manifest = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"cannot read the session manifest: {str(exc)[:200]}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "memos-ref-session":
        raise bad("is not a memos-ref session manifest (format 'memos-ref-session')")
    if manifest.get("version") != MANIFEST_VERSION:
        raise bad(
            f"manifest version {manifest.get('version')!r} is not {MANIFEST_VERSION} (earlier versions are not "
            f"checksummed as a whole and are refused: save the session again with this version)"
        )
    if set(manifest) != _MANIFEST_FIELDS:
        raise bad(f"manifest fields {sorted(manifest)} are not the expected {sorted(_MANIFEST_FIELDS)}")
    if manifest["manifest_sha256"] != manifest_checksum(manifest):
        raise bad("the manifest does not match its checksum (modified or damaged)")
    # The checksum only proves the manifest is intact, not that it was written by this package: check every field.
    fingerprint = manifest["fingerprint"]
    if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= 256:
        raise bad(f"fingerprint must be a non-empty string of at most 256 characters, got {fingerprint!r:.80}")
    digest = manifest["sha256"]
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise bad(f"sha256 must be 64 lowercase hex digits, got {digest!r:.80}")
    if not _is_int(manifest["bytes"]) or manifest["bytes"] < 0:
        raise bad(f"bytes must be a non-negative int, got {manifest['bytes']!r:.80}")
    spec_dict = manifest["kv_spec"]
    try:
        if not isinstance(spec_dict, dict):
            raise TypeError(f"expected an object, got {type(spec_dict).__name__}")
        spec = KVSpec.from_dict(spec_dict)
    except (KVCacheError, KeyError, TypeError, ValueError, OverflowError) as exc:
        raise bad(f"kv_spec is malformed: {exc}") from None
    if spec.to_dict() != spec_dict:
        raise bad(f"kv_spec {spec_dict} is not what KVSpec.to_dict() writes: {spec.to_dict()}")
    tokens = manifest["token_ids"]
    if not isinstance(tokens, list) or not tokens:
        raise bad(f"token_ids must be a non-empty list, got {type(tokens).__name__}")
    for i, t in enumerate(tokens):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise bad(f"token_ids[{i}] must be an int in [0, {vocab_size}), got {t!r:.80}")
    manifest["spec"] = spec
    manifest["segments"] = _parse_segments(manifest["segments"], len(tokens), bad)
    return manifest


def _parse_segments(raw: Any, num_tokens: int, bad: Callable[[str], CorruptCacheError]) -> list[Segment]:
    """Segments in order, without overlap, inside ``[0, num_tokens]``."""
    if not isinstance(raw, list):
        raise bad(f"segments must be a list, got {type(raw).__name__}")
    segments: list[Segment] = []
    previous_stop = 0
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != _SEGMENT_FIELDS:
            raise bad(f"segments[{i}] must be an object with fields {sorted(_SEGMENT_FIELDS)}, got {item!r:.120}")
        kind, seg_id, start, stop = item["kind"], item["seg_id"], item["start"], item["stop"]
        if not isinstance(kind, str) or kind not in _SEGMENT_KIND_VALUES:
            raise bad(f"segments[{i}].kind must be one of {[k.value for k in SegmentKind]}, got {kind!r:.80}")
        if not isinstance(seg_id, str) or len(seg_id) > 4096:
            raise bad(f"segments[{i}].seg_id must be a string of at most 4096 characters, got {seg_id!r:.80}")
        if not (_is_int(start) and _is_int(stop) and previous_stop <= start <= stop <= num_tokens):
            raise bad(
                f"segments[{i}] range [{start!r:.20}, {stop!r:.20}) must be ints with {previous_stop} <= start "
                f"<= stop <= {num_tokens} (segments in order, inside the session's tokens)"
            )
        segments.append(Segment(SegmentKind(kind), seg_id, start, stop))
        previous_stop = stop
    return segments


def _read_session_tensor(path: Path, manifest: dict[str, Any], spec: KVSpec) -> torch.Tensor:
    """The KV ``[L, 2, H, S, D]`` of a session file, checked against its manifest before and after parsing:
    size bounded by the geometry, checksum, exactly one tensor, the manifest's dtype (never converted) and
    shape, finite values."""
    expected = (spec.num_layers, 2, spec.num_kv_heads, len(manifest["token_ids"]), spec.head_dim)
    payload = math.prod(expected) * spec.bytes_per_element
    declared = manifest["bytes"]
    if not payload + 8 <= declared <= payload + 8 + MAX_TENSOR_HEADER_BYTES:
        raise CorruptCacheError(
            f"{path}: the manifest declares {declared} bytes, but KV of shape {expected} in {spec.dtype} takes "
            f"{payload} bytes plus a header of at most {MAX_TENSOR_HEADER_BYTES}"
        )
    data = _read_bounded(path, declared)
    if len(data) != declared or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise CorruptCacheError(f"{path} does not match its checksum (truncated or modified)")
    try:
        tensors = safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptCacheError(f"{path} is not a readable session tensor file: {str(exc)[:200]}") from None
    if set(tensors) != {"kv"}:
        raise CorruptCacheError(f"{path} must hold exactly one tensor 'kv', holds {sorted(tensors)}")
    kv = tensors["kv"]
    if kv.dtype != spec.dtype:
        raise CorruptCacheError(
            f"{path}: stored KV is {kv.dtype}, the manifest says {spec.dtype}; refusing to convert it"
        )
    if tuple(kv.shape) != expected:
        raise CorruptCacheError(f"{path}: stored KV has shape {tuple(kv.shape)}, the manifest implies {expected}")
    if kv.is_floating_point() and not bool(torch.isfinite(kv).all()):
        raise CorruptCacheError(f"{path}: stored KV holds NaN or infinite values")
    return kv


class SessionManager:
    """Owns the paged memory, the model (the package's forward), and the system prompts and memories.

    Args:
        model: a :class:`~memos_ref.model.llama.LlamaForward`.
        num_blocks: pool size in blocks (block size 16).
        fingerprint: model fingerprint for prefix hashing and saved files (default: computed from the weights).
        tokenizer: ``None`` for the shipped byte-level model (its marker tokens); for a real chat model, its
            transformers tokenizer (or a :class:`~memos_ref.chat.ChatCodec`): segments are then rendered
            through the model's chat template, one message each, with exact token boundaries, and replies stop
            at the end-of-turn token (see :mod:`memos_ref.chat`).
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int = 1024,
        *,
        block_size: int = 16,
        fingerprint: str | None = None,
        tokenizer: Any = None,
    ):
        if not callable(getattr(model, "kv_spec", None)) or not _is_int(getattr(model.config, "vocab_size", None)):
            raise ArgumentTypeError(
                f"model: expected the package's LlamaForward (memos_ref.model.load_model()), got {type(model).__name__}"
            )
        check_index("num_blocks", num_blocks, lo=1)
        check_index("block_size", block_size, lo=1)
        check_type("fingerprint", fingerprint, (str, type(None)))
        self.model = model
        self.vocab_size: int = model.config.vocab_size
        self.codec: ByteCodec | ChatCodec = _codec(tokenizer, self.vocab_size)
        self.tok: Any = self.codec.tok  # the ByteTokenizer, or the transformers tokenizer
        if fingerprint is None:
            fingerprint = self.fingerprint_of(model)
        self.fingerprint = fingerprint
        self.spec: KVSpec = model.kv_spec(block_size=block_size)
        self.kv = PagedKV(self.spec, num_blocks, fingerprint=fingerprint)
        self.system_prompts: dict[tuple[str, str], str] = {}
        self.memories: dict[str, Memory] = {}
        self._lock = threading.RLock()
        self.sessions: weakref.WeakSet[CacheSession] = weakref.WeakSet()
        self.tiering: Any = None  # a TierManager, after enable_tiering()
        self.prefetcher: Any = None  # a tiering.simulate.MarkovPredictor: enable_tiering(prefetch=...)

    @property
    def clock(self) -> Callable[[], float]:
        return self.tiering.clock if self.tiering is not None else time.monotonic

    def enable_tiering(self, store: Any, **options: Any) -> Any:
        """Attach a :class:`~memos_ref.tiering.manager.TierManager` over ``store`` (``options`` go to it):
        system prompts are pinned, blocks are labelled by segment kind for the ``priority`` policy, and under
        pressure idle sessions are suspended (their blocks become cached, then move to the tiers); a suspended
        session resumes by itself on its next call, reloading its blocks or recomputing them.

        ``prefetch=MarkovPredictor(window, threshold)`` (and ``prefetch_max_blocks``, default 8) brings the
        likely next session's blocks up from the tiers after each call (seed 001 §3.1)."""
        from memos_ref.tiering.manager import TierManager

        self.prefetcher = options.pop("prefetch", None)
        self.prefetch_max_blocks = options.pop("prefetch_max_blocks", 8)
        self.tiering = TierManager(self.kv, store, **options)
        self.tiering.on_pressure = self._suspend_idle
        for key in self.system_prompts:
            self._pin_system_prompt(key)
        return self.tiering

    def _pin_system_prompt(self, key: tuple[str, str]) -> None:
        ids = [*self.codec.prefix_ids(), *self._encode(SegmentKind.SYSTEM, self.system_prompts[key])]
        hashes = self.kv.prefix_cache.hashes(ids)
        self.tiering.pin(hashes)
        self.tiering.label(hashes, "system")

    def _after_call(self, session: CacheSession) -> None:
        """Prefetch: learn which session follows which, and bring the predicted next one's blocks up."""
        if self.prefetcher is None or self.tiering is None:
            return
        key = str(id(session))
        self.prefetcher.observe(key)
        predicted = self.prefetcher.predict(key)
        nxt = next((s for s in list(self.sessions) if str(id(s)) == predicted), None)
        if nxt is not None and nxt.suspended:
            self.tiering.prefetch(nxt.token_ids, nxt.cache.cache_salt, self.prefetch_max_blocks)

    def _suspend_idle(self, blocks_wanted: int) -> int:
        """Suspend the least recently active sessions idle for at least the minimum residency until about
        ``blocks_wanted`` blocks were released; returns how many were."""
        now = self.clock()
        idle = [
            s
            for s in list(self.sessions)
            if not s.closed and not s.suspended and now - s.last_active >= self.tiering.min_residency
        ]
        released = 0
        for session in sorted(idle, key=lambda s: s.last_active):
            if released >= blocks_wanted:
                break
            released += session.suspend(blocking=False)
        return released

    @staticmethod
    def fingerprint_of(model: Any) -> str:
        """The model's fingerprint: an alias of :func:`memos_ref.model.identity.fingerprint` (the same id as
        ``memos_ref.model.model_fingerprint()`` gives for the same weights by any route)."""
        return model_identity(model)

    # ------------------------------------------------------------------ registry
    def register_system_prompt(self, name: str, version: str, text: str) -> None:
        """Record a system prompt version; sessions refer to it by (name, version)."""
        check_type("name", name, str)
        check_type("version", version, str)
        check_type("text", text, str)
        with self._lock:
            key = (name, version)
            if key in self.system_prompts and self.system_prompts[key] != text:
                raise ConfigError(f"system prompt {name!r} version {version!r} is already registered with other text")
            self.system_prompts[key] = text
            if self.tiering is not None:
                self._pin_system_prompt(key)

    def _encode(self, kind: SegmentKind, text: str, history: list[dict[str, Any]] | None = None) -> list[int]:
        """The tokens of a segment after ``history`` (the chat messages before it; the byte codec ignores it)."""
        return self.codec.segment_ids(str(kind), text, history or [])

    def new_session(
        self,
        system: tuple[str, str] | None = None,
        tools: list[str] | None = None,
        memories: list[Memory] | None = None,
    ) -> CacheSession:
        """A session starting with a registered system prompt, a tool set, and/or memories (in that order of
        preference: memories already contain what was before them)."""
        _check_new_session_args(system, tools, memories)
        if memories:
            base = memories[-1]
            names = [m.name for m in memories]
            if names != self._chain(base):
                raise ConfigError(
                    f"memories {names} must be injected as they were built, in order: {self._chain(base)}"
                )
            if system or tools:
                raise ConfigError("a session started from memories takes its prefix from them")
            session = CacheSession(
                self, base.cache.fork(), list(base.token_ids), list(base.segments), list(base.messages)
            )
            session.prefill_reused = len(base.token_ids)
            return session
        if system is not None and system not in self.system_prompts:
            raise ConfigError(f"system prompt {system} is not registered: {sorted(self.system_prompts)}")
        session = CacheSession(self, None, [], [])
        ids: list[int] = self.codec.prefix_ids()
        plan: list[tuple[SegmentKind, str, list[int]]] = []
        messages: list[dict[str, Any]] = []
        parts = []
        if system is not None:
            parts.append((SegmentKind.SYSTEM, f"{system[0]}@{system[1]}", self.system_prompts[system]))
        if tools:
            parts.append((SegmentKind.TOOLS, tool_set_key(tools), self.codec.tools_text(tools)))
        for kind, seg_id, text in parts:
            plan.append((kind, seg_id, self._encode(kind, text, messages)))
            messages.append(self.codec.message(str(kind), text))
        for _, _, seg_ids in plan:
            ids.extend(seg_ids)
        if ids:  # a chat session with neither system prompt nor tools starts empty
            session._prefill(ids, plan, messages)
        return session

    def build_memory(
        self,
        name: str,
        text: str,
        after: Memory | None = None,
        *,
        system: tuple[str, str] | None = None,
        tools: list[Any] | None = None,
    ) -> Memory:
        """Compute a memory's KV once (after ``after``'s, when memories are meant to be used together).

        ``system`` / ``tools`` put a registered system prompt and a tool set before the first memory (their
        blocks are shared with every other session that has them, through the prefix cache); sessions started
        from the memory then have them too. A memory built ``after`` another takes its prefix from it."""
        check_type("name", name, str)
        check_type("text", text, str)
        check_type("after", after, (Memory, type(None)))
        _check_new_session_args(system, tools, None)
        with self._lock:
            if name in self.memories:
                raise ConfigError(f"a memory named {name!r} already exists")
            if after is not None and (system is not None or tools):
                raise ConfigError("a memory built after another takes its system prompt and tools from it")
            if system is not None and system not in self.system_prompts:
                raise ConfigError(f"system prompt {system} is not registered: {sorted(self.system_prompts)}")
            if after is None and system is None and not tools:
                ids = self._encode(SegmentKind.MEMORY, text)
                session = CacheSession(self, None, [], [])
                session._prefill(
                    [*self.codec.prefix_ids(), *ids],
                    [(SegmentKind.MEMORY, name, ids)],
                    [self.codec.message("memory", text)],
                )
            else:
                if after is None:
                    session = self.new_session(system, tools)
                else:
                    session = self.new_session(memories=[*self._memories_of(after), after])
                try:
                    session.append(SegmentKind.MEMORY, name, text)
                except BaseException:
                    session.close()
                    raise
            memory = Memory(
                name, tuple(session.token_ids), tuple(session.segment_list), session.cache, tuple(session.messages)
            )
            self.memories[name] = memory
            return memory

    def _chain(self, memory: Memory) -> list[str]:
        return [s.seg_id for s in memory.segments if s.kind == SegmentKind.MEMORY]

    def _memories_of(self, memory: Memory) -> list[Memory]:
        return [self.memories[n] for n in self._chain(memory)[:-1]]

    # ------------------------------------------------------------------ persistence
    def load(self, path: str | os.PathLike[str]) -> CacheSession:
        """Load a session saved by :meth:`CacheSession.save`.

        Both files are untrusted: their sizes are bounded before they are read, the manifest's checksum covers
        every field, and every field (types, lengths, token ids in the vocabulary, segment ranges, the KVSpec,
        the tensor's dtype and shape) is checked before a block is allocated. Raises
        :class:`~memos_ref.errors.CorruptCacheError` for a damaged or malformed file and
        :class:`~memos_ref.errors.ModelMismatchError` for another model or KVSpec; a failed load leaves the
        memory as it was (no block is allocated, none is leaked).
        """
        check_type("path", path, (str, os.PathLike))
        path = Path(path)
        manifest_path, tensor_path = path.with_suffix(".json"), path.with_suffix(".safetensors")
        manifest = _parse_manifest(_read_bounded(manifest_path, MAX_MANIFEST_BYTES), manifest_path, self.vocab_size)
        if manifest["fingerprint"] != self.fingerprint:
            raise ModelMismatchError(
                f"session was saved from model {manifest['fingerprint']}, this manager runs {self.fingerprint}; "
                f"load it with a manager on the model that saved it"
            )
        saved_spec: KVSpec = manifest["spec"]
        if saved_spec.with_(block_size=self.spec.block_size) != self.spec:
            raise ModelMismatchError(f"session KVSpec {saved_spec.to_dict()} does not match {self.spec.to_dict()}")
        kv = _read_session_tensor(tensor_path, manifest, self.spec)  # [L, 2, H, S, D], validated
        tokens: list[int] = manifest["token_ids"]
        # Loaded KV is salted by its file's checksum: it serves this session and its forks, but a file can never
        # plant blocks that other sessions would find by prefix.
        cache = PagedCache(self.kv, cache_salt=f"loaded:{manifest['sha256']}")
        try:
            for layer in range(self.spec.num_layers):
                cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
            cache.set_token_ids(torch.tensor([tokens]))
        except BaseException:
            cache.free()  # roll back: nothing of a failed load stays allocated
            raise
        # a chat history known by roles only: enough for the template to render what comes next
        messages = [self.codec.message(str(seg.kind), "") for seg in manifest["segments"]]
        return CacheSession(self, cache, list(tokens), manifest["segments"], messages)

    def stats(self) -> dict[str, Any]:
        return self.kv.stats()


def _codec(tokenizer: Any, vocab_size: int) -> ByteCodec | ChatCodec:
    """The codec for ``tokenizer``: the byte codec for ``None``, else a chat codec whose ids fit the model."""
    if tokenizer is None:
        return ByteCodec()
    codec = tokenizer if isinstance(tokenizer, (ByteCodec, ChatCodec)) else ChatCodec(tokenizer)
    size = len(codec.tok)
    if size > vocab_size:
        raise ConfigError(
            f"tokenizer has {size} tokens but the model's vocabulary is {vocab_size}: use the model's own tokenizer"
        )
    return codec


def _segment_kind(kind: Any) -> SegmentKind:
    """``kind`` as a :class:`SegmentKind` (its value as a string is accepted too)."""
    check_type("kind", kind, (SegmentKind, str))
    if kind not in _SEGMENT_KIND_VALUES:
        raise InvalidArgumentError(f"kind: expected one of {[k.value for k in SegmentKind]}, got {kind!r:.80}")
    return SegmentKind(kind)


def _check_new_session_args(system: Any, tools: Any, memories: Any) -> None:
    check_type("system", system, (tuple, type(None)))
    if system is not None and (len(system) != 2 or not all(isinstance(x, str) for x in system)):
        raise ArgumentTypeError(f"system: expected a (name, version) tuple of two str, got {system!r:.80}")
    check_type("tools", tools, (list, tuple, type(None)))
    for i, tool in enumerate(tools or ()):
        check_type(f"tools[{i}]", tool, (str, dict))
    check_type("memories", memories, (list, tuple, type(None)))
    for i, memory in enumerate(memories or ()):
        check_type(f"memories[{i}]", memory, Memory)


class CacheSession:
    """One agent conversation: a paged cache, its tokens, and the segments that say what they are."""

    def __init__(
        self,
        manager: SessionManager,
        cache: PagedCache | None,
        token_ids: list[int],
        segments: list[Segment],
        messages: list[dict[str, Any]] | None = None,
    ):
        self.manager = manager
        self.cache = cache if cache is not None else PagedCache(manager.kv)
        self.token_ids = token_ids
        self.segment_list = segments  # the Segment objects, in order; segments() describes them
        self.messages: list[dict[str, Any]] = messages if messages is not None else []  # one per segment
        self.last_reply: dict[str, Any] = {}  # prompt_tokens, new_tokens, ttft_s, stopped of the last generate()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.prefill_computed = 0  # tokens actually run through the model
        self.prefill_reused = 0  # tokens taken from the prefix cache or a memory
        self.closed = False
        self.suspended = False
        self.last_active = manager.clock()
        self.resumed_reused = 0  # tokens restored from the device cache or a tier on resume
        self.resumed_computed = 0  # tokens recomputed on resume
        self._lock = threading.RLock()
        manager.sessions.add(self)

    def _check_open(self) -> None:
        if self.closed:
            raise UseAfterFreeError("this session was closed; start a new one (or fork() before closing)")
        with self._lock:
            self.last_active = self.manager.clock()
            if self.suspended:
                self._resume()
            tiering = self.manager.tiering
            if tiering is not None and self.cache.sequences:
                tiering.touch(self.cache.sequences[0].block_table, self.last_active)

    # ------------------------------------------------------------------ suspend and resume (tiering)
    def suspend(self, blocking: bool = True) -> int:
        """Release this session's device blocks; its full blocks stay cached (and may move to a tier). The
        next call resumes it. Returns how many blocks were released (0 when ``blocking`` is False and the
        session is busy in another thread: a busy session is not idle)."""
        if not self._lock.acquire(blocking=blocking):
            return 0
        try:
            if self.closed or self.suspended or not self.cache.sequences:
                return 0
            active_before = self.manager.kv.allocator.num_active
            self.cache.set_token_ids(torch.tensor([self.token_ids]))
            self.cache.free()
            released = active_before - self.manager.kv.allocator.num_active  # shared blocks stay active
            self.suspended = True
            self.events.append(("suspended", {"blocks": released, "tokens": len(self.token_ids)}))
            return released
        finally:
            self._lock.release()

    def _resume(self) -> None:
        """Rebuild the cache from the device prefix cache, the tiers, and recomputation, in that order."""
        ids = self.token_ids
        hit, reused = self._build(ids)
        self.cache = hit
        self.suspended = False
        self.resumed_reused += reused
        self.resumed_computed += len(ids) - reused
        if self.manager.tiering is not None:
            self.manager.tiering.counts["recomputed_tokens"] += len(ids) - reused
        self.events.append(("resumed", {"reused": reused, "recomputed": len(ids) - reused}))

    def _rollback(self) -> None:
        """After a failed step, cut the cache back to the tokens the session records (all layers agree)."""
        seq = self.cache.sequences[0] if self.cache.sequences else None
        if seq is None:
            return
        seq.layer_tokens = [min(n, len(self.token_ids)) for n in seq.layer_tokens]
        seq.num_tokens = max(seq.layer_tokens)
        seq.truncate(min(len(self.token_ids), seq.num_tokens))

    # ------------------------------------------------------------------ building
    def _build(self, ids: list[int]) -> tuple[PagedCache, int]:
        """A new cache holding ``ids``: the cached prefix (device, then tiers) reused, the rest computed.
        Returns it and how many tokens were reused; on failure nothing stays referenced."""
        hit = PagedCache.from_prefix(self.manager.kv, torch.tensor([ids]), cache_salt=self.cache.cache_salt)
        reused = hit.get_seq_length()
        try:
            with torch.no_grad():
                self.manager.model(torch.tensor([ids[reused:]]), hit)
            hit.set_token_ids(torch.tensor([ids]))
        except Exception:
            hit.free()
            raise
        return hit, reused

    def _prefill(
        self, ids: list[int], plan: list[tuple[SegmentKind, str, list[int]]], messages: list[dict[str, Any]]
    ) -> None:
        """Fill an empty session with ``ids`` (the codec's prefix, e.g. BOS, + planned segments), reusing cached
        prefix blocks; ``messages`` is the chat history the segments render."""
        hit, reused = self._build(ids)
        self.cache.free()
        self.cache = hit
        self.token_ids = list(ids)
        self.messages = list(messages)
        pos = len(ids) - sum(len(seg_ids) for _, _, seg_ids in plan)
        for kind, seg_id, seg_ids in plan:
            self.segment_list.append(Segment(kind, seg_id, pos, pos + len(seg_ids)))
            pos += len(seg_ids)
        self.prefill_reused += reused
        self.prefill_computed += len(ids) - reused
        tiering = self.manager.tiering
        if tiering is not None:
            t = self.manager.spec.block_size
            kinds = {"system": "system", "tools": "tools", "memory": "memory"}
            for i, h in enumerate(self.manager.kv.prefix_cache.hashes(ids, self.cache.cache_salt)):
                end = (i + 1) * t - 1  # a block belongs to the segment of its last token
                seg = next((x for x in self.segment_list if x.start <= end < x.stop), None)
                tiering.label([h], kinds.get(str(seg.kind) if seg else "", "turn"))

    def _with_room(self, op: Callable[[], Any]) -> Any:
        """Run ``op``; if the pool ran out of blocks and tiering is on, make room (suspending idle sessions,
        moving cached blocks down) and try once more."""
        tiering = self.manager.tiering
        if tiering is not None and tiering.utilization() > tiering.high:
            tiering.step()  # make room before this call allocates (outside this session's lock: may suspend it)
        try:
            result = op()
        except OutOfBlocksError:
            if tiering is None:
                raise
            tiering.step()
            result = op()
        self.manager._after_call(self)
        return result

    def append(self, kind: SegmentKind, seg_id: str, text: str) -> Segment:
        """Add a segment (a user turn, a tool result, …): its tokens are prefilled into the cache."""
        kind = _segment_kind(kind)
        check_type("seg_id", seg_id, str)
        check_type("text", text, str)
        self._refuse_closed()
        return self._with_room(lambda: self._append(kind, seg_id, text))

    def _append(self, kind: SegmentKind, seg_id: str, text: str) -> Segment:
        with self._lock, torch.no_grad():  # held from the resume check to the end: nobody suspends us midway
            self._check_open()
            ids = self.manager._encode(SegmentKind(kind), text, self.messages)
            message = self.manager.codec.message(str(kind), text)
            if not self.token_ids:  # an empty chat session: its first segment may come from the prefix cache
                self._prefill(ids, [(SegmentKind(kind), seg_id, ids)], [message])
                return self.segment_list[-1]
            start = len(self.token_ids)
            try:
                self.manager.model(torch.tensor([ids]), self.cache)
            except Exception:
                self._rollback()
                raise
            self.token_ids.extend(ids)
            self.cache.set_token_ids(torch.tensor([self.token_ids]))
            segment = Segment(SegmentKind(kind), seg_id, start, start + len(ids))
            self.segment_list.append(segment)
            self.messages.append(message)
            self.prefill_computed += len(ids)
            return segment

    def generate(self, max_new_tokens: int, seg_id: str = "reply") -> str:
        """Greedy continuation as an assistant turn; returns its text.

        With a chat codec the reply starts with the template's generation prompt, stops at the end-of-turn token
        (or after ``max_new_tokens``) and is closed as the template renders an assistant message, so the session
        holds exactly the rendered conversation; the returned text has no special tokens. ``last_reply`` records
        the prompt length, the new tokens, whether a stop token ended it, and the time to the first token."""
        check_index("max_new_tokens", max_new_tokens, lo=0)
        check_type("seg_id", seg_id, str)
        self._refuse_closed()
        return self._with_room(lambda: self._generate(max_new_tokens, seg_id))

    def _generate(self, max_new_tokens: int, seg_id: str) -> str:
        codec, model = self.manager.codec, self.manager.model
        with self._lock, torch.no_grad():
            started = time.perf_counter()
            self._check_open()
            marker = codec.reply_prefix_ids(self.messages)
            start = len(self.token_ids)
            new: list[int] = []
            ttft, stopped = None, False
            try:
                logits = model(torch.tensor([marker]), self.cache)
                for i in range(max_new_tokens):
                    nxt = int(logits[0, -1].argmax())
                    new.append(nxt)
                    ttft = time.perf_counter() - started if ttft is None else ttft
                    stopped = nxt in codec.stop_ids
                    if stopped:
                        break
                    if i + 1 < max_new_tokens:
                        logits = model(torch.tensor([[nxt]]), self.cache)
                content = codec.decode(new[:-1] if stopped else new)
                close = codec.reply_suffix_ids(self.messages, content, stopped)
                # the last generated token is not yet in the cache: feed it (and the turn's closing tokens)
                tail = new[-1:] + close
                if tail:
                    model(torch.tensor([tail]), self.cache)
            except Exception:
                self._rollback()  # the session stays as it was before the call
                raise
            self.token_ids.extend(marker + new + close)
            self.cache.set_token_ids(torch.tensor([self.token_ids]))
            self.segment_list.append(Segment(SegmentKind.ASSISTANT, seg_id, start, len(self.token_ids)))
            self.messages.append(codec.message("assistant", content))
            self.last_reply = {
                "prompt_tokens": start + len(marker),
                "new_tokens": len(new),
                "stopped": stopped,
                "ttft_s": ttft,
            }
            return content

    # ------------------------------------------------------------------ agent operations
    def fork(self, n: int = 1) -> list[CacheSession]:
        """n sub-agent sessions sharing everything so far (blocks are shared, not copied)."""
        check_index("n", n, lo=0)
        with self._lock:
            self._check_open()
            return [
                CacheSession(
                    self.manager, self.cache.fork(), list(self.token_ids), list(self.segment_list), list(self.messages)
                )
                for _ in range(n)
            ]

    def compact(self, summary_text: str) -> None:
        """Replace the conversation after the system prompt and tools by a summary (seed 000 §6.3).

        The summarised session is built first (the system prompt and tools come from the prefix cache), then
        swapped in under the lock, and only then are the old blocks released — so the two sets coexist only
        for the build and the switch, and readers never see a half-built session. ``events`` records each
        step with block counts.
        """
        check_type("summary_text", summary_text, str)
        with self._lock:
            self._check_open()
            keep = []  # the leading system prompt, tools and memories stay; everything after is summarised
            for s in self.segment_list:
                if s.kind not in (SegmentKind.SYSTEM, SegmentKind.TOOLS, SegmentKind.MEMORY):
                    break
                keep.append(s)
            stop = keep[-1].stop if keep else len(self.manager.codec.prefix_ids())
            kept_messages = self.messages[: len(keep)]
            summary_ids = self.manager._encode(SegmentKind.SUMMARY, summary_text, kept_messages)
            ids = self.token_ids[:stop] + summary_ids
            fresh = CacheSession(self.manager, None, [], [])
            plan = [(s.kind, s.seg_id, self.token_ids[s.start : s.stop]) for s in keep]
            plan.append((SegmentKind.SUMMARY, "summary", summary_ids))
            before = self.manager.kv.allocator.num_active
            fresh._prefill(ids, plan, [*kept_messages, self.manager.codec.message("summary", summary_text)])
            self.events.append(
                (
                    "compact_built",
                    {
                        "blocks_active": self.manager.kv.allocator.num_active,
                        "blocks_before": before,
                        "time": time.perf_counter(),
                    },
                )
            )
            old = self.cache
            self.cache, self.token_ids, self.segment_list = fresh.cache, fresh.token_ids, fresh.segment_list
            self.messages = fresh.messages
            self.events.append(("switched", {"tokens": len(self.token_ids), "time": time.perf_counter()}))
            released = sum(seq.num_blocks for seq in old.sequences)
            old.free()
            self.events.append(
                (
                    "released",
                    {
                        "blocks": released,
                        "blocks_active": self.manager.kv.allocator.num_active,
                        "time": time.perf_counter(),
                    },
                )
            )
            self.prefill_computed += fresh.prefill_computed
            self.prefill_reused += fresh.prefill_reused

    def close(self) -> None:
        """Release the session's blocks (prefix-registered ones stay cached for reuse). Closing twice is a
        no-op; any other call on a closed session raises :class:`~memos_ref.errors.UseAfterFreeError`."""
        with self._lock:
            self.cache.free()
            self.closed = True

    def _refuse_closed(self) -> None:
        if self.closed:
            raise UseAfterFreeError("this session was closed; start a new one (or fork() before closing)")

    # ------------------------------------------------------------------ inspection and persistence
    def segments(self) -> list[dict[str, Any]]:
        """The segments — kind, id, token range — with their block ids and residency."""
        with self._lock:
            self._refuse_closed()
            if self.suspended:
                self._check_open()
            return self._segments()

    def blocks_shared(self) -> int:
        """How many of this session's blocks another sequence holds too (refcount above one)."""
        with self._lock:
            self._refuse_closed()
            if self.suspended or not self.cache.sequences:
                return 0
            refcount = self.manager.kv.allocator.refcount
            return sum(1 for block in set(self.cache.sequences[0].block_table) if refcount[block] > 1)

    def _segments(self) -> list[dict[str, Any]]:
        seq = self.cache.sequences[0]
        t = self.manager.spec.block_size
        return [
            {
                **s.to_dict(),
                "tokens": s.stop - s.start,
                "blocks": sorted({seq.block_table[p // t] for p in range(s.start, min(s.stop, seq.num_tokens))}),
                "residency": "device",
            }
            for s in self.segment_list
        ]

    def save(self, path: str | Path) -> Path:
        """Write ``path.safetensors`` (K/V ``[L, 2, H, S, D]``) and ``path.json`` (manifest; its
        ``manifest_sha256`` covers every other field, ``sha256`` the tensor file)."""
        check_type("path", path, (str, os.PathLike))
        with self._lock:
            self._refuse_closed()
            if self.suspended:
                self._check_open()
            return self._save(Path(path))

    def _save(self, path: Path) -> Path:
        seq = self.cache.sequences[0]
        kv = torch.stack([torch.stack(seq.to_dense(layer)) for layer in range(self.manager.spec.num_layers)])
        tensor_path = path.with_suffix(".safetensors")
        data = safetensors_save({"kv": kv.contiguous()})
        tensor_path.write_bytes(data)
        manifest: dict[str, Any] = {
            "format": "memos-ref-session",
            "version": MANIFEST_VERSION,
            "fingerprint": self.manager.fingerprint,
            "kv_spec": self.manager.spec.to_dict(),
            "token_ids": self.token_ids[: seq.num_tokens],
            "segments": [s.to_dict() for s in self.segment_list if s.stop <= seq.num_tokens],
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
        }
        manifest["manifest_sha256"] = manifest_checksum(manifest)
        path.with_suffix(".json").write_text(json.dumps(manifest))
        return path
