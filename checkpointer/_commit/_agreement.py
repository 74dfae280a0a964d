"""Step 0 of the commit protocol: every process agrees on what it is about to save.

Before a save writes anything, each process contributes its *proposal*: the path (so
the directory and the step), and a digest of the tree as the manifest would describe
it (structure, leaf paths, and per leaf its shape, dtype, chunking, saved sharding or
non-array value). Process 0 compares the proposals and publishes one verdict. Keys in
the coordination service (`jax.distributed`), all under `checkpointer/save/<n>/`, where
`n` counts this process's saves (every process calls save the same number of times, in
the same order):

```
p/<i>       process i's proposal: {"path", "step", "digest"} or {"path", "refused"}
verdict     process 0's answer: "ok:<generation>" | "error:<message>" | "details:[i, ...]"
tree/<i>    on "details" only: process i's full tree description, one process per
            distinct digest, so process 0 can name the leaves and values that differ
final       after "details": "error:<message>"
```
That is O(P) keys per save. A difference (another path or step, another tree, another
non-array value, a process that refused the save before the agreement) raises
`SaveAgreementError` on every process within a poll interval of the last arrival; a
process that does not arrive within `agreement_timeout_s` is named. Nothing is written
before the verdict is "ok".
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from .. import _coord, _format
from .._errors import SaveAgreementError

DEFAULT_AGREEMENT_TIMEOUT_S = 30.0
_PREFIX = "checkpointer/save"
# Differences shown per message (leaves, or groups of processes).
_MAX_SHOWN = 8

_counter = itertools.count(1)
_counter_lock = threading.Lock()


def next_ticket() -> int:
    """This process's next save number (1, 2, ...); names the save in the agreement."""
    with _counter_lock:
        return next(_counter)


@dataclasses.dataclass(frozen=True)
class Proposal:
    """What one process is about to save.

    Attributes:
      path: the checkpoint path (its parent is the directory).
      step: the step, or None.
      tree: `(leaf path or "(structure)", JSON description)` pairs, in tree order: the
        manifest entry of each leaf (array metadata or non-array value) and the
        structure. Per-process state is not part of it.
    """

    path: str
    step: int | None
    tree: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name, desc in self.tree:
            h.update(name.encode("utf-8", "surrogatepass") + b"\0" + desc.encode("utf-8", "surrogatepass") + b"\0")
        return h.hexdigest()[:32]


def proposal(path: str, step: int | None, structure: dict, leaves: Mapping[str, dict]) -> Proposal:
    """The proposal of a save: `leaves` maps leaf path to its manifest entry."""
    tree = [("(structure)", _canonical(structure))]
    tree += [(p, _canonical(entry)) for p, entry in leaves.items()]
    return Proposal(path, step, tuple(tree))


def _canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _client() -> Any:  # Any: jaxlib's DistributedRuntimeClient has no stubs
    return _coord._client()


def _key(ticket: int, *parts: object) -> str:
    return "/".join([_PREFIX, str(ticket), *map(str, parts)])


def refuse(ticket: int, path: str, error: BaseException) -> None:
    """Tells the others that this process will not take part in save `ticket` (it
    failed before the agreement, e.g. a leaf it cannot store), so they fail at once."""
    if _coord.process_count() == 1:
        return
    text = f"{type(error).__name__}: {error}"
    pidx = _coord.process_index()
    try:
        _client().key_value_set(_key(ticket, "p", pidx), json.dumps({"path": path, "refused": text}))
        if pidx == 0:  # process 0 gives the verdict itself: there is nothing to compare
            _publish_error(_client(), ticket, _refusal_problem(ticket, {0: {"path": path, "refused": text}}))
    except Exception:  # the service may be gone; the others then time out, naming us
        pass


def agree(
    ticket: int,
    mine: Proposal,
    *,
    timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S,
    before_verdict: Callable[[], None] | None = None,
) -> str:
    """Runs the agreement of save `ticket`; returns the generation on every process.

    Args:
      ticket: this process's save number (`next_ticket()`).
      mine: this process's proposal.
      timeout_s: how long to wait for the other processes, seconds.
      before_verdict: process 0 runs it once every proposal matched, before anyone
        is told to write (the object-store clean-up of the step's old content).
    Returns:
      The generation id of this save attempt (chosen by process 0).
    Raises:
      SaveAgreementError: the proposals differ, a process refused, or did not arrive
        within `timeout_s`; the message names each process and what it proposed.

    Multi-process: every process calls it once per save, in the same order.
    """
    if _coord.process_count() == 1:
        if before_verdict is not None:
            before_verdict()
        return _format.new_generation()
    client = _client()
    pidx, pcount = _coord.process_index(), _coord.process_count()
    client.key_value_set(_key(ticket, "p", pidx), json.dumps({"path": mine.path, "step": mine.step, "digest": mine.digest}))
    if pidx == 0:
        return _decide(client, ticket, mine, pcount, timeout_s, before_verdict)
    return _follow(client, ticket, mine, pidx, timeout_s)


