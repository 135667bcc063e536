"""A converted model's folder on disk: its manifest, its verification, and the rules for replacing it.

:mod:`memos_ref.model.pretrained` converts a model once into a folder of the cache; this module decides whether
such a folder can be loaded (:func:`verify_folder`: a bounded manifest naming every file's size and SHA-256,
regular files only, a stat stamp so unchanged files are not hashed again) and how it is replaced: under
:func:`folder_lock`, never through a link, a file in its place or a conversion in a newer format
(:func:`refuse_foreign`), and only once its verified replacement is ready (:func:`swap_in`). Manifests and stamps
are untrusted: bounded before read, parsed without recursing past the interpreter's limit, never executed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memos_ref.errors import ConfigError, CorruptCacheError, StateError

__all__ = [
    "LOCK_TIMEOUT_S",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "STAMP",
    "folder_lock",
    "lock_timeout",
    "newer_format",
    "read_small_json",
    "refuse_foreign",
    "sha256_file",
    "stamp",
    "swap_in",
    "verify_folder",
]

MANIFEST = "memos_manifest.json"
STAMP = ".memos_verified"  # sizes, mtimes and inodes of the files as last fully verified
MANIFEST_FORMAT = "memos-ref-pretrained-v1"
CHUNK = 1 << 20
#: Longest file name a manifest may list (bytes of UTF-8; the usual NAME_MAX of Linux and macOS file systems).
MAX_NAME_BYTES = 255
#: How long :func:`folder_lock` waits for another process's lock by default (a conversion takes about a minute on
#: 2 slow cores); ``$MEMOS_REF_LOCK_TIMEOUT`` (seconds) overrides it.
LOCK_TIMEOUT_S = 600.0


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_small_json(path: Path, limit: int = 64 * 1024) -> Any:
    """A small JSON file's value: a regular file of at most ``limit`` bytes, read once (bounded), parsed without
    recursing past Python's limit. Raises ``ValueError`` saying why not (the callers turn it into a reason)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"cannot open ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{info.st_size} bytes, more than {limit}")
        raw = os.read(fd, limit + 1)
    except OSError as exc:
        raise ValueError(f"cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise ValueError(f"more than {limit} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested past the limit
        raise ValueError(f"not JSON ({type(exc).__name__}: {str(exc)[:120]})") from None


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def stamp(folder: Path, files: dict[str, Any]) -> dict[str, list[int]]:
    return {rel: _stat_key(folder / rel) for rel in sorted(files)} | {MANIFEST: _stat_key(folder / MANIFEST)}


def _quick_ok(folder: Path, files: dict[str, Any]) -> bool:
    """True when every file is unchanged (size, mtime, inode) since its checksums were last verified, so the
    ~0.5 GB of weights need not be hashed again on every load (hashing takes ~6 s on 2 slow cores)."""
    try:
        return read_small_json(folder / STAMP) == stamp(folder, files)
    except (OSError, ValueError):  # a damaged stamp only costs a full hash, which writes a good one
        return False


def newer_format(manifest: Any) -> str | None:
    """The manifest's format when it names a later version of this one (written by a newer memos-ref): this
    format's name with a larger version number (of any length: ``v2``, ``v9999999``), or the same number with a
    revision after it (``v1.1``, ``v1-beta``). Such a folder is refused, never replaced."""
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    prefix, ours = MANIFEST_FORMAT.rsplit("v", 1)
    if not isinstance(fmt, str) or not fmt.startswith(prefix + "v") or fmt == MANIFEST_FORMAT:
        return None
    match = re.match(r"[0-9]+", fmt[len(prefix) + 1 :])
    if match is None:
        return None
    number = match.group(0).lstrip("0") or "0"  # compared as digit strings: no int() of a 60 KB number
    if (len(number), number) > (len(ours), ours) or (number == ours and match.end() < len(fmt) - len(prefix) - 1):
        return fmt
    return None


def verify_folder(folder: Path, source_sha256: str, *, full: bool = False) -> str | None:
    """``None`` when ``folder`` holds a complete conversion of the source with SHA-256 ``source_sha256``, else
    why not. Files unchanged since their last full check are not hashed again unless ``full``. Deletes nothing."""
    if folder.is_symlink() and not folder.is_dir():
        return "a symbolic link to nothing usable"
    manifest_path = folder / MANIFEST
    if not folder.is_dir() or not manifest_path.is_file():
        return "no manifest"
    try:
        manifest = read_small_json(manifest_path)
    except ValueError as exc:
        return f"unreadable manifest ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return "manifest of another format"
    if manifest.get("source_sha256") != source_sha256:
        return f"converted from another source ({str(manifest.get('source_sha256'))[:80]!r})"
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files or "config.json" not in files:
        return "manifest lists no weights"
    for rel, meta in files.items():
        if not isinstance(rel, str) or "/" in rel or "\\" in rel or "\x00" in rel or rel.startswith("."):
            return f"manifest names an unsafe path {rel[:80]!r}"
        if (size := len(rel.encode("utf-8", "surrogatepass"))) > MAX_NAME_BYTES:
            return f"manifest names a file name of {size} bytes, more than {MAX_NAME_BYTES}"
        path = folder / rel
        try:
            if path.is_symlink():
                return f"{rel} is a symbolic link (a conversion holds regular files only)"
            if not isinstance(meta, dict) or not path.is_file() or path.stat().st_size != meta.get("bytes"):
                return f"{rel} is missing or has the wrong size"
        except OSError as exc:  # a name the file system refuses, a file it cannot stat
            return f"{rel[:80]!r} cannot be checked ({exc.strerror})"
    if not full and _quick_ok(folder, files):
        return None
    for rel, meta in files.items():
        try:
            digest = sha256_file(folder / rel)
        except OSError as exc:
            return f"{rel} cannot be read ({exc.strerror})"
        if digest != meta.get("sha256"):
            return f"{rel} fails its checksum"
    with contextlib.suppress(OSError):
        tmp = folder / f"{STAMP}.tmp"
        tmp.write_text(json.dumps(stamp(folder, files)))
        os.replace(tmp, folder / STAMP)
    return None


def lock_timeout() -> float:
    """Seconds :func:`folder_lock` waits by default: ``$MEMOS_REF_LOCK_TIMEOUT`` when set (a finite number > 0,
    else :class:`~memos_ref.errors.ConfigError`), else :data:`LOCK_TIMEOUT_S`."""
    raw = os.environ.get("MEMOS_REF_LOCK_TIMEOUT")
    if raw is None or raw == "":
        return LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"$MEMOS_REF_LOCK_TIMEOUT: expected a number of seconds > 0, got {raw[:40]!r}")
    return value


