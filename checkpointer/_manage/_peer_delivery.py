"""Restart after a lost node over the device interconnect: a process whose own local copy
of the chosen step is gone (a replacement node) receives its boxes, inside the restore
call, from the process that holds its copy (`PeerService.held`), instead of fetching
the files first.

The step and the holders are chosen from every process's inventory (one round,
`_peers.choose_peer_step`). Then, on every process, in the same order:

1. Each holder publishes the small files of the copy it serves (manifest, markers,
   `zarr.json` nodes, process records: `META_NAMES`) in the coordination service's
   key-value store; the replacement reads them (it needs the tree's structure, shapes
   and values), into a temporary folder.
2. Each holder reads the replacement's boxes (as the target places them on the
   replacement's devices) from the copy it holds (`region_reader`: the chunks' crc32c
   are checked); every process with its own copy reads its boxes from it meanwhile
   (`restore_from`, not cooperative, no collective: on a thread, beside the transfers).
   One round of the rendezvous on the holders' reads before the transfers, one on the
   own reads after them. A damaged
   copy, or a target this path does not cover (host leaves, PRNG keys, a sharding that
   is not a `NamedSharding` on devices, a box that differs in shape between devices),
   makes every process fall back, the same way, to fetching the copy over TCP
   (`PeerService.fetch`, the next holder when a copy fails its crc32c).
3. The boxes travel in rounds of one JAX program each (`jax.lax.ppermute` under
   `shard_map`, over a one-dimensional mesh of the devices that send or receive in the
   round; every process with a device in it runs it): a device sends at most one box
   and receives at most one per round. Nothing else moves: the processes that read
   their own copy run no program.
4. The replacement assembles its arrays from the boxes received, and in the background
   fetches its copy over TCP into its local tier, so the step is whole on every local
   tier again (and can be replicated to the durable tier).

Device collectives run on the calling thread only (the restore call), never on a
background thread.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .. import _coord, _encoding, _format
from .._errors import CheckpointError
from .._format import ArrayMetadata, Box, PyTree, ValueMetadata, read_metadata, rebuild
from .._restore import RestoreOptions, resolve_tree
from .._storage import LocalStorage
from . import _mesh_restart, _peers, _tiers
from ._peers import PeerService

log = logging.getLogger("checkpointer")

MAX_META_BYTES = 2 << 20  # the small files of one copy, as the key-value store carries them
_AXIS = "peers"


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


@dataclasses.dataclass(frozen=True)
class _Transfer:
    """One box of one leaf: from a device of its holder to one of the replacement's."""

    leaf: str
    box: Box
    src: int  # device id
    dst: int  # device id
    round: int


def _plan(resolved_by_replaced: Mapping[int, Any], holder_of: dict[int, int]) -> tuple[list[_Transfer], str | None]:
    """The transfers of every replaced process's unique boxes (its first device holding
    each), their senders' devices taken in turn, each device sending and receiving at
    most one box per round; or why this path does not cover the target."""
    by_process: dict[int, list[jax.Device]] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    for devices in by_process.values():
        devices.sort(key=lambda d: d.id)
    transfers: list[_Transfer] = []
    busy: dict[tuple[int, str], set[int]] = {}  # (round, "src"|"dst") → devices in use
    for r in sorted(resolved_by_replaced):
        resolved = resolved_by_replaced[r]
        senders = by_process.get(holder_of[r], [])
        if not senders:
            return [], f"process {holder_of[r]} has no device"
        turn = 0
        for leaf in resolved.leaves:
            meta, lt = leaf.meta, leaf.target
            if isinstance(meta, ValueMetadata):
                continue
            why = _unsupported(meta, lt)
            if why:
                return [], f"{meta.keystr or meta.path}: {why}"
            first: dict[Box, int] = {}
            for device, box in leaf.device_boxes:
                first.setdefault(box, device)
            if len({b.shape for b in first}) > 1:
                return [], f"{meta.keystr or meta.path}: its boxes differ in shape"
            for box, device in sorted(first.items(), key=lambda kv: kv[1]):
                rnd, src = 0, -1
                while src < 0:
                    used, taken = busy.setdefault((rnd, "src"), set()), busy.setdefault((rnd, "dst"), set())
                    free = [s.id for s in senders[turn % len(senders):] + senders[:turn % len(senders)] if s.id not in used]
                    if free and device not in taken:
                        src = free[0]
                    else:
                        rnd += 1
                busy[(rnd, "src")].add(src)
                busy[(rnd, "dst")].add(device)
                transfers.append(_Transfer(leaf.path, box, src, device, rnd))
                turn += 1
    return transfers, None


