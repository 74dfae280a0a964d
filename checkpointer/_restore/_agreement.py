"""The rendezvous of a cooperative restore: agree before reading, report before exchanging.

A cooperative restore is collective (its exchange is one JAX program run by every
process), so a process that cannot take part must make every process raise instead of
leaving them waiting in the exchange. Two rounds in the coordination service's
key-value store (`jax.distributed`), under `checkpointer/restore/<n>/` where `n` counts
this process's cooperative restores (every process makes them in the same order):

```
p/<i>          round 1, before anyone reads: {"path", "marker", "digest"} (the commit
               marker's content, i.e. the save's generation, and a digest of the
               resolved target and options) or {"path", "refused": "<error>"}
p-verdict      process 0: "ok" | "error:<message>"
read/<i>       round 2, after reading its share: {"ok": true} or {"refused": "<error>"}
read-verdict   process 0: "ok" | "error:<message>"
```

Process 0 polls each round's directory and answers as soon as a refusal or a
difference is known (fail fast), or once every process arrived; the others block on
the verdict. A process that does not arrive within the round's timeout is named. The
machinery is the save agreement's (`_agreement`): the same grouping of processes in
messages and the same canonical JSON for digests.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping

from .. import _commit, _coord
from .._errors import RestoreAgreementError

# Round 1 waits this long for every process (they all just called restore).
DEFAULT_AGREEMENT_TIMEOUT_S = _commit.DEFAULT_AGREEMENT_TIMEOUT_S
# Round 2 waits for the slowest process's reads.
DEFAULT_READ_TIMEOUT_S = _coord.DEFAULT_COMMIT_TIMEOUT_S
_PREFIX = "checkpointer/restore"
# Process 0's longest pause between polls: a restore waits for it twice, so it is kept
# short (one key-value directory read per pause; the save agreement allows 0.1 s).
_MAX_POLL_S = 0.02

_counter = itertools.count(1)
_counter_lock = threading.Lock()


def next_ticket() -> int:
    """This process's next cooperative restore number (1, 2, ...)."""
    with _counter_lock:
        return next(_counter)


