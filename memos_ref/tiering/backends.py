"""Storage backends for KV blocks below the device pool: host memory, disk, Redis — one interface.

A backend stores opaque bytes (:mod:`memos_ref.tiering.blockfile` makes and checks them) under validated keys:
``put``, ``get``, ``delete``, ``contains``, ``keys``, ``stats`` and batched ``put_many`` / ``get_many``. Each
has a byte budget and evicts its least recently used blocks to stay inside it — handing each to ``on_evict``
first, so the tier store can demote it to the next tier (Redis: its own ``maxmemory`` policy, plus an optional
TTL).

What a backend reads is untrusted (another process, or anyone with write access to the directory or the
server, may have put it there): reads are bounded by ``max_item_bytes`` (the tier store sets it to the largest
block file its geometry allows) and a copy that cannot be a block — too large, not a regular file, a symlink —
is answered as a miss and counted ``corrupt``. Nothing raises into the caller for what it finds stored.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import secrets
import socket
import stat
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, StateError, check_type
from memos_ref.lru import SizedLRU
from memos_ref.resilient import (
    DEFAULT_FAILURE_THRESHOLD,
    DEFAULT_TIMEOUT_S,
    ResilientRedis,
    check_seconds,
    ttl_to_px,
    validate_ttl,
)

__all__ = ["DiskBackend", "HostMemoryBackend", "RedisTierBackend", "TierBackend", "validate_block_key"]

_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: Redis's largest string value: the default read bound of the Redis tier.
_REDIS_MAX_VALUE = 512 * 2**20
_BYTES = (bytes, bytearray, memoryview)


def _operation(method: Callable[..., Any]) -> Callable[..., Any]:
    """One public call of the Redis tier, bounded as one Redis operation (:meth:`ResilientRedis.operation`): a
    hung server costs it one timeout, however many round trips it makes."""

    def bounded(self: RedisTierBackend, *args: Any, **kwargs: Any) -> Any:
        with self.redis.operation():
            return method(self, *args, **kwargs)

    bounded.__name__, bounded.__doc__ = method.__name__, method.__doc__
    return bounded


def validate_block_key(key: str) -> str:
    """Block keys become file names and Redis keys: 1-128 of ``[A-Za-z0-9_-]`` (no dots, no slashes)."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"block key: expected str, got {type(key).__name__} ({key!r:.80})")
    if not _KEY.fullmatch(key):
        raise ConfigError(f"invalid block key {key!r}: expected 1-128 characters of [A-Za-z0-9_-]")
    return key


def _check_data(data: object) -> None:
    check_type("data", data, _BYTES)


def _positive_int(name: str, value: object) -> int:
    check_type(name, value, int)
    if value <= 0:  # type: ignore[operator]
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


