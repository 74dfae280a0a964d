"""Inspection in the library (issue 26 item 1): the tree, the shard map, the plan picture
and the run picture work on every checkpoint this library writes: packed and unpacked
leaves, replica-parallel writes from 2 processes, memory://, an imported Orbax
checkpoint. Each picture is checked against the files: the shard map's rectangles are
the records' boxes with their processes, the plan picture's numbers are plan_restore's.
"""

import json
import sys

import jax
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
from multiprocess import WORKERS, run_processes

import checkpointer as ckpt
from checkpointer._cli import main as cli_main
from checkpointer._storage import storage_for
from checkpointer._tools import plan_bars

KINDS = ("default", "unpacked_memory", "two_processes", "orbax")


def _state(mesh):
    def put(shape, spec):
        g = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        return jax.device_put(g, NamedSharding(mesh, spec))

    return {
        "params": {"w": put((64, 128), P("data", "model")), "big": put((1024, 512), P("data"))},
        "bias": put((128,), P("model")),
        "step": 3,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Path of each kind of checkpoint: the defaults (packs its small leaves), unpacked
    on memory://, 2 processes x 2 devices (replica-parallel), an imported Orbax one."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("inspect")
    state = _state(make_mesh((2, 4), ("data", "model")))
    paths = {"default": str(root / "default" / "5"), "unpacked_memory": "memory://inspect-tests/5",
             "two_processes": str(root / "two" / "1"), "orbax": str(root / "imported" / "2")}
    ckpt.save(paths["default"], state)
    ckpt.save(paths["unpacked_memory"], state, pack_small_leaves_bytes=0, overwrite=True)
    run_processes(WORKERS / "inspect_worker.py", 2, 2, {"path": paths["two_processes"]}, timeout_s=180)
    with ocp.StandardCheckpointer() as c:
        c.save(str(root / "orbax"), state["params"])
    ckpt.import_orbax(str(root / "orbax"), paths["orbax"])
    return paths


def _records(path):
    """{process: its processes/<i>.json}, read here as plain JSON."""
    storage, p = storage_for(path)
    n = ckpt.metadata(path).process_count
    return {i: json.loads(storage.read_file(f"{p}/processes/{i}.json", max_bytes=1 << 26)) for i in range(n)}


def _recorded_boxes(path, leaf_path):
    """(origin, shape, process, packed) of every chunk of a leaf, from the JSON records:
    unpacked chunks carry `leaf`; packed ones are boxes of the record's `packed` index."""
    out = set()
    for i, rec in _records(path).items():
        for c in rec["chunks"]:
            if c.get("leaf") == leaf_path:
                out.add((tuple(c["box"][0]), tuple(c["box"][1]), i, False))
        for b in (rec.get("packed") or {}).get("boxes", []):
            if b["leaf"] == leaf_path:
                out.add((tuple(b["box"][0]), tuple(b["box"][1]), i, True))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_tree_names_every_leaf_as_keystr_with_shape_dtype_bytes_sharding_and_packing(saved, kind):
    path = saved[kind]
    meta = ckpt.metadata(path)
    view = ckpt.inspect_tree(path)
    assert list(view.leaves) == list(meta.leaves)
    for p, s in view.leaves.items():
        m = meta.leaves[p]
        assert s.keystr == meta.keystr(p)
        if isinstance(m, ckpt.ArrayMetadata):
            assert (s.shape, s.dtype, s.nbytes, s.packed) == (m.shape, str(m.dtype), m.nbytes, m.packed)
            assert s.saved_sharding == (m.saved_sharding.describe() if m.saved_sharding else "host numpy array")
    assert view.total_bytes == meta.total_bytes
    if kind == "default":  # the defaults pack the small leaves and keep the large one unpacked
        by_name = {s.keystr: s for s in view.leaves.values()}
        assert by_name["['params']['w']"].packed and by_name["['bias']"].packed and not by_name["['params']['big']"].packed
        assert by_name["['params']['big']"].saved_sharding == "P('data') on mesh data=2 x model=4"
        assert by_name["['step']"].saved_sharding == "value 3"
    # The leaves sit where the tree has them (treescope draws this tree).
    leaves = jax.tree_util.tree_leaves_with_path(view.tree)
    assert {jax.tree_util.keystr(kp) for kp, _ in leaves} == {s.keystr for s in view.leaves.values()}
    html = view._repr_html_()  # what a notebook shows: treescope's interactive HTML (its payload is compressed)
    assert html.startswith("<script>") and "treescope-container" in html
    import treescope

    text = treescope.render_to_text(view.tree)  # the same rendering, as text
    for s in view.leaves.values():
        assert f"keystr={s.keystr!r}".replace("'", '"') in text.replace("'", '"') and f"packed={s.packed}" in text
    assert all(s.keystr in str(view) for s in view.leaves.values())


@pytest.mark.parametrize("kind", KINDS)
def test_the_shard_map_draws_the_records_boxes_coloured_by_their_process(saved, kind):
    path = saved[kind]
    meta = ckpt.metadata(path)
    for leaf_path, m in meta.arrays.items():
        want = _recorded_boxes(path, leaf_path)
        chunks = ckpt.shard_chunks(path, meta.keystr(leaf_path))
        assert {(c.box.origin, c.box.shape, c.process_index, c.packed) for c in chunks} == want
        assert len(chunks) == len(want) and want
        assert all(c.packed == m.packed for c in chunks)
        fig = ckpt.plot_shards(path, [meta.keystr(leaf_path)])
        ax = fig.axes[0]
        rects = [(round(r.get_y()), round(r.get_x()), round(r.get_height()), round(r.get_width())) for r in ax.patches]
        if m.shape and len(m.shape) == 2:
            assert sorted(rects) == sorted((c.box.origin[0], c.box.origin[1], c.box.shape[0], c.box.shape[1]) for c in chunks)
        else:
            assert sorted(rects) == sorted((0, c.box.origin[0], 1, c.box.shape[0]) for c in chunks)
        # One colour per process: the rectangles of one process share it, others differ.
        colours = {}
        for r, c in zip(ax.patches, chunks):
            colours.setdefault(c.process_index, set()).add(r.get_facecolor())
        assert all(len(v) == 1 for v in colours.values())
        assert len({next(iter(v)) for v in colours.values()}) == len(colours)
        assert meta.keystr(leaf_path) in ax.get_title()


def test_the_shard_map_shows_which_device_wrote_and_the_replicas_skipped(saved):
    chunks = ckpt.shard_chunks(saved["default"], "['params']['big']")  # P('data') on 2x4: 4 holders a box
    assert sorted(c.box.origin for c in chunks) == [(0, 0), (512, 0)]
    for c in chunks:
        assert c.holders == ((0, 1, 2, 3) if c.box.origin == (0, 0) else (4, 5, 6, 7))
        assert c.writer == c.holders[0] and c.skipped == c.holders[1:]
    texts = [t.get_text() for t in ckpt.plot_shards(saved["default"], "['params']['big']").axes[0].texts]
    assert sorted(texts) == ["p0\ndev@0\nskip 3", "p0\ndev@4\nskip 3"]


def test_replica_parallel_chunks_of_two_processes_each_name_their_writer(saved):
    path = saved["two_processes"]
    rep = ckpt.shard_chunks(path, "['rep']")  # P(None, 'model') on 2x2: both processes hold each box
    assert {c.process_index for c in rep} == {0, 1}
    for c in rep:
        assert len(c.holders) == 2 and c.writer in c.holders and c.writer // 2 == c.process_index
        assert c.skipped == tuple(h for h in c.holders if h != c.writer)
    own = ckpt.shard_chunks(path, "['own']")  # P('data', 'model'): each process writes its own boxes
    assert all(c.holders == (c.writer,) and c.skipped == () for c in own)
    assert {c.process_index for c in own} == {0, 1}
    bias = ckpt.shard_chunks(path, "['bias']")
    assert bias and all(c.packed for c in bias)


def test_an_imported_orbax_checkpoint_names_no_writing_device(saved):
    chunks = ckpt.shard_chunks(saved["orbax"], "['big']")  # Orbax saved it P('data') on 2x4; the import wrote it from the host
    assert [c.holders for c in chunks] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(c.writer is None and c.skipped == () and c.process_index == 0 for c in chunks)
    texts = [t.get_text() for t in ckpt.plot_shards(saved["orbax"], "['big']").axes[0].texts]
    assert texts == ["p0", "p0"]


def test_plot_shards_selects_by_keystr_glob_and_storage_path_and_names_a_missing_leaf(saved):
    path = saved["default"]
    assert [ax.get_title().split()[0] for ax in ckpt.plot_shards(path, "['params']*").axes if ax.get_visible()] == [
        "['params']['big']", "['params']['w']"]  # in tree order
    assert len([ax for ax in ckpt.plot_shards(path, ["params/w", "['bias']"]).axes if ax.get_visible()]) == 2
    with pytest.raises(ckpt.StructureMismatchError, match=r"no array leaf 'nope'.*\['params'\]\['w'\]"):
        ckpt.plot_shards(path, "nope")


def test_the_plan_picture_shows_plan_restores_numbers(saved):
    mesh = make_mesh((4, 2), ("data", "model"))
    target = {"params": {"w": NamedSharding(mesh, P("data", "model")), "big": NamedSharding(mesh, P(None, "model"))},
              "bias": NamedSharding(mesh, P("model")), "step": None}
    for kind in ("default", "unpacked_memory"):
        plan = ckpt.plan_restore(saved[kind], target)
        bars = plan_bars(plan)
        assert (bars.bytes_needed, bars.bytes_read, bars.read_amplification) == (
            plan.bytes_needed, plan.bytes_read, plan.read_amplification)
        assert sum(r for _, _, r in bars.devices) == pytest.approx(plan.bytes_read)
        assert sum(n for _, n, _ in bars.devices) == pytest.approx(plan.bytes_needed)
        assert [label for label, *_ in bars.devices] == [str(d) for d in range(8)]
        fig = ckpt.plot_plan(plan)
        headline = fig.get_suptitle()
        assert f"{plan.bytes_needed:,} bytes needed, {plan.bytes_read:,} read" in headline
        assert f"read amplification {plan.read_amplification:.3f}" in headline
        ax = fig.axes[0]
        heights = [r.get_height() for r in ax.patches]
        assert sum(heights[8:]) * 1024 == pytest.approx(plan.bytes_read)  # the read bars, in KiB
        assert all(t.get_fontsize() >= 10 for t in ax.get_xticklabels())


def test_the_plan_picture_of_every_process_and_of_many_devices(saved):
    path = saved["two_processes"]
    mesh = AbstractMesh((2, 2), ("data", "model"))
    target = {"rep": NamedSharding(mesh, P("data", None)), "own": NamedSharding(mesh, P(None, "model")),
              "bias": NamedSharding(mesh, P()), "step": None}
    plans = [ckpt.plan_restore(path, target, process_index=i, processes=2, cooperative=False) for i in range(2)]
    bars = plan_bars(plans)
    assert [(label, n, r) for label, n, r, _ in bars.processes] == [
        (str(p.process_index), p.bytes_needed, p.bytes_read) for p in plans]
    assert sum(r for _, _, r in bars.devices) == pytest.approx(sum(p.bytes_read for p in plans))
    fig = ckpt.plot_plan(plans)
    assert len(fig.axes) == 2 and f"{sum(p.bytes_read for p in plans):,} read" in fig.get_suptitle()
    # Cooperative plans (replicated leaves, split between the processes and exchanged): the
    # devices show their reads, the processes their needs, reads and what peers send.
    replicated = {"rep": NamedSharding(mesh, P()), "own": NamedSharding(mesh, P()), "bias": NamedSharding(mesh, P()), "step": None}
    coop = [ckpt.plan_restore(path, replicated, process_index=i, processes=2) for i in range(2)]
    bars = plan_bars(coop)
    assert bars.cooperative and bars.bytes_received == sum(p.bytes_received for p in coop) > 0
    assert sum(r for _, _, r in bars.devices) == pytest.approx(sum(p.bytes_read for p in coop))
    fig = ckpt.plot_plan(coop)
    device_panel, process_panel = fig.axes[:2]
    assert len(device_panel.patches) == len(bars.devices)  # reads only
    assert sum(r.get_height() for r in process_panel.patches[4:]) == pytest.approx(bars.bytes_received / 2**20)
    # 256 target devices: at most 32 bars, neighbours summed.
    big = AbstractMesh((16, 16), ("data", "model"))
    plan = ckpt.plan_restore(saved["default"], {"params": {"w": NamedSharding(big, P("data", "model")),
                                                           "big": NamedSharding(big, P("data", "model"))},
                                                "bias": NamedSharding(big, P("model")), "step": None}, processes=1)
    bars = plan_bars(plan)
    assert len(bars.devices) == 32 and bars.devices[0][0] == "0-7" and bars.devices[-1][0] == "248-255"
    assert sum(r for _, _, r in bars.devices) == pytest.approx(plan.bytes_read)


def test_the_run_picture_shows_steps_metrics_commit_lag_and_the_timeline(tmp_path):
    from checkpointer._tools import read_timeline
    from checkpointer._tools._timeline import step_summary

    run = str(tmp_path / "run")
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(3)) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, {"w": np.full((64, 64), step, np.float32)}, metrics={"loss": 1.0 / step})
        manager.wait_until_finished()
        from_manager = ckpt.plot_run(manager)
    fig = ckpt.plot_run(run)
    assert from_manager.get_suptitle() == fig.get_suptitle() == f"run {run}: steps 2 … 4 (3 committed)"
    top, mid, bottom = fig.axes[:3]
    (line,) = top.get_lines()
    assert list(line.get_xdata()) == [2, 3, 4] and list(line.get_ydata()) == [1 / 2, 1 / 3, 1 / 4]
    phases = read_timeline(run)
    lags = [step_summary([p for p in phases if p.step == s]).commit_lag_s for s in (2, 3, 4)]
    assert [r.get_height() for r in mid.patches[3:6]] == pytest.approx(lags)
    assert [t.get_text() for t in bottom.get_yticklabels()] == ["step 2", "step 3", "step 4"]
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.plot_run(str(tmp_path / "empty"))


