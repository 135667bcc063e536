"""Blocks on a local disk, one file per block, confined to one root that one process holds.

What a backend reads is untrusted (another process, or anyone with write access to the directory, may have put
it there): reads are bounded by ``max_item_bytes`` and a file that cannot be a block — too large, not a regular
file, a symlink, a size other than the books recorded — is answered as a miss and counted ``corrupt``. Nothing
raises into the caller for what it finds stored.
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
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from memos_ref.errors import ConfigError, StateError, check_type
from memos_ref.lru import SizedLRU
from memos_ref.resilient import check_seconds
from memos_ref.tiering.backend_base import BLOCK_KEY, BudgetLRU, check_data, validate_block_key

__all__ = ["DiskBackend", "temp_name"]

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
_PENDING_RELEASES: list[tuple[int, Path]] = []  # finalizers that found _ROOTS_LOCK busy (see _release_root)
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
    """A backend's finalizer. The garbage collector may run it inside this thread's own ``with _ROOTS_LOCK:``
    (a new backend allocating while an old one in a reference cycle dies), so it never blocks on that lock: when
    the lock is busy the release is queued, and the holder carries it out as it lets the lock go."""
    if owner[0] != os.getpid():  # a forked child exiting: the lock and the books are its parent's
        return
    _PENDING_RELEASES.append(owner)
    _drain_if_free()


def _drain_if_free() -> None:
    """Carry out the queued releases unless another frame holds ``_ROOTS_LOCK`` (it calls this once it lets go)."""
    while _PENDING_RELEASES and _ROOTS_LOCK.acquire(blocking=False):
        try:
            _drain_releases()
        finally:
            _ROOTS_LOCK.release()


def _drain_releases() -> None:
    """Carry out the queued releases (under ``_ROOTS_LOCK``)."""
    while _PENDING_RELEASES:
        owner = _PENDING_RELEASES.pop()
        books = _ROOTS.get(owner)
        if books is None:
            continue
        books.users -= 1
        if books.users == 0:
            del _ROOTS[owner]
            if books.lock_fd is not None:
                os.close(books.lock_fd)  # releases the inter-process lock


class DiskBackend(BudgetLRU):
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
            _drain_releases()
            books = _ROOTS.get(self._owner)
            if books is None:
                books = _ROOTS[self._owner] = _RootBooks(_lock_root(self.root))  # StateError: another process
            books.users += 1
        _drain_if_free()  # what a collection inside the block above queued (an old backend's release)
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
                    if not BLOCK_KEY.fullmatch(key) or key[:2] != shard:
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
                try:
                    return _read_bounded(fd, self.max_item_bytes)
                except _Unsafe:  # it grew past the bound while being read: not a block either, and never adopted
                    self._unlink(name, dfd)  # at a restart, so removed now rather than left outside the budget
                    raise
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
        check_data(data)
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
                data = self._resized(key, data)
            if data is None:
                self.counts["misses"] += 1
                return None
            self._sizes.touch(key)
            self.counts["hits"] += 1
            return data

    def _resized(self, key: str, data: bytes) -> bytes | None:
        """A file whose size is not the one the books recorded (replaced outside this process): the books take
        its real size and evict others until the budget holds again (counted ``resized``); a file that could
        never fit the budget is dropped as ``corrupt``. Whether the bytes are a block is the caller's check."""
        self.counts["resized"] += 1
        if len(data) > self.budget_bytes:
            self._drop(key)
            self.counts["corrupt"] += 1
            return None
        self._sizes.put(key, len(data))
        self._make_room(0, keep=key)
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