def _unsupported(meta: ArrayMetadata, lt) -> str | None:
    if lt is None or lt.sharding is None:
        return "a host target"
    if not isinstance(lt.sharding, NamedSharding) or lt.sharding.memory_kind not in (None, "device"):
        return "not a NamedSharding on devices"
    if meta.key_impl is not None:
        return "PRNG keys"
    return None


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: str, device_id: int) -> Callable[[], jax.Array]:
    """A compiled program making zeros on one device (made there, not copied from the host)."""
    device = next(d for d in jax.local_devices() if d.id == device_id)
    return jax.jit(functools.partial(jnp.zeros, shape, np.dtype(dtype)), out_shardings=SingleDeviceSharding(device))


@functools.lru_cache(maxsize=64)
def _program(device_ids: tuple[int, ...], perm: tuple[tuple[int, int], ...]):
    from jax import shard_map

    devices = {d.id: d for d in jax.devices()}
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in device_ids]), (_AXIS,))

    def move(*xs):
        return tuple(jax.lax.ppermute(x, _AXIS, perm=list(perm)) for x in xs)

    return mesh, jax.jit(shard_map(move, mesh=mesh, in_specs=PartitionSpec(_AXIS), out_specs=PartitionSpec(_AXIS)))


def _run_rounds(transfers: Sequence[_Transfer], sending: dict[tuple[str, Box], np.ndarray],
                dtypes: dict[str, np.dtype]) -> dict[tuple[str, int], jax.Array]:
    """Runs every round; returns (leaf, destination device id) → the box received there
    (a single-device array), for this process's destination devices."""
    pidx = jax.process_index()
    devices = {d.id: d for d in jax.devices()}
    received: dict[tuple[str, int], jax.Array] = {}
    for rnd in sorted({t.round for t in transfers}):
        group = [t for t in transfers if t.round == rnd]
        # One program per set of device pairs: the leaves whose boxes go the same way.
        by_pairs: dict[tuple[tuple[int, int], ...], list[_Transfer]] = {}
        pairs_of: dict[str, list[_Transfer]] = {}
        for t in group:
            pairs_of.setdefault(t.leaf, []).append(t)
        for ts in pairs_of.values():
            by_pairs.setdefault(tuple(sorted((t.src, t.dst) for t in ts)), []).extend(ts)
        for pairs, ts in sorted(by_pairs.items()):
            ids = tuple(sorted({i for p in pairs for i in p}))
            if not any(devices[i].process_index == pidx for i in ids):
                continue
            pos = {i: k for k, i in enumerate(ids)}
            mesh, program = _program(ids, tuple((pos[s], pos[d]) for s, d in pairs))
            sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
            leaves = sorted({t.leaf for t in ts})
            inputs = []
            for leaf in leaves:
                mine = {t.src: t for t in ts if t.leaf == leaf}
                shape = next(t.box.shape for t in ts if t.leaf == leaf)
                bufs = []
                for i in ids:
                    d = devices[i]
                    if d.process_index != pidx:
                        continue
                    if i in mine:
                        bufs.append(jax.device_put(sending.pop((leaf, mine[i].box))[None], d))
                    else:  # a receiver's input: ppermute overwrites it
                        bufs.append(_zeros((1, *shape), str(dtypes[leaf]), d.id)())
                inputs.append(jax.make_array_from_single_device_arrays((len(ids), *shape), sharding, bufs))
            outs = program(*inputs)
            for leaf, out in zip(leaves, outs):
                dsts = {t.dst for t in ts if t.leaf == leaf}
                for shard in out.addressable_shards:
                    if shard.device.id in dsts:
                        received[(leaf, shard.device.id)] = shard.data[0]
            del inputs, outs
    return received


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
    sending: dict[tuple[str, Box], np.ndarray] = {}
    transfers: list[_Transfer] = []
    dtypes: dict[str, np.dtype] = {}
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
        transfers, why = _plan(resolved_by, holder_of)
        outcome = "ok" if why is None else f"the target is not covered by this path ({why})"
        if why is None:
            reads = _start_held_reads(peers, step, holder_of, resolved_by, transfers)
            if pidx not in holder_of:  # the own read goes on beside the transfers (no collective in it)
                own = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointer-peer-own")
                own_read = own.submit(read_own)
                own.shutdown(wait=False)
            sending = {k: f.result() for k, f in reads.items()}
            for leaf in next(iter(resolved_by.values())).leaves:
                if isinstance(leaf.meta, ArrayMetadata) and leaf.target is not None:
                    dtypes[leaf.path] = np.dtype(leaf.target.dtype if leaf.target.dtype is not None else leaf.meta.dtype)
            if pidx in holder_of:
                resolved_mine = resolved_by[pidx]
    except (CheckpointError, OSError, ValueError, RuntimeError) as e:  # a damaged copy, a file gone, the key-value store
        outcome = f"process {pidx}: {type(e).__name__}: {e}"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    outcomes = agree(lambda: outcome)  # the boxes to send are read
    bad = [o for o in outcomes if o != "ok"]
    if bad:
        _drop(own_read)
        return None, "; ".join(dict.fromkeys(bad))
    received = _run_rounds(transfers, sending, dtypes)
    if own_read is not None:
        try:
            tree, outcome = own_read.result(), "ok"
        except (CheckpointError, OSError, ValueError, RuntimeError) as e:  # a damaged own copy
            outcome = f"process {pidx}: {type(e).__name__}: {e}"
    outcomes = agree(lambda: outcome)  # every own copy is read
    bad = [o for o in outcomes if o != "ok"]
    if bad:
        return None, "; ".join(dict.fromkeys(bad))
    if pidx not in holder_of:
        return tree, None
    assert resolved_mine is not None and meta is not None
    tree = _assemble(meta, resolved_mine, received)
    return tree, None


