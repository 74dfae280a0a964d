"""The rendezvous of a cooperative restore: agree before reading, report before exchanging.

A cooperative restore is collective (its exchange is one JAX program run by every
process), so a process that cannot take part must make every process raise instead of
leaving them waiting in the exchange. Two rounds of the rendezvous (`_coord.Round`),
under `checkpointer/restore/<n>/` where `n` counts this process's cooperative restores
(every process makes them in the same order):

```
target/p/<i>     round 1, before anyone reads: {"path", "marker", "digest"} (the commit
                 marker's content, i.e. the save's generation, and a digest of the
                 resolved target and options) or {"path", "refused": "<error>"}
target/verdict   process 0: "ok:" | "error:<message>" | "timeout:<message>" | "details:[i, ...]"
target/detail/<i>  on "details": process i's target description (one process per
                 distinct digest), so the message names the leaves that differ
read/p/<i>       round 2, after reading its share: {"ok": true} or {"refused": "<error>"}
read/verdict     process 0: "ok:" | "error:<message>" | "timeout:<message>"
```
(and each round's `ack/<i>` and `final`, as every round has). Process 0 answers as soon
as a refusal or a difference is known (fail fast), or once every process arrived; the
others block on the verdict. A process that does not arrive within the round's timeout
is named.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Mapping

from jax.sharding import NamedSharding

from .. import _commit, _coord
from .._coord import MAX_SHOWN, Details, Round, groups, procs
from .._errors import RestoreAgreementError
from ._targets import ResolvedTarget

# Round 1 waits this long for every process (they all just called restore).
DEFAULT_AGREEMENT_TIMEOUT_S = _commit.DEFAULT_AGREEMENT_TIMEOUT_S
# Round 2 waits for the slowest process's reads (the commit timeout's default before issue
# 22: a restore's reads are not bounded by the skew of writes).
DEFAULT_READ_TIMEOUT_S = 600.0
# Process 0's longest pause between polls: a restore waits for it twice, so it is kept
# short (one key-value directory read per pause; the save agreement allows 0.1 s).
_MAX_POLL_S = 0.02
# Round names in keys, by the phase names of `refuse`.
_ROUNDS = {"p": "target", "read": "read"}

_counter = itertools.count(1)
_counter_lock = threading.Lock()


def next_ticket() -> int:
    """This process's next cooperative restore number (1, 2, ...)."""
    with _counter_lock:
        return next(_counter)


def target_description(resolved: ResolvedTarget, partial: bool, missing: str) -> dict:
    """What every process of a cooperative restore must have equal: the options, the
    target leaves kept rather than read, and per leaf (named by its key string, as
    `jax.tree_util.keystr` prints it) the result shape, dtype and global sharding
    (mesh axes and devices, spec, memory kind)."""
    leaves: list[list[object]] = []
    for leaf in resolved.leaves:
        name = leaf.meta.keystr if leaf.meta.keystr is not None else repr(leaf.path)
        lt = leaf.target
        if lt is None:
            leaves.append([name, "value"])
            continue
        s = lt.sharding
        where: object
        if s is None:
            where = "host"
        elif isinstance(s, NamedSharding):
            where = {"axes": [list(s.mesh.axis_names), list(s.mesh.axis_sizes)], "devices": [d.id for d in s.mesh.devices.flat],
                     "spec": str(s.spec), "memory_kind": s.memory_kind}
        else:
            where = repr(s)
        dtype = lt.dtype if lt.dtype is not None else getattr(leaf.meta, "dtype", None)  # None: the stored dtype
        leaves.append([name, {"shape": list(lt.shape), "dtype": None if dtype is None else str(dtype), "sharding": where}])
    options = {"partial": partial, "missing": missing, "cooperative": True, "kept": list(resolved.kept_keystrs)}
    return {"options": options, "leaves": leaves}


