"""The on-disk format, pure of I/O policy: names, boxes and chunk grids, leaf paths and tree
structure, dtypes and the zarr v3 encoding (array specs, shard-file layout), leaf metadata
and values, the JSON files (manifest, per-process records), zarr group nodes, the
user-metadata rule and sharding geometry.
"""

from ._box import Box, cell_box, grid_cells, row_slabs
from ._dtypes import dtype_kind, dtype_name, is_numeric_dtype, is_whole_byte_dtype
from ._json import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_MANIFEST_BYTES,
    dumps,
    dumps_large,
    finite_number,
    json_depth,
    load_json,
    loads,
    readable_size,
)
from ._layout import (
    ARRAYS,
    COMMITTED,
    FORMAT_VERSION,
    MANIFEST,
    PROCESSES,
    RETIRED,
    array_dir,
    chunk_key,
    deleting_name,
    generation_time,
    is_step_name,
    new_generation,
    parse_deleting_name,
    parse_partial_name,
    partial_name,
    process_record_name,
)
from ._leaves import MAX_CHUNKS_PER_LEAF, ArrayMetadata, PackedBox, SavedSharding, ValueMetadata, with_fields
from ._manifest import check_reference_targets, library_version, manifest_json, metadata, read_metadata
from ._metadata import CheckpointMetadata
from ._records import ChunkRecord, PackedBoxRecord, PackRecord, ProcessRecord, parse_phases, phases_json, read_process_record
from ._references import (
    FORMAT_VERSION_REFERENCES,
    ChunkRef,
    pack_file,
    pack_ref_key,
    refs_from_json,
    sibling,
    source_path,
    split_pack_key,
)
from ._shard_file import ShardFileLayout
from ._sharding import named_shard_boxes, spec_axes
from ._tree import PyTree, describe, escape_key, flatten, keystrs, rebuild
from ._units import format_bytes
from ._user_metadata import metadata_json, metrics_json
from ._values import value_from_json, value_repr, value_to_json
from ._zarr_arrays import data_crc32c, inner_chunk_shape, zarr_spec, zarr_supports_dtype
from ._zarr_groups import ZARR_JSON, write_group_nodes

__all__ = ['ARRAYS', 'ArrayMetadata', 'Box', 'COMMITTED', 'CheckpointMetadata', 'ChunkRecord', 'ChunkRef', 'FORMAT_VERSION', 'FORMAT_VERSION_REFERENCES', 'MANIFEST', 'MAX_CHUNKS_PER_LEAF', 'MAX_JSON_BYTES', 'MAX_JSON_DEPTH', 'MAX_MANIFEST_BYTES', 'PROCESSES', 'PackRecord', 'PackedBox', 'PackedBoxRecord', 'ProcessRecord', 'PyTree', 'RETIRED', 'SavedSharding', 'ShardFileLayout', 'ValueMetadata', 'ZARR_JSON', 'array_dir', 'cell_box', 'check_reference_targets', 'chunk_key', 'data_crc32c', 'deleting_name', 'describe', 'dtype_kind', 'dtype_name', 'dumps', 'dumps_large', 'escape_key', 'finite_number', 'flatten', 'format_bytes', 'generation_time', 'grid_cells', 'inner_chunk_shape', 'is_numeric_dtype', 'is_step_name', 'is_whole_byte_dtype', 'json_depth', 'keystrs', 'library_version', 'load_json', 'loads', 'manifest_json', 'metadata', 'metadata_json', 'metrics_json', 'named_shard_boxes', 'new_generation', 'pack_file', 'pack_ref_key', 'parse_deleting_name', 'parse_partial_name', 'parse_phases', 'partial_name', 'phases_json', 'process_record_name', 'read_metadata', 'read_process_record', 'readable_size', 'rebuild', 'refs_from_json', 'row_slabs', 'sibling', 'source_path', 'spec_axes', 'split_pack_key', 'value_from_json', 'value_repr', 'value_to_json', 'with_fields', 'write_group_nodes', 'zarr_spec', 'zarr_supports_dtype']
