"""Step 0 of the commit protocol: every process agrees on what it is about to save.

Before a save writes anything, each process contributes its *proposal*: the path (so
the directory and the step), and a digest of the tree as the manifest would describe
it (structure, leaf paths, and per leaf its shape, dtype, chunking, saved sharding or
non-array value). Process 0 compares the proposals and publishes one verdict. It is one
round of the rendezvous (`_coord.Round`), keyed `checkpointer/save/<n>/`, where `n`
counts this process's saves (every process calls save the same number of times, in the
same order):

```
p/<i>       process i's proposal: {"path", "step", "digest"} or {"path", "refused"}
verdict     process 0's answer: "ok:<generation>" | "error:<message>" | "timeout:<message>"
            | "details:[i, ...]"
detail/<i>  on "details" only: process i's full tree description, one process per
            distinct digest, so process 0 can name the leaves and values that differ
final       after "details": "error:<message>"
ack/<i>     process i has the verdict (process 0 then deletes the round's keys)
```
That is O(P) keys per save. A difference (another path or step, another tree, another
non-array value, another `incremental` option, a process that refused the save before the agreement) raises
`SaveAgreementError` on every process within a poll interval of the last arrival; a
process that does not arrive within `agreement_timeout_s` is named. Nothing is written
before the verdict is "ok".
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import threading
from collections.abc import Callable, Mapping

from .. import _coord, _format
from .._coord import MAX_SHOWN, Details, Round, groups, procs
from .._errors import CorruptCheckpointError, SaveAgreementError

DEFAULT_AGREEMENT_TIMEOUT_S = 30.0
_SERIES = "save"

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
      incremental: the save's `incremental` option: every process must pass the same
        (a process without it would write chunks the others' references leave out, or
        the other way round), else the save is refused naming the processes.
    """

    path: str
    step: int | None
    tree: tuple[tuple[str, str], ...]
    incremental: bool = False

    @property
    def digest(self) -> str:
        # sha256 of every `name \0 description \0`, in order (encoded at once: one leaf's is ~100 bytes).
        text = "".join(f"{name}\0{desc}\0" for name, desc in self.tree)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def proposal(path: str, step: int | None, structure: dict, leaves: Mapping[str, dict], *, incremental: bool = False,
             describe_structure: bool = True) -> Proposal:
    """The proposal of a save: `leaves` maps leaf path to its manifest entry;
    `describe_structure=False` leaves the structure out (a job of one process compares
    its proposal with nothing)."""
    tree = [("(structure)", _coord.canonical(structure) if describe_structure else "")]
    texts: dict[int, str] = {}  # id(entry) -> its text: leaves of one layout share one entry object
    for p, entry in leaves.items():
        text = texts.get(id(entry))
        if text is None:
            text = texts[id(entry)] = _coord.canonical(entry)
        tree.append((p, text))
    return Proposal(path, step, tuple(tree), incremental)


def _round(ticket: int, path: str, timeout_s: float) -> Round:
    """The rendezvous of save `ticket`."""
    return Round(
        f"{_SERIES}/{ticket}", decide=lambda got: _decide(ticket, path, got), timeout_s=timeout_s,
        what=f"save #{ticket} of {path}", error=SaveAgreementError, timeout_name="agreement_timeout_s",
        hint="Every process must call save (or the manager's save) the same number of times, in the same order, "
             "with the same path and tree.",
    )


def refuse(ticket: int, path: str, error: BaseException) -> None:
    """Tells the others that this process will not take part in save `ticket` (it
    failed before the agreement, e.g. a leaf it cannot store), so they fail at once."""
    _round(ticket, path, DEFAULT_AGREEMENT_TIMEOUT_S).refuse(error, path=path)


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

    def outcome(got: Mapping[int, dict]) -> str:
        if before_verdict is not None:
            before_verdict()
        return _format.new_generation()

    return _round(ticket, mine.path, timeout_s).agree(
        {"path": mine.path, "step": mine.step, "digest": mine.digest, "incremental": mine.incremental}, outcome=outcome,
        detail=lambda: list(mine.tree),
    )


# --- process 0's rule --------------------------------------------------------------------


def _decide(ticket: int, path: str, got: Mapping[int, dict]) -> str | Details | None:
    """A refusal or another path/step is known without waiting for all; different
    trees, once every process proposed, need the descriptions (`Details`)."""
    problem = _path_problem(ticket, got)
    if problem is not None or len(got) < _coord.process_count():
        return problem
    digests = {i: p.get("digest") for i, p in got.items()}
    if len(set(digests.values())) <= 1:
        return None
    reps = tuple(ps[0] for ps, _ in groups(digests))
    return Details(reps, lambda trees: _tree_problem(ticket, path, digests, trees))


