"""Restart after a lost node over the device interconnect: a process whose own local copy
of the chosen step is gone (a replacement node) receives its boxes, inside the restore
call, from the process that holds its copy (`PeerService.held`), instead of fetching
the files first. So does a process whose own copy failed its checks in the local-only
read (`restart(retry=...)`): its damaged copy counts as gone.

The step and the holders are chosen from every process's inventory (one round,
`_peers.choose_peer_step`). Then, on every process, in the same order:

1. Each holder publishes the small files of the copy it serves (manifest, markers,
   `zarr.json` nodes, process records: `META_NAMES`) in the coordination service's
   key-value store; the replacement reads them (it needs the tree's structure, shapes
   and values), into a temporary folder.
2. Every process plans the transfers (`_peer_transfer.plan`: which of the holder's
   devices sends which box to which of the replacement's) and compiles the programs it
   runs; each holder starts reading the boxes it sends from the copy it holds, on a
   background thread (`_encoding.read_into`: every inner chunk's crc32c checked in the
   pass that reads it); every process with its own copy starts reading its boxes from it
   (`restore_from`, not cooperative, no collective: on a thread). Then one round of the
   rendezvous: every process has the same programs to run (it does not wait for the
   reads). A target this path does not cover (host leaves, PRNG keys, a sharding that is
   not a `NamedSharding` on devices), or a failure before that round (the small files,
   a compile), makes every process fall back, the same way, to fetching the copy over
   TCP (`PeerService.fetch`, the next holder when a copy fails its crc32c).
3. The boxes travel as the holder reads them: per round of device pairs, JAX programs
   (`jax.lax.ppermute` under `shard_map`, over a one-dimensional mesh of the devices
   that send or receive, every leaf whose boxes go between the same pairs an operand of
   one, at most `_peer_transfer.MAX_PROGRAM_BYTES` to a program), each run once the
   holder has read its boxes, so one travels while the next is read; every process with
   a device in a program runs it, the processes that read their own copy run none. A
   holder whose read failed sends zeros for what it did not read.
4. One round of the rendezvous on every read (the holders' and the own): if any failed
   (a damaged copy), what was received is dropped and every process falls back the same
   way as in 2 (a step is never assembled from two steps). Else the replacement
   assembles its arrays from the boxes received, and in the background (once they are
   in place) fetches its copy over TCP into its local tier, so the step is whole on
   every local tier again (and can be replicated to the durable tier).

Device collectives run on the calling thread only (the restore call), never on a
background thread.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _coord, _format
from .._errors import CheckpointError
from .._format import ArrayMetadata, PyTree, read_metadata
from .._restore import RestoreOptions, resolve_tree
from .._storage import LocalStorage
from . import _mesh_restart, _peer_transfer, _peers, _tier_references, _tiers
from ._peers import PeerService

log = logging.getLogger("checkpointer")

MAX_META_BYTES = 2 << 20  # the small files of one copy, as the key-value store carries them


def is_meta_name(key: str) -> bool:
    """Whether a file of a step folder is one of its small files (not chunk data)."""
    name = key.rsplit("/", 1)[-1]
    return key in (_format.MANIFEST, _format.COMMITTED) or name == "zarr.json" or key.startswith("processes/")


def meta_files(folder: str) -> dict[str, str]:
    """The small files of a step folder, key → base64 of its bytes."""
    out: dict[str, str] = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            key = os.path.relpath(os.path.join(dirpath, name), folder).replace(os.sep, "/")
            if is_meta_name(key):
                with open(os.path.join(dirpath, name), "rb") as f:
                    out[key] = base64.b64encode(f.read()).decode()
    return out


def _publish_meta(client: Any, key: str, folder: str) -> None:
    """Publishes the small files of the copy `folder` under `key` (`{"files"}`), or why
    not (`{"error"}`: the replaced process then does not wait for them)."""
    try:
        raw = json.dumps({"files": meta_files(folder)})
        if len(raw) > MAX_META_BYTES:
            raise CheckpointError(f"the small files of {folder} are {len(raw)} bytes (at most {MAX_META_BYTES})")
    except (OSError, CheckpointError) as e:
        client.key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}), allow_overwrite=True)
        raise
    client.key_value_set(key, raw, allow_overwrite=True)


def _write_meta(files: dict[str, str], folder: str) -> None:
    for key, data in files.items():
        if key.startswith("/") or ".." in key.split("/"):
            raise CheckpointError(f"a peer sent the file name {key!r}")
        path = f"{folder}/{key}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


def deliver(
    peers: PeerService,
    step: int,
    generation: str,
    sources: Sequence[Sequence[int]],
    target: object,
    options: RestoreOptions,
    read_own: Callable[[], PyTree],
    agree: Callable[[Callable[[], str]], list[str]],
) -> tuple[PyTree | None, str | None]:
    """Restores `step` with the replaced processes' boxes received from their holders
    (module docstring). Returns (tree, None), or (None, why every process falls back).

    Args:
      peers: this process's peer service.
      step, generation, sources: `choose_peer_step`'s answer ([] for a process that
        reads its own copy).
      target, options: the restore's.
      read_own: reads this process's own copy of `step` (a process with one).
      agree: one round of the rendezvous (`_tiers.agree` on the manager's directory).

    Multi-process: every process calls it with the same step and sources.
    """
    pidx = _coord.process_index()
    holder_of = {r: int(s[0]) for r, s in enumerate(sources) if s}
    client = _coord.client()
    tmp: str | None = None
    tree: PyTree | None = None
    progs: list[_peer_transfer.Program] = []
    compiled: list[_peer_transfer.Compiled] = []
    held: _peer_transfer.HeldReads | None = None
    resolved_mine = None
    meta = None
    own_read: concurrent.futures.Future | None = None
    timeout_ms = int(peers.timeout_s * 1000)
    try:
        for r, h in holder_of.items():
            if h == pidx:
                _publish_meta(client, peers._key("meta", step, generation, r), f"{peers.held(r).root}/{step}")
        if pidx in holder_of:
            raw = client.blocking_key_value_get(peers._key("meta", step, generation, pidx), timeout_ms)
            files = _format.load_json(raw, what="the small files of a peer copy", max_bytes=4 * MAX_META_BYTES)
            if not isinstance(files, dict) or "error" in files:
                raise CheckpointError(f"process {holder_of[pidx]} could not send the small files of its copy: "
                                      f"{files.get('error') if isinstance(files, dict) else files}")
            tmp = tempfile.mkdtemp(prefix=f"checkpointer-peer-{step}-")
            _write_meta(files["files"], tmp)
            meta = read_metadata(LocalStorage(), tmp)
        else:
            meta = read_metadata(LocalStorage(), f"{peers.local_root}/{step}")
        resolved_by = {r: resolve_tree(meta, target, partial=options.partial, process_index=r, missing=options.missing)
                       for r in holder_of}
        transfers, why = _peer_transfer.plan(resolved_by, holder_of)
        outcome = "ok" if why is None else f"the target is not covered by this path ({why})"
        if why is None:
            dtypes = {leaf.path: np.dtype(leaf.target.dtype if leaf.target.dtype is not None else leaf.meta.dtype)
                      for leaf in next(iter(resolved_by.values())).leaves
                      if isinstance(leaf.meta, ArrayMetadata) and leaf.target is not None}
            progs = _peer_transfer.programs(transfers, dtypes)
            # Every process planned the transfers from its own target: a process whose target
            # differs (another spec, dtype or mesh for a replaced process) would receive boxes
            # planned for another target, i.e. wrong data. The plans must be identical.
            outcome = "ok:" + hashlib.sha256(repr(progs).encode()).hexdigest()
            folders = {r: f"{peers.held(r).root}/{step}" for r, h in holder_of.items() if h == pidx}
            if folders:  # the boxes this process sends are read in the background
                process_of = {d.id: d.process_index for d in jax.devices()}
                held = _peer_transfer.HeldReads(progs, folders, process_of)
            if pidx not in holder_of:  # the own read goes on beside the transfers (no collective in it)
                own = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointer-peer-own")
                own_read = own.submit(read_own)
                own.shutdown(wait=False)
            else:
                resolved_mine = resolved_by[pidx]
            compiled = _peer_transfer.compile_programs(progs)  # meanwhile: no collective in a compile
    except Exception as e:  # the key-value store, a copy's small files, a compile: every process falls back alike
        outcome = f"process {pidx}: {type(e).__name__}: {e}"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        outcomes = agree(lambda: outcome)  # every process has the same programs to run (the reads go on)
        bad = [o for o in outcomes if not o.startswith("ok:")]
        if not bad and len(set(outcomes)) > 1:
            bad = ["the processes' targets differ (their plans of the transfers are not the same), so each process "
                   "reads its copy for its own target"]
        if not bad:
            received, failed = _peer_transfer.run(compiled, held)
    except BaseException:  # a round or a transfer failed: no read of a held copy outlives the caller's locks
        _stop(held, own_read)
        raise
    if bad:
        _stop(held, own_read)
        return None, "; ".join(dict.fromkeys(bad))
    outcome = "ok" if failed is None else f"process {pidx}: {failed}"
    if own_read is not None:
        try:
            tree = own_read.result()
        except (CheckpointError, OSError, ValueError, RuntimeError) as e:  # a damaged own copy
            outcome = f"process {pidx}: {type(e).__name__}: {e}"
    # Every box sent was read and checked, every own copy is read: else what was received
    # is dropped and every process falls back the same way.
    outcomes = agree(lambda: outcome)
    bad = [o for o in outcomes if o != "ok"]
    if bad:
        return None, "; ".join(dict.fromkeys(bad))
    if pidx not in holder_of:
        return tree, None
    assert resolved_mine is not None and meta is not None
    return _peer_transfer.assemble(meta, resolved_mine, received), None


def _stop(held: _peer_transfer.HeldReads | None, own_read: concurrent.futures.Future | None) -> None:
    """Stops the background reads of held copies and waits for them and for an own read:
    the caller (`restart`) holds the tiers' locks only until `deliver` returns or raises."""
    if held is not None:
        held.stop()
    _drop(own_read)


def _drop(read: concurrent.futures.Future | None) -> None:
    """Waits for an own read that is not used (its arrays are dropped), ignoring its error."""
    if read is not None:
        concurrent.futures.wait([read])


class Refetch(threading.Thread):
    """Fetches this process's copy of a step into its local tier in the background (TCP,
    no device collective), so the step is whole on every local tier again; `join()` and
    `error` as an `AsyncSave` has them (the replication of the step waits for it). It
    starts once `after` (the arrays the restore received) is in place: the fetch does not
    compete with the transfer still in flight."""

    def __init__(self, peers: PeerService, step: int, generation: str, sources: Sequence[int],
                 after: object = None) -> None:
        super().__init__(name="checkpointer-peer-refetch", daemon=True)
        self.peers, self.step, self.generation, self.sources = peers, step, generation, list(sources)
        self.error: BaseException | None = None
        self._after = after
        self.start()

    def run(self) -> None:
        try:
            jax.block_until_ready(self._after)
        except Exception:  # e.g. the caller already donated the arrays: they were in place
            pass
        self._after = None
        failed = self.peers.fetch(self.step, self.generation, self.sources)
        if failed is not None:
            self.error = CheckpointError(f"process {self.peers.process_index} could not fetch its copy of step "
                                         f"{self.step} after the restore: {failed}")
            log.warning("%s", self.error)


def restart(tier: Any, target: object, options: RestoreOptions, latest_durable: int | None,
            resume: Callable[..., None] | None, retry: tuple[int, bool] | None = None,
            ) -> tuple[tuple[PyTree, str, int] | None, int | None, tuple[int, str] | None]:
    """`restore(None)` with `peer_copies`, before the local-only vote: every process
    tells what it holds newer than the newest durable step (its own local steps, the
    copies it holds of others'), in one round; every process picks from the same answers
    the newest step whose every process's share is held whole somewhere (its own copy,
    or a checked copy of the same generation on a peer: `choose_peer_step`). When every
    process has its own copy, the local-only vote reads it. Otherwise the replaced
    processes receive their boxes over the device interconnect (`deliver`); where that
    path does not cover the target, or a copy is damaged, they fetch their copy over TCP
    (the next holder when one fails its crc32c) and the vote reads it. `tier`: the
    manager's `LocalTier`.

    `retry`: (step, whether this process's own copy of it is damaged), the same step on
    every process, when the local-only read of that step found damaged own copies: the
    steps up to it are chosen again, a damaged own copy not counted as held, so the
    holders' checked copies serve the damaged shares (and replace them, fetched after the
    restore) before an older step is restored.

    Returns:
      (the restored (tree, source, durable bytes), None, None), or (None, the step after
      the chosen one: the vote looks below it, None when no step is; (step, generation)
      when every process's own copy of it is whole: the local-only vote, made in the
      same round, need not be made again).

    Raises:
      RestoreAgreementError: the processes' own copies of one step are of different
        save attempts (generations): the same error on every process.
    """
    peers = tier.peers
    assert peers is not None
    count = _coord.process_count()
    own: dict[int, str] = {}
    stale: list[str] = []
    newest_stale = -1
    below, damaged = (retry[0] + 1, retry[0] if retry[1] else None) if retry is not None else (None, None)
    for s in tier.local_steps():
        if s == damaged or (below is not None and s >= below):
            continue
        marker = _tiers.read_marker(tier.storage, f"{tier.root}/{s}")
        if marker is None:
            continue
        if marker.process_count != count:
            if latest_durable is None or s > latest_durable:
                stale.append(f"step {s} was saved by {marker.process_count} processes, the job has {count}")
                newest_stale = s
            continue
        own[s] = marker.generation
    stale = stale if stale and newest_stale > max(own, default=-1) else []  # older ones: this job's steps come first
    if stale:
        log.warning("local copies in %s are of another process count (%s): they are combined over the device exchange "
                    "where the surviving copies cover the target, else %s is read", tier.root, "; ".join(stale),
                    tier.directory)
    needed = _tier_references.needed_keys(tier.storage, tier.process_index, target, options)

    def propose() -> str:  # the inventory, and the local-only vote in the same round
        vote = _tiers.local_restore_proposal(tier.storage, tier.root, latest_durable, needed, below=below)
        inventory = peers.inventory(own, latest_durable)
        if below is not None:  # a retry: the steps up to the damaged one
            inventory["held"] = {o: kept for o, held in inventory["held"].items()
                                 if (kept := {s: g for s, g in held.items() if int(s) < below})}
        return _coord.canonical({"inventory": inventory, "vote": vote, "stale": bool(stale)})

    answers = [_format.load_json(v, what="a peer-step vote") for v in
               _tiers.agree(tier.directory, propose, tier.commit_timeout_s)]
    if any(a.get("stale") for a in answers):  # saved by another process count: `_mesh_restart`, every process alike
        return None, None, None
    chosen = _peers.choose_peer_step([a["inventory"] for a in answers], tier.directory)
    if chosen is None:
        return None, None, None
    step, generation, sources = chosen
    if not any(sources):  # every process reads its own copy
        voted = (step, generation) if all(a["vote"] == f"{step} {generation}" for a in answers) else None
        return None, step + 1, voted

    def read_own() -> PyTree:
        tree, outcome, _ = tier._read_local_only(step, target, options)
        if tree is None:
            raise CheckpointError(outcome)
        return tree

    tree, why = deliver(peers, step, generation, sources, target, options, read_own,
                        lambda propose: _tiers.agree(tier.directory, propose, tier.commit_timeout_s))
    delivered = tree is not None
    if tree is None:  # e.g. another mesh: the copies combined file by file over the device exchange
        combined, reason = _mesh_restart.restart(tier, target, options, latest_durable, None, only=(step, generation))
        tree, why = (combined[0], None) if combined is not None else (None, "; ".join(filter(None, [why, reason])))
    mine = sources[_coord.process_index()]
    if tree is not None:
        log.warning("restored step %d from the local tiers: processes %s received their boxes from the processes "
                    "holding their copies (newest durable step: %s)", step,
                    [r for r, s in enumerate(sources) if s], latest_durable)
        if retry is not None and delivered:  # else `_mesh_restart` gave its reason
            tier.last_restore_reason = (
                f"step {step}: the own local copies of {_coord.procs([r for r, s in enumerate(sources) if s])} are "
                "damaged or missing: those processes received their boxes from the processes holding checked copies")
        if mine and resume is not None:  # the writer's first recovery, due in `resume`, would remove the
            tier.recover()                # fetch's partial folder while it is written: done now, once
        refetch = Refetch(peers, step, generation, mine, after=tree) if mine else None
        if resume is not None:
            resume(step, generation, False, local_save=refetch, best_effort=True)
        return (tree, "local", 0), None, None
    log.warning("the replaced processes fetch their copies of step %d over TCP instead of receiving their boxes in "
                "the restore: %s", step, why)
    if mine and own.get(step) != generation:
        failed = peers.fetch(step, generation, mine)
        if failed is not None:
            log.warning("process %d could not fetch its copy of step %d from a peer (%s); the restore falls back to an "
                        "older step or %s", peers.process_index, step, failed, tier.directory)
    return None, step + 1, None
