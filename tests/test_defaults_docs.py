"""Defaults and docs agree (issue 22 item 8): the commit timeout below JAX's heartbeat,
the docs' `jax.make_mesh` examples on the installed JAX, `checkpointer ls`'s text on
crashed saves, the linen example's leaf names, the Python requirement, and
`repr(RestoreStats)`."""

import importlib.metadata
import inspect
import re
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._cli import _main as _cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The README and the site's pages: the examples and figures these tests check live on the pages now.
DOCS = "\n".join([README, *((ROOT / "docs" / f"{page}.md").read_text() for page in ("getting_started", "flax", "many_hosts", "elastic_resume"))])


def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_the_commit_timeout_default_is_below_jaxs_heartbeat_timeout():
    heartbeat_s = _default(jax.distributed.initialize, "heartbeat_timeout_seconds")
    for fn in (ckpt.save, ckpt.save_async, ckpt.CheckpointManager.__init__):
        assert _default(fn, "commit_timeout_s") < heartbeat_s, fn
    assert f"default {heartbeat_s} s" in " ".join(DOCS.split())


def _make_mesh_calls(text):
    """Every `jax.make_mesh(...)` call of `text`, parentheses balanced."""
    calls = []
    for m in re.finditer(r"jax\.make_mesh\(", text):
        depth, i = 0, m.end() - 1
        while True:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        calls.append(re.sub(r"#[^\n]*", "", text[m.start():i]))
    return calls


def test_the_docs_make_mesh_examples_give_auto_axes_on_the_installed_jax():
    scope = {"jax": jax, "N_DATA": 2, "N_MODEL": 4}
    for line in DOCS.splitlines():
        if line.startswith("auto = "):
            exec(line, scope)  # noqa: S102 (the page's own line)
    calls = _make_mesh_calls(DOCS)
    assert len(calls) >= 3
    for call in calls:
        mesh = eval(call, scope)  # noqa: S307 (the page's own expression)
        assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}, (call, mesh.axis_types)


def test_the_docs_nnx_mesh_runs_a_tensor_parallel_nnx_model():
    nnx = pytest.importorskip("flax.nnx")
    scope = {"jax": jax}
    exec(next(line for line in DOCS.splitlines() if line.startswith("auto = ")), scope)  # noqa: S102
    mesh = eval(_make_mesh_calls(DOCS[DOCS.index("## Flax NNX"):])[0], scope)  # noqa: S307

    class Model(nnx.Module):  # column- then row-parallel, as the page's comment says
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 32, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")), rngs=rngs)
            self.l2 = nnx.Linear(32, 8, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None)), rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.relu(self.l1(x)))

    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        out = model(jax.numpy.ones((4, 8)))
    assert out.shape == (4, 8)


def test_ls_says_a_managers_first_save_or_recover_removes_crashed_saves(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt.save(str(run / "1"), {"w": np.ones(2)})
    (run / "2.partial-20260101000000-aaaaaaaa" / "arrays").mkdir(parents=True)
    assert _cli.main(["ls", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "its first save or recover() does" in out and "opening this directory does" not in out, out
    mgr = ckpt.CheckpointManager(str(run))  # what the text says: opening removes nothing
    assert (run / "2.partial-20260101000000-aaaaaaaa").exists()
    mgr.recover()
    assert not (run / "2.partial-20260101000000-aaaaaaaa").exists()
    mgr.close()


def test_the_linen_examples_leaf_names_are_the_ones_a_train_state_gets(tmp_path):
    linen = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")
    from flax.training.train_state import TrainState

    class MLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            return linen.Dense(4)(x)

    model = MLP()
    params = model.init(jax.random.key(0), np.ones((1, 3), np.float32))  # {'params': {'Dense_0': ...}}
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    ckpt.save(str(tmp_path / "1"), state)
    restored = ckpt.restore(str(tmp_path / "1"), state)
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(restored)}
    shown = re.search(r"# leaves named (\S+), ", DOCS)
    assert shown, "the linen example names its leaves"
    assert shown.group(1) in names, (shown.group(1), sorted(names))
    assert "params/params/Dense_0/kernel" in ckpt.metadata(str(tmp_path / "1")).arrays  # as stored


def test_the_python_requirement_is_the_same_in_the_readme_pyproject_and_jax():
    needs = re.search(r"Needs Python (\d+\.\d+) or newer", README)
    assert needs and "Needs only" not in README
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    jax_needs = importlib.metadata.metadata("jax")["Requires-Python"]
    assert declared == f">={needs.group(1)}" == jax_needs, (needs.group(1), declared, jax_needs)


def test_repr_of_restore_stats_summarises_the_plan(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, {f"w{i}": np.full((64, 64), i, np.float32) for i in range(20)}, pack_small_leaves_bytes=0)
    stats = ckpt.RestoreStats()
    ckpt.restore(path, stats=stats)
    text = repr(stats)
    assert stats.plan is not None and len(str(stats.plan).splitlines()) == 25  # the whole table: title, head, rule, 20 leaves, rule, total
    assert repr(stats.plan).startswith("<RestorePlan for ") and "['w0']" in repr(stats.plan)  # a summary, by key string
    assert len(text) < 600 and "<RestorePlan: 20 leaves, " in text and "ChunkRead" not in text, text
    assert text.startswith("RestoreStats(bytes_read=") and f"chunk_reads={stats.chunk_reads}" in text