def _refusal_problem(ticket: int, got: Mapping[int, dict]) -> str:
    """The message naming the processes of `got` that refused save `ticket`."""
    refused = _coord.refusals(got)
    lines = [f"save #{ticket} was refused before anything was written:"]
    lines += [f"  process {i} ({got[i].get('path')}): {text}" for i, text in sorted(refused.items())][:MAX_SHOWN]
    return "\n".join(lines)


def _path_problem(ticket: int, got: Mapping[int, dict]) -> str | None:
    if _coord.refusals(got):
        return _refusal_problem(ticket, got)
    targets = {i: (p.get("path"), p.get("step")) for i, p in got.items()}
    if len(set(targets.values())) <= 1:
        return _incremental_problem(ticket, got)
    lines = [f"processes save different checkpoints as their save #{ticket}; nothing was written:"]
    for ps, (path, step) in groups(targets)[:MAX_SHOWN]:
        lines.append(f"  {procs(ps)}: {path} (step {step})")
    lines.append(
        "Every process must save the same path (same directory and step) in the same order; derive the path from "
        "values every process shares (the step), not from the process, the host or the clock."
    )
    return "\n".join(lines)


def _incremental_problem(ticket: int, got: Mapping[int, dict]) -> str | None:
    """Processes that disagree about `incremental` (e.g. a restarted job's processes
    given different options): the save is refused, naming them."""
    modes = {i: bool(p.get("incremental")) for i, p in got.items()}
    if len(set(modes.values())) <= 1:
        return None
    lines = [f"processes disagree about incremental= for save #{ticket} of {next(iter(got.values())).get('path')}; "
             "nothing was written:"]
    lines += [f"  {procs(ps)}: incremental={mode}" for ps, mode in groups(modes)[:MAX_SHOWN]]
    lines.append("Every process must pass the same incremental= (to save, save_async or CheckpointManager): a step's "
                 "references are gathered from every process, and its retention follows them.")
    return "\n".join(lines)


def _tree_problem(ticket: int, path: str, digests: Mapping[int, str | None], described: Mapping[int, object]) -> str:
    """Names the leaves (as `jax.tree_util.keystr` prints them) whose description
    differs, and each group of processes' description."""
    trees = {i: _as_tree(d) for i, d in described.items()}
    groups_ = [(ps, trees.get(ps[0])) for ps, _ in groups(digests)]
    lines = [f"processes save different trees to {path} (save #{ticket}); nothing was written:"]
    names: list[str] = []
    for _, tree in groups_:
        for name in tree or {}:
            if name not in names:
                names.append(name)
    keystrs = _keystrs([tree for _, tree in groups_])
    shown = 0
    for name in names:
        descs = [(ps, (tree or {}).get(name)) for ps, tree in groups_ if tree is not None]
        if len({d for _, d in descs}) <= 1:
            continue
        if shown == MAX_SHOWN:
            lines.append("  ... (more leaves differ)")
            break
        shown += 1
        what = "the tree structure" if name == "(structure)" else f"leaf {keystrs.get(name) or repr(name)}"
        lines.append(f"  {what}:")
        for ps, desc in descs:
            lines.append(f"    {procs(ps)}: {_human(desc)}")
    for ps, tree in groups_:
        if tree is None:
            lines.append(f"  {procs(ps)}: (did not send its tree description in time)")
    lines.append(
        "Non-array leaves must be equal on every process; per-process values (a data-loader position, a host's "
        "seed) go into save(..., per_process_state=...). Arrays must have the same shape, dtype and sharding."
    )
    return "\n".join(lines)


def _as_tree(description: object) -> dict[str, str] | None:
    """A process's tree description as sent (`[[name, desc], ...]`), or None."""
    try:
        return {str(name): str(desc) for name, desc in description} if isinstance(description, list) else None
    except (TypeError, ValueError):
        return None


def _keystrs(trees: list[dict[str, str] | None]) -> dict[str, str]:
    """Leaf path -> key string, from the structures of the trees (`["w"]`, `.params`)."""
    out: dict[str, str] = {}
    for tree in trees:
        try:
            names = _format.keystrs(_format.loads((tree or {})["(structure)"], "a process's tree structure"))
        except (KeyError, ValueError, CorruptCheckpointError):
            continue
        for leaf, name in names.items():
            out.setdefault(leaf, name or "<root>")
    return out


def _human(desc: str | None) -> str:
    """A short text of one leaf description (a manifest entry as canonical JSON)."""
    if desc is None:
        return "absent"
    try:
        entry = _format.load_json(desc, what="a leaf description")
    except ValueError:
        return desc[:200]
    if isinstance(entry, dict) and entry.get("type") == "array":
        sharding = entry.get("saved_sharding")
        where = _format.SavedSharding.from_json(sharding).describe() if sharding else "host numpy array"
        return f"{entry.get('dtype')}{entry.get('shape')} {where}"
    if isinstance(entry, dict) and entry.get("type") == "value":
        try:
            return repr(_format.value_from_json(entry.get("value"), "agreement"))[:200]
        except Exception:
            return desc[:200]
    return desc[:200]
