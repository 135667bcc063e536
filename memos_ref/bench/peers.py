"""Peers for side-by-side benchmarks: pinned, fetched by one command, loaded from their own sources.

    make peers                              # = python -m memos_ref.bench.peers fetch
    python -m memos_ref.bench allocator --json

``fetch`` puts each peer's Python sources under :func:`cache_root` (``$MEMOS_REF_PEERS``, else
``$MEMOS_REF_CACHE/peers``, else ``~/.cache/memos-ref/peers``), one folder per pinned version, with a
``PEER.json`` that says what it is and where it came from:

* **vLLM** — ``pip download vllm==<VLLM_VERSION> --no-deps`` (the PyPI wheel); only its ``*.py`` files are
  unpacked (the wheel's compiled extensions are not needed: the benchmark imports two pure-Python files). The
  wheel's SHA-256 is recorded.
* **nano-vllm** — the source archive of commit :data:`NANOVLLM_COMMIT` from GitHub's codeload where it can be
  reached; elsewhere skipped with the reason (``PEER.json`` is not written). ``MEMOS_REF_NANOVLLM_SRC`` may name
  a checkout instead (its commit is read with ``git rev-parse`` when it is a git work tree).

``MEMOS_REF_VLLM_SRC`` / ``MEMOS_REF_NANOVLLM_SRC`` override the cache with a source folder (the folder that
holds ``vllm/`` or ``nanovllm/``). No peer code is vendored in this repository.

:func:`import_with_stubs` loads one file of a large project with every other import of that project stubbed,
so vLLM's ``block_pool.py`` runs without vLLM's dependencies. :func:`versions` records the version of every
peer a benchmark may name (vLLM, nano-vllm, transformers, cachetools, redis-py, redis-server), for the JSON.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import types
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "NANOVLLM_COMMIT",
    "VLLM_VERSION",
    "PeerSource",
    "cache_root",
    "fetch",
    "import_with_stubs",
    "locate",
    "versions",
]

#: The vLLM release the allocator benchmark compares with (its wheel on PyPI)
VLLM_VERSION = "0.33.0"
#: nano-vllm has no release on PyPI: a commit of github.com/GeeeekExplorer/nano-vllm (2026-04-26, PR #218)
NANOVLLM_COMMIT = "bb823b3e06983d71485a8e1f23715ebd87d98ef8"
NANOVLLM_URL = "https://codeload.github.com/GeeeekExplorer/nano-vllm/tar.gz/{commit}"
ENV = {"vllm": "MEMOS_REF_VLLM_SRC", "nanovllm": "MEMOS_REF_NANOVLLM_SRC"}
_MAX_ARCHIVE_BYTES = 64 << 20  # nano-vllm's archive is well under 1 MiB; refuse anything absurd


@dataclass(frozen=True)
class PeerSource:
    """Where a peer's sources are, and what they are (``version``/``commit``, and how they were obtained)."""

    name: str
    path: Path
    info: dict[str, Any]


def cache_root() -> Path:
    """The folder ``fetch`` writes to: ``$MEMOS_REF_PEERS``, else ``$MEMOS_REF_CACHE/peers``, else
    ``~/.cache/memos-ref/peers``."""
    if os.environ.get("MEMOS_REF_PEERS"):
        return Path(os.environ["MEMOS_REF_PEERS"]).expanduser()
    base = os.environ.get("MEMOS_REF_CACHE") or str(Path.home() / ".cache" / "memos-ref")
    return Path(base).expanduser() / "peers"


