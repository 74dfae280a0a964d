"""Moving whole files between processes over the device interconnect, inside a
collective call (a restart onto another mesh or another number of processes,
`_mesh_restart`): no socket, no durable tier.

The bytes one process sends another form one *stream* (its files back to back, in an
order both know). A stream is cut into parts of at most `PART_BYTES`, and a stream of
at least `SPREAD_BYTES` into at least as many parts as the two processes have device
pairs, so the sender's devices send in parallel. Every part is a pair of devices (one
of the sender's, one of the receiver's, taken in turn) and a round: in a round a
device sends at most one part and receives at most one (first fit, longest parts
first), so a round is one `jax.lax.ppermute` under `shard_map` over a one-dimensional
mesh of the devices in it, each input a `(1, L)` uint8 row (L: the round's longest
part, rounded up to 1/8 of its power of two so that few programs are compiled). The
plan (`plan_parts`) is pure and the same on every process; each process runs the
rounds with a device of its own, in round order, and skips the others.

Memory: the sender holds the streams it sends (read before the first round); a device
holds one part in and one out per round.

Device collectives run on the calling thread only (never on a background thread).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

PART_BYTES = 64 << 20  # the most one device sends in one round
SPREAD_BYTES = 1 << 20  # a stream this long goes over several device pairs
_AXIS = "files"


@dataclasses.dataclass(frozen=True)
class Stream:
    """The files process `src` sends process `dst`: (key, bytes) in stream order."""

    src: int
    dst: int
    files: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.files)


@dataclasses.dataclass(frozen=True)
class Part:
    """Bytes `[offset, offset + length)` of stream `stream`, from device `src_device`
    to device `dst_device` in round `round`."""

    stream: int
    offset: int
    length: int
    src_device: int
    dst_device: int
    round: int


def devices_by_process() -> dict[int, list[int]]:
    """Process → the ids of its devices, ascending."""
    out: dict[int, list[int]] = {}
    for d in jax.devices():
        out.setdefault(d.process_index, []).append(d.id)
    return {p: sorted(ids) for p, ids in out.items()}


def plan_parts(streams: Sequence[Stream], devices: Mapping[int, Sequence[int]], part_bytes: int = PART_BYTES) -> list[Part]:
    """The parts of every stream, each with its devices and round (module docstring).

    Raises:
      ValueError: a process of a stream has no device.

    Multi-process: pure; the same plan on every process for the same arguments.
    """
    cut: list[tuple[int, int, int, int, int]] = []  # (stream, offset, length, src device, dst device)
    for i, s in enumerate(streams):
        srcs, dsts = list(devices.get(s.src, ())), list(devices.get(s.dst, ()))
        if not srcs or not dsts:
            raise ValueError(f"process {s.src if not srcs else s.dst} has no device to exchange files on")
        total = s.nbytes
        n = max(1, math.ceil(total / part_bytes))
        if total >= SPREAD_BYTES:
            n = max(n, min(len(srcs), len(dsts)))
        offset = 0
        for k in range(n):
            length = total // n + (1 if k < total % n else 0)
            cut.append((i, offset, length, srcs[(k + s.dst) % len(srcs)], dsts[(k + s.src) % len(dsts)]))
            offset += length
    sending: list[set[int]] = []
    receiving: list[set[int]] = []
    parts = []
    for i, offset, length, src, dst in sorted(cut, key=lambda c: (-c[2], c[0], c[1])):
        rnd = 0
        while rnd < len(sending) and (src in sending[rnd] or dst in receiving[rnd]):
            rnd += 1
        if rnd == len(sending):
            sending.append(set())
            receiving.append(set())
        sending[rnd].add(src)
        receiving[rnd].add(dst)
        parts.append(Part(i, offset, length, src, dst, rnd))
    return sorted(parts, key=lambda p: (p.round, p.src_device))


def _row_bytes(n: int) -> int:
    """`n` rounded up to a multiple of 1/8 of its power of two (at least 8 bytes)."""
    if n <= 8:
        return 8
    step = max(1, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


@functools.lru_cache(maxsize=64)
def _program(device_ids: tuple[int, ...], perm: tuple[tuple[int, int], ...]):
    from jax import shard_map

    devices = {d.id: d for d in jax.devices()}
    mesh = jax.sharding.Mesh(np.array([devices[i] for i in device_ids]), (_AXIS,))

    def move(x):
        return jax.lax.ppermute(x, _AXIS, perm=list(perm))

    return mesh, jax.jit(shard_map(move, mesh=mesh, in_specs=PartitionSpec(_AXIS), out_specs=PartitionSpec(_AXIS)))


def run(streams: Sequence[Stream], parts: Sequence[Part], sending: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Runs every round this process has a device in.

    Args:
      streams, parts: the plan (`plan_parts`), the same on every process.
      sending: stream index → its bytes (uint8, `Stream.nbytes` long), for every
        stream this process sends.
    Returns:
      Stream index → its bytes, for every stream this process receives.

    Multi-process: collective among the processes of each round; every process calls
    it with the same plan.
    """
    pidx = jax.process_index()
    devices = {d.id: d for d in jax.devices()}
    received = {i: np.empty(s.nbytes, np.uint8) for i, s in enumerate(streams) if s.dst == pidx}
    for rnd in sorted({p.round for p in parts}):
        group = [p for p in parts if p.round == rnd]
        ids = tuple(sorted({i for p in group for i in (p.src_device, p.dst_device)}))
        if not any(devices[i].process_index == pidx for i in ids):
            continue
        pos = {i: k for k, i in enumerate(ids)}
        mesh, program = _program(ids, tuple(sorted((pos[p.src_device], pos[p.dst_device]) for p in group)))
        width = _row_bytes(max(p.length for p in group))
        by_src = {p.src_device: p for p in group}
        rows = []
        for i in ids:
            if devices[i].process_index != pidx:
                continue
            row = np.zeros((1, width), np.uint8)
            p = by_src.get(i)
            if p is not None:
                row[0, :p.length] = sending[p.stream][p.offset:p.offset + p.length]
            rows.append(jax.device_put(row, devices[i]))
        inputs = jax.make_array_from_single_device_arrays((len(ids), width), NamedSharding(mesh, PartitionSpec(_AXIS)), rows)
        out = program(inputs)
        by_dst = {p.dst_device: p for p in group}
        for shard in out.addressable_shards:
            p = by_dst.get(shard.device.id)
            if p is not None and streams[p.stream].dst == pidx:
                received[p.stream][p.offset:p.offset + p.length] = np.asarray(shard.data)[0, :p.length]
        del inputs, out
    return received