def _holder(fh: Any) -> str:
    """Who holds the lock, as its holder wrote it in the file (its process id), bounded; ``'unknown'`` else."""
    try:
        text = os.pread(fh.fileno(), 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return "unknown"
    return f"process {text}" if text.isdigit() else "unknown"


@contextlib.contextmanager
def folder_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """An exclusive lock on ``path`` (two processes converting at once would waste a minute each), waited for at
    most ``timeout`` seconds (default :func:`lock_timeout`, 600 s): a lock another process keeps longer (a stuck
    or stopped conversion) is a :class:`~memos_ref.errors.StateError` naming the lock file and its holder's
    process id. A lock path that is not a regular file (a folder, a FIFO) or a cache that cannot be written is a
    :class:`~memos_ref.errors.CorruptCacheError` naming it."""
    import fcntl  # POSIX only: imported here so that the folder checks (and the model loader) import anywhere

    timeout = lock_timeout() if timeout is None else timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 <= timeout < math.inf):
        raise ConfigError(f"timeout: expected a finite number of seconds >= 0, got {timeout!r:.40}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise CorruptCacheError(f"{path}: expected the lock file, found something else; remove it")
        fh = open(path, "a+")  # noqa: SIM115 (closed below, after the unlock; read for the holder's id)
    except OSError as exc:
        raise CorruptCacheError(f"cannot create the lock {path}: {exc}") from None
    with fh:
        deadline, pause = time.monotonic() + timeout, 0.01
        while True:  # bounded by the deadline
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StateError(
                        f"{path}: another process ({_holder(fh)}) has held this lock for more than {timeout:g} s "
                        f"(a conversion takes about a minute); wait for it, stop it, or raise $MEMOS_REF_LOCK_TIMEOUT"
                    ) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)
        try:
            with contextlib.suppress(OSError):  # who holds it, for the next waiter's message
                os.truncate(fh.fileno(), 0)
                os.pwrite(fh.fileno(), f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def refuse_foreign(target: Path, why: str) -> None:
    """Refuse to replace what memos-ref did not create: a link, a file, or a conversion in a newer format."""
    if target.is_symlink():
        raise CorruptCacheError(
            f"{target} is a symbolic link whose folder fails verification ({why}); memos-ref never replaces or "
            f"deletes through a link: fix its target, or remove the link to convert again"
        )
    if target.exists() and not target.is_dir():
        raise CorruptCacheError(
            f"{target} should be a converted model folder but is a file; remove it to convert again (memos-ref "
            f"does not delete what it did not create)"
        )
    if target.is_dir():
        try:
            newer = newer_format(read_small_json(target / MANIFEST))
        except ValueError:
            newer = None
        if newer is not None:
            raise ConfigError(
                f"{target} holds a conversion in manifest format {newer!r:.80}, newer than this memos-ref reads "
                f"({MANIFEST_FORMAT!r}): upgrade memos-ref, or delete the folder to convert again; it was left as "
                f"it is"
            )


def swap_in(fresh: Path, target: Path) -> None:
    """Move the verified ``fresh`` conversion to ``target``; an old folder there is moved aside first and deleted
    only once the new one is in place (a crash leaves one of them, never neither)."""
    aside = None
    if target.is_dir():
        aside = Path(tempfile.mkdtemp(prefix=".replaced-", dir=target.parent))
        os.rmdir(aside)
        os.replace(target, aside)
    try:
        os.replace(fresh, target)
    except BaseException:
        if aside is not None:
            os.replace(aside, target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