def test_the_command_line_writes_shard_maps_and_read_plans(saved, tmp_path, capsys):
    shards, plan = tmp_path / "shards.png", tmp_path / "plan.png"
    assert cli_main(["inspect", saved["default"], "--png", str(shards), "--leaf", "['params']*"]) == 0
    assert cli_main(["plan", saved["two_processes"], "--mesh", "2x2", "--processes", "2", "--png", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"wrote the shard map to {shards}" in out and f"wrote the read plan to {plan}" in out
    for f in (shards, plan):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 10_000
    assert cli_main(["inspect", saved["default"], "--leaf", "x"]) == 2
    assert "--leaf selects the leaves --png draws" in capsys.readouterr().err


def test_without_matplotlib_or_treescope_the_error_names_the_extra(saved, monkeypatch):
    view = ckpt.inspect_tree(saved["default"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "treescope", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'checkpointer\[notebook\]'"):
        ckpt.plot_shards(saved["default"])
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'checkpointer\[notebook\]'"):
        view._repr_html_()
    assert "['params']['w']" in str(view)  # the text needs neither


def test_the_inspection_pages_examples_run_as_written(tmp_path, monkeypatch, capsys):
    import pathlib
    import re
    import tempfile

    page = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "inspection.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) == 6
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/inspection.md", "exec"), namespace)
    assert pathlib.Path(f"{namespace['path']}-shards.png").stat().st_size > 10_000
    plan = namespace["plan"]
    assert f"{plan.bytes_needed:,} bytes needed, {plan.bytes_read:,} read" in capsys.readouterr().out
    assert namespace["fig"].get_suptitle().startswith("run ")  # the last picture: the run
    assert len(namespace["plans"]) == 2


@pytest.fixture(scope="module")
def s3():
    from gcsserver import started_or_skipped
    from s3server import running_s3_server

    with started_or_skipped(running_s3_server) as server:
        yield server


def test_every_function_works_on_s3(s3):
    run = f"s3://{s3.new_bucket()}/run"
    state = _state(make_mesh((2, 4), ("data", "model")))
    with ckpt.CheckpointManager(run, keep=ckpt.KeepLatest(2)) as manager:
        for step in (1, 2):
            manager.save(step, state, metrics={"loss": 1.0 / step})
        manager.wait_until_finished()
    path = f"{run}/2"
    view = ckpt.inspect_tree(path)
    assert {s.keystr: s.packed for s in view.leaves.values() if s.shape} == {
        "['bias']": True, "['params']['big']": False, "['params']['w']": True}
    for leaf_path in ("params/w", "params/big"):
        chunks = ckpt.shard_chunks(path, leaf_path)
        assert {(c.box.origin, c.box.shape, c.process_index, c.packed) for c in chunks} == _recorded_boxes(path, leaf_path)
    assert len(ckpt.plot_shards(path).axes[0].patches) == 2  # the largest leaf first: ['params']['big'], 2 chunks
    mesh = make_mesh((4, 2), ("data", "model"))
    plan = ckpt.plan_restore(path, {"params": {"w": NamedSharding(mesh, P("data")), "big": NamedSharding(mesh, P("model"))},
                                    "bias": NamedSharding(mesh, P()), "step": None})
    assert f"{plan.bytes_needed:,} bytes needed, {plan.bytes_read:,} read" in ckpt.plot_plan(plan).get_suptitle()
    fig = ckpt.plot_run(run)
    assert fig.get_suptitle() == f"run {run}: steps 1 … 2 (2 committed)"
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [1.0, 0.5]


def test_a_shard_map_of_leaves_of_size_zero_draws_empty_panels(tmp_path, capsys):
    # Leaves of size 0 store no chunk: the legend had no entry and matplotlib raised
    # "ValueError: number sections must be larger than 0" (`inspect --png`: internal error).
    path = str(tmp_path / "zero")
    ckpt.save(path, {"z": np.zeros((0, 3), np.float32), "y": np.zeros((2, 0, 5), np.float32)})
    fig = ckpt.plot_shards(path)
    assert len([ax for ax in fig.axes if ax.get_visible()]) == 2 and not any(ax.patches for ax in fig.axes)
    assert fig.axes[0].get_title().endswith("no chunk stored (size 0)")
    png = tmp_path / "zero.png"
    assert cli_main(["inspect", path, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_png_of_a_checkpoint_without_arrays_is_a_usage_error(tmp_path, capsys):
    # It printed "internal error: ValueError ..." and exited 1.
    path = str(tmp_path / "values")
    ckpt.save(path, {"step": 3, "name": "run"})
    assert cli_main(["inspect", path, "--png", str(tmp_path / "x.png")]) == 2
    assert "holds none (only values)" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_a_python_int_longer_than_4300_digits_is_shown_by_its_size(tmp_path, capsys):
    # Saved and restored fine, but repr() of it raises ValueError (Python's int-to-text
    # limit): inspect_tree, `checkpointer inspect` (text and --json), a restore's
    # structure error and the Orbax export's refusal all escaped as that ValueError.
    path = str(tmp_path / "big")
    ckpt.save(path, {"v": 2**20000, "w": np.ones(3)})
    assert "<int of 20001 bits>" in str(ckpt.inspect_tree(path))
    assert cli_main(["inspect", path]) == 0 and "<int of 20001 bits>" in capsys.readouterr().out
    assert cli_main(["inspect", "--json", path]) == 0
    assert json.loads(capsys.readouterr().out)["leaves"][0]["value"] == "<int of 20001 bits>"
    with pytest.raises(ckpt.StructureMismatchError, match="the value <int of 20001 bits>"):
        ckpt.restore(path, {"v": {"a": 1}, "w": np.zeros(3)})
    with pytest.raises(ckpt.UnsupportedValueError, match=r"\['v'\] of .* holds <int of 20001 bits>"):
        ckpt.export(path, str(tmp_path / "o"), format="orbax")


@pytest.mark.parametrize("last", [0, -1, 2.5])
def test_plot_run_refuses_a_last_that_is_not_a_count(tmp_path, last):
    # last=0 drew every step and last=-1 every step but the oldest (list slicing).
    with pytest.raises(ValueError, match="last=.... needs an int >= 1"):
        ckpt.plot_run(str(tmp_path), last=last)
