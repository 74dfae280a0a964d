"""Fuzzing the readers around checkpoints (issue 27 item 2): the save journal
(`checkpointer status`, `checkpointer timeline`, the follower), the step catalog of an
object-store directory, and an Orbax checkpoint's metadata (`_METADATA`,
`_CHECKPOINT_METADATA`) read by `import_orbax`.

Properties: only documented errors come out (`CheckpointError`), naming the file or
directory; the CLI never reports an internal error, and a journal line that does not
parse is skipped (`status` of a healthy directory stays 0 whatever is appended); a valid
Orbax checkpoint imports and round-trips bit-exactly.

`make test` runs the `ci` profile (tests/fuzzing.py); the longer run:
`CHECKPOINTER_FUZZ=long .venv/bin/python -m pytest -q tests/test_fuzz_tools.py`.
"""

import itertools
import json
import os
import shutil

import numpy as np
import pytest
from fuzzing import damage_bytes, documented, fuzz, hostile_json, hostile_variant, mutate_json
from hypothesis import given, strategies as st

import checkpointer as ckpt
from checkpointer._cli import _main as _cli
from checkpointer._commit import _catalog, _directory
from checkpointer._storage import storage_for

_runs = itertools.count()


def _tree(step):
    return {"w": np.full((4, 8), step, np.float32)}


# --- the save journal -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("fuzz_journal") / "run")
    with ckpt.CheckpointManager(d) as mgr:
        for step in (1, 2):
            mgr.save(step, _tree(step))
    return d


@fuzz(1)
@given(data=st.data())
def test_hostile_journal_lines_are_skipped_by_status_timeline_and_the_follower(run_dir, data, capsys):
    d = os.path.join(os.path.dirname(run_dir), f"run{next(_runs)}")
    shutil.copytree(run_dir, d)
    journal = os.path.join(d, _directory.SAVE_JOURNAL)
    with open(journal, "rb") as f:
        lines = f.read().splitlines()
    sample = json.loads(data.draw(st.sampled_from(lines)))
    added = []
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["edit", "noise"]))
        line = mutate_json(data, sample) if how == "edit" else damage_bytes(data, json.dumps(sample).encode())
        added.append(line.replace(b"\n", b" "))
    with open(journal, "ab") as f:
        f.write(b"\n".join(added) + b"\n")
    for argv in (["status", d, "--json"], ["timeline", d], ["timeline", d, "--json"]):
        code = _cli.main(argv)
        out, err = capsys.readouterr()
        assert code in (0, 1, 2), (argv, code, err)  # 1: an alert a hostile line may well raise
        assert "internal error" not in out + err and "Traceback" not in out + err, (argv, err)
    from checkpointer._manage import _follow

    storage, path = storage_for(d)
    assert _follow._JournalSteps(storage, path).update() >= {1, 2}
    shutil.rmtree(d)


# --- the step catalog (object stores) ---------------------------------------------------------

_names = st.sampled_from(["3", "-1", "01", "1e3", "99999999999999999999", "..", ".", "a", "2.partial-x", " 4", "4 ",
                          "catalog.json", "0x10", "\u0663", ""]) | st.text(max_size=6)


def _plant(storage, key, body):
    try:
        storage.write_file(key, body)
    except Exception:  # a name the store refuses: nothing planted (the set-up, not the property)
        pass


@fuzz(1)
@given(data=st.data())
def test_hostile_catalog_entries_give_documented_errors_only(data):
    d = f"memory://fuzz-catalog-{next(_runs)}/run"
    with ckpt.CheckpointManager(d, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, _tree(step))
    storage, path = storage_for(d)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(_names).replace("/", "_")
        body = data.draw(st.sampled_from([b"", b"{}", b"[[[[", json.dumps({"step": 2**70}).encode()]) | st.binary(max_size=40))
        _plant(storage, f"{path}/{_catalog.CATALOG}/{name or 'x'}", body)
    if data.draw(st.booleans()):
        _plant(storage, f"{path}/{_catalog.CATALOG}/{_catalog.HEADER}", data.draw(st.binary(max_size=40)))
    steps = documented(lambda: ckpt.CheckpointManager(d, read_only=True).all_steps(), d)
    assert steps is None or {1, 2} <= set(steps) and all(isinstance(s, int) and s >= 0 for s in steps)
    got = documented(lambda: ckpt.CheckpointManager(d, read_only=True).restore(2), d)
    assert got is None or np.array_equal(np.asarray(got["w"]), _tree(2)["w"])


# --- Orbax metadata -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def orbax_ckpt(tmp_path_factory):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = tmp_path_factory.mktemp("fuzz_orbax") / "orbax"
    tree = {"w": np.arange(24, dtype=np.float32).reshape(4, 6) + 100, "b": np.arange(3, dtype=np.int32) + 7}
    with ocp.StandardCheckpointer() as c:
        c.save(str(path), tree)
    return str(path), tree


def test_a_valid_orbax_checkpoint_imports_bit_exactly(orbax_ckpt, tmp_path):
    src, tree = orbax_ckpt
    ckpt.import_orbax(src, str(tmp_path / "imported"))
    back = ckpt.restore(str(tmp_path / "imported"))
    for k, v in tree.items():
        assert np.asarray(back[k]).tobytes() == v.tobytes() and np.asarray(back[k]).dtype == v.dtype, k


@fuzz(1)
@given(data=st.data())
def test_hostile_orbax_metadata_gives_documented_errors_only(orbax_ckpt, tmp_path_factory, data):
    src, tree = orbax_ckpt
    copy = tmp_path_factory.mktemp("orbax_victim") / "orbax"
    shutil.copytree(src, copy)
    names = sorted(n for n in os.listdir(copy) if n.startswith("_") and os.path.isfile(copy / n))
    name = data.draw(st.sampled_from(names))
    raw = (copy / name).read_bytes()
    try:
        json.loads(raw)
        variant = hostile_variant(data, raw)
    except ValueError:
        variant = damage_bytes(data, raw) if data.draw(st.booleans()) else json.dumps(data.draw(hostile_json)).encode()
    (copy / name).write_bytes(variant)
    dst = str(copy.parent / "imported")
    documented(lambda: ckpt.import_orbax(str(copy), dst), str(copy), name)
    shutil.rmtree(copy.parent)
