"""Exports that cannot half-fail: reserved names refused before a file is opened, no
temporary or partial output left by a failure, and `leaves=` / `--leaves` selection."""

import json
import os

import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._cli import _main as _cli


def _train_tree():
    rng = np.random.default_rng(0)
    return {
        "params": {"dense": {"kernel": rng.standard_normal((8, 4)).astype(np.float32), "bias": np.zeros(4, np.float32)}},
        "opt_state": [{"mu": {"dense": {"kernel": np.ones((8, 4), np.float32)}}, "count": np.int32(3)}],
        "step": 3,
    }


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.exists(folder) else []


def test_safetensors_export_refuses_a_reserved_tensor_name_before_opening_a_file(tmp_path, monkeypatch):
    ckpt.save(str(tmp_path / "1"), {"__metadata__": np.ones(2, np.float32), "w": np.zeros(3, np.float32)})
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
    with pytest.raises(ckpt.UnsupportedValueError, match=r"'__metadata__'.*reserves.*nothing was written"):
        ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"))
    assert not (tmp_path / "st").exists()
    assert not [f for f in opened if f.startswith(str(tmp_path / "st"))]
    # The other leaves export when the reserved one is left out.
    report = ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), leaves="w")
    assert list(report.tensors) == ["w"]


@pytest.mark.usefixtures("unpacked_layout")  # damages one leaf's chunk file
@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_failed_export_leaves_no_temporary_or_partial_file(tmp_path, fmt):
    path = str(tmp_path / "1")
    ckpt.save(path, {"a": np.arange(64, dtype=np.float32), "b": np.arange(64, dtype=np.float32),
                     "z": np.arange(64, dtype=np.float32)})
    with open(f"{path}/arrays/z/c/0", "r+b") as f:  # the last leaf: earlier files are complete by then
        f.truncate(10)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "README").write_text("mine")
    out = str(out_dir / "model") if fmt == "safetensors" else str(out_dir / "a.npz")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['z'\]"):
        ckpt.export(path, out, format=fmt, max_shard_bytes=256)  # safetensors: one file per tensor
    assert _listing(out_dir) == ["README"]  # the folder the export would have created is gone too


def test_export_of_the_params_only_selects_leaves_by_glob(tmp_path):
    import safetensors.numpy

    tree = _train_tree()
    ckpt.save(str(tmp_path / "1"), tree)
    for leaves in ("params", "params.*", "['params']*", ["params.dense.kernel", "params.dense.bias"]):
        report = ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), leaves=leaves, overwrite=True)
        assert sorted(report.tensors) == ["params.dense.bias", "params.dense.kernel"], leaves
    loaded = safetensors.numpy.load_file(report.files[0])
    assert sorted(loaded) == ["params.dense.bias", "params.dense.kernel"]
    np.testing.assert_array_equal(loaded["params.dense.kernel"], tree["params"]["dense"]["kernel"])
    assert report.total_bytes == 8 * 4 * 4 + 4 * 4


def test_a_key_string_glob_takes_its_brackets_literally(tmp_path):
    ckpt.save(str(tmp_path / "1"), _train_tree())
    # As a plain glob, "['opt_state']*" is a character class: it would match every name
    # starting with o, p, t, s, a, e or _ (the params too).
    report = ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), leaves="['opt_state']*")
    assert sorted(report.tensors) == ["opt_state.0.mu.dense.kernel"]
    report = ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), leaves="['params']['dense']['bias']", overwrite=True)
    assert sorted(report.tensors) == ["params.dense.bias"]


def test_export_glob_that_matches_nothing_raises_naming_the_top_level_keys(tmp_path):
    ckpt.save(str(tmp_path / "1"), _train_tree())
    with pytest.raises(ckpt.StructureMismatchError, match=r"leaves='model\.\*' matches no array leaf.*"
                       r"top-level keys are 'opt_state', 'params', 'step'"):
        ckpt.export(str(tmp_path / "1"), str(tmp_path / "st"), leaves=["params", "model.*"])
    assert not (tmp_path / "st").exists()


def test_cli_export_leaves(tmp_path, capsys):
    ckpt.save(str(tmp_path / "1"), _train_tree())
    assert _cli.main(["export", str(tmp_path / "1"), "-o", str(tmp_path / "st"), "--leaves", "params", "--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["tensors"]) == ["params.dense.bias", "params.dense.kernel"]
    assert _cli.main(["export", str(tmp_path / "1"), "-o", str(tmp_path / "x"), "--leaves", "nothing*"]) == 2
    assert "top-level keys are 'opt_state', 'params', 'step'" in capsys.readouterr().err
