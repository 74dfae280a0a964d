"""Restart onto another mesh, sharding or number of processes from the local tiers:
`restore(None)` when no process can read the newest local step alone (the target's
boxes differ from the ones each process saved, or the job has another number of
processes), but the local copies that survive, together, hold every file the target
needs. Each process then reads what it holds and receives the rest, file by file, from
a process that holds it, over the device interconnect, inside the restore call; the
durable tier is not read.

What a process can read (`visible_shares`): its own local folder (`LOCAL/process-<i>/`:
its own steps and the peer copies it holds), and the folders of the other processes
whose `node.json` names this process's node (`peer_node`, or the host name: folders of
the same machine, written by an earlier job with more processes per node). A *share*
is one saving process's files of one step: its own local step, or a peer copy of it.

Then, on every process, in the same order (every meeting one round of the rendezvous,
`_tiers.agree`):

1. Inventory: every process tells the shares it can read of steps newer than the newest
   durable one (step, generation, saving processes, owner). Candidates: each (step,
   generation) with at least one share, newest first; one generation only per attempt
   (a step is never assembled from two saves).
2. The small files every process needs (each owner's record and pack node; the
   manifest and `zarr.json` nodes for a process that holds no share) travel through
   the coordination service's key-value store, published by the lowest process that
   holds them.
3. Each process stages the step in a temporary folder beside the process folders:
   hard links to the files it holds (copies where links fail), the records and nodes
   received, and a manifest indexing every present owner's pack; it resolves its
   target there and names the files it lacks. Round: every process's list. A file no
   share holds (the share of a process that survives nowhere) fails the attempt for
   every process, with which shares were found and which are missing.
4. Each lacking file is sent by a process that holds it (the least loaded holder),
   over `_file_exchange` (ppermute rounds of the devices), after a round on the
   senders' reads. The receiver writes it into its staging folder.
5. Each process restores from its staging folder (`restore_from`, every chunk's crc32c
   checked; not cooperative, no collective). Round: a process whose restore failed
   fails the attempt on every process.

An attempt that fails goes to the next candidate (at most `MAX_ATTEMPTS`); when none
succeeds the caller restores the newest durable step, with the reasons. After success
the step is replicated to the durable tier again only when every process holds its own
copy of it (the same processes saved it): a step saved by another number of processes
cannot be replicated by this job.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _coord, _encoding, _format
from .._errors import CheckpointError, CorruptCheckpointError
from .._format import ArrayMetadata, ProcessRecord, PyTree, read_metadata, read_process_record
from .._restore import RestoreOptions, resolve_tree, restore_from
from .._storage import LocalStorage
from . import _file_exchange, _tiers
from ._tier import PEER_COPIES_DIR, LocalStepTier, PeerCopyTier

log = logging.getLogger("checkpointer")

NODE_FILE = "node.json"  # LOCAL/process-<i>/node.json: {"node": name}
COPY_RECORD = "peer-copy.json"  # a peer copy's own record (`_peer_copy.COPY_RECORD`): not a file of the step
MAX_KV_BYTES = 2 << 20  # one value of the key-value store
MAX_ATTEMPTS = 3
STAGING_PREFIX = "restart-"  # LOCAL/restart-<step>-p<process>-<random>/: a restart's staging folder
_attempts = itertools.count()  # names the key-value keys of each attempt (never reused in a job)


def write_node(root: str, node: str) -> None:
    """Records that the process folder `root` is on node `node` (atomically; only when
    it changes)."""
    path = f"{root}/{NODE_FILE}"
    data = json.dumps({"node": node})
    try:
        with open(path) as f:
            if f.read() == data:
                return
    except OSError:
        pass
    os.makedirs(root, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(data)
    os.replace(tmp, path)


def remove_staging_leftovers(root: str, process_index: int) -> None:
    """Removes the staging folders a restore of process `process_index` left beside
    `root` when its process died in it (their hard links hold disk space)."""
    parent = os.path.dirname(root)
    for name in _listdir(parent):
        if name.startswith(STAGING_PREFIX) and f"-p{process_index}-" in name:
            shutil.rmtree(f"{parent}/{name}", ignore_errors=True)


def read_node(root: str) -> str | None:
    """The node the process folder `root` is on, or None (no or unreadable `node.json`)."""
    path = f"{root}/{NODE_FILE}"
    try:
        with open(path, "rb") as f:
            obj = _format.load_json(f.read(4096), what=path)  # bounded: never a RecursionError
        return str(obj["node"]) if isinstance(obj, dict) and "node" in obj else None
    except (OSError, ValueError, CheckpointError):
        return None


@dataclasses.dataclass(frozen=True)
class Share:
    """One saving process's files of one step, as this process can read them.

    Attributes:
      owner: the process (of the saving job) whose files these are.
      step, generation: the step and its save attempt.
      count: processes of the saving job.
      folder: where this process reads them.
      own: the folder is this process's own local step of its own index.
    """

    owner: int
    step: int
    generation: str
    count: int
    folder: str
    own: bool


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _is_process_dir(name: str) -> bool:
    return name.startswith(_tiers.PROCESS_DIR_PREFIX) and name[len(_tiers.PROCESS_DIR_PREFIX):].isdigit()


def visible_shares(root: str, node: str, process_index: int, newer_than: int | None) -> list[Share]:
    """The shares this process can read of steps newer than `newer_than`: in its own
    folder `root` first, then in the folders beside it on the same node (module
    docstring), each folder's own steps then the peer copies it holds."""
    parent = os.path.dirname(root)
    roots = [root] + [f"{parent}/{n}" for n in _listdir(parent)
                      if _is_process_dir(n) and f"{parent}/{n}" != root and read_node(f"{parent}/{n}") == node]
    storage = LocalStorage()
    out: list[Share] = []

    def add(tier_folders: Mapping[int, str], base: str, owner: int | None, own_root: bool) -> None:
        for step, folder in tier_folders.items():
            if newer_than is not None and step <= newer_than:
                continue
            marker = _tiers.read_marker(storage, f"{base}/{folder}")
            if marker is None or (owner is not None and marker.process_index != owner):
                continue
            out.append(Share(marker.process_index, step, marker.generation, marker.process_count, f"{base}/{folder}",
                             own_root and marker.process_index == process_index))

    for r in roots:
        add(LocalStepTier(storage, r).folders(), r, None, r == root)
        copies = f"{r}/{PEER_COPIES_DIR}"
        for name in _listdir(copies):
            if _is_process_dir(name):
                owner = int(name[len(_tiers.PROCESS_DIR_PREFIX):])
                add(PeerCopyTier(storage, f"{copies}/{name}", owner).folders(), f"{copies}/{name}", owner, False)
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A step whose shares some processes hold: `holders` owner → the processes that
    read its share; `own` the owners whose own process holds its own copy."""

    step: int
    generation: str
    count: int
    holders: Mapping[int, tuple[int, ...]]
    own: frozenset[int]

    @property
    def whole(self) -> bool:
        """Every saving process's share survives somewhere."""
        return len(self.holders) == self.count

    def coverage(self, job: int) -> str:
        """The step's shares: expected and found, in words."""
        found = sorted(self.holders)
        missing = sorted(set(range(self.count)) - set(found))
        text = (f"step {self.step} (saved by {self.count} processes, the job has {job}): the local copies this job "
                f"reads hold the shares of {_coord.procs(found)} ({len(found)} of {self.count})")
        return text + (f"; the share of {_coord.procs(missing)} survives in none" if missing else "")