# --- process 0 ---------------------------------------------------------------------------------


def _decide(
    client: Any, ticket: int, mine: Proposal, pcount: int, timeout_s: float, before_verdict: Callable[[], None] | None
) -> str:
    # Fail fast: a refusal or another path/step is known without waiting for all.
    got = _proposals(_coord.poll_reports(
        client, _key(ticket, "p") + "/", time.monotonic() + timeout_s,
        lambda r: _settled(ticket, _proposals(r), pcount),
    ))
    problem = _path_problem(ticket, got)
    if problem is not None:
        _fail(client, ticket, problem)
    missing = [i for i in range(pcount) if i not in got]
    if missing:
        _fail(
            client, ticket,
            f"save #{ticket} of {mine.path}: processes {missing} did not arrive within {timeout_s:g} s "
            f"(agreement_timeout_s); processes {sorted(got)} did. Every process must call save (or the manager's "
            "save) the same number of times, in the same order, with the same path and tree.",
        )
    digests = {i: got[i].get("digest") for i in range(pcount)}
    if len(set(digests.values())) > 1:
        others: dict[str | None, int] = {}
        for i, d in sorted(digests.items()):
            if d != digests[0]:
                others.setdefault(d, i)
        reps = sorted(others.values())
        client.key_value_set(_key(ticket, "verdict"), "details:" + json.dumps(reps))
        trees: dict[int, dict[str, str] | None] = {0: dict(mine.tree)}
        wait_until = time.monotonic() + timeout_s
        for i in reps:
            try:
                raw = client.blocking_key_value_get(_key(ticket, "tree", i), max(1, int((wait_until - time.monotonic()) * 1000)))
                trees[i] = dict(json.loads(raw))
            except Exception:
                trees[i] = None
        message = _tree_problem(ticket, mine.path, digests, trees)
        client.key_value_set(_key(ticket, "final"), "error:" + message)
        raise SaveAgreementError(message)
    try:
        if before_verdict is not None:
            before_verdict()
    except BaseException as e:
        _publish_error(client, ticket, f"save #{ticket} of {mine.path}: process 0 could not prepare it: {type(e).__name__}: {e}")
        raise
    generation = _format.new_generation()
    client.key_value_set(_key(ticket, "verdict"), "ok:" + generation)
    return generation


def _settled(ticket: int, got: Mapping[int, dict], pcount: int) -> bool:
    """Whether process 0 can decide: every process proposed, or the difference of paths
    or a refusal is known already."""
    return all(i in got for i in range(pcount)) or _path_problem(ticket, got) is not None


def _proposals(reports: Mapping[int, str]) -> dict[int, dict]:
    """The proposals among the reports `p/<i>` (JSON objects; anything else is skipped)."""
    out: dict[int, dict] = {}
    for i, value in reports.items():
        try:
            proposal = json.loads(value)
        except (ValueError, TypeError):
            continue
        if isinstance(proposal, dict):
            out[i] = proposal
    return out


def _publish_error(client: Any, ticket: int, message: str) -> None:
    """Process 0: publishes the verdict "error:<message>" (best effort)."""
    try:
        client.key_value_set(_key(ticket, "verdict"), "error:" + message)
    except Exception:
        pass


def _fail(client: Any, ticket: int, message: str) -> NoReturn:
    """Process 0: publishes the error verdict and raises it here too."""
    _publish_error(client, ticket, message)
    raise SaveAgreementError(message)


_V = TypeVar("_V")


def _groups(values: Mapping[int, _V]) -> list[tuple[list[int], _V]]:
    """Processes grouped by equal value, in process order of first appearance."""
    out: list[tuple[list[int], _V]] = []
    for i in sorted(values):
        for procs, v in out:
            if v == values[i]:
                procs.append(i)
                break
        else:
            out.append(([i], values[i]))
    return out


def _procs(procs: list[int]) -> str:
    if len(procs) == 1:
        return f"process {procs[0]}"
    shown = ", ".join(map(str, procs[:_MAX_SHOWN])) + (f", ... ({len(procs)} in all)" if len(procs) > _MAX_SHOWN else "")
    return f"processes {shown}"


def _refusal_problem(ticket: int, got: Mapping[int, dict]) -> str:
    """The message naming the processes of `got` that refused save `ticket`."""
    refused = {i: p["refused"] for i, p in got.items() if "refused" in p}
    lines = [f"save #{ticket} was refused before anything was written:"]
    lines += [f"  process {i} ({got[i].get('path')}): {text}" for i, text in sorted(refused.items())][:_MAX_SHOWN]
    return "\n".join(lines)


