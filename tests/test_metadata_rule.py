"""One rule for `save(metadata=)` and the manager's `metrics=` / `metadata=`."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import checkpointer as ckpt


def _tree():
    return {"w": np.arange(4, dtype=np.float32)}


def test_numpy_and_jax_scalars_become_python_numbers_in_metadata(tmp_path):
    meta = {
        "lr": np.float32(0.5), "epoch": np.int64(3), "done": np.bool_(True), "loss": jnp.float32(1.25),
        "n": jnp.int32(7), "half": ml_dtypes.bfloat16(0.5), "zero_d": np.array(2.0), "nested": {"a": [np.int8(1), 2.0]},
    }
    ckpt.save(str(tmp_path / "1"), _tree(), metadata=meta)
    got = ckpt.metadata(str(tmp_path / "1")).user_metadata
    assert got == {"lr": 0.5, "epoch": 3, "done": True, "loss": 1.25, "n": 7, "half": 0.5, "zero_d": 2.0,
                   "nested": {"a": [1, 2.0]}}
    assert type(got["epoch"]) is int and type(got["done"]) is bool and type(got["lr"]) is float


@pytest.mark.parametrize("value, stored", [
    (float("nan"), "NaN"), (float("inf"), "Infinity"), (-float("inf"), "-Infinity"),
    (np.float32("nan"), "NaN"), (jnp.float32(-jnp.inf), "-Infinity"),
])
def test_non_finite_values_are_stored_alike_in_metadata_and_metrics(tmp_path, value, stored):
    ckpt.save(str(tmp_path / "1"), _tree(), metadata={"a": {"b": value}})
    assert ckpt.metadata(str(tmp_path / "1")).user_metadata == {"a": {"b": stored}}
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        mgr.save(2, _tree(), metrics={"loss": value}, metadata={"x": value})
    assert ckpt.metadata(str(tmp_path / "run" / "2")).user_metadata == {"x": stored, "metrics": {"loss": stored}}


@pytest.mark.parametrize("bad, named", [
    ({"a": {"b": object()}}, "metadata['a']['b']"),
    ({"a": [1, np.arange(3)]}, "metadata['a'][1]"),
    ({"c": 1 + 2j}, "metadata['c']"),
    ({"a": {3: 1}}, "metadata['a']"),
])
def test_refused_metadata_names_the_key_path(tmp_path, bad, named):
    with pytest.raises(ckpt.UnsupportedValueError) as e:
        ckpt.save(str(tmp_path / "1"), _tree(), metadata=bad)
    assert named in str(e.value)
    assert not (tmp_path / "1").exists()


def test_refused_metric_names_the_metric(tmp_path):
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError, match=r"metrics\['loss'\]"):
            mgr.save(1, _tree(), metrics={"loss": [1.0, 2.0]})
        with pytest.raises(ckpt.UnsupportedValueError, match=r"metadata\['cfg'\]\['opt'\]"):
            mgr.save(1, _tree(), metadata={"cfg": {"opt": object()}})
        assert mgr.all_steps() == []


def test_refused_metadata_and_metrics_name_the_checkpoint_path(tmp_path):
    with pytest.raises(ckpt.UnsupportedValueError, match=f"saving {tmp_path / '1'}: metadata\\['a'\\]\\['b'\\] is a"):
        ckpt.save(str(tmp_path / "1"), _tree(), metadata={"a": {"b": object()}})
    with ckpt.CheckpointManager(tmp_path / "run", async_save=False) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError, match=f"saving {tmp_path / 'run' / '3'}: metrics\\['loss'\\] must be"):
            mgr.save(3, _tree(), metrics={"loss": [1.0]})
        with pytest.raises(ckpt.UnsupportedValueError, match=f"saving {tmp_path / 'run' / '3'}: metrics must be a dict"):
            mgr.save(3, _tree(), metrics=[1.0])


def test_manager_save_stores_metadata_beside_metrics(tmp_path):
    with ckpt.CheckpointManager(tmp_path, keep=ckpt.KeepBest("loss", n=1)) as mgr:
        mgr.save(1, _tree(), metrics={"loss": np.float32(2.0)}, metadata={"data": {"epoch": np.int64(0)}, "note": "warmup"})
        mgr.save(2, _tree(), metrics={"loss": 1.0}, metadata={"data": {"epoch": 1}})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]  # KeepBest still reads metrics beside the metadata
    meta = ckpt.metadata(str(tmp_path / "2")).user_metadata
    assert meta == {"data": {"epoch": 1}, "metrics": {"loss": 1.0}}


def test_manager_metadata_may_not_use_the_metrics_key(tmp_path):
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(ckpt.UnsupportedValueError, match="metrics="):
            mgr.save(1, _tree(), metadata={"metrics": {"loss": 1.0}})


def test_metrics_keep_their_old_storage(tmp_path):
    # Ints as floats, str/bool/None as they are (unchanged from earlier releases).
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, _tree(), metrics={"step": 3, "tag": "a", "ok": True, "none": None, "acc": jax.numpy.float32(0.5)})
    assert ckpt.metadata(str(tmp_path / "1")).user_metadata["metrics"] == {
        "step": 3.0, "tag": "a", "ok": True, "none": None, "acc": 0.5}