def inventory(shares: Sequence[Share], node: str) -> dict:
    """This process's part of the first round: `{"node", "shares": [[step, generation,
    count, owner, own], ...]}`."""
    seen: dict[tuple[int, str, int, int], bool] = {}
    for s in shares:
        k = (s.step, s.generation, s.count, s.owner)
        seen[k] = seen.get(k, False) or s.own
    return {"node": node, "shares": [[*k, own] for k, own in sorted(seen.items())]}


def candidates(inventories: Sequence[Mapping]) -> list[Candidate]:
    """Every (step, generation) some process holds a share of, newest step first (then
    the most owners found, then the newest generation). Multi-process: pure."""
    table: dict[tuple[int, str], tuple[set[int], dict[int, set[int]], set[int]]] = {}
    for p, inv in enumerate(inventories):
        for step, generation, count, owner, own in inv.get("shares", []):
            counts, holders, owns = table.setdefault((int(step), str(generation)), (set(), {}, set()))
            counts.add(int(count))
            holders.setdefault(int(owner), set()).add(p)
            if own:
                owns.add(int(owner))
    out = []
    for (step, generation), (counts, holders, owns) in table.items():
        (count,) = counts if len(counts) == 1 else (0,)
        if count and all(0 <= o < count for o in holders):
            out.append(Candidate(step, generation, count, {o: tuple(sorted(h)) for o, h in sorted(holders.items())},
                                 frozenset(owns)))
    return sorted(out, key=lambda c: (c.step, len(c.holders), c.generation), reverse=True)


