"""Session manifests (issue 30's survivors): every tampered case in the older tests was also invalid for another
reason, so the checksum itself was never what refused one; and the vocabulary bound was tested far from the edge.
Here each edit leaves a manifest that is valid in every field but the checksum, and the bound is probed at
``vocab_size - 1`` and ``vocab_size`` exactly."""

from __future__ import annotations

import json

import pytest
import torch

from memos_ref.errors import CorruptCacheError
from memos_ref.session.persist import manifest_checksum, parse_manifest, read_session_tensor, write_session
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
