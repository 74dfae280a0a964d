"""Looking into checkpoints: verify, the restore drill, export, the Orbax import, the save
timeline, the default targets of the CLI and the drill, the notebook pictures (`_inspect`).
"""

from ._default_targets import abstract_mesh, default_axis_names, scratch_mesh, target_specs, target_tree
from ._drill import DrillReport, drill
from ._export import ExportReport, export
from ._inspect import (
    CheckpointTree,
    LeafSummary,
    WrittenChunk,
    inspect_tree,
    plot_shards,
    save_png,
    shard_chunks,
)
from ._orbax_run import ImportReport, import_orbax
from ._plan_figure import PlanBars, plan_bars, plot_plan
from ._run_figure import plot_run
from ._timeline import append_journal, append_journal_line, read_timeline, render_png, render_text, timeline
from ._verify import VerifyReport, verify

__all__ = ['CheckpointTree', 'DrillReport', 'ExportReport', 'ImportReport', 'LeafSummary', 'PlanBars', 'VerifyReport', 'WrittenChunk', 'abstract_mesh', 'append_journal', 'append_journal_line', 'default_axis_names', 'drill', 'export', 'import_orbax', 'inspect_tree', 'plan_bars', 'plot_plan', 'plot_run', 'plot_shards', 'read_timeline', 'render_png', 'render_text', 'save_png', 'scratch_mesh', 'shard_chunks', 'target_specs', 'target_tree', 'timeline', 'verify']
