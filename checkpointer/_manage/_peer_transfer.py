"""The boxes of a lost node's share over the device interconnect (`_peer_delivery`'s
transport): which device sends which box, the holder's reads of the boxes it sends, the
programs that move them, and the replaced process's arrays from what it received.

- `plan`: a replaced process's devices (by id) take its holder's devices in turn: its
  k-th device receives from the holder's (k mod n)-th, in round k // n (after the rounds
  of any other replaced process the same holder serves). In a round every device sends
  at most one box of a leaf and receives at most one.
- `programs`: per round, every leaf whose boxes go between the same device pairs is one
  operand of one program (`jax.lax.ppermute` under `shard_map` over a one-dimensional
  mesh of those devices; each box a block along the first axis, so what a device
  receives is its box, no copy), at most `MAX_OPERANDS` operands and `MAX_PROGRAM_BYTES`
  to a program. Processes with as many devices each: a few programs of many leaves, not
  one per leaf (on gloo, 16 programs of 8 MiB blocks took 2-5x the time of one program
  with 16 operands); not one in all either, so that the transfer overlaps the reads.
- `HeldReads`: the holder reads the boxes it sends from the copy it holds on a background
  thread (no collective in it), into the host buffers the program sends (a CPU device
  adopts them, no copy), every inner chunk's crc32c checked in the same pass
  (`_encoding.read_into`).
- `compile_programs` (ahead: while the reads go on, before the round that lets them
  run), then `run`: runs each program once its blocks are read (`HeldReads.ready`; the
  leaves are read in the programs' order), while the next ones are read; on the calling
  thread only (the restore call), never on a background one.
- `assemble`: the replaced process's tree from the boxes it received.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .. import _encoding, _memory
from .._errors import CheckpointError
from .._format import ArrayMetadata, Box, PyTree, ValueMetadata, read_metadata, rebuild
from .._storage import LocalStorage

_AXIS = "peers"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One box of one leaf: from a device of its holder to one of the replaced process's."""

    leaf: str
    box: Box
    src: int  # device id
    dst: int  # device id
    round: int

    @property
    def block(self) -> tuple[int, ...]:
        """The box's block in its operand (a scalar box travels as one element)."""
        return self.box.shape or (1,)


@dataclasses.dataclass(frozen=True)
class Operand:
    """The boxes of one leaf (of one block shape) that travel in one program."""

    leaf: str
    block: tuple[int, ...]
    dtype: np.dtype  # as the devices hold it (canonical)
    transfers: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """One program: `ppermute` of every operand along `pairs` over the mesh `ids`."""

    ids: tuple[int, ...]  # device ids, ascending
    pairs: tuple[tuple[int, int], ...]  # (src, dst) device ids
    operands: tuple[Operand, ...]


def devices_by_process() -> dict[int, list[int]]:
    """Every process's device ids, ascending."""
    out: dict[int, list[int]] = {}
    for d in jax.devices():
        out.setdefault(d.process_index, []).append(d.id)
    for ids in out.values():
        ids.sort()
    return out


def unsupported(meta: ArrayMetadata, lt: Any) -> str | None:
    """Why this path does not carry a leaf (None: it does)."""
    if lt is None or lt.sharding is None:
        return "a host target"
    if not isinstance(lt.sharding, NamedSharding) or lt.sharding.memory_kind not in (None, "device"):
        return "not a NamedSharding on devices"
    if meta.key_impl is not None:
        return "PRNG keys"
    return None


