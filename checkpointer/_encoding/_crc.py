"""crc32c of bytes that were read in pieces: the checksum of a whole from its pieces'.

A cooperative restore may split a packed chunk among processes (`_packed`): no process
holds all its bytes, but each can checksum its piece, and the chunk's crc32c follows
from the pieces' crc32c and lengths, so every byte is still checked. The pieces'
crc32c travel with the exchange (`piece_values` on each process, XOR-combined by the
caller), then every process checks every shared chunk alike (`check_pieces`). The direct
writer combines a chunk's `data_crc32c` from its inner chunks' crc32c the same way
(`_write`). `combine` costs a few µs whatever the lengths (no bytes are read).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from .. import _errors
from .._errors import CorruptCheckpointError, where
from ._leaf_plan import RestorePlan, SharedChunk

# crc32c's polynomial, bit-reflected (Castagnoli).
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """a·b modulo crc32c's polynomial (bit-reflected 32-bit polynomials over GF(2))."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    out, p = [], 1 << 30  # x¹
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _powers()  # x^(2^k) modulo the polynomial, k = 0..31


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """x^(8·nbytes) modulo the polynomial: what moves a crc past `nbytes` bytes."""
    p, k = 1 << 31, 3  # x⁰; a byte is 2³ bits
    while nbytes:
        if nbytes & 1:
            p = _multmodp(_X2N[k & 31], p)
        nbytes >>= 1
        k += 1
    return p


# Lengths combined often get byte tables (`_tables`): four lookups instead of `_multmodp`'s
# loop; a length seen fewer times keeps the loop (a table costs 1,024 products to build).
_TABLE_AFTER = 4
_seen: dict[int, int] = {}


@functools.lru_cache(maxsize=64)
def _tables(nbytes: int) -> tuple[tuple[int, ...], ...]:
    """x ↦ x·x^(8·nbytes) as four 256-entry tables, one per byte of x (the product is
    linear in x, so the products of x's bytes XOR to that of x)."""
    shift = _shift(nbytes)
    return tuple(tuple(_multmodp(shift, b << (8 * k)) for b in range(256)) for k in range(4))


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c(A + B) from crc32c(A), crc32c(B) and len(B), without reading any bytes.

    crc32c is affine in its data: crc(A + B) is crc(A) multiplied by x^(8·len(B))
    modulo the polynomial, XOR crc(B) (zlib's `crc32_combine`, whose pre- and
    post-conditioning cancel here as there). A few µs per call, under 1 µs for a length
    combined often (byte tables; a writer combines pieces of few distinct lengths).
    """
    if len_b == 0:
        return crc_a
    seen = _seen.get(len_b, 0)
    if seen < _TABLE_AFTER:
        if len(_seen) < 4096:  # bounded: a stream of distinct lengths keeps the loop
            _seen[len_b] = seen + 1
        return _multmodp(_shift(len_b), crc_a) ^ crc_b
    t0, t1, t2, t3 = _tables(len_b)
    return t0[crc_a & 0xFF] ^ t1[(crc_a >> 8) & 0xFF] ^ t2[(crc_a >> 16) & 0xFF] ^ t3[crc_a >> 24] ^ crc_b


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
                yield lp.name, chunk, offset, nbytes, reader


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
            f"{where(keystr=leaf, path=path, process=_errors.this_process())}: packed bytes {c.offset}..{c.offset + c.nbytes} of "
            f"{c.key}, read in pieces by processes {readers}: crc32c mismatch (stored {c.crc32c:#010x}, the pieces give "
            f"{computed:#010x}): the data is damaged{more}. Run `checkpointer verify {path}` for a full report."
        )
