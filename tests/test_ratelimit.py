"""The write-rate limit: the token bucket on a fake clock, and its hooks into saves."""

import math
import threading

import jax
import numpy as np
import pytest
from conftest import make_mesh
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpointer as ckpt
from checkpointer._storage import _ratelimit
from checkpointer._storage._ratelimit import TokenBucket

# About the per-leaf layout (each leaf its own zarr array and chunk files): small leaves
# are not packed here (tests/test_pack.py covers the packed layout).
pytestmark = pytest.mark.usefixtures("unpacked_layout")


class FakeClock:
    """Monotonic seconds that move only when someone sleeps (or the test advances it)."""

    def __init__(self):
        self.now_s = 100.0
        self.slept = []

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now_s += seconds


def test_full_bucket_grants_the_burst_at_once_then_paces_at_the_rate():
    clock = FakeClock()
    bucket = TokenBucket(100.0, 50.0, clock=clock, sleep=clock.sleep)
    assert bucket.acquire(50) == 0.0
    assert bucket.acquire(25) == pytest.approx(0.25)
    assert clock.now_s == pytest.approx(100.25)
    clock.now_s += 10.0  # idle: refills to the burst, no further
    assert bucket.acquire(50) == 0.0
    assert bucket.acquire(1) == pytest.approx(0.01)


def test_acquire_larger_than_the_burst_waits_as_burst_sized_pieces_would():
    clock = FakeClock()
    bucket = TokenBucket(1000.0, 100.0, clock=clock, sleep=clock.sleep)
    assert bucket.acquire(1000) == pytest.approx(0.9)  # 100 from the full bucket, 900 at the rate
    assert clock.now_s == pytest.approx(100.9)
    assert bucket.acquire(0) == 0.0
    assert bucket.acquire(100) == pytest.approx(0.1)  # the bucket was left empty
    assert bucket.waited_s == pytest.approx(1.0)


def test_default_burst_is_50_ms_at_the_rate_with_a_floor():
    assert TokenBucket(200 * 2**20).burst_bytes == pytest.approx(0.05 * 200 * 2**20)
    assert TokenBucket(1000.0).burst_bytes == _ratelimit.MIN_BURST_BYTES


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(1.0, 1e9),
    burst_fraction=st.floats(0.01, 2.0),
    ops=st.lists(st.tuples(st.integers(0, 10**9), st.floats(0.0, 3.0)), min_size=1, max_size=30),
)
def test_bytes_granted_in_any_window_stay_below_burst_plus_rate_times_window(rate, burst_fraction, ops):
    clock = FakeClock()
    burst = rate * burst_fraction
    bucket = TokenBucket(rate, burst, clock=clock, sleep=clock.sleep)
    calls = []  # (clock when the acquire began, clock when it returned, bytes)
    for n_bytes, idle_s in ops:
        clock.now_s += idle_s
        began_s = clock.now_s
        bucket.acquire(n_bytes)
        calls.append((began_s, clock.now_s, n_bytes))
    # The bucket holds at most the burst when acquire i begins, gains rate * dt, and is
    # never in debt when acquire j returns.
    for i in range(len(calls)):
        for j in range(i, len(calls)):
            granted = sum(n for _, _, n in calls[i : j + 1])
            bound = burst + rate * (calls[j][1] - calls[i][0])
            assert granted <= bound * (1 + 1e-9) + 1e-6


def test_threads_share_one_bucket_without_losing_reservations():
    class Frozen:  # time stands still: every reservation adds its debt to the queue
        def __init__(self):
            self.mu, self.slept = threading.Lock(), []

        def sleep(self, s):
            with self.mu:
                self.slept.append(s)

    frozen = Frozen()
    rate, burst, piece, threads, per_thread = 1000.0, 100.0, 100, 8, 25
    bucket = TokenBucket(rate, burst, clock=lambda: 0.0, sleep=frozen.sleep)
    workers = [threading.Thread(target=lambda: [bucket.acquire(piece) for _ in range(per_thread)]) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    n = threads * per_thread
    # The k-th reservation (1-based) waits (k * piece - burst) / rate, whatever the order.
    expected = sorted(max(0.0, (k * piece - burst) / rate) for k in range(1, n + 1))
    assert sorted([0.0] + frozen.slept) == pytest.approx(expected)
    assert bucket.waited_s == pytest.approx(sum(expected))


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, True, "fast"])
def test_invalid_caps_are_refused_before_anything_is_written(bad, tmp_path):
    with pytest.raises(ValueError, match="max_write_bytes_per_s"):
        _ratelimit.limiter_for(bad)
    with pytest.raises(ValueError, match="max_write_bytes_per_s"):
        ckpt.save(str(tmp_path / "c"), {"x": np.zeros(4)}, max_write_bytes_per_s=bad)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match="max_write_bytes_per_s"):
        ckpt.CheckpointManager(str(tmp_path / "d"), max_write_bytes_per_s=bad)


def test_limiter_for_none_is_unlimited():
    assert _ratelimit.limiter_for(None) is None


def _state():
    mesh = make_mesh((2, 4), ("data", "model"))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "b": np.arange(10, dtype=np.int16)}


def test_save_acquires_each_chunk_before_writing_it(tmp_path, monkeypatch):
    calls = []
    real = TokenBucket.acquire
    monkeypatch.setattr(TokenBucket, "acquire", lambda self, n: calls.append(n) or real(self, n))
    state = _state()
    ckpt.save(str(tmp_path / "1"), state, max_write_bytes_per_s=2**30)
    # 8 chunks of w (32 x 8 float32 each) and one of b
    assert sorted(calls) == sorted([32 * 8 * 4] * 8 + [20])
    out = ckpt.restore(str(tmp_path / "1"))
    np.testing.assert_array_equal(out["w"], np.asarray(state["w"]))
    calls.clear()
    ckpt.save_async(str(tmp_path / "2"), state, max_write_bytes_per_s=2**30).wait()
    assert sum(calls) == 64 * 32 * 4 + 20


def test_manager_shares_one_bucket_and_status_shows_the_write_rate(tmp_path):
    with ckpt.CheckpointManager(str(tmp_path / "run"), max_write_bytes_per_s=2**30) as mgr:
        assert mgr.status().last_write_bytes_per_s is None
        mgr.save(1, _state())
        mgr.wait_until_finished()
        limiter = mgr._write_limiter
        rate = mgr.status().last_write_bytes_per_s
        assert rate is not None and rate > 0
        mgr.save(2, _state())
        mgr.wait_until_finished()
        assert mgr._write_limiter is limiter
    with ckpt.CheckpointManager(str(tmp_path / "sync"), async_save=False) as mgr:
        mgr.save(1, _state())
        assert mgr.status().last_write_bytes_per_s > 0