def restart(tier: Any, target: object, options: RestoreOptions, latest_durable: int | None,
            resume: Callable[..., None] | None, *, only: tuple[int, str] | None = None,
            ) -> tuple[tuple[PyTree, str, int] | None, str | None]:
    """`restore(None)` from the surviving local copies (module docstring). `tier`: the
    manager's `LocalTier`; `only`: (step, generation) to try alone (the peers' restart
    after its own path failed; the caller then resumes the replication).

    Returns:
      ((tree, "local", 0), how it was restored), or (None, why not: the caller restores
      the newest durable step; None when no process holds a share of a newer step).

    Multi-process: every process calls it, with the same arguments.
    """
    pidx, count = _coord.process_index(), _coord.process_count()
    shares: list[Share] = []

    def propose() -> str:
        shares.extend(s for s in visible_shares(tier.root, tier.node, pidx, latest_durable)
                      if only is None or (s.step, s.generation) == only)
        return _coord.canonical(inventory(shares, tier.node))

    answers = [_format.load_json(v, what="a restart inventory") for v in _tiers.agree(tier.directory, propose, tier.commit_timeout_s)]
    found = candidates(answers)
    if not found:
        return None, None
    folders: dict[tuple[int, str], dict[int, str]] = {}
    for s in shares:  # its own folder first
        folders.setdefault((s.step, s.generation), {}).setdefault(s.owner, s.folder)
    reasons: list[str] = []
    attempts = 0
    for c in found:
        if not c.whole:
            reasons.append(c.coverage(count))
            continue
        if attempts == MAX_ATTEMPTS:
            break
        attempts += 1
        tree, how = _attempt(tier, c, folders.get((c.step, c.generation), {}), target, options, count)
        if tree is None:
            reasons.append(f"{c.coverage(count)}, but {how}")
            log.warning("the local copies of step %d cannot be combined for this restore: %s", c.step, reasons[-1])
            continue
        how = "; ".join([*reasons, how])
        tier.last_restore_reason = how
        log.warning("restored step %d from the local tiers (newest durable step: %s): %s", c.step, latest_durable, how)
        if resume is not None and only is None:
            if c.count == count and c.own == frozenset(range(count)):
                marker = _tiers.read_marker(tier.storage, folders[(c.step, c.generation)][pidx])
                resume(c.step, c.generation, bool(marker and marker.overwrite))
            else:
                log.warning("step %d is not replicated to %s by this job: %s; the next durable save covers it", c.step,
                            tier.directory, f"it was saved by {c.count} processes, the job has {count}"
                            if c.count != count else f"{_coord.procs(sorted(set(range(count)) - c.own))} hold no own "
                            "copy of it")
        return (tree, "local", 0), how
    return None, "; ".join(reasons)


def _kv_key(tier: Any, attempt: int, *parts: object) -> str:
    tag = hashlib.sha256(tier.directory.encode()).hexdigest()[:12]
    return "/".join(["checkpointer", "restart", tag, str(attempt), *map(str, parts)])


def _small_files(folder: str, keys: Sequence[str]) -> dict[str, str]:
    out = {}
    for key in keys:
        if os.path.exists(f"{folder}/{key}"):
            with open(f"{folder}/{key}", "rb") as f:
                out[key] = base64.b64encode(f.read()).decode()
    return out


