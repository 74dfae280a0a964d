"""Looking into checkpoints: verify, the restore drill, export, the Orbax import, the save
timeline, the default targets of the CLI and the drill.
"""

from ._default_targets import abstract_mesh, default_axis_names, scratch_mesh, target_specs, target_tree
from ._drill import DrillReport, drill
from ._export import ExportReport, export
from ._orbax_run import ImportReport, import_orbax
from ._timeline import append_journal, append_journal_line, read_timeline, render_png, render_text, timeline
from ._verify import VerifyReport, verify

__all__ = ['DrillReport', 'ExportReport', 'ImportReport', 'VerifyReport', 'abstract_mesh', 'append_journal', 'append_journal_line', 'default_axis_names', 'drill', 'export', 'import_orbax', 'read_timeline', 'render_png', 'render_text', 'scratch_mesh', 'target_specs', 'target_tree', 'timeline', 'verify']