class TierBackend(ABC):
    """Bytes by key, within a budget."""

    name = "tier"

    def __init__(self, max_item_bytes: int) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.RLock()
        #: the largest stored item a read accepts (larger ones are answered as misses and counted corrupt)
        self.max_item_bytes = _positive_int("max_item_bytes", max_item_bytes)

    def limit_item_bytes(self, limit: int) -> None:
        """Lower :attr:`max_item_bytes` to ``limit`` (the tier store passes its geometry's largest block file)."""
        self.max_item_bytes = min(self.max_item_bytes, _positive_int("limit", limit))

    @abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store ``data``; False if it was not stored (larger than the budget, or the backend is down)."""

    @abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> list[str]: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...

    def contains(self, key: str) -> bool:
        return key in set(self.keys())

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        check_type("items", items, Mapping)
        return {k: self.put(k, v) for k, v in items.items()}

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        found = {k: self.get(k) for k in _key_list(keys)}
        return {k: v for k, v in found.items() if v is not None}

    def stats(self) -> dict[str, Any]:
        keys = self.keys()
        return {**self.counts, "blocks": len(keys), "bytes": self.nbytes}


class _BudgetLRU(TierBackend):
    """Shared bookkeeping: sizes in least-recently-used order and eviction to a byte budget."""

    def __init__(self, budget_bytes: int, max_item_bytes: int | None = None) -> None:
        budget_bytes = _positive_int("budget_bytes", budget_bytes)
        super().__init__(budget_bytes if max_item_bytes is None else max_item_bytes)
        self.budget_bytes = budget_bytes
        self._sizes: SizedLRU[int] = SizedLRU(int)  # key -> stored bytes, least recently used first
        #: called with (key, data) for each block evicted to fit the budget (the tier store demotes it)
        self.on_evict: Callable[[str, bytes], None] | None = None

    @property
    def nbytes(self) -> int:
        return self._sizes.total

    def keys(self) -> list[str]:
        self._check_usable()
        with self._lock:
            return list(self._sizes)

    def contains(self, key: str) -> bool:
        self._check_usable()
        return validate_block_key(key) in self._sizes

    def _check_usable(self) -> None:
        """Raise :class:`StateError` when the backend can no longer be used (see :class:`DiskBackend`)."""

    def delete(self, key: str) -> bool:
        validate_block_key(key)
        self._check_usable()
        with self._lock:
            if key not in self._sizes:
                return False
            self._drop(key)
            return True

    def _reserve(self, key: str, size: int) -> bool:
        """Make room for ``size`` bytes under ``key`` (what it holds now will be replaced); False if it can
        never fit. The books change only in :meth:`_commit`, once the bytes are really stored."""
        if size > self.budget_bytes or size > self.max_item_bytes:
            self.counts["rejected"] += 1
            return False
        self._make_room(size - (self._sizes.get(key) or 0), keep=key)
        return True

    def _commit(self, key: str, size: int) -> None:
        self._sizes.put(key, size)  # most recently used
        self.counts["puts"] += 1

    def _make_room(self, need: int, keep: str) -> None:
        """Evict least recently used entries other than ``keep`` (the key being replaced, whose old size is
        still counted) until ``need`` more bytes fit."""
        while self._sizes.total + need > self.budget_bytes:
            victim = self._sizes.oldest(exclude=keep)
            if victim is None:
                break
            if self.on_evict is not None:
                data = self._peek(victim)
                if data is not None:
                    self.on_evict(victim, data)
            self._drop(victim)
            self.counts["evictions"] += 1

    @abstractmethod
    def _drop(self, key: str) -> None: ...

    @abstractmethod
    def _peek(self, key: str) -> bytes | None:
        """The stored bytes, without counting a hit or touching the LRU order."""


def _key_list(keys: Iterable[str]) -> list[str]:
    """``keys`` as a list of valid block keys (a lone string is refused: it would iterate characters)."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"keys: expected an iterable of str, got {type(keys).__name__} ({keys!r:.80})")
    out = list(keys)
    for k in out:
        validate_block_key(k)
    return out


class HostMemoryBackend(_BudgetLRU):
    """Blocks in host RAM (pinned when CUDA is available, so device copies can be asynchronous)."""

    name = "host"

    def __init__(self, budget_bytes: int, *, pin: bool | None = None) -> None:
        super().__init__(budget_bytes)
        if pin is not None:
            check_type("pin", pin, bool)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._data: dict[str, Any] = {}

    def put(self, key: str, data: bytes) -> bool:
        validate_block_key(key)
        _check_data(data)
        with self._lock:
            if not self._reserve(key, len(data)):
                return False
            try:
                if self.pin:
                    buf = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
                    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    self._data[key] = buf
                else:
                    self._data[key] = bytes(data)
            except RuntimeError:  # pinned memory can run out: refuse the block rather than fail the caller
                self.counts["errors"] += 1
                return False
            self._commit(key, len(data))
            return True

    def get(self, key: str) -> bytes | None:
        validate_block_key(key)
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.counts["misses"] += 1
                return None
            if len(value) > self.max_item_bytes:  # stored before the tier store lowered the bound
                self._drop(key)
                self.counts["corrupt"] += 1
                self.counts["misses"] += 1
                return None
            self._sizes.touch(key)
            self.counts["hits"] += 1
            return value.numpy().tobytes() if isinstance(value, torch.Tensor) else value

    def _drop(self, key: str) -> None:
        self._sizes.pop(key)
        del self._data[key]

    def _peek(self, key: str) -> bytes | None:
        value = self._data.get(key)
        return value.numpy().tobytes() if isinstance(value, torch.Tensor) else value