def _common_keys(folder: str) -> list[str]:
    """The manifest, the marker and the `zarr.json` nodes of a share (not a pack's)."""
    keys = [_format.MANIFEST, _format.COMMITTED]
    for dirpath, _, names in os.walk(folder):
        rel = os.path.relpath(dirpath, folder).replace(os.sep, "/")
        if _format.ZARR_JSON in names and not rel.startswith(_encoding.PACKED):
            keys.append(_format.ZARR_JSON if rel == "." else f"{rel}/{_format.ZARR_JSON}")
    return keys


def _owner_keys(owner: int) -> list[str]:
    return [_format.process_record_name(owner), f"{_encoding.array_name(owner)}/{_format.ZARR_JSON}"]


def _publish(client: Any, key: Callable[..., str], c: Candidate, folders: Mapping[int, str], count: int) -> list[str]:
    """Publishes the small files this process is the first holder of (every key, an
    error in place of the files that failed). Returns the keys published."""
    pidx = _coord.process_index()
    every = {p for h in c.holders.values() for p in h}
    jobs: list[tuple[str, str, list[str] | None]] = [  # (key, folder, the files; None: the common ones)
        (key("owner", w), folders[w], _owner_keys(w)) for w, h in c.holders.items() if h[0] == pidx]
    if min(every) == pidx and any(p not in every for p in range(count)):
        jobs.append((key("common"), folders[min(folders)], None))
    for k, folder, names in jobs:
        try:
            raw = json.dumps({"files": _small_files(folder, _common_keys(folder) if names is None else names)})
            if len(raw) > MAX_KV_BYTES:
                raise CheckpointError(f"the small files are {len(raw)} bytes, more than the {MAX_KV_BYTES} one value of "
                                      "the coordination service carries here")
        except (OSError, CheckpointError) as e:
            raw = json.dumps({"error": f"process {pidx}: {type(e).__name__}: {e}"})
        client.key_value_set(k, raw, allow_overwrite=True)
    return [k for k, _, _ in jobs]


def _collect(client: Any, key: Callable[..., str], c: Candidate, folders: Mapping[int, str], timeout_s: float) -> dict[str, bytes]:
    """The small files this process lacks, from their publishers."""
    pidx = _coord.process_index()
    keys = [key("owner", w) for w in c.holders if w not in folders]
    if pidx not in {p for h in c.holders.values() for p in h}:
        keys.append(key("common"))
    out: dict[str, bytes] = {}
    for k in keys:
        obj = _format.load_json(client.blocking_key_value_get(k, int(timeout_s * 1000)), what=k, max_bytes=4 * MAX_KV_BYTES)
        if not isinstance(obj, dict) or "files" not in obj:
            raise CheckpointError(f"the small files under {k} were not sent: {obj.get('error') if isinstance(obj, dict) else obj}")
        for name, data in obj["files"].items():
            if name.startswith("/") or ".." in name.split("/"):
                raise CheckpointError(f"a peer sent the file name {name!r}")
            out[name] = base64.b64decode(data)
    return out


def _link(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another file system, or one without hard links
        shutil.copyfile(src, dst)


def _write(path: str, data: bytes | memoryview) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _stage(tmp: str, c: Candidate, folders: Mapping[int, str], received: Mapping[str, bytes]) -> dict[int, ProcessRecord]:
    """Builds the step in `tmp` from the shares this process reads and the small files
    received; returns the records of every owner found."""
    for owner in sorted(folders):
        src = folders[owner]
        for dirpath, _, names in os.walk(src):
            for name in names:
                rel = os.path.relpath(os.path.join(dirpath, name), src).replace(os.sep, "/")
                if rel not in (_format.MANIFEST, _format.COMMITTED, COPY_RECORD) and not os.path.exists(f"{tmp}/{rel}"):
                    _link(f"{src}/{rel}", f"{tmp}/{rel}")
    for rel, data in received.items():
        if rel not in (_format.MANIFEST, _format.COMMITTED) and not os.path.exists(f"{tmp}/{rel}"):
            _write(f"{tmp}/{rel}", data)
    if folders:
        first = folders[min(folders)]
        with open(f"{first}/{_format.MANIFEST}", "rb") as f:
            manifest = f.read()
        with open(f"{first}/{_format.COMMITTED}", "rb") as f:
            marker = f.read()
    else:
        manifest, marker = received[_format.MANIFEST], received[_format.COMMITTED]
    storage = LocalStorage()
    records = {w: read_process_record(storage, f"{tmp}/{_format.process_record_name(w)}") for w in c.holders}
    if any(r.references or r.packed_references for r in records.values()):
        raise CheckpointError(f"step {c.step} is an incremental save whose shares reference earlier steps: its local copies "
                              "are not combined across processes")
    raw = _format.loads(manifest, f"{folders.get(min(folders)) if folders else 'a peer'}/{_format.MANIFEST}")
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"the manifest of step {c.step} is not a JSON object")
    if raw.pop("packed_processes", None) is not None:  # a local manifest indexes its own pack: every present one
        raw.pop("packed", None)
        packs = [r.packed.to_json() for _, r in sorted(records.items()) if r.packed is not None]
        if packs:
            raw["packed"] = packs
    _write(f"{tmp}/{_format.MANIFEST}", _format.dumps(raw))
    _write(f"{tmp}/{_format.COMMITTED}", marker)
    return records