def _drop(read: concurrent.futures.Future | None) -> None:
    """Waits for an own read that is not used (its arrays are dropped), ignoring its error."""
    if read is not None:
        concurrent.futures.wait([read])


def _start_held_reads(peers: PeerService, step: int, holder_of: Mapping[int, int], resolved_by: Mapping[int, Any],
                      transfers: Sequence[_Transfer]) -> dict[tuple[str, Box], concurrent.futures.Future]:
    """Starts reading, on a pool of threads, every box this process sends: from the copy
    it holds of the replaced process's step (its chunks' crc32c checked), cast to the
    target dtype."""
    local = {d.id for d in jax.local_devices()}
    out: dict[tuple[str, Box], concurrent.futures.Future] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(4, os.cpu_count() or 2), thread_name_prefix="checkpointer-peer-read")
    for r, h in holder_of.items():
        if h != _coord.process_index():
            continue
        folder = f"{peers.held(r).root}/{step}"
        held_meta = read_metadata(LocalStorage(), folder)
        by_path = {leaf.path: leaf for leaf in resolved_by[r].leaves}
        readers: dict[str, Callable[[Box], np.ndarray]] = {}
        for t in transfers:
            if t.src not in local or (t.leaf, t.box) in out:
                continue
            leaf, m = by_path[t.leaf], held_meta.leaves[t.leaf]
            assert isinstance(m, ArrayMetadata) and leaf.target is not None and isinstance(leaf.meta, ArrayMetadata)
            if t.leaf not in readers:
                readers[t.leaf] = _encoding.region_reader(LocalStorage(), folder, m)
            dtype = np.dtype(leaf.target.dtype if leaf.target.dtype is not None else leaf.meta.dtype)
            out[(t.leaf, t.box)] = pool.submit(lambda read, box, dt: np.ascontiguousarray(read(box).astype(dt, copy=False)),
                                               readers[t.leaf], t.box, dtype)
    pool.shutdown(wait=False)
    return out