def digest(description: object) -> str:
    """A digest of a JSON-serialisable description (of the target and options)."""
    return hashlib.sha256(_commit._canonical(description).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _key(ticket: int, *parts: object) -> str:
    return "/".join([_PREFIX, str(ticket), *map(str, parts)])


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def refuse(ticket: int, path: str, error: BaseException, *, phase: str = "p") -> None:
    """Tells the others this process will not take part in restore `ticket` (round
    `phase`: "p" before reading, "read" after), so they raise at once. Never raises."""
    if _coord.process_count() == 1:
        return
    try:
        client = _coord._client()
        client.key_value_set(_key(ticket, phase, _coord.process_index()), json.dumps({"path": path, "refused": _error_text(error)}))
    except Exception:  # the service may be gone: the others then time out, naming us
        pass


def agree(ticket: int, path: str, marker: str, target_digest: str, *, timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> None:
    """Round 1: every process restores the same committed save onto the same target.

    Args:
      ticket: this process's restore number (`next_ticket()`).
      path: the checkpoint path.
      marker: the commit marker's content as this process read it (names the save's
        generation).
      target_digest: `digest` of the resolved target and options.
      timeout_s: how long to wait for the other processes, seconds.
    Raises:
      RestoreAgreementError: a process refused (its error is named), restores another
        path, another save (marker) or onto another target, or did not arrive in time.

    Multi-process: every process calls it once per cooperative restore, in order.
    """
    mine = {"path": path, "marker": marker, "digest": target_digest}
    _round(ticket, "p", mine, _compare, timeout_s, path)


def report_read(ticket: int, path: str, *, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
    """Round 2: this process read its share; returns once every process did.

    Raises:
      RestoreAgreementError: a process failed to read its share (named, with its
        error), or did not report within `timeout_s`.

    Multi-process: every process that passed `agree` calls it (or `refuse(...,
    phase="read")`) before the exchange.
    """
    _round(ticket, "read", {"ok": True}, lambda got: None, timeout_s, path)


def _round(ticket: int, phase: str, mine: dict, compare: Callable[[Mapping[int, dict]], str | None], timeout_s: float, path: str) -> None:
    if _coord.process_count() == 1:
        return
    client = _coord._client()
    pidx, pcount = _coord.process_index(), _coord.process_count()
    client.key_value_set(_key(ticket, phase, pidx), json.dumps(mine))
    verdict_key = _key(ticket, f"{phase}-verdict")
    what = "before reading" if phase == "p" else "after reading"
    if pidx == 0:
        message = _collect(client, ticket, phase, pcount, compare, timeout_s, path)
        client.key_value_set(verdict_key, "ok" if message is None else "error:" + message)
        if message is not None:
            raise RestoreAgreementError(message)
        return
    try:
        # Process 0 answers within its own timeout of arriving; allow as long again.
        verdict = client.blocking_key_value_get(verdict_key, int(2 * timeout_s * 1000))
    except Exception as e:
        raise RestoreAgreementError(
            f"cooperative restore #{ticket} of {path} (process {pidx}): process 0 gave no verdict {what} within "
            f"{2 * timeout_s:g} s ({e}). Every process must call restore the same number of times, in the same "
            "order; or pass cooperative=False to restore independently."
        ) from e
    if verdict != "ok":
        raise RestoreAgreementError(verdict.partition(":")[2])


def _collect(client, ticket: int, phase: str, pcount: int, compare, timeout_s: float, path: str) -> str | None:
    """Process 0: polls the round's entries; the problem to report, or None when all agree."""
    deadline = time.monotonic() + timeout_s
    prefix = _key(ticket, phase) + "/"
    pause = 0.005
    while True:
        try:
            entries = client.key_value_dir_get(prefix)
        except Exception:
            entries = []
        got: dict[int, dict] = {}
        for key, value in entries:
            try:
                got[int(key.rsplit("/", 1)[1])] = json.loads(value)
            except (ValueError, TypeError):
                continue
        refused = {i: p["refused"] for i, p in got.items() if "refused" in p}
        if refused:
            when = "before reading" if phase == "p" else "while reading its share"
            lines = [f"cooperative restore #{ticket} of {path} failed {when} on {len(refused)} process(es); nothing was exchanged:"]
            lines += [f"  process {i}: {text}" for i, text in sorted(refused.items())][: _commit._MAX_SHOWN]
            return "\n".join(lines)
        problem = compare(got)
        if problem is not None:
            return f"cooperative restore #{ticket}: {problem}"
        missing = [i for i in range(pcount) if i not in got]
        if not missing:
            return None
        if time.monotonic() >= deadline:
            return (
                f"cooperative restore #{ticket} of {path}: processes {missing} did not arrive "
                f"{'before reading' if phase == 'p' else 'after reading'} within {timeout_s:g} s; processes "
                f"{sorted(got)} did. A cooperative restore is collective: every process must call restore with the "
                "same path and target, in the same order (or all pass cooperative=False)."
            )
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, _MAX_POLL_S)


def _compare(got: Mapping[int, dict]) -> str | None:
    """Round 1: another path, save or target on some process (known without waiting for all)."""
    ok = {i: p for i, p in got.items() if "refused" not in p}
    for field, noun, fix in (
        ("path", "different checkpoints", "Restore the same path on every process (derive it from values they share)."),
        ("marker", "different saves of the checkpoint (its commit marker differs: it was replaced or deleted meanwhile)",
         "Restore again; keep retention and overwrites away from a step that is being restored."),
        ("digest", "onto different targets (shapes, dtypes, shardings, partial or cooperative differ)",
         "Pass the same target (the same global shardings) on every process."),
    ):
        values = {i: p.get(field) for i, p in ok.items()}
        if len(set(values.values())) > 1:
            lines = [f"processes restore {noun}; nothing was read:"]
            for procs, v in _commit._groups(values)[: _commit._MAX_SHOWN]:
                shown = v if field == "path" else f"{field} {str(v)[:48]}"
                lines.append(f"  {_commit._procs(procs)}: {shown}")
            lines.append(fix)
            return "\n".join(lines)
    return None