def _needs(tmp: str, target: object, options: RestoreOptions, records: Mapping[int, ProcessRecord]) -> dict[str, object]:
    """`{"need": [[key, owner, bytes], ...]}`: every file this process's target needs and
    its staging folder lacks; or `{"uncovered": why}` when one is in no share found."""
    pidx = _coord.process_index()
    owner_of: dict[str, tuple[int, int | None]] = {}
    for w, r in records.items():
        for ch in r.chunks:
            owner_of[ch.key] = (w, ch.file_bytes)
    meta = read_metadata(LocalStorage(), tmp)
    resolved = resolve_tree(meta, target, partial=options.partial, process_index=pidx, missing=options.missing)
    keys: dict[str, None] = {}
    lost: list[str] = []
    for leaf in resolved.leaves:
        if leaf.target is None or not isinstance(leaf.meta, ArrayMetadata):
            continue
        try:
            keys.update(dict.fromkeys(k for k, _ in _encoding.files(leaf.meta, [b for _, b in leaf.device_boxes])))
        except CorruptCheckpointError:  # a packed chunk in no pack found
            lost.append(leaf.meta.keystr or leaf.path)
    lacking = [k for k in keys if not os.path.exists(f"{tmp}/{k}")]
    lost += [k for k in lacking if k not in owner_of]
    if lost:
        return {"uncovered": f"process {pidx}'s target needs {len(lost)} file(s) or leaves of it that no surviving local "
                             f"copy holds (e.g. {lost[0]})"}
    out = []
    for k in lacking:
        w, size = owner_of[k]
        if size is None:
            raise CheckpointError(f"the record of process {w} gives no size for {k}")
        out.append([k, w, size])
    return {"need": out}


def _streams(c: Candidate, needs: Sequence[Sequence[Sequence]]) -> list[tuple[_file_exchange.Stream, tuple[int, ...]]]:
    """Who sends what: each lacking file from the least loaded process holding its share
    (ties: the lowest index). Returns the streams and, per stream, each file's owner."""
    load: dict[int, int] = {}
    by_pair: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for q, need in enumerate(needs):
        for key, owner, size in need:
            h = min((p for p in c.holders[int(owner)] if p != q), key=lambda p: (load.get(p, 0), p))
            load[h] = load.get(h, 0) + int(size)
            by_pair.setdefault((h, q), []).append((str(key), int(owner), int(size)))
    return [(_file_exchange.Stream(h, q, tuple((k, n) for k, _, n in files)), tuple(w for _, w, _ in files))
            for (h, q), files in sorted(by_pair.items())]


def _read_stream(stream: _file_exchange.Stream, owners: Sequence[int], folders: Mapping[int, str]) -> np.ndarray:
    buf = np.empty(stream.nbytes, np.uint8)
    offset = 0
    for (key, size), w in zip(stream.files, owners):
        path = f"{folders[w]}/{key}"
        with open(path, "rb") as f:
            n = f.readinto(buf[offset:offset + size].data)
            if n != size or f.read(1):
                raise CorruptCheckpointError(f"{path} is not the {size} bytes its record says")
        offset += size
    return buf


