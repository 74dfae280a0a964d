"""One notation for a leaf wherever a user reads it (issue 25 item 4): the key string as
`jax.tree_util.keystr` writes it for the saved tree, never the storage path: plans (str
and repr), the command line, errors and reports."""

from typing import NamedTuple

import jax
import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._errors import leaf_name, path_keystr
from checkpointer._format import flatten


class Adam(NamedTuple):
    count: object
    nu: object


def _tree():
    params = {"params": {"l2": {"bias": np.arange(64.0, dtype=np.float32), "kernel": np.ones((8, 8), np.float32)}}}
    return {"opt_state": (Adam(np.int32(0), params), None), "step": np.arange(3)}


def test_print_of_a_restore_plan_names_leaves_by_key_string(tmp_path):
    path = str(tmp_path / "1")
    tree = _tree()
    ckpt.save(path, tree, pack_small_leaves_bytes=0)
    plan = ckpt.plan_restore(path, jax.tree.map(lambda _: None, tree))
    text = str(plan)
    want = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][1][0])
    assert want == "['opt_state'][0].nu['params']['l2']['bias']"
    assert want in text and "opt_state/0/nu" not in text, text
    assert want in repr(plan) and "opt_state/0" not in repr(plan), repr(plan)
    assert {leaf.name for leaf in plan.leaves} == {jax.tree_util.keystr(kp) for kp, x in
                                                   jax.tree_util.tree_flatten_with_path(tree)[0] if isinstance(x, np.ndarray)}


def test_a_leaf_path_without_its_saved_key_string_is_written_as_keystr_writes_dict_keys():
    tree = {"a/b": {"c": [np.ones(1)], "": np.ones(1), "..": np.ones(1), "%x": np.ones(1)}, "ints": {0: np.ones(1), 7: np.ones(1)}}
    for (p, _), (kp, _) in zip(flatten(tree), jax.tree_util.tree_flatten_with_path(tree)[0]):
        assert path_keystr(p) == jax.tree_util.keystr(kp), p
    assert leaf_name("") == "<root>" and leaf_name("x", "") == "<root>" and leaf_name("a/0", ".a[0]") == ".a[0]"


def test_errors_and_verify_name_the_leaf_by_key_string(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, _tree(), pack_small_leaves_bytes=0)
    chunk = tmp_path / "1" / "arrays" / "opt_state" / "0" / "nu" / "params" / "l2" / "bias" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = ckpt.verify(path)
    assert any(p.startswith("leaf ['opt_state'][0].nu['params']['l2']['bias']:") for p in report.problems), report.problems
    assert not any("opt_state/0" in p.split(":")[0] for p in report.problems), report.problems
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"leaf \['opt_state'\]\[0\]\.nu\['params'\]\['l2'\]\['bias'\] in "):
        ckpt.restore(path)


def test_the_command_line_plans_name_leaves_by_key_string(tmp_path, capsys):
    from checkpointer._cli import _main as _cli

    path = str(tmp_path / "1")
    ckpt.save(path, _tree(), pack_small_leaves_bytes=0)
    for argv in (["plan-save", path, "--mesh", "4x2", "--processes", "2"], ["plan", path, "--mesh", "8"]):
        assert _cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "['opt_state'][0].nu['params']['l2']['bias']" in out and "opt_state/0/nu" not in out, (argv, out)