def _path_problem(ticket: int, got: Mapping[int, dict]) -> str | None:
    if any("refused" in p for p in got.values()):
        return _refusal_problem(ticket, got)
    targets = {i: (p.get("path"), p.get("step")) for i, p in got.items()}
    if len(set(targets.values())) <= 1:
        return None
    lines = [f"processes save different checkpoints as their save #{ticket}; nothing was written:"]
    for procs, (path, step) in _groups(targets)[:_MAX_SHOWN]:
        lines.append(f"  {_procs(procs)}: {path} (step {step})")
    lines.append(
        "Every process must save the same path (same directory and step) in the same order; derive the path from "
        "values every process shares (the step), not from the process, the host or the clock."
    )
    return "\n".join(lines)


def _tree_problem(ticket: int, path: str, digests: Mapping[int, str | None], trees: Mapping[int, dict | None]) -> str:
    by_digest: dict[str | None, list[int]] = {}
    for i, d in sorted(digests.items()):
        by_digest.setdefault(d, []).append(i)
    groups = [(procs, trees.get(procs[0])) for procs in by_digest.values()]
    lines = [f"processes save different trees to {path} (save #{ticket}); nothing was written:"]
    names: list[str] = []
    for _, tree in groups:
        for name in tree or {}:
            if name not in names:
                names.append(name)
    shown = 0
    for name in names:
        descs = [(procs, (tree or {}).get(name)) for procs, tree in groups if tree is not None]
        if len({d for _, d in descs}) <= 1:
            continue
        if shown == _MAX_SHOWN:
            lines.append("  ... (more leaves differ)")
            break
        shown += 1
        what = "the tree structure" if name == "(structure)" else f"leaf {name!r}"
        lines.append(f"  {what}:")
        for procs, desc in descs:
            lines.append(f"    {_procs(procs)}: {_human(desc)}")
    for procs, tree in groups:
        if tree is None:
            lines.append(f"  {_procs(procs)}: (did not send its tree description in time)")
    lines.append(
        "Non-array leaves must be equal on every process; per-process values (a data-loader position, a host's "
        "seed) go into save(..., per_process_state=...). Arrays must have the same shape, dtype and sharding."
    )
    return "\n".join(lines)


def _human(desc: str | None) -> str:
    """A short text of one leaf description (a manifest entry as canonical JSON)."""
    if desc is None:
        return "absent"
    try:
        entry = json.loads(desc)
    except ValueError:
        return desc[:200]
    if isinstance(entry, dict) and entry.get("type") == "array":
        from .._format import SavedSharding

        sharding = entry.get("saved_sharding")
        where = SavedSharding.from_json(sharding).describe() if sharding else "host numpy array"
        return f"{entry.get('dtype')}{entry.get('shape')} {where}"
    if isinstance(entry, dict) and entry.get("type") == "value":
        from .._format import value_from_json

        try:
            return repr(value_from_json(entry.get("value"), "agreement"))[:200]
        except Exception:
            return desc[:200]
    return desc[:200]


# --- other processes ---------------------------------------------------------------------------


def _follow(client: Any, ticket: int, mine: Proposal, pidx: int, timeout_s: float) -> str:
    verdict = _wait_verdict(client, ticket, mine, timeout_s)
    kind, _, body = verdict.partition(":")
    if kind == "ok":
        return body
    if kind == "details":
        if pidx in json.loads(body):
            client.key_value_set(_key(ticket, "tree", pidx), json.dumps(list(mine.tree)))
        try:
            final = client.blocking_key_value_get(_key(ticket, "final"), int((timeout_s + 5) * 1000))
        except Exception as e:
            raise SaveAgreementError(
                f"save #{ticket} of {mine.path}: the processes' trees differ, and process 0 did not say how within "
                f"{timeout_s:g} s: {e}"
            ) from e
        body = final.partition(":")[2]
    raise SaveAgreementError(body)


def _wait_verdict(client: Any, ticket: int, mine: Proposal, timeout_s: float) -> str:
    """Waits for process 0's verdict: `timeout_s`, and as long again if process 0 is
    there (it then publishes within its own timeout)."""
    key = _key(ticket, "verdict")
    for attempt in range(2):
        try:
            return client.blocking_key_value_get(key, int(timeout_s * 1000))
        except Exception as e:
            error = e
        if attempt == 0:
            try:
                client.key_value_try_get(_key(ticket, "p", 0))  # raises when absent
                here = True
            except Exception:
                here = False
            if not here:
                break
    raise SaveAgreementError(
        f"save #{ticket} of {mine.path}: process 0 did not arrive within {timeout_s:g} s (agreement_timeout_s), "
        f"or gave no verdict ({error}). Every process must call save the same number of times, in the same order."
    )
