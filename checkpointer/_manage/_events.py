"""The manager's figures as `jax.monitoring` events, for the metrics systems JAX users
already listen to (`jax.monitoring.register_event_duration_secs_listener`,
`register_scalar_listener`, `register_event_listener`).

Every process records its own figures, once per save (or restore) of a
`CheckpointManager`; process 0's commit includes retention. `EVENTS` lists each name with
its kind and Orbax's nearest `/jax/orbax/...` (or `/jax/checkpoint/...`) event; the
table in docs/operating.md is written from it (tests/test_alerts.py checks they agree).
"""

from __future__ import annotations

import logging

log = logging.getLogger("checkpointer")

SAVE_BLOCKING_S = "/checkpointer/save/blocking_duration_secs"
SAVE_WRITE_S = "/checkpointer/save/write_duration_secs"
SAVE_COMMIT_S = "/checkpointer/save/commit_duration_secs"
SAVE_COMMIT_LAG_S = "/checkpointer/save/commit_lag_duration_secs"
SAVE_COMMIT_LAG_STEPS = "/checkpointer/save/commit_lag_steps"
SAVE_BYTES = "/checkpointer/save/bytes"
SAVE_FAILURE = "/checkpointer/save/failure"
RESTORE_S = "/checkpointer/restore/duration_secs"
RESTORE_BYTES = "/checkpointer/restore/bytes"

# name -> (kind: "duration" | "scalar" | "event", Orbax's nearest event, what it measures)
EVENTS: dict[str, tuple[str, str, str]] = {
    SAVE_BLOCKING_S: ("duration", "/jax/orbax/write/blocking_duration_secs",
                      "seconds `save` blocked training (the host snapshot, the agreement included)"),
    SAVE_WRITE_S: ("duration", "/jax/orbax/write/background_ts_duration_secs",
                   "seconds this process spent writing its chunks (until durable)"),
    SAVE_COMMIT_S: ("duration", "/jax/orbax/write/finalize_duration_secs",
                    "seconds from this process's chunks durable to the commit (process 0: reports, manifest, "
                    "marker, publication, retention)"),
    SAVE_COMMIT_LAG_S: ("duration", "/jax/orbax/write/background_duration_secs",
                        "seconds from the end of the snapshot to the commit: how long the copied state was not yet safe"),
    SAVE_COMMIT_LAG_STEPS: ("scalar", "/jax/checkpoint/write/async/commit_future_count",
                            "steps between the newest step handed to `save` and the newest committed one, at the commit"),
    SAVE_BYTES: ("scalar", "/jax/orbax/write/gbytes", "bytes of chunk files this process wrote (Orbax: GB)"),
    SAVE_FAILURE: ("event", "/jax/orbax/write/success",
                   "a save failed on this process (Orbax records successes instead)"),
    RESTORE_S: ("duration", "/jax/orbax/read/total_duration_secs", "seconds a manager's `restore` took"),
    RESTORE_BYTES: ("scalar", "/jax/checkpoint/read/gbytes",
                    "bytes a manager's `restore` read from storage on this process (Orbax: GB)"),
}


def _record(name: str, value: float | None = None) -> None:
    """Records one event; never raises (a listener's failure must not fail a save)."""
    import jax

    kind = EVENTS[name][0]
    try:
        if kind == "event":
            jax.monitoring.record_event(name)
        elif value is None:
            return
        elif kind == "duration":
            jax.monitoring.record_event_duration_secs(name, float(value))
        else:
            jax.monitoring.record_scalar(name, float(value))
    except Exception as e:
        log.warning("a jax.monitoring listener failed on %s: %s", name, e)


def save_blocked(seconds: float) -> None:
    _record(SAVE_BLOCKING_S, seconds)


def save_committed(*, write_s: float | None, commit_s: float | None, commit_lag_s: float | None,
                   commit_lag_steps: int, bytes_written: int) -> None:
    """The figures of one committed save, on the process that took part."""
    _record(SAVE_WRITE_S, write_s)
    _record(SAVE_COMMIT_S, commit_s)
    _record(SAVE_COMMIT_LAG_S, commit_lag_s)
    _record(SAVE_COMMIT_LAG_STEPS, commit_lag_steps)
    _record(SAVE_BYTES, bytes_written)


def save_failed() -> None:
    _record(SAVE_FAILURE)


def restored(seconds: float, bytes_read: int) -> None:
    _record(RESTORE_S, seconds)
    _record(RESTORE_BYTES, bytes_read)