def digest(description: object) -> str:
    """A digest of a JSON-serialisable description (of the target and options)."""
    return hashlib.sha256(_coord.canonical(description).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _round(ticket: int, phase: str, path: str, timeout_s: float) -> Round:
    when = "before reading" if phase == "p" else "after reading"
    return Round(
        f"restore/{ticket}/{_ROUNDS[phase]}", decide=lambda got: _decide(ticket, phase, path, got), timeout_s=timeout_s,
        what=f"cooperative restore #{ticket} of {path}", error=RestoreAgreementError, arrive=f"arrive {when}",
        hint="A cooperative restore is collective: every process must call restore with the same path and target, in "
             "the same order (or all pass cooperative=False).",
        max_poll_s=_MAX_POLL_S,
    )


def refuse(ticket: int, path: str, error: BaseException, *, phase: str = "p") -> None:
    """Tells the others this process will not take part in restore `ticket` (round
    `phase`: "p" before reading, "read" after), so they raise at once. Never raises."""
    timeout_s = DEFAULT_AGREEMENT_TIMEOUT_S if phase == "p" else DEFAULT_READ_TIMEOUT_S
    _round(ticket, phase, path, timeout_s).refuse(error, path=path)


def agree(ticket: int, path: str, marker: str, target: dict, *, timeout_s: float = DEFAULT_AGREEMENT_TIMEOUT_S) -> None:
    """Round 1: every process restores the same committed save onto the same target.

    Args:
      ticket: this process's restore number (`next_ticket()`).
      path: the checkpoint path.
      marker: the commit marker's content as this process read it (names the save's
        generation).
      target: `target_description` of the resolved target and options.
      timeout_s: how long to wait for the other processes, seconds.
    Raises:
      RestoreAgreementError: a process refused (its error is named), restores another
        path, another save (marker) or onto another target (the leaves that differ are
        named, with each group of processes' shape, dtype and sharding), or did not
        arrive in time.

    Multi-process: every process calls it once per cooperative restore, in order.
    """
    mine = {"path": path, "marker": marker, "digest": digest(target)}
    _round(ticket, "p", path, timeout_s).agree(mine, detail=lambda: target)


def report_read(ticket: int, path: str, *, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
    """Round 2: this process read its share; returns once every process did.

    Raises:
      RestoreAgreementError: a process failed to read its share (named, with its
        error), or did not report within `timeout_s`.

    Multi-process: every process that passed `agree` calls it (or `refuse(...,
    phase="read")`) before the exchange.
    """
    _round(ticket, "read", path, timeout_s).agree({"ok": True})


# --- process 0's rule --------------------------------------------------------------------


def _decide(ticket: int, phase: str, path: str, got: Mapping[int, dict]) -> str | Details | None:
    refused = _coord.refusals(got)
    if refused:
        when = "before reading" if phase == "p" else "while reading its share"
        lines = [f"cooperative restore #{ticket} of {path} failed {when} on {len(refused)} process(es); nothing was exchanged:"]
        lines += [f"  process {i}: {text}" for i, text in sorted(refused.items())][:MAX_SHOWN]
        return "\n".join(lines)
    if phase != "p":
        return None
    for field, noun, fix in (
        ("path", "different checkpoints", "Restore the same path on every process (derive it from values they share)."),
        ("marker", "different saves of the checkpoint (its commit marker differs: it was replaced or deleted meanwhile)",
         "Restore again; keep retention and overwrites away from a step that is being restored."),
    ):
        values = {i: p.get(field) for i, p in got.items()}
        if len(set(values.values())) > 1:
            lines = [f"cooperative restore #{ticket}: processes restore {noun}; nothing was read:"]
            for ps, v in groups(values)[:MAX_SHOWN]:
                lines.append(f"  {procs(ps)}: {v if field == 'path' else f'{field} {str(v)[:48]}'}")
            lines.append(fix)
            return "\n".join(lines)
    digests = {i: p.get("digest") for i, p in got.items()}
    if len(set(digests.values())) <= 1:
        return None
    reps = tuple(ps[0] for ps, _ in groups(digests))
    return Details(reps, lambda targets: _target_problem(ticket, path, digests, targets))


def _target_problem(ticket: int, path: str, digests: Mapping[int, object], targets: Mapping[int, object]) -> str:
    """Names the options and the leaves (by key string) whose target differs, with each
    group of processes' shape, dtype and sharding."""
    described = [(ps, targets.get(ps[0])) for ps, _ in groups(digests)]
    known = [(ps, t) for ps, t in described if isinstance(t, dict)]
    lines = [f"cooperative restore #{ticket} of {path}: processes restore onto different targets; nothing was read:"]
    options = [(ps, t.get("options")) for ps, t in known]
    if len({_coord.canonical(o) for _, o in options}) > 1:
        lines.append("  the options (partial, missing, target leaves kept rather than read):")
        lines += [f"    {procs(ps)}: {_human_options(o)}" for ps, o in options]
    per_group = [(ps, _leaves(t)) for ps, t in known]
    names: list[str] = []
    for _, leaves in per_group:
        names += [n for n in leaves if n not in names]
    shown = 0
    for name in names:
        descs = [(ps, leaves.get(name)) for ps, leaves in per_group]
        if len({_coord.canonical(d) for _, d in descs}) <= 1:
            continue
        if shown == MAX_SHOWN:
            lines.append("  ... (more leaves differ)")
            break
        shown += 1
        lines.append(f"  leaf {name or '<root>'}:")
        lines += [f"    {procs(ps)}: {_human(d)}" for ps, d in descs]
    for ps, t in described:
        if not isinstance(t, dict):
            lines.append(f"  {procs(ps)}: (did not send its target in time)")
    lines.append("Pass the same target (the same global shapes, dtypes and shardings) and options on every process.")
    return "\n".join(lines)


def _leaves(target: dict) -> dict[str, object]:
    out: dict[str, object] = {}
    for entry in target.get("leaves", []):
        if isinstance(entry, list) and len(entry) == 2:
            out[str(entry[0])] = entry[1]
    return out


def _human_options(options: object) -> str:
    if not isinstance(options, dict):
        return str(options)[:200]
    kept = options.get("kept") or []
    shown = ", ".join(map(str, kept[:MAX_SHOWN])) + (", ..." if len(kept) > MAX_SHOWN else "")
    return f"partial={options.get('partial')}, missing={options.get('missing')!r}, kept [{shown}]"


def _human(desc: object) -> str:
    """A short text of one leaf's target: `float32[256, 128] PartitionSpec('model',) over mesh
    (data=4, model=2) on devices 0..7`."""
    if desc is None:
        return "not restored (absent from its target)"
    if desc == "value":
        return "a non-array value"
    if not isinstance(desc, dict):
        return str(desc)[:200]
    text = f"{desc.get('dtype') or 'the stored dtype'}{desc.get('shape')}"
    where = desc.get("sharding")
    if where == "host":
        return f"{text} on the host"
    if not isinstance(where, dict):
        return f"{text} {str(where)[:200]}"
    names, sizes = (where.get("axes") or [[], []])[:2]
    mesh = ", ".join(f"{n}={s}" for n, s in zip(names, sizes))
    ids = where.get("devices") or []
    devices = ", ".join(map(str, ids[:MAX_SHOWN])) + (f", ... ({len(ids)} in all)" if len(ids) > MAX_SHOWN else "")
    memory = f", memory kind {where['memory_kind']}" if where.get("memory_kind") not in (None, "device") else ""
    return f"{text} {where.get('spec')} over mesh ({mesh}) on devices [{devices}]{memory}"
