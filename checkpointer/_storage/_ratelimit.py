"""The write-rate limit: a token bucket that paces a save's chunk writes.

`max_write_bytes_per_s` on `save`, `save_async` and `CheckpointManager` caps how fast
one process issues bytes to storage, so a checkpoint burst does not starve the training
job's own reads of the same storage (dataset shards on the same file system or bucket).

Rules:
- Tokens are bytes. The bucket refills at `rate_bytes_per_s` up to `burst_bytes` and
  starts full. By default `burst_bytes = max(rate_bytes_per_s * DEFAULT_BURST_S,
  MIN_BURST_BYTES)`: 50 ms of writing at the cap, so a save of `B` bytes finishes no
  earlier than `(B - burst_bytes) / rate_bytes_per_s` seconds after it starts.
- `acquire(n)` reserves `n` bytes: granted at once when the bucket holds them;
  otherwise the level goes below zero and the caller sleeps until the refill has paid
  the debt. A request larger than the burst is thus granted when it would have been if
  taken in burst-sized pieces back to back, with one sleep. Over any interval of `T`
  seconds the bytes granted stay below `burst_bytes + rate_bytes_per_s * T`, also with
  several threads acquiring at once (they queue through the debt).
- The unit of pacing is one chunk write (one zarr shard file: one file write or one
  object PUT): `write_snapshot` acquires a chunk's bytes, then issues its write. A chunk
  larger than the burst waits for all its bytes and is then written at storage speed;
  the cap holds for the average over the save, not within one chunk. (Writing a chunk as
  several slab writes yields the same file but rewrites it once per slab — measured:
  4 slabs wrote 2.5x, 16 slabs 9x the bytes — and a transaction around the slabs
  issues the whole file at commit, so neither paces the storage traffic.)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

DEFAULT_BURST_S = 0.05
MIN_BURST_BYTES = 64 * 1024


class TokenBucket:
    """A thread-safe token bucket of bytes.

    Args:
      rate_bytes_per_s: refill rate, bytes per second (> 0, finite).
      burst_bytes: capacity, bytes (> 0); default: see the module rules.
      clock: monotonic seconds (tests pass a fake clock).
      sleep: sleeps for the given seconds (tests pass one that advances the fake clock).
    Raises:
      ValueError: a rate or burst that is not a positive finite number.

    Multi-process: per process; each process has its own bucket and its own cap.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.rate_bytes_per_s = _positive("rate_bytes_per_s", rate_bytes_per_s)
        if burst_bytes is None:
            burst_bytes = max(self.rate_bytes_per_s * DEFAULT_BURST_S, MIN_BURST_BYTES)
        self.burst_bytes = _positive("burst_bytes", burst_bytes)
        self._clock, self._sleep = clock, sleep
        self._mu = threading.Lock()
        self._level_bytes = self.burst_bytes
        self._updated_s = clock()
        self.waited_s = 0.0  # total seconds callers slept, for reports

    def acquire(self, n_bytes: int) -> float:
        """Blocks until `n_bytes` may be written; returns the seconds slept.

        Args:
          n_bytes: bytes about to be written (>= 0), any size (a request above the
            burst waits as long as burst-sized pieces would).
        """
        if n_bytes <= 0:
            return 0.0
        with self._mu:
            now = self._clock()
            self._level_bytes = min(self.burst_bytes, self._level_bytes + (now - self._updated_s) * self.rate_bytes_per_s)
            self._updated_s = now
            self._level_bytes -= float(n_bytes)
            wait_s = -self._level_bytes / self.rate_bytes_per_s if self._level_bytes < 0 else 0.0
            self.waited_s += wait_s
        if wait_s > 0:
            self._sleep(wait_s)
        return wait_s


def _positive(name: str, value: object) -> float:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a positive number of bytes (per second), got {value!r}")
    return number


def limiter_for(max_write_bytes_per_s: float | None) -> TokenBucket | None:
    """The bucket for a `max_write_bytes_per_s` argument (None: unlimited, no bucket).

    Raises:
      ValueError: not None and not a positive finite number (e.g. 0, -1, inf, "fast").
    """
    if max_write_bytes_per_s is None:
        return None
    try:
        return TokenBucket(max_write_bytes_per_s)
    except ValueError:
        raise ValueError(
            f"max_write_bytes_per_s must be None (unlimited) or a positive number of bytes per second, "
            f"got {max_write_bytes_per_s!r}; e.g. 200 * 2**20 for 200 MiB/s"
        ) from None


def acquire(limiter: TokenBucket | None, n_bytes: int) -> None:
    """`limiter.acquire(n_bytes)`, or nothing when there is no limit."""
    if limiter is not None:
        limiter.acquire(n_bytes)
