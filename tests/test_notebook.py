"""notebooks/inspect_checkpoint.ipynb runs top to bottom and shows what it promises."""

import pathlib

import nbformat
import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "inspect_checkpoint.ipynb"


def _stream(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def test_the_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert "XLA_FLAGS" in code[0].source and code[0].source.index("XLA_FLAGS") < code[0].source.index("import jax")


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's checkpoint folder goes here
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr" and "Traceback" in o.text]
    text = "\n".join(_stream(c) for c in code)

    assert "8 devices" in text
    # 1. The tree as a table, from ckpt.metadata.
    tables = [o.data["text/markdown"] for o in outputs if o.output_type == "display_data" and "text/markdown" in o.data]
    assert len(tables) == 1
    # Leaves are named as jax.tree_util.keystr prints them; the storage path is a column.
    assert (
        "| `.params['params']['Dense_0']['kernel']` | (512, 1024) | float32 | P('data', 'model') on mesh data=2 x model=4 |"
        in tables[0]
    )
    assert "`.opt_state[0].nu['params']['Dense_1']['bias']`" in tables[0] and "| `.step` |" in tables[0]
    assert "`arrays/params/params/Dense_0/kernel`" in tables[0]
    # 2., 3. and 5. Three pictures: who wrote which chunk; the read plan on another mesh;
    # the save timeline.
    pngs = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pngs) == 3
    assert all(len(o.data["image/png"]) > 10_000 for o in pngs)  # real figures, not empty axes
    assert "read amplification 1.00" in text
    assert "identical to the saved state: True" in text
    # 4. zarr-python reads the leaf and it equals the original.
    assert "zarr-python read equals the saved array: True" in text
    # 5. The timeline of the manager's run: the two steps retention kept, one process.
    assert "phases of steps [2, 3], processes [0]" in text
    # The notebook removed its checkpoint folder.
    assert not list(tmp_path.glob("inspect-checkpoint-*"))
