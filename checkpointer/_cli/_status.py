"""`status`: the probe of a directory in use, for a cron job or a Kubernetes probe
(`_manage.read_status`): the newest committed step and its age, the step in flight, the
commit lag, the last failed save. Exit status 0 ok, 1 a bound crossed or a save failing,
2 usage, 3 the directory cannot be read. Takes no lock."""

from __future__ import annotations

import sys
import time

from .. import _manage
from .._errors import CheckpointError, UsageError
from ._ui import _UI, PROG, _age

UNREADABLE = 3


def _cmd_status(args, ui: _UI) -> int:
    try:
        status = _manage.read_status(args.directory)
    except OSError as e:  # missing, not a directory, no permission (CheckpointNotFoundError too)
        sys.stderr.write(f"{PROG}: error: cannot read {args.directory}: {type(e).__name__}: {' '.join(str(e).split())}\n")
        return UNREADABLE
    except CheckpointError as e:  # one checkpoint, not a directory of steps
        raise UsageError(str(e)) from e
    problems = status.problems(max_lag_steps=args.max_lag_steps, max_age_s=args.max_age_s)
    if ui.json_mode:
        ui.json({**status.to_json(), "ok": not problems, "problems": problems})
        return 1 if problems else 0
    latest = "-" if status.latest_committed_step is None else (
        f"{status.latest_committed_step} ({_age(status.latest_age_s)} ago)" if status.latest_age_s is not None
        else str(status.latest_committed_step))
    lag = "-" if status.commit_lag_steps is None else f"{status.commit_lag_steps} steps" + (
        f" (step {status.newest_step} handed to save)" if status.commit_lag_steps else "")
    f = status.last_failure
    failure = "-" if f is None else (f"step {f.step} on process {f.process_index}, {_age(time.time() - f.unix_s)} ago"
                                     f"{'' if status.failing else ' (a later step committed)'}: {f.error}")
    ui.fields([
        ("directory", status.directory),
        ("newest committed", latest),
        ("in flight", "-" if status.step_in_flight is None else status.step_in_flight),
        ("commit lag", lag),
        ("last failure", failure),
        *([("node losses survived", ", ".join(f"step {s}: {n}" for s, n in status.node_losses_survived.items()))]
          if status.node_losses_survived else []),
        ("status", "OK" if not problems else "ALERT"),
    ])
    for p in problems:
        ui.line(f"ALERT: {p}")
    return 1 if problems else 0