def _unstaged(text: str, tmp: str | None, step: int, folders: Mapping[int, str]) -> str:
    """An error's text with the staging folder (removed when the attempt ends) named by the
    copies staged in it, and without a `checkpointer verify` of that folder."""
    if not tmp:
        return text
    text = re.sub(r"\s*Run `checkpointer verify " + re.escape(tmp) + r"` for a full report[.;]?", "", text)
    return text.replace(tmp, f"step {step} staged from {', '.join(sorted(set(folders.values())))}")


def _attempt(tier: Any, c: Candidate, folders: Mapping[int, str], target: object, options: RestoreOptions,
             count: int) -> tuple[PyTree | None, str]:
    """One candidate, on every process (module docstring, 2-5): (tree, how) or (None, why)."""
    pidx = _coord.process_index()
    attempt = next(_attempts)
    client = _coord.client() if count > 1 else None

    def key(*parts: object) -> str:
        return _kv_key(tier, attempt, *parts)

    def agree(outcome: str) -> list[str]:
        return _tiers.agree(tier.directory, lambda: outcome, tier.commit_timeout_s)

    tmp: str | None = None
    published: list[str] = []
    records: dict[int, ProcessRecord] = {}
    try:
        proposal: dict[str, object]
        try:
            if client is not None:
                published = _publish(client, key, c, folders, count)
            os.makedirs(os.path.dirname(tier.root), exist_ok=True)  # a replacement node's may not exist yet
            tmp = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{c.step}-p{pidx}-", dir=os.path.dirname(tier.root))
            received = _collect(client, key, c, folders, tier.commit_timeout_s) if client is not None else {}
            records = _stage(tmp, c, folders, received)
            proposal = _needs(tmp, target, options, records)
        except Exception as e:  # a damaged or missing file, the key-value store, a target that does not fit
            proposal = {"error": f"process {pidx}: {type(e).__name__}: {_unstaged(str(e), tmp, c.step, folders)}"}
        answers = [_format.load_json(v, what="a restart's needs") for v in agree(_coord.canonical(proposal))]
        bad = [str(a.get("uncovered") or a.get("error")) for a in answers if "need" not in a]
        if bad:
            return None, "; ".join(dict.fromkeys(bad))
        streams = _streams(c, [a["need"] for a in answers])
        nbytes = sum(s.nbytes for s, _ in streams)
        got: dict[int, np.ndarray] = {}
        if streams:
            outcome, sending = "ok", {}
            try:
                parts = _file_exchange.plan_parts([s for s, _ in streams], _file_exchange.devices_by_process())
                sending = {i: _read_stream(s, owners, folders) for i, (s, owners) in enumerate(streams) if s.src == pidx}
            except Exception as e:  # a file gone or cut short, a process without devices
                outcome = f"process {pidx}: {type(e).__name__}: {e}"
            bad = [o for o in agree(outcome) if o != "ok"]
            if bad:
                return None, "; ".join(dict.fromkeys(bad))
            got = _file_exchange.run([s for s, _ in streams], parts, sending)
            sending.clear()
        tree, outcome = None, "ok"
        try:
            assert tmp is not None
            for i, data in got.items():
                offset = 0
                for k, size in streams[i][0].files:
                    _write(f"{tmp}/{k}", data[offset:offset + size].data)
                    offset += size
            tree = restore_from(LocalStorage(), tmp, target, options)
        except Exception as e:  # a chunk that fails its crc32c, a file cut short
            outcome = f"process {pidx}: {type(e).__name__}: {_unstaged(str(e), tmp, c.step, folders)}"
        bad = [o for o in agree(outcome) if o != "ok"]
        if bad:
            return None, "; ".join(dict.fromkeys(bad))
        return tree, (f"step {c.step} (saved by {c.count} processes, the job has {count}) combined from the local "
                      f"copies for this target: {sum(len(s.files) for s, _ in streams)} files, {nbytes} bytes over the "
                      f"device exchange, 0 from {tier.directory}")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for k in published:
            try:
                assert client is not None
                client.key_value_delete(k)
            except Exception:  # housekeeping only
                pass
