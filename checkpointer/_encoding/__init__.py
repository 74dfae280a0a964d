"""Stored-leaf encodings: one interface (`LeafEncoding`) per way a leaf's chunks are
stored (its own zarr array; packed into its writers' packs), the registry `ENCODINGS`
and `encoding_of`, and the operations that dispatch through it; per-leaf read plans,
checked reads of planned byte ranges, writing and reading packs, and writing stored
leaves buffered (TensorStore) or direct (`O_DIRECT`, local files).
"""

from ._base import LeafEncoding, ReadContext, VerifyContext
from ._crc import check_pieces, combine as combine_crc32c, piece_values
from ._image import ShardImage, fill_images, image_bytes, image_data
from ._leaf_plan import BoxRead, ChunkRead, LeafRestorePlan, PeerPiece, RestorePlan, SharedChunk
from ._pack import (
    PACKED,
    PackSlab,
    PackWriter,
    array_name,
    buffer_bytes as pack_buffer_bytes,
    check_threshold,
    packs_leaf,
    packs_of_save,
)
from ._read import RestoreStats, fast_path_supported
from ._registry import (
    ENCODINGS,
    by_encoding,
    check_files,
    encoding_of,
    files,
    plan_leaf,
    read_into,
    region_reader,
    replicated_files,
    start_restore,
    start_write,
)
from ._write import (
    BUFFERED,
    DIRECT,
    LeafWrite,
    WriteContext,
    WriteResult,
    chunk_record,
    direct_supported,
    lower_workers,
    write_context,
)

__all__ = ['BUFFERED', 'BoxRead', 'ChunkRead', 'DIRECT', 'ENCODINGS', 'LeafEncoding', 'LeafRestorePlan', 'LeafWrite', 'PACKED', 'PackSlab', 'PackWriter', 'PeerPiece', 'ReadContext', 'RestorePlan', 'RestoreStats', 'ShardImage', 'SharedChunk', 'VerifyContext', 'WriteContext', 'WriteResult', 'array_name', 'by_encoding', 'check_files', 'check_pieces', 'check_threshold', 'chunk_record', 'combine_crc32c', 'direct_supported', 'encoding_of', 'fast_path_supported', 'files', 'fill_images', 'image_bytes', 'image_data', 'lower_workers', 'pack_buffer_bytes', 'packs_leaf', 'packs_of_save', 'piece_values', 'plan_leaf', 'read_into', 'region_reader', 'replicated_files', 'start_restore', 'start_write', 'write_context']