_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | _O_CLOEXEC
#: O_NONBLOCK: opening a FIFO planted as a block file returns at once (then fstat refuses it) instead of
#: waiting for a writer forever.
_READ_FLAGS = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
#: errno values that mean "a path component is a symlink or not a directory": refused, never followed.
_UNSAFE_ERRNOS = {errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EMLINK}
_SHARD = re.compile(r"[A-Za-z0-9_-]{1,2}")
#: ``.tmp-{host}-{pid}-{token}``: the host tag and pid say whose in-flight write a temporary file is.
_HOST = hashlib.blake2b(socket.gethostname().encode(errors="replace"), digest_size=4).hexdigest()
_TMP = re.compile(r"\.tmp-([0-9a-f]{8})-([0-9]{1,10})-[0-9a-f]{1,64}")


class _Unsafe(Exception):
    """A directory entry that is not what a block file must be (a FIFO, a device, too large, ...)."""


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):  # alive but not ours, or not a valid pid: be careful
        return True
    return True


def temp_name(pid: int | None = None) -> str:
    """The name of a temporary file written by process ``pid`` (default: this one) on this host."""
    return f".tmp-{_HOST}-{os.getpid() if pid is None else pid}-{secrets.token_hex(6)}"


class _RootBooks:
    """What every :class:`DiskBackend` of this process on one root shares: the books (sizes in LRU order), the
    lock that guards them, and the descriptor holding the root's inter-process lock (``root/.lock``)."""

    def __init__(self, lock_fd: int | None) -> None:
        self.sizes: SizedLRU[int] = SizedLRU(int)
        self.lock = threading.RLock()
        self.lock_fd = lock_fd
        self.users = 0


#: by (pid, root): a forked child inherits this dict but not the parent's record lock, so it must lock anew
_ROOTS: dict[tuple[int, Path], _RootBooks] = {}
_ROOTS_LOCK = threading.Lock()
_LOCK_NAME = ".lock"
#: O_NONBLOCK: a FIFO planted at ``root/.lock`` opens at once (then fstat refuses it) instead of blocking.
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _O_CLOEXEC


def _lock_root(root: Path) -> int | None:
    """Take ``root/.lock`` exclusively for this process (a POSIX record lock: released by the kernel when the
    process exits, even by a crash). Raises :class:`StateError` when another live process holds it; None when
    the file cannot be made (a read-only root: nothing can be written there anyway)."""
    try:
        root_fd = os.open(root, _DIR_FLAGS)
        try:
            fd = os.open(_LOCK_NAME, _LOCK_FLAGS, 0o644, dir_fd=root_fd)
        finally:
            os.close(root_fd)
    except OSError as exc:
        if exc.errno in _UNSAFE_ERRNOS:
            raise ConfigError(f"disk tier root {str(root)!r}: {_LOCK_NAME} is a symlink or a directory") from None
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # a FIFO, a socket, a device: lockf would fail or block on it
        os.close(fd)
        raise ConfigError(f"disk tier root {str(root)!r}: {_LOCK_NAME} is not a regular file (mode {mode:o})")
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise StateError(
                f"disk tier root {str(root)!r} is in use by another process (pid {holder:.20}): one process per "
                "root — give each process its own root (or share blocks through the Redis tier)"
            ) from None
        return None  # a file system without record locks: unlocked
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _release_root(owner: tuple[int, Path]) -> None:
    if owner[0] != os.getpid():  # a forked child exiting: the lock and the books are its parent's
        return
    with _ROOTS_LOCK:
        books = _ROOTS.get(owner)
        if books is None:
            return
        books.users -= 1
        if books.users == 0:
            del _ROOTS[owner]
            if books.lock_fd is not None:
                os.close(books.lock_fd)  # releases the inter-process lock


