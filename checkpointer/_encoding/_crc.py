"""crc32c of bytes that were read in pieces: the checksum of a whole from its pieces'.

A cooperative restore may split a packed chunk among processes (`_packed`): no process
holds all its bytes, but each can checksum its piece, and the chunk's crc32c follows
from the pieces' crc32c and lengths, so every byte is still checked. The pieces'
crc32c travel with the exchange (`piece_values` on each process, XOR-combined by the
caller), then every process checks every shared chunk alike (`check_pieces`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import crc32c
import numpy as np

from .. import _errors
from .._errors import CorruptCheckpointError, where
from ._leaf_plan import RestorePlan, SharedChunk

_ZEROS = memoryview(bytes(1 << 20))


def _through_zeros(crc: int, n: int) -> int:
    """crc32c continued from `crc` through `n` zero bytes (1 MiB of zeros at a time)."""
    while n:
        m = min(n, len(_ZEROS))
        crc = crc32c.crc32c(_ZEROS[:m], value=crc)
        n -= m
    return crc


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B).

    crc32c is affine in its state and its data: continuing crc(A) through B equals
    continuing it through len(B) zero bytes, XOR crc(B), XOR the continuation of the
    initial state through those zeros. The zero runs are checksummed by the C library
    (hardware crc32c where there is one): about as fast as reading the piece.
    """
    if len_b == 0:
        return crc_a
    return _through_zeros(crc_a, len_b) ^ crc_b ^ _through_zeros(0, len_b)


def combine_all(pieces: Iterable[tuple[int, int]]) -> int:
    """crc32c of the concatenation of pieces given as `(crc32c, length)`, in order."""
    out = 0  # crc32c of no bytes
    for crc, n in pieces:
        out = combine(out, crc, n)
    return out


def _pieces(plan: RestorePlan) -> Iterator[tuple[str, SharedChunk, int, int, int]]:
    for lp in plan.leaves:
        for chunk in lp.shared:
            for offset, nbytes, reader in chunk.pieces:
                yield lp.leaf_path, chunk, offset, nbytes, reader


def piece_values(plan: RestorePlan, piece_crcs: Mapping[tuple[str, int], int]) -> np.ndarray:
    """What this process contributes to the check of the plan's shared chunks: one
    uint32 per piece of every `LeafRestorePlan.shared` chunk, in plan order (the same
    on every process), its crc32c where this process is the piece's reader, else 0.
    XOR over every process's values gives every piece's crc32c (`check_pieces`)."""
    me = plan.process_index
    out = [piece_crcs[(c.key, offset)] if reader == me else 0 for _, c, offset, _, reader in _pieces(plan)]
    return np.asarray(out, np.uint32)


def check_pieces(plan: RestorePlan, values: np.ndarray, path: str) -> None:
    """After the exchange, on every process alike: each shared chunk's crc32c, combined
    from its pieces' (`values`: the XOR of every process's `piece_values`), must be the
    one in the manifest.

    Raises:
      CorruptCheckpointError: naming the leaf, the file and its bytes, the processes
        that read the pieces, and the fix.
    """
    chunks: dict[tuple[str, str, int], tuple[SharedChunk, list[tuple[int, int]]]] = {}
    for (leaf, c, _, nbytes, _), v in zip(_pieces(plan), values.tolist()):
        chunks.setdefault((leaf, c.key, c.offset), (c, []))[1].append((int(v), nbytes))
    bad = []
    for (leaf, _, _), (c, pieces) in chunks.items():
        computed = combine_all(pieces)
        if computed != c.crc32c:
            bad.append((leaf, c, computed))
    if bad:
        leaf, c, computed = bad[0]
        readers = sorted({r for _, _, r in c.pieces})
        more = f"; {len(bad) - 1} more shared chunks fail too" if len(bad) > 1 else ""
        raise CorruptCheckpointError(
            f"{where(leaf=leaf, path=path, process=_errors.this_process())}: packed bytes {c.offset}..{c.offset + c.nbytes} of "
            f"{c.key}, read in pieces by processes {readers}: crc32c mismatch (stored {c.crc32c:#010x}, the pieces give "
            f"{computed:#010x}): the data is damaged{more}. Run `checkpointer verify {path}` for a full report."
        )
