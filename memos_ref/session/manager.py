"""SessionManager: the paged memory, the model, the registry of system prompts and memories, and the sessions.

* the same system-prompt version (and tool set) in any session means the same blocks: sessions start from the
  prefix cache; a new version means new blocks, and the old ones become evictable when no session holds them;
* ``manager.build_memory(text)`` computes a memory's KV once (MemOS "activation memory");
  ``manager.new_session(memories=[...])`` starts a session *from* it — sharing its blocks, never writing them;
* ``manager.load(path)`` reads a session saved by ``session.save(path)`` (:mod:`memos_ref.session.persist`);
* ``manager.enable_tiering(store)`` attaches a :class:`~memos_ref.tiering.manager.TierManager`: residency (what
  stays on the device, what moves down) is tiering's policy; the manager pins system prompts, labels blocks by
  segment kind, and relieves pressure by suspending idle sessions when tiering asks.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memos_ref.chat import ByteCodec, ChatCodec, check_text, tool_lines
from memos_ref.errors import ArgumentTypeError, ConfigError, ModelMismatchError, check_index, check_type
from memos_ref.hf import PagedCache
from memos_ref.model.identity import fingerprint as model_identity
from memos_ref.paged.store import PagedKV
from memos_ref.session.persist import (
    manifest_limit,
    parse_manifest,
    read_bounded,
    read_session_tensor,
    session_files,
)
from memos_ref.session.segments import Segment, SegmentKind, SessionLayout
from memos_ref.session.session import CacheSession
from memos_ref.spec import KVSpec

__all__ = ["Memory", "SessionManager"]


@dataclass(frozen=True)
class Memory:
    """A memory's KV, computed once and held by the manager; sessions start from it without writing it."""

    name: str
    token_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    cache: PagedCache
    messages: tuple[dict[str, Any], ...] = ()  # the chat history its segments render (a chat codec's)


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
        if not callable(getattr(model, "kv_spec", None)) or type(getattr(model.config, "vocab_size", None)) is not int:
            raise ArgumentTypeError(
                f"model: expected the package's LlamaForward (memos_ref.model.load_model()), got {type(model).__name__}"
            )
        check_index("num_blocks", num_blocks, lo=1)
        check_index("block_size", block_size, lo=1)
        check_type("fingerprint", fingerprint, (str, type(None)))
        self.model = model
        self.vocab_size: int = model.config.vocab_size
        self.codec: ByteCodec | ChatCodec = _codec(tokenizer, self.vocab_size)
        self.layout = SessionLayout(self.codec)  # the one token layout (memos_ref.session.segments)
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
        self.prefetcher: Any = None  # a tiering.prefetch.MarkovPredictor: enable_tiering(prefetch=...)

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
        self.tiering.set_relief(self)  # under pressure tiering suspends some of suspendable() (its policy)
        for key in self.system_prompts:
            self._pin_system_prompt(key)
        return self.tiering

    def _pin_system_prompt(self, key: tuple[str, str]) -> None:
        ids, _, _ = self.layout.opening((*key, self.system_prompts[key]), None)
        hashes = self.kv.prefix_cache.hashes(ids)
        self.tiering.pin(hashes)
        self.tiering.label(hashes, "system")

    def after_call(self, session: CacheSession) -> None:
        """Called by a session after each call: with prefetch on, learn which session follows which, and bring
        the predicted next one's blocks up."""
        if self.prefetcher is None or self.tiering is None:
            return
        key = str(id(session))
        self.prefetcher.observe(key)
        predicted = self.prefetcher.predict(key)
        nxt = next((s for s in list(self.sessions) if str(id(s)) == predicted), None)
        if nxt is not None and nxt.suspended:
            self.tiering.prefetch(nxt.token_ids, nxt.cache.cache_salt, self.prefetch_max_blocks)

    def suspendable(self) -> list[CacheSession]:
        """Tiering's :class:`~memos_ref.tiering.manager.PressureRelief`: the live sessions holding device blocks
        (open, not suspended). Which to suspend under pressure is tiering's policy (least recently active first,
        after the minimum residency)."""
        return [s for s in list(self.sessions) if not s.closed and not s.suspended]

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
        check_text("text", text)
        with self._lock:
            key = (name, version)
            if key in self.system_prompts and self.system_prompts[key] != text:
                raise ConfigError(f"system prompt {name!r} version {version!r} is already registered with other text")
            self.system_prompts[key] = text
            if self.tiering is not None:
                self._pin_system_prompt(key)

    def encode_segment(
        self, kind: SegmentKind | str, text: str, history: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The tokens of a segment after ``history`` (the chat messages before it; the byte codec ignores it)."""
        return self.layout.segment_ids(kind, text, history or [])

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
        text = None if system is None else (*system, self.system_prompts[system])
        ids, plan, messages = self.layout.opening(text, tools)  # tokenized before a session exists
        session = CacheSession(self, None, [], [])
        if ids:  # a chat session with neither system prompt nor tools starts empty
            session.prefill_segments(ids, plan, messages)
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
        check_text("text", text)
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
                ids = self.encode_segment(SegmentKind.MEMORY, text)
                session = CacheSession(self, None, [], [])
                session.prefill_segments(
                    [*self.layout.prefix_ids(), *ids],
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
        :class:`~memos_ref.errors.ModelMismatchError` for another model or KVSpec, or tokens laid out by another
        codec (a chat session loaded by a manager without its tokenizer, or the reverse); a failed load leaves the
        memory as it was (no block is allocated, none is leaked).
        """
        check_type("path", path, (str, os.PathLike))
        manifest_path, tensor_path = session_files(path)
        manifest = parse_manifest(read_bounded(manifest_path, manifest_limit()), manifest_path, self.vocab_size)
        if manifest["fingerprint"] != self.fingerprint:
            raise ModelMismatchError(
                f"session was saved from model {manifest['fingerprint']}, this manager runs {self.fingerprint}; "
                f"load it with a manager on the model that saved it"
            )
        saved_spec: KVSpec = manifest["spec"]
        if saved_spec.with_(block_size=self.spec.block_size) != self.spec:
            raise ModelMismatchError(f"session KVSpec {saved_spec.to_dict()} does not match {self.spec.to_dict()}")
        tokens: list[int] = manifest["token_ids"]
        # tokens laid out by another codec (a chat template's, saved by a manager with a tokenizer, or the byte
        # codec's) are refused now, not at the next append or generate
        self.codec.check_layout(tokens, [(str(s.kind), s.start, s.stop) for s in manifest["segments"]])
        kv = read_session_tensor(tensor_path, manifest, self.spec)  # [L, 2, H, S, D], validated
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


def _check_new_session_args(system: Any, tools: Any, memories: Any) -> None:
    check_type("system", system, (tuple, type(None)))
    if system is not None and (len(system) != 2 or not all(isinstance(x, str) for x in system)):
        raise ArgumentTypeError(f"system: expected a (name, version) tuple of two str, got {system!r:.80}")
    check_type("tools", tools, (list, tuple, type(None)))
    for i, tool in enumerate(tools or ()):
        check_type(f"tools[{i}]", tool, (str, dict))
    if tools:
        tool_lines(tools)  # JSON-serialisable, valid Unicode: refused before anything is built
    check_type("memories", memories, (list, tuple, type(None)))
    for i, memory in enumerate(memories or ()):
        check_type(f"memories[{i}]", memory, Memory)