class DiskBackend(_BudgetLRU):
    """One file per block under ``root`` (``root/ab/abcd….kvb``), written atomically: a temporary file in the
    same directory, fsync, then rename — a crash leaves the old file or the new one, never half of one.
    Existing files are adopted at start (oldest first in the LRU order).

    Confinement: ``root`` is resolved once, at construction; below it every directory is opened with
    ``O_NOFOLLOW | O_DIRECTORY`` and every file relative to its directory's descriptor with ``O_NOFOLLOW``, so a
    shard directory or a block file replaced by a symlink is refused (counted ``unsafe``) — nothing is ever
    read, written or deleted outside ``root``. A read opens with ``O_NONBLOCK`` and checks with ``fstat`` that
    it has a regular file of at most ``max_item_bytes`` before reading a byte (a FIFO, a device or a huge file
    is a miss, counted ``corrupt``, and its directory entry is removed).

    **One root, one process.** The root is locked for the process (``root/.lock``, a POSIX record lock the kernel
    drops when the process exits, even by a crash): a backend in another process on the same root raises
    :class:`StateError` naming the holder's pid. Backends of one process on one root share one set of books (and
    one lock), so each put evicts until the root's total fits that backend's budget: the smallest budget among
    them holds after its puts, the largest always. The lock is released when every backend of the process on the
    root is closed (:meth:`close`) or garbage-collected. At start the backend adopts the files found and evicts
    the least recently modified ones until they fit its budget (a restart with a smaller budget).

    Temporary files are named ``.tmp-{host}-{pid}-{token}``; at start only stale ones are removed — written by
    a process of this host that is no longer alive, or older than ``stale_tmp_s`` — so a backend starting in one
    process never deletes another's write in flight. Unreadable directories, dangling symlinks and a read-only
    root are skipped (counted), never raised.

    Args:
        root: the directory (created if missing).
        budget_bytes: the most bytes of block files kept; least recently used ones are evicted beyond it.
        max_item_bytes: the largest file read (default: ``budget_bytes``; the tier store lowers it to the
            largest block file of its geometry).
        stale_tmp_s: age after which any temporary file is considered abandoned.
    """

    name = "disk"
    SUFFIX = ".kvb"

    def __init__(
        self,
        root: str | os.PathLike,
        budget_bytes: int,
        *,
        max_item_bytes: int | None = None,
        stale_tmp_s: float = 3600.0,
    ) -> None:
        check_type("root", root, (str, os.PathLike))
        super().__init__(budget_bytes, max_item_bytes)
        self.stale_tmp_s = check_seconds("stale_tmp_s", stale_tmp_s, allow_zero=True)
        try:
            Path(root).mkdir(parents=True, exist_ok=True)
            self.root = Path(root).resolve(strict=True)
        except OSError as exc:
            raise ConfigError(f"cannot use {os.fspath(root)!r} as a disk tier root: {exc}") from None
        if not self.root.is_dir():
            raise ConfigError(f"disk tier root {str(self.root)!r} is not a directory")
        self._owner = (os.getpid(), self.root)
        with _ROOTS_LOCK:
            books = _ROOTS.get(self._owner)
            if books is None:
                books = _ROOTS[self._owner] = _RootBooks(_lock_root(self.root))  # StateError: another process
            books.users += 1
        self._closer = weakref.finalize(self, _release_root, self._owner)
        self._sizes, self._lock = books.sizes, books.lock  # shared with this process's other backends here
        with self._lock:
            found: list[tuple[float, str, int]] = []
            for shard in self._shards():
                found += self._scan_shard(shard)
            adopted = {key for _, key, _ in found}
            for key in [k for k in self._sizes if k not in adopted]:  # gone from disk since
                self._sizes.pop(key)
            for _, key, size in sorted(found):
                if key not in self._sizes:
                    self._sizes.put(key, size)
            self._make_room(0, keep=None)  # the budget holds from the start

    def close(self) -> None:
        """Stop using the root: once every backend of this process on it is closed, its lock is released (a
        closed backend must not be used again: it raises :class:`StateError`)."""
        self._closer()

    def _check_usable(self) -> None:
        """Raise :class:`StateError` when this backend is closed, or used in another process than the one that
        made it (a forked child does not hold the root's lock: it would write beside its parent, unlocked)."""
        if not self._closer.alive:
            raise StateError(f"disk tier backend on {str(self.root)!r} is closed: make a new DiskBackend")
        if self._owner[0] != os.getpid():
            raise StateError(
                f"disk tier backend on {str(self.root)!r} was made by process {self._owner[0]}, used in "
                f"{os.getpid()} (after fork): one process per root — make the child its own DiskBackend on "
                "its own root"
            )

    # ------------------------------------------------------------------ paths, confined
    def path(self, key: str) -> Path:
        validate_block_key(key)
        return self.root / key[:2] / f"{key}{self.SUFFIX}"

    @contextmanager
    def _dir(self, shard: str, *, create: bool = False) -> Iterator[int]:
        """A descriptor of ``root/shard``; raises OSError (ELOOP / ENOTDIR) if it is a symlink or a file."""
        root_fd = os.open(self.root, _DIR_FLAGS)
        try:
            if create:
                with suppress(FileExistsError):
                    os.mkdir(shard, 0o755, dir_fd=root_fd)
            fd = os.open(shard, _DIR_FLAGS, dir_fd=root_fd)
        finally:
            os.close(root_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def _failed(self, exc: OSError) -> None:
        self.counts["unsafe" if exc.errno in _UNSAFE_ERRNOS else "errors"] += 1

    def _shards(self) -> list[str]:
        try:
            with os.scandir(self.root) as it:
                entries = list(it)
        except OSError as exc:
            self._failed(exc)
            return []
        shards = []
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir and _SHARD.fullmatch(entry.name):
                shards.append(entry.name)
            elif _SHARD.fullmatch(entry.name):
                self.counts["unsafe"] += 1  # a symlink or a file where a shard directory belongs: left alone
        return sorted(shards)

    def _scan_shard(self, shard: str) -> list[tuple[float, str, int]]:
        """Adopt the block files of one shard and remove its stale temporary files."""
        found = []
        now = time.time()
        try:
            with self._dir(shard) as dfd:
                for entry in list(os.scandir(dfd)):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if entry.name.startswith(".tmp-"):
                        if self._stale(entry.name, st, now):
                            self._unlink(entry.name, dfd)
                        continue
                    key = entry.name[: -len(self.SUFFIX)] if entry.name.endswith(self.SUFFIX) else ""
                    if not _KEY.fullmatch(key) or key[:2] != shard:
                        continue
                    if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_item_bytes:
                        self.counts["unsafe"] += 1  # a dangling symlink, a FIFO, a huge file: not adopted
                        continue
                    found.append((st.st_mtime, key, st.st_size))
        except OSError as exc:  # unreadable, replaced by a symlink, gone
            self._failed(exc)
        return found

    def _stale(self, name: str, st: os.stat_result, now: float) -> bool:
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime >= self.stale_tmp_s:
            return True
        m = _TMP.fullmatch(name)
        if m is None or m[1] != _HOST:  # another host's, or an unknown writer's: only its age decides
            return False
        pid = int(m[2])
        return pid != os.getpid() and not _pid_alive(pid)

    def _unlink(self, name: str, dfd: int) -> bool:
        """Remove one directory entry (never what a symlink points to)."""
        try:
            os.unlink(name, dir_fd=dfd)
            return True
        except FileNotFoundError:
            return False
        except OSError as exc:  # a read-only directory, a directory where a file belongs
            self._failed(exc)
            return False

    def _read(self, key: str) -> bytes:
        """The file's bytes; raises OSError or :class:`_Unsafe`, having removed an unsafe entry."""
        with self._dir(key[:2]) as dfd:
            name = f"{key}{self.SUFFIX}"
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except OSError as exc:
                if exc.errno in _UNSAFE_ERRNOS:  # a symlink (to /dev/zero, to a secret, ...)
                    self._unlink(name, dfd)
                    raise _Unsafe(f"{name} is a symlink or a directory") from None
                raise
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_item_bytes:
                    self._unlink(name, dfd)
                    raise _Unsafe(f"{name}: mode {st.st_mode:o}, {st.st_size} bytes")
                return _read_bounded(fd, self.max_item_bytes)
            finally:
                os.close(fd)

    def _lookup(self, key: str) -> bytes | None:
        """The stored bytes, or None; a missing or unsafe file is forgotten from the books."""
        try:
            return self._read(key)
        except _Unsafe:
            self.counts["corrupt"] += 1
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._failed(exc)
        if key in self._sizes:
            self._sizes.pop(key)
        return None

    # ------------------------------------------------------------------ the interface
    def put(self, key: str, data: bytes) -> bool:
        validate_block_key(key)
        _check_data(data)
        self._check_usable()
        with self._lock:
            if not self._reserve(key, len(data)):
                return False
            try:
                self._write(key, data)
            except OSError as exc:
                self._failed(exc)
                return False  # the old file, if any, is untouched and still counted
            self._commit(key, len(data))
            return True

    def _write(self, key: str, data: bytes) -> None:
        with self._dir(key[:2], create=True) as dfd:
            tmp = temp_name()
            fd = os.open(tmp, _WRITE_FLAGS, 0o644, dir_fd=dfd)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, f"{key}{self.SUFFIX}", src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                self._unlink(tmp, dfd)
                raise

    def get(self, key: str) -> bytes | None:
        validate_block_key(key)
        self._check_usable()
        with self._lock:
            if key not in self._sizes:
                self.counts["misses"] += 1
                return None
            data = self._lookup(key)
            if data is not None and len(data) != self._sizes.get(key):
                # not the file this root's books wrote (edited outside): serving it would leave the books, and
                # so the budget, wrong — drop it as corrupt
                self._drop(key)
                self.counts["corrupt"] += 1
                data = None
            if data is None:
                self.counts["misses"] += 1
                return None
            self._sizes.touch(key)
            self.counts["hits"] += 1
            return data

    def _drop(self, key: str) -> None:
        self._sizes.pop(key)
        try:
            with self._dir(key[:2]) as dfd:
                self._unlink(f"{key}{self.SUFFIX}", dfd)
        except OSError as exc:  # the shard directory is gone or was replaced by a symlink: delete nothing
            if exc.errno != errno.ENOENT:
                self._failed(exc)

    def _peek(self, key: str) -> bytes | None:
        try:
            return self._read(key)
        except (_Unsafe, OSError):
            return None


def _read_bounded(fd: int, limit: int) -> bytes:
    """Read ``fd`` to its end, refusing (as :class:`_Unsafe`) more than ``limit`` bytes."""
    chunks, total = [], 0
    while True:
        chunk = os.read(fd, min(1 << 20, limit + 1 - total))
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > limit:
            raise _Unsafe(f"grew past {limit} bytes while being read")
        chunks.append(chunk)


class RedisTierBackend(TierBackend):
    """Blocks in Redis, shared by every process (or machine) that points at the server: the remote tier.

    Keys are ``{namespace}:{fingerprint[:16]}:{tenant}:{key}``: blocks of one model never mix with another's,
    and tenants are separated. ``ttl`` (seconds) lets the server expire cold blocks; its ``maxmemory-policy``
    evicts under pressure. Errors as :class:`~memos_ref.resilient.ResilientRedis`: every Redis error (a dead
    server, a full one, a read-only replica, a value of another type planted at a key) is a miss or a dropped
    write, counted by kind (``redis_errors_<kind>`` in :meth:`stats`); a dead server degrades after
    ``failure_threshold`` consecutive failures. Reads fetch at most ``max_item_bytes + 1`` bytes (``GETRANGE``),
    so a huge value planted by another client is a miss counted ``corrupt``, never a huge allocation.
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        fingerprint: str,
        namespace: str = "memos-kv",
        tenant: str = "default",
        ttl: float | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_after: float = 1.0,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        redis: ResilientRedis | None = None,
        max_item_bytes: int = _REDIS_MAX_VALUE,
    ) -> None:
        super().__init__(max_item_bytes)
        for label, value in (("namespace", namespace), ("tenant", tenant), ("fingerprint", fingerprint)):
            check_type(label, value, str)
            if not _KEY.fullmatch(value):  # no ':' or glob characters anywhere
                raise ConfigError(f"{label} must be 1-128 of [A-Za-z0-9_-], got {value!r}")
        self.ttl = validate_ttl(ttl)
        if redis is not None:
            check_type("redis", redis, ResilientRedis)
        self.redis = redis or ResilientRedis(
            url, timeout=timeout, retry_after=retry_after, failure_threshold=failure_threshold
        )
        self.prefix = f"{namespace}:{fingerprint[:16]}:{tenant}:"
        self._px = ttl_to_px(self.ttl)

    def _k(self, key: str) -> str:
        return self.prefix + validate_block_key(key)

    def _value(self, raw: object) -> bytes | None:
        """One value read with GETRANGE: None when absent, of another type (an error object from a pipeline)
        or larger than the bound (counted ``corrupt``)."""
        if isinstance(raw, Exception):
            self.redis.count_error(raw)
            return None
        if not isinstance(raw, bytes) or not raw:  # GETRANGE answers "" for a missing key
            return None
        if len(raw) > self.max_item_bytes:
            self.counts["corrupt"] += 1
            return None
        return raw

    @_operation
    def put(self, key: str, data: bytes) -> bool:
        rkey = self._k(key)
        _check_data(data)
        ok = len(data) <= self.max_item_bytes and self.redis.call(
            lambda: self.redis.client.set(rkey, bytes(data), px=self._px), None
        )
        self.counts["puts" if ok else "dropped_puts"] += 1
        return bool(ok)

    @_operation
    def get(self, key: str) -> bytes | None:
        rkey = self._k(key)
        raw = self.redis.call(lambda: self.redis.client.getrange(rkey, 0, self.max_item_bytes), None)
        data = self._value(raw)
        self.counts["hits" if data is not None else "misses"] += 1
        return data

    @_operation
    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = _key_list(keys)
        rkeys = [self._k(k) for k in keys]

        def read() -> list:
            pipe = self.redis.client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.getrange(rkey, 0, self.max_item_bytes)
            return pipe.execute(raise_on_error=False)

        values = self.redis.call(read, None) if rkeys else []
        found = {}
        for k, raw in zip(keys, values or []):
            data = self._value(raw)
            if data is not None:
                found[k] = data
        self.counts["hits"] += len(found)
        self.counts["misses"] += len(keys) - len(found)
        return found

    @_operation
    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        check_type("items", items, Mapping)
        prepared = []
        for k, v in items.items():
            _check_data(v)
            prepared.append((k, self._k(k), v))
        small = [(k, rkey, v) for k, rkey, v in prepared if len(v) <= self.max_item_bytes]

        def write() -> list:
            pipe = self.redis.client.pipeline(transaction=False)
            for _, rkey, data in small:
                pipe.set(rkey, bytes(data), px=self._px)
            return pipe.execute(raise_on_error=False)

        results = (self.redis.call(write, None) if small else []) or [None] * len(small)
        ok = dict.fromkeys(items, False)
        for (k, _, _), result in zip(small, results):
            if isinstance(result, Exception):
                self.redis.count_error(result)
            ok[k] = result is True
        stored = sum(ok.values())
        self.counts["puts"] += stored
        self.counts["dropped_puts"] += len(ok) - stored
        return ok

    @_operation
    def delete(self, key: str) -> bool:
        rkey = self._k(key)
        return bool(self.redis.call(lambda: self.redis.client.delete(rkey), 0))

    @_operation
    def contains(self, key: str) -> bool:
        """True when a block (a string value) is stored under ``key``; a value of another type planted there is
        not a block, as :meth:`get` answers a miss for it."""
        rkey = self._k(key)
        return self.redis.call(lambda: self.redis.client.type(rkey), b"none") == b"string"

    def _scan(self) -> list[bytes]:
        return self.redis.call(lambda: list(self.redis.client.scan_iter(match=self.prefix + "*", count=1000)), [])

    @_operation
    def keys(self) -> list[str]:
        """The block keys of this namespace. Keys another client planted under the prefix that are not valid
        block keys (not UTF-8, wrong characters) are skipped and counted ``foreign_keys``."""
        prefix, out = self.prefix.encode(), []
        for rkey in self._scan():
            try:
                key = rkey[len(prefix) :].decode("ascii") if rkey.startswith(prefix) else ""
            except UnicodeDecodeError:
                key = ""
            if _KEY.fullmatch(key):
                out.append(key)
            else:
                self.counts["foreign_keys"] += 1
        return out

    @property
    @_operation
    def nbytes(self) -> int:
        def total() -> int:
            keys = self.keys()  # block keys only: what other clients planted under the prefix is not ours
            if not keys:
                return 0
            pipe = self.redis.client.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(self.prefix + k)
            return sum(n for n in pipe.execute(raise_on_error=False) if isinstance(n, int))  # skip other types

        return self.redis.call(total, 0)

    @_operation
    def clear(self) -> None:
        """Remove this namespace's blocks (SCAN + UNLINK; never FLUSHDB on a shared server)."""
        keys = self._scan()
        for i in range(0, len(keys), 1000):
            self.redis.call(lambda i=i: self.redis.client.unlink(*keys[i : i + 1000]), 0)

    @_operation
    def stats(self) -> dict[str, Any]:
        base = {**self.counts, **{f"redis_{k}": v for k, v in self.redis.counts.items()}}
        base["degraded"] = int(self.redis.is_down())
        if not self.redis.is_down():
            base["blocks"] = len(self.keys())
            base["bytes"] = self.nbytes
        return base
