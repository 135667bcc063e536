"""Session manifests (issue 30's survivors): every tampered case in the older tests was also invalid for another
reason, so the checksum itself was never what refused one; and the vocabulary bound was tested far from the edge.
Here each edit leaves a manifest that is valid in every field but the checksum, and the bound is probed at
``vocab_size - 1`` and ``vocab_size`` exactly."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_tensors

from memos_ref.errors import ArgumentTypeError, CorruptCacheError, InvalidArgumentError
from memos_ref.session.persist import (
    MAX_TENSOR_HEADER_BYTES,
    manifest_checksum,
    parse_manifest,
    read_bounded,
    read_session_tensor,
    session_files,
    write_session,
)
from memos_ref.session.segments import Segment, SegmentKind
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)
VOCAB = 300


@pytest.fixture
def saved(tmp_path):
    tokens = [1, 2, 3, VOCAB - 1, 5]
    kv = torch.randn(2, 2, 2, len(tokens), 4, generator=torch.Generator().manual_seed(5))
    segments = [Segment(SegmentKind.SYSTEM, "sys", 0, 2), Segment(SegmentKind.USER, "u1", 2, 5)]
    path = write_session(tmp_path / "s", kv, "model-fp", SPEC, tokens, segments)
    manifest_path = path.with_suffix(".json")
    return manifest_path, json.loads(manifest_path.read_bytes()), kv


# one edit per field, each leaving a value that every other check accepts
EDITS = {
    "fingerprint": lambda m: m.update(fingerprint="another-model"),
    "token_ids": lambda m: m["token_ids"].__setitem__(0, 7),
    "segments": lambda m: m["segments"][1].update(seg_id="u2"),
    "segment kind": lambda m: m["segments"][1].update(kind="assistant"),
    "segment range": lambda m: m["segments"][0].update(stop=1),
    "bytes": lambda m: m.update(bytes=m["bytes"] + 1),
    "sha256": lambda m: m.update(sha256="0" * 64),
    "kv_spec": lambda m: m["kv_spec"].update(block_size=16),
}


def _with(manifest: dict, edit, *, resign: bool) -> bytes:
    m = json.loads(json.dumps(manifest))
    edit(m)
    if resign:
        m["manifest_sha256"] = manifest_checksum(m)
    return json.dumps(m).encode()


@pytest.mark.parametrize("field", sorted(EDITS))
def test_an_edited_manifest_is_refused_by_its_checksum_alone(saved, field):
    """The same edit with the checksum recomputed parses (so the edit is valid in itself); without it, the manifest
    is refused, and the error says the checksum did not match."""
    path, manifest, _ = saved
    parse_manifest(_with(manifest, EDITS[field], resign=True), path, VOCAB)  # valid apart from the checksum
    with pytest.raises(CorruptCacheError, match="does not match its checksum"):
        parse_manifest(_with(manifest, EDITS[field], resign=False), path, VOCAB)


def test_the_saved_session_round_trips(saved):
    """The control: what write_session wrote parses and its tensor reads back bit-identical."""
    path, manifest, kv = saved
    parsed = parse_manifest(path.read_bytes(), path, VOCAB)
    assert parsed["token_ids"] == manifest["token_ids"] and parsed["spec"] == SPEC
    assert torch.equal(read_session_tensor(path.with_suffix(".safetensors"), parsed, SPEC), kv)


def test_a_flipped_checksum_digit_is_refused(saved):
    path, manifest, _ = saved
    m = dict(manifest)
    digit = m["manifest_sha256"][-1]
    m["manifest_sha256"] = m["manifest_sha256"][:-1] + ("0" if digit != "0" else "1")
    with pytest.raises(CorruptCacheError, match="does not match its checksum"):
        parse_manifest(json.dumps(m).encode(), path, VOCAB)


@pytest.mark.parametrize("token, ok", [(0, True), (VOCAB - 1, True), (VOCAB, False), (-1, False)])
def test_token_ids_are_bounded_by_the_vocabulary_exactly(saved, token, ok):
    """Ids 0..vocab_size-1 load; vocab_size (one past the last embedding row) and -1 are refused, naming the bound,
    even in a manifest whose checksum was recomputed."""
    path, manifest, _ = saved
    raw = _with(manifest, lambda m: m["token_ids"].__setitem__(2, token), resign=True)
    if ok:
        assert parse_manifest(raw, path, VOCAB)["token_ids"][2] == token
    else:
        with pytest.raises(CorruptCacheError, match=rf"token_ids\[2\] must be an int in \[0, {VOCAB}\)"):
            parse_manifest(raw, path, VOCAB)


# ---------------------------------------------------------------- issue 30, full mutmut run of persist.py
def _resigned(manifest: dict, edit) -> bytes:
    return _with(manifest, edit, resign=True)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_manifest_with_a_non_json_number_is_refused_saying_so(saved, constant):
    """NaN and the infinities are not JSON: a manifest holding one is refused while it is read, and the error names
    the constant (not a later, unrelated complaint such as the checksum)."""
    path, manifest, _ = saved
    raw = json.dumps(manifest).replace(f'"bytes": {manifest["bytes"]}', f'"bytes": {constant}').encode()
    assert constant.encode() in raw
    with pytest.raises(CorruptCacheError, match=rf"cannot read the session manifest: {constant} is not JSON"):
        parse_manifest(raw, path, VOCAB)


BAD_SEGMENTS = {
    "not a list": (lambda m: m.update(segments={"a": 1}), r"segments must be a list, got dict"),
    "not an object": (lambda m: m["segments"].__setitem__(0, [1]), r"segments\[0\] must be an object with fields"),
    "bad kind": (
        lambda m: m["segments"][1].update(kind="bogus"),
        r"segments\[1\]\.kind must be one of \['system', .*got 'bogus'",
    ),
    "seg_id too long": (
        lambda m: m["segments"][1].update(seg_id="x" * 4097),
        r"segments\[1\]\.seg_id must be a string of at most 4096 characters",
    ),
    "seg_id not a string": (
        lambda m: m["segments"][1].update(seg_id=7),
        r"segments\[1\]\.seg_id must be a string of at most 4096 characters, got 7",
    ),
    "overlapping": (
        lambda m: m["segments"][1].update(start=1),
        r"segments\[1\] range \[1, 5\) must be ints with 2 <= start <= stop <= 5",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SEGMENTS))
def test_a_bad_segment_is_refused_naming_what_was_expected_and_what_came(saved, case):
    """Each malformed segment (in a manifest whose checksum was recomputed, so only the segment is wrong) is refused
    with a CorruptCacheError saying which segment, what was expected and what it holds."""
    path, manifest, _ = saved
    edit, message = BAD_SEGMENTS[case]
    with pytest.raises(CorruptCacheError, match=message):
        parse_manifest(_resigned(manifest, edit), path, VOCAB)


def test_segment_bounds_are_inclusive_where_the_format_says_so(saved):
    """A seg_id of exactly 4096 characters loads, and so does an empty segment (start == stop)."""
    path, manifest, _ = saved
    parsed = parse_manifest(_resigned(manifest, lambda m: m["segments"][1].update(seg_id="y" * 4096)), path, VOCAB)
    assert parsed["segments"][1].seg_id == "y" * 4096

    def empty_tail(m):
        m["segments"].append({"kind": "user", "seg_id": "u2", "start": 5, "stop": 5})

    parsed = parse_manifest(_resigned(manifest, empty_tail), path, VOCAB)
    assert [(s.start, s.stop) for s in parsed["segments"]] == [(0, 2), (2, 5), (5, 5)]


def _payload_bytes(tokens: int) -> int:
    return SPEC.num_layers * 2 * SPEC.num_kv_heads * tokens * SPEC.head_dim * 4  # float32


@pytest.mark.parametrize(
    "extra, in_bounds",
    [(7, False), (8, True), (8 + MAX_TENSOR_HEADER_BYTES, True), (9 + MAX_TENSOR_HEADER_BYTES, False)],
)
def test_the_declared_tensor_size_is_bounded_by_the_geometry_exactly(saved, extra, in_bounds):
    """The manifest's byte count must lie in [payload + 8, payload + 8 + MAX_TENSOR_HEADER_BYTES] (the safetensors
    length prefix and a bounded header): outside it the file is refused before it is read, naming both figures;
    inside it, the file is read and (here, as the count is wrong) refused by its size or checksum."""
    path, _manifest, _ = saved
    parsed = parse_manifest(path.read_bytes(), path, VOCAB)
    payload = _payload_bytes(len(parsed["token_ids"]))
    parsed["bytes"] = payload + extra
    tensor = path.with_suffix(".safetensors")
    if in_bounds:  # read, then refused by the file's own size or checksum, not by the bound
        with pytest.raises(CorruptCacheError, match=r"does not match its checksum|expected at most") as info:
            read_session_tensor(tensor, parsed, SPEC)
        assert "the manifest declares" not in str(info.value)
    else:
        expected = rf"declares {payload + extra} bytes, but KV of shape .* takes {payload} bytes plus a header of at"
        with pytest.raises(CorruptCacheError, match=expected):
            read_session_tensor(tensor, parsed, SPEC)


def _replace_tensor_file(path, parsed: dict, data: bytes) -> None:
    """Write ``data`` as the session's tensor file and make the manifest's size and checksum agree with it, so only
    the content can be what is refused."""
    path.with_suffix(".safetensors").write_bytes(data)
    parsed["bytes"], parsed["sha256"] = len(data), hashlib.sha256(data).hexdigest()


def test_a_tensor_file_with_the_wrong_content_is_refused_saying_what_it_holds(saved):
    """Files whose size and checksum match the manifest but whose content is wrong: not safetensors, an extra
    tensor, or the right byte count in the wrong shape. Each is refused naming what it holds."""
    path, _manifest, kv = saved
    parsed = parse_manifest(path.read_bytes(), path, VOCAB)
    tensor = path.with_suffix(".safetensors")
    size = _payload_bytes(len(parsed["token_ids"])) + 8
    _replace_tensor_file(path, parsed, b"\x10" + b"\x00" * (size - 1))  # a header length pointing past the end
    with pytest.raises(CorruptCacheError, match=r"is not a readable session tensor file: \S") as info:
        read_session_tensor(tensor, parsed, SPEC)
    assert "file: None" not in str(info.value)
    _replace_tensor_file(path, parsed, save_tensors({"kv": kv.contiguous(), "a": torch.zeros(1)}))
    with pytest.raises(CorruptCacheError, match=r"must hold exactly one tensor 'kv', holds \['a', 'kv'\]"):
        read_session_tensor(tensor, parsed, SPEC)
    wrong_shape = kv.reshape(2, 2, 2, 4, 5).contiguous()  # the same byte count
    _replace_tensor_file(path, parsed, save_tensors({"kv": wrong_shape}))
    with pytest.raises(CorruptCacheError, match=r"has shape \(2, 2, 2, 4, 5\), the manifest implies \(2, 2, 2, 5, 4\)"):
        read_session_tensor(tensor, parsed, SPEC)


def test_a_parser_error_is_quoted_at_most_200_characters(saved, monkeypatch):
    """A hostile file can make the tensor parser's message as long as it likes; the refusal quotes its first 200
    characters only. (safetensors' own messages are short, so a parser that fails with a long one stands in.)"""
    import memos_ref.session.persist as persist

    def long_failure(data):
        raise ValueError("x" * 199 + "yz" + "w" * 300)

    monkeypatch.setattr(persist, "safetensors_load", long_failure)
    path, _manifest, _kv = saved
    parsed = parse_manifest(path.read_bytes(), path, VOCAB)
    with pytest.raises(CorruptCacheError) as info:
        read_session_tensor(path.with_suffix(".safetensors"), parsed, SPEC)
    assert str(info.value).endswith("is not a readable session tensor file: " + "x" * 199 + "y")


def test_an_older_manifest_version_is_refused_saying_to_save_again(saved):
    """A version-1 manifest (valid otherwise, checksum recomputed) is refused naming both versions and what to do."""
    path, manifest, _kv = saved
    with pytest.raises(CorruptCacheError, match=r"manifest version 1 is not 2 \(earlier versions are not checksummed"
                       r" as a whole and are refused: save the session again with this version\)"):  # fmt: skip
        parse_manifest(_resigned(manifest, lambda m: m.update(version=1)), path, VOCAB)


def test_the_manifest_limit_falls_back_to_the_module_default(monkeypatch):
    """memos_ref.session.MAX_MANIFEST_BYTES is the knob; without it the limit is persist's own default."""
    import memos_ref.session
    import memos_ref.session.persist as persist

    monkeypatch.setattr(memos_ref.session, "MAX_MANIFEST_BYTES", 1234)
    assert persist.manifest_limit() == 1234
    monkeypatch.delattr(memos_ref.session, "MAX_MANIFEST_BYTES")
    assert persist.manifest_limit() == persist.MAX_MANIFEST_BYTES == 32 << 20


# ---------------------------------------------------------------- issue 30, second full mutmut run: the canonical form
def test_the_manifest_checksum_is_sha256_of_the_documented_canonical_json():
    """The checksum covers canonical JSON: keys sorted at every depth, no spaces, non-ASCII escaped as \\uXXXX, and
    ``manifest_sha256`` itself left out. The oracle is SHA-256 over bytes written out by hand."""
    manifest = {"manifest_sha256": "left out", "zeta": [1, 2.5], "alpha": {"b": "modèle", "a": None}}
    canonical = b'{"alpha":{"a":null,"b":"mod\\u00e8le"},"zeta":[1,2.5]}'
    assert manifest_checksum(manifest) == hashlib.sha256(canonical).hexdigest()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_canonical_form_refuses_nan_and_the_infinities(value):
    """NaN and the infinities have no JSON spelling, so no canonical form: checksumming a manifest holding one is
    refused rather than hashing Python's non-standard ``NaN``/``Infinity``."""
    with pytest.raises(ValueError, match="not JSON compliant"):
        manifest_checksum({"format": "memos-ref-session", "bytes": value})


def test_a_manifest_written_by_another_implementation_following_the_canonical_form_loads(saved):
    """A writer that follows the documented canonical form (here: the checksum computed with a hand-written
    ``json.dumps`` using those options) but lays its file out differently (keys in another order, indented, UTF-8
    rather than escapes) produces a manifest that verifies and loads."""
    path, manifest, _ = saved
    foreign = {key: manifest[key] for key in reversed(sorted(manifest)) if key != "manifest_sha256"}
    foreign["fingerprint"] = "modèle-ü"
    canonical = json.dumps(foreign, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    foreign["manifest_sha256"] = hashlib.sha256(canonical.encode("ascii")).hexdigest()
    raw = json.dumps(foreign, indent=2, ensure_ascii=False).encode("utf-8")
    assert "modèle-ü".encode() in raw and b", " not in raw.replace(b",\n", b"")
    parsed = parse_manifest(raw, path, VOCAB)
    assert parsed["fingerprint"] == "modèle-ü" and parsed["token_ids"] == manifest["token_ids"]


# ---------------------------------------------------------------- issue 30, second full mutmut run: read_bounded
def test_read_bounded_names_the_argument_and_what_it_got(tmp_path):
    """Each refused argument is named with what was expected and what came (the package's error contract), and a
    limit of 0 is a valid bound: an empty file reads as ``b""``, a one-byte file is refused."""
    empty, one = tmp_path / "empty", tmp_path / "one"
    empty.write_bytes(b"")
    one.write_bytes(b"x")
    with pytest.raises(ArgumentTypeError, match=r"^path: expected str or PathLike, got int \(3\)$"):
        read_bounded(3, 10)
    with pytest.raises(ArgumentTypeError, match=r"^limit: expected int, got float \(1\.5\)$"):
        read_bounded(empty, 1.5)
    with pytest.raises(InvalidArgumentError, match=r"^limit: expected a number of bytes >= 0, got -1$"):
        read_bounded(empty, -1)
    assert read_bounded(empty, 0) == b""
    with pytest.raises(CorruptCacheError, match=r"holds 1 bytes, more than the 0 expected at most$"):
        read_bounded(one, 0)


def test_a_path_that_cannot_be_opened_is_named_and_quoted_at_most_200_characters(tmp_path):
    """A missing file is refused naming it; a hostile path (here 300 characters and a NUL) is quoted by its first 200
    characters only."""
    missing = tmp_path / "missing.json"
    with pytest.raises(CorruptCacheError) as info:
        read_bounded(missing, 10)
    assert str(info.value).startswith(f"cannot open {str(missing)!r}: [Errno {errno.ENOENT}]")
    with pytest.raises(CorruptCacheError) as info:
        read_bounded("x" * 300 + "\x00", 10)
    assert str(info.value) == f"cannot open {'x' * 200!r}: embedded null byte"


@contextlib.contextmanager
def _reads_recorded(monkeypatch, after_read=None):
    """``os.read`` spied on: yields the list of ``(bytes asked, bytes returned)``; ``after_read(call_index)`` runs
    after each read (another writer, say)."""
    real_read, calls = os.read, []

    def spy(fd, n):
        chunk = real_read(fd, n)
        calls.append((n, len(chunk)))
        if after_read is not None:
            after_read(len(calls) - 1)
        return chunk

    with monkeypatch.context() as m:
        m.setattr(os, "read", spy)
        yield calls


def test_a_large_file_is_read_in_chunks_of_at_most_1_mib_never_asking_past_limit_plus_one(tmp_path, monkeypatch):
    """A 2.5 MiB file at a 2.5 MiB limit comes back byte-identical, read in chunks of at most 1 MiB (so a large
    limit never allocates a buffer of its own size), and no read asks for more than the ``limit + 1`` bytes the
    bound allows in total."""
    limit = 5 << 19  # 2.5 MiB
    data = bytes(range(256)) * (limit // 256)
    path = tmp_path / "big"
    path.write_bytes(data)
    with _reads_recorded(monkeypatch) as calls:
        assert read_bounded(path, limit) == data
    assert max(n for n, _ in calls) == 1 << 20 and len(calls) >= 3
    received = 0
    for asked, got in calls:
        assert asked <= limit + 1 - received
        received += got
    assert received == limit


def test_a_file_that_grows_after_its_size_is_checked_is_refused_not_truncated(tmp_path, monkeypatch):
    """Another writer appends between the size check and the read: the file is refused (it grew past the limit),
    never returned cut at the limit."""
    path = tmp_path / "m.json"
    path.write_bytes(b"x" * 10)
    real_fstat = os.fstat

    def fstat_then_append(fd):
        info = real_fstat(fd)
        with open(path, "ab") as fh:
            fh.write(b"y" * 5)
        return info

    with monkeypatch.context() as m:
        m.setattr(os, "fstat", fstat_then_append)
        with pytest.raises(CorruptCacheError, match=rf"^{re.escape(str(path))} grew past 10 bytes while being read$"):
            read_bounded(path, 10)


def test_a_file_that_grows_while_read_is_refused_after_at_most_limit_plus_one_bytes(tmp_path, monkeypatch):
    """The file holds exactly ``limit`` bytes at the first read, then another writer appends 1000 more: one extra
    byte is read to find that out, and the file is refused — having read ``limit + 1`` bytes of it, no more."""
    path = tmp_path / "m.json"
    path.write_bytes(b"x" * 10)

    def append_once(index):
        if index == 0:
            with open(path, "ab") as fh:
                fh.write(b"y" * 1000)

    with (
        _reads_recorded(monkeypatch, append_once) as calls,
        pytest.raises(CorruptCacheError, match=r"grew past 10 bytes while being read$"),
    ):
        read_bounded(path, 10)
    assert sum(got for _, got in calls) == 11


def test_a_read_error_is_refused_naming_the_file_and_the_cause(tmp_path, monkeypatch):
    """A failing disk (an ``OSError`` from the read itself) is a CorruptCacheError naming the file and the cause."""
    path = tmp_path / "m.json"
    path.write_bytes(b"x" * 10)

    def failing_read(fd, n):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(os, "read", failing_read)
        with pytest.raises(CorruptCacheError) as info:
            read_bounded(path, 10)
    assert str(info.value) == f"cannot read {path}: [Errno {errno.EIO}] Input/output error"


def test_read_bounded_works_where_the_platform_has_no_o_nonblock(tmp_path, monkeypatch):
    """Windows' ``os`` has no ``O_NONBLOCK``: the flag is then left out (not ``None``, not another flag such as
    ``O_WRONLY``) and the file reads as usual. Simulated here by removing the attribute."""
    path = tmp_path / "m.json"
    path.write_bytes(b"x" * 10)
    with monkeypatch.context() as m:
        m.delattr(os, "O_NONBLOCK")
        assert read_bounded(path, 10) == b"x" * 10


@pytest.mark.skipif(not hasattr(os, "O_CLOEXEC") or hasattr(os, "O_BINARY"), reason="the stand-in is POSIX's O_CLOEXEC")
def test_read_bounded_asks_for_o_binary_where_the_platform_has_it(tmp_path, monkeypatch):
    """On Windows a descriptor opened without ``O_BINARY`` is in text mode (CRLF translated, Ctrl-Z read as the end
    of the file), which would change the bytes checksummed. Where ``os`` has ``O_BINARY`` it is passed to
    ``os.open``; simulated here with a harmless real flag (``O_CLOEXEC``) standing in for it."""
    path = tmp_path / "m.json"
    path.write_bytes(b"a\r\nb\x1ac")
    real_open, flags = os.open, []

    def spy(file, flag, *args, **kwargs):
        flags.append(flag)
        return real_open(file, flag, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "O_BINARY", os.O_CLOEXEC, raising=False)
        m.setattr(os, "open", spy)
        assert read_bounded(path, 10) == b"a\r\nb\x1ac"
    assert len(flags) == 1 and flags[0] & os.O_CLOEXEC and flags[0] & os.O_NONBLOCK


# ---------------------------------------------------------------- issue 30, second full mutmut run: parse_manifest
def _refused_exactly(raw: bytes, path, message: str) -> None:
    """``parse_manifest`` refuses ``raw`` with exactly ``"<path>: <message>"``."""
    with pytest.raises(CorruptCacheError) as info:
        parse_manifest(raw, path, VOCAB)
    assert str(info.value) == f"{path}: {message}"


EXPECTED_FIELDS = (
    "['bytes', 'fingerprint', 'format', 'kv_spec', 'manifest_sha256', 'segments', 'sha256', 'token_ids', 'version']"
)


def test_what_is_not_a_session_manifest_is_refused_for_that_reason(saved):
    """JSON that is not an object (a list, a string, a number) and an object of another format (valid in every
    other field, checksum recomputed) are refused saying what a session manifest is."""
    path, manifest, _ = saved
    message = "is not a memos-ref session manifest (format 'memos-ref-session')"
    for raw in [b"[1, 2]", b'"memos-ref-session"', b"7", b"null"]:
        _refused_exactly(raw, path, message)
    _refused_exactly(_resigned(manifest, lambda m: m.update(format="memos-ref-session-v3")), path, message)


def test_a_manifest_with_an_extra_field_is_refused_naming_both_field_lists(saved):
    path, manifest, _ = saved
    raw = _resigned(manifest, lambda m: m.update(comment="hi"))
    got = EXPECTED_FIELDS.replace("'bytes', ", "'bytes', 'comment', ")
    _refused_exactly(raw, path, f"manifest fields {got} are not the expected {EXPECTED_FIELDS}")


def test_a_checksum_mismatch_is_refused_with_exactly_its_message(saved):
    path, manifest, _ = saved
    raw = _with(manifest, lambda m: m.update(fingerprint="another-model"), resign=False)
    _refused_exactly(raw, path, "the manifest does not match its checksum (modified or damaged)")


def test_a_reader_error_is_quoted_at_most_200_characters(saved, monkeypatch):
    """The JSON reader's message is quoted by its first 200 characters only (the standard library's are short, so
    a reader failing with a long one stands in)."""
    path, _manifest, _ = saved

    def long_failure(text, **kwargs):
        raise ValueError("x" * 199 + "yz" + "w" * 300)

    monkeypatch.setattr(json, "loads", long_failure)
    _refused_exactly(b"{}", path, "cannot read the session manifest: " + "x" * 199 + "y")


@pytest.mark.parametrize("length, ok", [(0, False), (1, True), (256, True), (257, False)])
def test_the_fingerprint_length_is_bounded_exactly(saved, length, ok):
    """A fingerprint of 1 to 256 characters loads; an empty one or one of 257 is refused, quoting at most 80
    characters of it."""
    path, manifest, _ = saved
    raw = _resigned(manifest, lambda m: m.update(fingerprint="f" * length))
    if ok:
        assert parse_manifest(raw, path, VOCAB)["fingerprint"] == "f" * length
    else:
        got = repr("f" * length)[:80]
        _refused_exactly(raw, path, f"fingerprint must be a non-empty string of at most 256 characters, got {got}")


@pytest.mark.parametrize(
    "digest",
    ["a" * 63, "a" * 65, "A" * 64, "X" * 64, "g" * 64, 5, ["a"] * 64],
    ids=["63-digits", "65-digits", "upper-case", "X", "g", "a-number", "a-list"],
)
def test_a_tensor_digest_that_is_not_64_lowercase_hex_digits_is_refused(saved, digest):
    """The tensor file's sha256 must be 64 lowercase hex digits: too short, too long, upper case, other letters, a
    number or a list of digits are refused, quoting what came."""
    path, manifest, _ = saved
    raw = _resigned(manifest, lambda m: m.update(sha256=digest))
    _refused_exactly(raw, path, f"sha256 must be 64 lowercase hex digits, got {repr(digest)[:80]}")


@pytest.mark.parametrize("value, ok", [(0, True), (-1, False), ("12", False), (True, False), (1.0, False)])
def test_the_declared_byte_count_is_a_non_negative_int(saved, value, ok):
    """0 is a valid count for the manifest (the tensor check later compares it with the geometry); a negative
    number, a string, a bool or a float is refused, quoting it."""
    path, manifest, _ = saved
    raw = _resigned(manifest, lambda m: m.update(bytes=value))
    if ok:
        assert parse_manifest(raw, path, VOCAB)["bytes"] == value
    else:
        _refused_exactly(raw, path, f"bytes must be a non-negative int, got {value!r}")


def test_a_kv_spec_that_is_not_an_object_or_not_canonical_is_refused_saying_why(saved):
    """A kv_spec that is not a JSON object is refused naming the type it is; one that KVSpec reads but would not
    have written (``bytes_per_token`` left out) is refused showing both dicts."""
    path, manifest, _ = saved
    _refused_exactly(
        _resigned(manifest, lambda m: m.update(kv_spec=[1])),
        path,
        "kv_spec is malformed: expected an object, got list",
    )
    short = {k: v for k, v in SPEC.to_dict().items() if k != "bytes_per_token"}
    _refused_exactly(
        _resigned(manifest, lambda m: m.update(kv_spec=short)),
        path,
        f"kv_spec {short} is not what KVSpec.to_dict() writes: {SPEC.to_dict()}",
    )


@pytest.mark.parametrize("tokens, kind", [([], "list"), ({}, "dict"), (5, "int")])
def test_token_ids_must_be_a_non_empty_list(saved, tokens, kind):
    """An empty token list (with no segments, so nothing else is wrong), an object or a number is refused naming
    the type that came."""
    path, manifest, _ = saved
    raw = _resigned(manifest, lambda m: m.update(token_ids=tokens, segments=[]))
    _refused_exactly(raw, path, f"token_ids must be a non-empty list, got {kind}")


# ---------------------------------------------------------------- issue 30, second full mutmut run: paths and writes
def test_session_files_refuses_a_nul_a_bytes_path_and_a_path_without_a_name():
    """A path with a NUL, a bytes path (``os.fspath`` of a bytes-like) and a path with no file name to put a suffix on
    are each an InvalidArgumentError naming ``path``, what was expected and what came."""
    nul = "a\x00b"
    for bad in [nul, b"dir/s"]:
        with pytest.raises(InvalidArgumentError) as info:
            session_files(bad)
        assert str(info.value) == f"path: expected a file path without NUL characters, got {bad!r}"
    for nameless in ["", "/"]:
        with pytest.raises(InvalidArgumentError) as info:
            session_files(nameless)
        assert re.fullmatch(rf"path: expected a file path, got {nameless!r} \(.*has an empty name\)", str(info.value))
    assert session_files("dir/s") == (Path("dir/s.json"), Path("dir/s.safetensors"))


def _save(path):
    kv = torch.zeros(2, 2, 2, 1, 4)
    return write_session(path, kv, "model-fp", SPEC, [1], [Segment(SegmentKind.USER, "u", 0, 1)])


def test_each_file_is_written_under_a_private_hidden_temporary_name_then_renamed(tmp_path, monkeypatch):
    """Each file is written to a hidden sibling ``.<name>.<pid>.<8 random hex digits>.tmp`` and renamed into place
    (tensor first, manifest last): per process and random, so concurrent writers never share a temporary file and a
    leftover is recognisable. Two saves use four distinct names, and only the pair remains."""
    real_replace, renames = os.replace, []

    def spy(src, dst):
        renames.append((Path(src), Path(dst)))
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", spy)
        _save(tmp_path / "s")
        _save(tmp_path / "s")
    assert [dst.name for _, dst in renames] == ["s.safetensors", "s.json"] * 2
    for src, dst in renames:
        assert src.parent == dst.parent == tmp_path
        assert re.fullmatch(rf"\.{re.escape(dst.name)}\.{os.getpid()}\.[0-9a-f]{{8}}\.tmp", src.name)
    assert len({src for src, _ in renames}) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.safetensors"]


def test_saving_into_a_missing_folder_is_an_invalid_argument_naming_the_path(tmp_path):
    """The path's folder does not exist: an InvalidArgumentError naming ``path``, the file and the cause (not an
    error from cleaning up a temporary file that was never created), and nothing is written."""
    target = tmp_path / "missing" / "s"
    with pytest.raises(InvalidArgumentError) as info:
        _save(target)
    tensor_file = target.with_suffix(".safetensors")
    assert str(info.value).startswith(f"path: cannot write {tensor_file}: [Errno {errno.ENOENT}]")
    assert list(tmp_path.iterdir()) == []


def test_a_write_failing_for_another_reason_raises_that_error_and_leaves_nothing(tmp_path, monkeypatch):
    """Running out of descriptors (EMFILE) is not a bad path: that OSError itself propagates (not masked by the
    clean-up of a temporary file that was never created) and the folder is left as it was."""
    import memos_ref.session.persist as persist

    def no_descriptors(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(persist, "open", no_descriptors, raising=False)
    with pytest.raises(OSError) as info:
        _save(tmp_path / "s")
    assert type(info.value) is OSError and info.value.errno == errno.EMFILE
    assert list(tmp_path.iterdir()) == []


def test_the_longest_legal_session_name_saves_and_a_longer_one_is_an_invalid_argument(tmp_path):
    """A session whose file names are as long as the file system allows saves and loads; one whose names are longer
    is an InvalidArgumentError naming ``path`` (a path that cannot be written), leaving nothing behind."""
    stem = "b" * (os.pathconf(tmp_path, "PC_NAME_MAX") - len(".safetensors"))
    path = _save(tmp_path / stem)
    assert parse_manifest(path.with_suffix(".json").read_bytes(), path, VOCAB)["token_ids"] == [1]
    with pytest.raises(InvalidArgumentError, match=r"^path: cannot write"):
        _save(tmp_path / (stem + "cc"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [stem + ".json", stem + ".safetensors"]