def plan(resolved_by_replaced: Mapping[int, Any], holder_of: Mapping[int, int],
         by_process: Mapping[int, Sequence[int]] | None = None) -> tuple[list[Transfer], str | None]:
    """The transfers of every replaced process's unique boxes (to its first device
    holding each; empty boxes are made on the device instead), or why this path does
    not cover the target. The same on every process (a pure function of the resolved
    targets and `by_process`, default `devices_by_process()`)."""
    by_process = devices_by_process() if by_process is None else by_process
    transfers: list[Transfer] = []
    next_round: dict[int, int] = {}  # holder → its first round still free
    for r in sorted(resolved_by_replaced):
        h = holder_of[r]
        senders, slot = list(by_process.get(h, ())), {d: k for k, d in enumerate(by_process.get(r, ()))}
        if not senders:
            return [], f"process {h} has no device"
        base, rounds = next_round.get(h, 0), 0
        for leaf in resolved_by_replaced[r].leaves:
            meta, lt = leaf.meta, leaf.target
            if isinstance(meta, ValueMetadata):
                continue
            why = unsupported(meta, lt)
            if why:
                return [], f"{meta.keystr or meta.path}: {why}"
            first: dict[Box, int] = {}
            for device, box in leaf.device_boxes:
                first.setdefault(box, device)
            for box, device in first.items():
                if device not in slot:
                    return [], f"{meta.keystr or meta.path}: device {device} is not one of process {r}'s"
                if not box.size:
                    continue
                k = slot[device]
                transfers.append(Transfer(leaf.path, box, senders[k % len(senders)], device, base + k // len(senders)))
                rounds = max(rounds, k // len(senders) + 1)
        next_round[h] = base + rounds
    return transfers, None


# Operands of one program at most: XLA's compile time grows faster than the operands (on
# CPU: 16 operands 0.14 s, 256 0.26 s, 1,024 1.7 s, 4,096 23 s).
MAX_OPERANDS = 128
# Bytes of one program at most (every operand's blocks): the holder reads the boxes of the
# programs in order and each program runs once its own are read, so the transfer of one
# goes on while the next is read; programs of the same operand shapes share a compile.
MAX_PROGRAM_BYTES = 64 << 20
# Programs per round of device pairs at most (larger ones above MAX_PROGRAM_BYTES): a tree
# of many shapes may compile each program, ~50-150 ms on CPU (beside the reads).
MAX_PIPELINED_PROGRAMS = 8


def programs(transfers: Sequence[Transfer], dtypes: Mapping[str, np.dtype]) -> list[Program]:
    """The programs that carry `transfers`, in the order every process runs them: per
    round and set of device pairs, the operands by dtype, block shape and leaf, at most
    `MAX_OPERANDS` and `MAX_PROGRAM_BYTES` to a program (or the round's bytes over
    `MAX_PIPELINED_PROGRAMS`, the larger; programs of the same operand shapes share a
    compile)."""
    operands: dict[tuple[int, str, tuple[int, ...]], list[Transfer]] = {}
    for t in transfers:
        operands.setdefault((t.round, t.leaf, t.block), []).append(t)
    grouped: dict[tuple[int, tuple[tuple[int, int], ...]], list[Operand]] = {}
    for (rnd, leaf, block), ts in sorted(operands.items()):
        ts.sort(key=lambda t: t.src)
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtypes[leaf]))
        grouped.setdefault((rnd, tuple((t.src, t.dst) for t in ts)), []).append(Operand(leaf, block, dtype, tuple(ts)))
    out = []
    for (_, pairs), ops in sorted(grouped.items()):
        ops.sort(key=lambda op: (op.dtype.name, op.block, op.leaf))
        ids = tuple(sorted({i for p in pairs for i in p}))
        sizes = [int(np.prod(op.block)) * op.dtype.itemsize * len(op.transfers) for op in ops]
        limit = max(MAX_PROGRAM_BYTES, -(-sum(sizes) // MAX_PIPELINED_PROGRAMS))
        group: list[Operand] = []
        size = 0
        for op, nbytes in zip(ops, sizes):
            if group and (len(group) == MAX_OPERANDS or size + nbytes > limit):
                out.append(Program(ids, pairs, tuple(group)))
                group, size = [], 0
            group.append(op)
            size += nbytes
        if group:
            out.append(Program(ids, pairs, tuple(group)))
    return out


Key = tuple[int, int, int]  # (program, operand, device id): one block of one operand


def _local(program: Program) -> list[jax.Device]:
    devices = {d.id: d for d in jax.local_devices()}
    return [devices[i] for i in program.ids if i in devices]


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: np.dtype, device_id: int) -> Callable[[], jax.Array]:
    """A compiled program making zeros on one device (made there, not copied from the host)."""
    device = next(d for d in jax.local_devices() if d.id == device_id)
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=SingleDeviceSharding(device))


def _placeholder(block: tuple[int, ...], dtype: np.dtype, device: jax.Device) -> jax.Array:
    """A receiving device's block of an operand (ppermute overwrites it; never read): on a
    CPU device an untouched host buffer it adopts (no copy, no page touched), elsewhere
    zeros made on the device."""
    if device.platform == "cpu":
        return jax.device_put(_memory.host_buffer(block, dtype), device)
    return _zeros(block, dtype, device.id)()


class HeldReads:
    """Reads, on a background thread, every box this process sends (from the copy it
    holds of the replaced process's step, `folders`: replaced process → that copy), cast
    to the target dtype, and puts each on its sending device (a CPU device adopts the
    host buffer the box was read into: no copy); `result()` waits for it.

    A read that fails (a damaged or missing file) stops the reading; the blocks not read
    travel as zeros and are discarded (the failure is this process's outcome in the round
    after the transfers).
    """

    def __init__(self, progs: Sequence[Program], folders: Mapping[int, str], process_of: Mapping[int, int]) -> None:
        local = {d.id: d for d in jax.local_devices()}
        self._jobs: dict[int, list[tuple[str, list[tuple[Key, Box, jax.Device]]]]] = {}  # by replaced process
        for p, prog in enumerate(progs):
            for o, op in enumerate(prog.operands):
                for t in op.transfers:
                    if t.src in local:
                        leaves = self._jobs.setdefault(process_of[t.dst], [])
                        if not leaves or leaves[-1][0] != op.leaf:
                            leaves.append((op.leaf, []))
                        leaves[-1][1].append(((p, o, t.src), t.box, local[t.src]))
        self._dtypes = {(p, o): op.dtype for p, prog in enumerate(progs) for o, op in enumerate(prog.operands)}
        self._folders = dict(folders)
        self._done: dict[Key, jax.Array] = {}
        self._left = {p: 0 for p in range(len(progs))}  # blocks not yet read, per program
        for leaves in self._jobs.values():
            for _, blocks in leaves:
                for key, _, _ in blocks:
                    self._left[key[0]] += 1
        self._ready = threading.Condition()
        self._over = False  # the reads are over (done, failed or stopped)
        self.error: str | None = None
        self._stop = threading.Event()
        self._x64 = bool(jax.config.jax_enable_x64)  # type: ignore[attr-defined]  # the reader places arrays with the caller's
        self._thread = threading.Thread(target=self._run, name="checkpointer-peer-held", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops reading at the next leaf and waits (the transfers will not run)."""
        self._stop.set()
        self._thread.join()

    def ready(self, program: int) -> dict[Key, jax.Array]:
        """Waits until every block this process sends in `program` is read (or the reads
        are over: failed or stopped); returns the blocks read so far."""
        with self._ready:
            self._ready.wait_for(lambda: self._over or not self._left[program])
            return dict(self._done)

    def result(self) -> tuple[dict[Key, jax.Array], str | None]:
        """Waits for the reads: every block this process sends → its array (a block
        missing: it travels as zeros), and the error that stopped the reads (None: every
        box read and checked)."""
        self._thread.join()
        return dict(self._done), self.error

    def _run(self) -> None:
        # Leaves on a pool (each leaf's boxes read together by one worker, as the restore's
        # leaf pool does): no barrier between leaves, so a worker the scheduler holds back
        # holds back its own leaf only.
        workers = max(4, 2 * (os.cpu_count() or 1))
        with _memory.paused(), \
                concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="checkpointer-peer-read") as pool:
            futures = []
            try:
                for r, leaves in self._jobs.items():
                    folder = self._folders[r]
                    held = read_metadata(LocalStorage(), folder)
                    for leaf, blocks in leaves:
                        m = held.leaves.get(leaf)
                        if not isinstance(m, ArrayMetadata):
                            raise CheckpointError(f"the copy {folder} has no array leaf {leaf}")
                        futures.append(pool.submit(self._read_leaf, folder, m, blocks))
                for f in futures:
                    f.result()
            except Exception as e:  # a damaged copy, a file gone; anything else too: never send what was not read
                self.error = f"{type(e).__name__}: {e}"
                self._stop.set()  # the leaves not started are not read
                concurrent.futures.wait(futures)
            finally:
                with self._ready:
                    self._over = True
                    self._ready.notify_all()

    def _read_leaf(self, folder: str, m: ArrayMetadata, blocks: list[tuple[Key, Box, jax.Device]]) -> None:
        """Reads one leaf's boxes together (`_encoding.read_into`), casts, places each."""
        if self._stop.is_set():
            return
        hosts = [_memory.host_buffer(box.shape, m.dtype) for _, box, _ in blocks]
        _encoding.read_into(LocalStorage(), folder, m, [(box, h) for (_, box, _), h in zip(blocks, hosts)])
        with jax.enable_x64(self._x64):  # a worker thread: the caller's setting
            for (key, _, device), host in zip(blocks, hosts):
                dtype = self._dtypes[key[:2]]
                if host.dtype != dtype:
                    with np.errstate(all="ignore"):  # the cast was asked for: NaN/overflow are not news
                        host = host.astype(dtype)
                arr = jax.device_put(host.reshape(host.shape or (1,)), device)
                with self._ready:
                    self._done[key] = arr
                    self._left[key[0]] -= 1
                    if not self._left[key[0]]:
                        self._ready.notify_all()


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program this process runs, compiled (`compile_programs`)."""

    index: int  # in the programs' order
    program: Program
    local: tuple[jax.Device, ...]  # this process's devices in it, in mesh order
    sharding: NamedSharding
    executable: Any


def compile_programs(progs: Sequence[Program]) -> list[Compiled]:
    """The programs this process has a device in, compiled ahead of their inputs (an
    executable per set of device pairs and operand shapes, cached): no collective in a
    compile, so before the round that lets them run, while the reads go on."""
    out = []
    for p, prog in enumerate(progs):
        local = _local(prog)
        if local:
            pos = {i: k for k, i in enumerate(prog.ids)}
            perm = tuple((pos[s], pos[d]) for s, d in prog.pairs)
            shapes = tuple(((len(prog.ids) * op.block[0], *op.block[1:]), op.dtype) for op in prog.operands)
            mesh, exe = _executable(prog.ids, perm, shapes)
            out.append(Compiled(p, prog, tuple(local), NamedSharding(mesh, PartitionSpec(_AXIS)), exe))
    return out


def run(compiled: Sequence[Compiled], held: HeldReads | None) -> tuple[dict[tuple[str, int], jax.Array], str | None]:
    """Runs every compiled program, in order, each once `held` has read its blocks (the
    reads of the next go on meanwhile), with those blocks (`held`'s for the boxes this
    process sends, zeros where a read failed; placeholders for the others: ppermute
    overwrites them).

    Returns:
      (leaf, destination device id) → the box received there (a single-device array),
      for this process's destination devices; and `held`'s error (None: every box this
      process sent was read and checked; else what it sent is not to be used).

    Multi-process: every process with a device in a program runs it, in the programs'
    order; on the calling thread only (the restore call).
    """
    received: dict[tuple[str, int], jax.Array] = {}
    for c in compiled:
        prog = c.program
        sent = held.ready(c.index) if held is not None else {}
        inputs = []
        for o, op in enumerate(prog.operands):
            srcs = {t.src for t in op.transfers}
            blocks = []
            for d in c.local:
                arr = sent.get((c.index, o, d.id)) if d.id in srcs else None
                if arr is None:
                    arr = _zeros(op.block, op.dtype, d.id)() if d.id in srcs else _placeholder(op.block, op.dtype, d)
                blocks.append(arr)
            inputs.append(jax.make_array_from_single_device_arrays((len(prog.ids) * op.block[0], *op.block[1:]), c.sharding, blocks))
        outs = c.executable(*inputs)
        del inputs
        for op, out in zip(prog.operands, outs, strict=True):
            dsts = {t.dst: t for t in op.transfers}
            for shard in out.addressable_shards:
                t = dsts.get(shard.device.id)
                if t is not None:
                    received[(op.leaf, t.dst)] = shard.data if t.box.shape else shard.data.reshape(())
        del outs
    return received, (held.result()[1] if held is not None else None)


@functools.lru_cache(maxsize=64)
def _executable(device_ids: tuple[int, ...], perm: tuple[tuple[int, int], ...],
                shapes: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> tuple[jax.sharding.Mesh, Any]:
    mesh, fn = _program(device_ids, perm)
    sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
    return mesh, fn.lower(*[jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]).compile()


@functools.lru_cache(maxsize=64)
def _program(device_ids: tuple[int, ...], perm: tuple[tuple[int, int], ...]) -> tuple[jax.sharding.Mesh, Any]:
    from jax import shard_map

    devices = {d.id: d for d in jax.devices()}
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in device_ids]), (_AXIS,))

    def move(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jax.lax.ppermute(x, _AXIS, perm=list(perm)) for x in xs)

    return mesh, jax.jit(shard_map(move, mesh=mesh, in_specs=PartitionSpec(_AXIS), out_specs=PartitionSpec(_AXIS)))


def assemble(meta: Any, resolved: Any, received: Mapping[tuple[str, int], jax.Array]) -> PyTree:
    """The replaced process's tree from the boxes it received (a box two of its devices
    hold is received once and copied; an empty box is made on its device)."""
    results: dict[str, object] = {}
    devices = {d.id: d for d in jax.local_devices()}
    for leaf in resolved.leaves:
        m, lt = leaf.meta, leaf.target
        if isinstance(m, ValueMetadata):
            results[leaf.path] = m.value
            continue
        by_box: dict[Box, jax.Array] = {}
        for device, box in leaf.device_boxes:
            if (leaf.path, device) in received:
                by_box.setdefault(box, received[(leaf.path, device)])
        dtype = lt.dtype if lt.dtype is not None else m.dtype
        boxes = dict(leaf.device_boxes)
        shards = []
        for d in lt.sharding.addressable_devices_indices_map(tuple(lt.shape)):
            box = boxes[d.id]
            if box not in by_box:  # an empty box: nothing travels
                by_box[box] = _zeros(box.shape, np.dtype(jax.dtypes.canonicalize_dtype(dtype)), d.id)()
            arr = by_box[box]
            shards.append(arr if arr.devices() == {d} else jax.device_put(arr, devices[d.id]))
        results[leaf.path] = jax.make_array_from_single_device_arrays(tuple(lt.shape), lt.sharding, shards)
    if resolved.treedef is None:
        return rebuild(meta.structure, lambda p: results[p], where="a peer copy")
    results.update(resolved.kept)
    return jax.tree_util.tree_unflatten(resolved.treedef, [results[p] for p in resolved.order])