def _git_commit(folder: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and len(out.stdout.strip()) == 40 else None


def locate(name: str) -> PeerSource | None:
    """The sources of peer ``name`` (``"vllm"`` or ``"nanovllm"``): the env override, else the fetched pinned
    copy; ``None`` when neither exists."""
    if name not in ENV:
        raise ValueError(f"unknown peer {name!r}; expected one of {sorted(ENV)}")
    override = os.environ.get(ENV[name])
    if override:
        path = Path(override).expanduser()
        info: dict[str, Any] = {"source": f"${ENV[name]}={path}"}
        if name == "vllm":
            info["version"] = _vllm_version_in(path)
        commit = _git_commit(path)
        if commit:
            info["commit"] = commit
        return PeerSource(name, path, info)
    folder = cache_root() / (f"vllm-{VLLM_VERSION}" if name == "vllm" else f"nanovllm-{NANOVLLM_COMMIT[:12]}")
    meta = folder / "PEER.json"
    if not meta.is_file():
        return None
    return PeerSource(name, folder, json.loads(meta.read_text()))


def _vllm_version_in(path: Path) -> str | None:
    """vLLM's version as its source tree states it (``vllm/_version.py``), if it does."""
    version_file = path / "vllm" / "_version.py"
    if not version_file.is_file():
        return None
    for line in version_file.read_text().splitlines():
        if line.startswith(("__version__", "version")) and "=" in line:
            return line.split("=", 1)[1].strip().strip("'\"")
    return None


def _fetch_vllm(root: Path) -> dict[str, Any]:
    folder = root / f"vllm-{VLLM_VERSION}"
    if (folder / "PEER.json").is_file():
        return json.loads((folder / "PEER.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"vllm=={VLLM_VERSION}", "--no-deps", "-d", tmp, "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
            return {"skipped": f"pip download vllm=={VLLM_VERSION} failed: {tail[0]}"}
        wheel = wheels[0]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.infolist():
                name = member.filename
                if not name.startswith("vllm/") or not name.endswith(".py") or ".." in Path(name).parts:
                    continue
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
    info = {
        "version": VLLM_VERSION,
        "source": f"PyPI wheel {wheel.name} (pip download --no-deps), Python sources only",
        "wheel_sha256": digest,
    }
    (staging / "PEER.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return info


def _fetch_nanovllm(root: Path, timeout: float = 20.0) -> dict[str, Any]:
    folder = root / f"nanovllm-{NANOVLLM_COMMIT[:12]}"
    if (folder / "PEER.json").is_file():
        return json.loads((folder / "PEER.json").read_text())
    url = NANOVLLM_URL.format(commit=NANOVLLM_COMMIT)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            data = resp.read(_MAX_ARCHIVE_BYTES + 1)
    except (OSError, ValueError) as exc:
        return {
            "skipped": f"GitHub could not be reached ({type(exc).__name__}: {exc}); set "
            f"{ENV['nanovllm']} to a checkout of commit {NANOVLLM_COMMIT} to compare"
        }
    if len(data) > _MAX_ARCHIVE_BYTES:
        return {"skipped": f"{url} is larger than {_MAX_ARCHIVE_BYTES} bytes"}
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts[1:]  # drop the archive's top folder
            if not member.isfile() or not parts or parts[0] != "nanovllm" or ".." in parts:
                continue
            if not member.name.endswith(".py"):
                continue
            target = staging.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            extracted = tar.extractfile(member)
            if extracted is not None:
                target.write_bytes(extracted.read())
    info = {"commit": NANOVLLM_COMMIT, "source": url, "archive_sha256": hashlib.sha256(data).hexdigest()}
    (staging / "PEER.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return info


def fetch(root: Path | None = None) -> dict[str, dict[str, Any]]:
    """Fetch every pinned peer into ``root`` (default :func:`cache_root`); a peer that cannot be fetched is
    reported with ``skipped`` and its reason, never an exception."""
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return {"vllm": _fetch_vllm(root), "nanovllm": _fetch_nanovllm(root)}


def _redis_server_version() -> str | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.split():
        if word.startswith("v="):
            return word[2:]
    return None


def versions(*names: str) -> dict[str, Any]:
    """The versions of the peers ``names`` as found now (installed packages, the fetched sources, the
    ``redis-server`` on PATH); ``None`` for one that is absent. Known names: vllm, nanovllm, transformers,
    cachetools, redis-py, redis-server."""
    from importlib import metadata

    out: dict[str, Any] = {}
    for name in names:
        if name in ENV:
            src = locate(name)
            out[name] = None if src is None else {k: v for k, v in src.info.items() if k != "skipped"}
        elif name == "redis-server":
            out[name] = _redis_server_version()
        else:
            dist = {"redis-py": "redis"}.get(name, name)
            try:
                out[name] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                out[name] = None
    return out


# --------------------------------------------------------------------------------- loading one file of a peer
class _Stub(types.ModuleType):
    """A module that answers every attribute with a permissive stand-in class (and is a package too)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(name)
        setattr(self, name, value)
        return value


def _stub_class(name: str) -> type:
    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    return type(
        name,
        (),
        {
            "__init__": lambda self, *a, **k: None,
            "__getattr__": lambda self, attr: ignore,
            "__class_getitem__": classmethod(lambda cls, item: cls),
        },
    )


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``wanted`` modules of package ``top`` from ``root``; answers any other ``top.*`` import with a stub."""

    def __init__(self, root: Path, top: str, wanted: set[str]) -> None:
        self.root, self.top, self.wanted = root, top, wanted

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.top and not fullname.startswith(self.top + "."):
            return None
        if fullname in self.wanted:
            file = self.root.joinpath(*fullname.split(".")).with_suffix(".py")
            return importlib.util.spec_from_file_location(fullname, file)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Stub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_with_stubs(
    root: Path, top: str, wanted: list[str], extra: dict[str, types.ModuleType] | None = None
) -> dict[str, types.ModuleType]:
    """Import the modules ``wanted`` (dotted names under package ``top``) from the source files under ``root``,
    with every other import of ``top.*`` they make answered by a stub — so one file of a large project (vLLM's
    ``block_pool.py``) loads without its dependencies. ``extra`` adds stand-ins for third-party modules the files
    import (present only during the import). ``sys.modules`` is restored afterwards: the modules returned stay
    usable, nothing else sees them."""
    for name in wanted:
        if not root.joinpath(*name.split(".")).with_suffix(".py").is_file():
            raise FileNotFoundError(f"{root} has no {name.replace('.', '/')}.py")
    extra = {k: v for k, v in (extra or {}).items() if k not in sys.modules}
    saved = {k: v for k, v in sys.modules.items() if k == top or k.startswith(top + ".")}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(extra)
    finder = _SourceFinder(root, top, set(wanted))
    sys.meta_path.insert(0, finder)
    try:
        return {name: importlib.import_module(name) for name in wanted}
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == top or k.startswith(top + ".")]:
            del sys.modules[k]
        for k in extra:
            sys.modules.pop(k, None)
        sys.modules.update(saved)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m memos_ref.bench.peers", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["fetch", "show"])
    args = parser.parse_args(argv)
    if args.command == "fetch":
        report = fetch()
    else:
        report = {
            name: (None if (src := locate(name)) is None else {**src.info, "path": str(src.path)}) for name in ENV
        }
    print(json.dumps({"root": str(cache_root()), **report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
