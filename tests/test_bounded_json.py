"""The library's one bounded JSON parser (issue 27 item 1): every JSON it reads goes through
`_format.load_json`, which checks size and nesting depth before parsing, so a hostile file is
refused as the documented error naming the file, never a bare RecursionError or ValueError.
The property-based variants of these files are in tests/test_fuzz_*.py."""

import json
import os
import struct

import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer import _format
from checkpointer._cli import _main as _cli
from checkpointer._commit import _directory

DEEP = 50_000


def _nested(levels):
    return b"[" * levels + b"]" * levels


def _safetensors(path, header: bytes, data: bytes = b""):
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


# --- the parser ----------------------------------------------------------------------------


@pytest.mark.parametrize("text, depth", [
    (b"1", 0), (b"[]", 1), (b'[[1], {"a": [2]}]', 3), (b'"[[[["', 0), (b'["\\"[["]', 1),
    (b'{"a\\\\": [[]]}', 3), (b'"\\\\\\\\"', 0), ('[["é[ü{"]]'.encode(), 2),
])
def test_json_depth_counts_brackets_outside_strings_only(text, depth):
    assert _format.json_depth(text) == depth


def test_json_depth_follows_escapes_across_its_scan_chunks(monkeypatch):
    monkeypatch.setattr(_format._json, "_SCAN_CHUNK", 8)
    values = (["aaaa\\", [[]]], ["aaaaa\"[[]]"], ["aaaaaa\\\"[[", [[[{"\\": []}]]]], [[[[[[[[[[]]]]]]]]]])
    for text in (json.dumps(v).encode() for v in values):
        assert _format.json_depth(text) == _depth_of(json.loads(text)), text


def _depth_of(obj):
    if isinstance(obj, dict):
        obj = list(obj.values())
    return 1 + max(map(_depth_of, obj), default=0) if isinstance(obj, list) else 0


def test_load_json_refuses_depth_size_and_malformed_as_the_callers_error():
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"f\.json nests arrays and objects 50000 levels deep"):
        _format.load_json(_nested(DEEP), what="f.json")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"f\.json nests .* 3 levels deep, more than the 2"):
        _format.load_json(b"[[[]]]", what="f.json", max_depth=2)
    assert _format.load_json(b"[[]]", what="f.json", max_depth=2) == [[]]
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"f\.json is larger than 4 bytes"):
        _format.load_json(b"[1, 2]", what="f.json", max_bytes=4)
    with pytest.raises(ckpt.RestoreAgreementError, match=r"f\.json is not valid JSON"):
        _format.load_json(b"{", what="f.json", error=ckpt.RestoreAgreementError)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"f\.json is not valid JSON"):
        _format.load_json("[\ud800", what="f.json")


# --- every reader: nested 50,000 levels deep -------------------------------------------------


def test_a_deeply_nested_safetensors_header_names_the_file(tmp_path):
    f = str(tmp_path / "model.safetensors")
    _safetensors(f, b'{"x": ' + _nested(DEEP) + b"}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="model.safetensors") as e:
        ckpt.restore_safetensors(f, {"x": np.zeros(1, np.float32)})
    assert not isinstance(e.value.__cause__, RecursionError) and not isinstance(e.value.__context__, RecursionError)


def test_a_deeply_nested_safetensors_index_names_the_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + _nested(DEEP) + b"}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="model.safetensors.index.json"):
        ckpt.restore_safetensors(str(tmp_path), {"x": np.zeros(1, np.float32)})


def test_a_zero_sized_shape_too_large_for_numpy_names_the_file_and_tensor(tmp_path):
    f = str(tmp_path / "model.safetensors")
    _safetensors(f, json.dumps({"x": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}}).encode())
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"model\.safetensors.*tensor 'x' has shape \(0, 4611686018427387904\)"):
        ckpt.restore_safetensors(f, {"x": None})


def _run_with_a_deep_journal_line(tmp_path):
    d = str(tmp_path / "run")
    with ckpt.CheckpointManager(d) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": np.full((4,), step, np.float32)})
    with open(os.path.join(d, _directory.SAVE_JOURNAL), "ab") as f:
        f.write(_nested(DEEP) + b"\n")
    return d


def test_status_and_timeline_skip_a_deeply_nested_journal_line(tmp_path, capsys):
    d = _run_with_a_deep_journal_line(tmp_path)
    code = _cli.main(["status", d, "--max-lag-steps", "0", "--max-age-s", "3600"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "internal error" not in out + err
    code = _cli.main(["timeline", d])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "internal error" not in out + err and "RecursionError" not in out + err


def test_the_follower_skips_a_deeply_nested_journal_line(tmp_path):
    from checkpointer._manage import _follow
    from checkpointer._storage import storage_for

    d = _run_with_a_deep_journal_line(tmp_path)
    storage, path = storage_for(d)
    assert _follow._JournalSteps(storage, path).update() == {1, 2}


def test_import_orbax_of_a_deeply_nested_metadata_is_the_documented_error(tmp_path):
    src = tmp_path / "orbax"
    src.mkdir()
    (src / "_METADATA").write_bytes(b'{"tree_metadata": ' + _nested(DEEP) + b"}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="_METADATA"):
        ckpt.import_orbax(str(src), str(tmp_path / "out"))


def test_a_dtype_that_is_not_a_string_names_the_file_and_tensor(tmp_path):
    """Found by tests/test_fuzz_safetensors.py: a list as dtype escaped as TypeError."""
    f = str(tmp_path / "model.safetensors")
    _safetensors(f, json.dumps({"x": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4)
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"model\.safetensors.*tensor 'x' has dtype \[\]"):
        ckpt.restore_safetensors(f, {"x": None})


def test_an_orbax_value_type_that_is_not_a_string_is_the_documented_error(tmp_path):
    """Found by tests/test_fuzz_tools.py: a list as value_type escaped as TypeError."""
    src = tmp_path / "orbax"
    src.mkdir()
    (src / "_METADATA").write_text(json.dumps({"tree_metadata": {"('w',)": {
        "key_metadata": [{"key": "w", "key_type": 2}], "value_metadata": {"value_type": [], "skip_deserialize": False}}}}))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"_METADATA: the value_type of \('w',\) is \[\]"):
        ckpt.import_orbax(str(src), str(tmp_path / "out"))
