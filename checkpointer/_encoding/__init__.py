"""Stored-leaf encodings (a leaf in its own zarr array; small leaves packed per process):
per-leaf read plans, checked reads of planned byte ranges, writing and reading packs.
"""

from ._leaf_plan import BoxRead, ChunkRead, LeafRestorePlan, PeerPiece, RestorePlan, chunk_keys, plan_leaf
from ._pack import PACKED, PackWriter, array_name, check_pack_files, check_threshold, packs_leaf, packs_of_save, restore_packed
from ._read import RestoreStats, check_chunk_files, fast_path_supported, open_zarr_array, read_box
from ._registry import region_reader

__all__ = ['BoxRead', 'ChunkRead', 'LeafRestorePlan', 'PACKED', 'PackWriter', 'PeerPiece', 'RestorePlan', 'RestoreStats', 'array_name', 'check_chunk_files', 'check_pack_files', 'check_threshold', 'chunk_keys', 'fast_path_supported', 'open_zarr_array', 'packs_leaf', 'packs_of_save', 'plan_leaf', 'read_box', 'region_reader', 'restore_packed']