def _assemble(meta, resolved, received: dict[tuple[str, int], jax.Array]) -> PyTree:
    """The replaced process's tree from the boxes it received (a box two of its devices
    hold is received once and copied)."""
    results: dict[str, object] = {}
    for leaf in resolved.leaves:
        m, lt = leaf.meta, leaf.target
        if isinstance(m, ValueMetadata):
            results[leaf.path] = m.value
            continue
        by_box: dict[Box, jax.Array] = {}
        for device, box in leaf.device_boxes:
            if (leaf.path, device) in received:
                by_box.setdefault(box, received[(leaf.path, device)])
        devices = {d.id: d for d in jax.local_devices()}
        shards = []
        index = lt.sharding.addressable_devices_indices_map(tuple(lt.shape))
        boxes = dict(leaf.device_boxes)
        for d in index:
            arr = by_box[boxes[d.id]]
            shards.append(arr if arr.devices() == {d} else jax.device_put(arr, devices[d.id]))
        results[leaf.path] = jax.make_array_from_single_device_arrays(tuple(lt.shape), lt.sharding, shards)
    if resolved.treedef is None:
        return rebuild(meta.structure, lambda p: results[p], where="a peer copy")
    results.update(resolved.kept)
    return jax.tree_util.tree_unflatten(resolved.treedef, [results[p] for p in resolved.order])


class Refetch(threading.Thread):
    """Fetches this process's copy of a step into its local tier in the background (TCP,
    no device collective), so the step is whole on every local tier again; `join()` and
    `error` as an `AsyncSave` has them (the replication of the step waits for it)."""

    def __init__(self, peers: PeerService, step: int, generation: str, sources: Sequence[int]) -> None:
        super().__init__(name="checkpointer-peer-refetch", daemon=True)
        self.peers, self.step, self.generation, self.sources = peers, step, generation, list(sources)
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        failed = self.peers.fetch(self.step, self.generation, self.sources)
        if failed is not None:
            self.error = CheckpointError(f"process {self.peers.process_index} could not fetch its copy of step "
                                         f"{self.step} after the restore: {failed}")
            log.warning("%s", self.error)


def restart(tier: Any, target: object, options: RestoreOptions, latest_durable: int | None,
            resume: Callable[..., None] | None,
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
    for s in tier.local_steps():
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
    needed = tier._needed_keys(target, options.partial, options.missing)

    def propose() -> str:  # the inventory, and the local-only vote in the same round
        vote = _tiers.local_restore_proposal(tier.storage, tier.root, latest_durable, needed)
        return _coord.canonical({"inventory": peers.inventory(own, latest_durable), "vote": vote, "stale": bool(stale)})

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
    if tree is None:  # e.g. another mesh: the copies combined file by file over the device exchange
        combined, reason = _mesh_restart.restart(tier, target, options, latest_durable, None, only=(step, generation))
        tree, why = (combined[0], None) if combined is not None else (None, "; ".join(filter(None, [why, reason])))
    mine = sources[_coord.process_index()]
    if tree is not None:
        log.warning("restored step %d from the local tiers: processes %s received their boxes from the processes "
                    "holding their copies (newest durable step: %s)", step,
                    [r for r, s in enumerate(sources) if s], latest_durable)
        refetch = Refetch(peers, step, generation, mine) if mine else None
        if resume is not None:
            resume(step, generation, False, local_save=refetch)
        return (tree, "local", 0), None, None
    log.warning("the replaced processes fetch their copies of step %d over TCP instead of receiving their boxes in "
                "the restore: %s", step, why)
    if mine and own.get(step) != generation:
        failed = peers.fetch(step, generation, mine)
        if failed is not None:
            log.warning("process %d could not fetch its copy of step %d from a peer (%s); the restore falls back to an "
                        "older step or %s", peers.process_index, step, failed, tier.directory)
    return None, step + 1, None
