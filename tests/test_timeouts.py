"""Timeouts are checked when given: a save, a `save_async` or a manager with a timeout
that is not a number of seconds in (0, a week] raises ValueError naming the keyword,
and nothing is written (before the check, `inf` or 30 days passed in one process and
overflowed the coordination service's 32-bit millisecond waits in a job of many)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import checkpointer as ckpt

BAD = [math.inf, math.nan, 0, -1, 30 * 24 * 3600, True, "60"]


@pytest.mark.parametrize("name", ["commit_timeout_s", "agreement_timeout_s"])
@pytest.mark.parametrize("value", BAD, ids=repr)
def test_a_save_with_a_bad_timeout_raises_naming_it_and_writes_nothing(tmp_path, name, value):
    path = tmp_path / "1"
    with pytest.raises(ValueError, match=name):
        ckpt.save(str(path), {"w": jnp.ones(4)}, **{name: value})
    with pytest.raises(ValueError, match=name):
        ckpt.save_async(str(tmp_path / "2"), {"w": jnp.ones(4)}, **{name: value})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["commit_timeout_s", "agreement_timeout_s"])
def test_a_manager_with_a_bad_timeout_raises_at_construction(tmp_path, name):
    with pytest.raises(ValueError, match=f"{name} must be a number of seconds"):
        ckpt.CheckpointManager(str(tmp_path / "run"), **{name: math.inf})


def test_a_week_an_int_and_numpy_scalars_are_accepted(tmp_path):
    ckpt.save(str(tmp_path / "1"), {"w": jnp.ones(4)}, commit_timeout_s=7 * 24 * 3600, agreement_timeout_s=5)
    ckpt.save(str(tmp_path / "2"), {"w": jnp.ones(4)}, commit_timeout_s=np.int64(30), agreement_timeout_s=np.float32(2.5))
    assert ckpt.restore(str(tmp_path / "1"))["w"].tolist() == [1.0] * 4
