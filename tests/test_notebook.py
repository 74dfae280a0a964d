"""notebooks/inspect_checkpoint.ipynb runs top to bottom and shows what it promises, with
the library's inspection functions only, on a checkpoint saved with the defaults.

It is committed with its outputs (the docs site renders it without executing it again);
refresh them after changing it with `python tests/test_notebook.py --write`.
"""

import pathlib
import re
import sys
import tempfile

import nbformat
import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "inspect_checkpoint.ipynb"
# The committed notebook, outputs included, stays small (modest dpi, four pictures).
MAX_NOTEBOOK_BYTES = 500_000
# Plotting code the notebook must not need any more: the pictures are the library's.
NOT_IN_THE_NOTEBOOK = ("matplotlib", "plt", "Rectangle", "plt.", "json.loads", "processes/", "add_patch")


def _stream(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def execute(nb, workdir: pathlib.Path, *, record_timing: bool = True):
    """Runs `nb` in a fresh kernel with its temporary folders under `workdir`."""
    import os

    from nbclient import NotebookClient

    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(workdir)  # the kernel inherits it: the notebook's checkpoint folder goes here
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=record_timing,
                       resources={"metadata": {"path": str(workdir)}}).execute()
    finally:
        if old is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = old
    return nb


def check_outputs(nb) -> None:
    """What an executed notebook must show: no error, the tree, three pictures, the plan's
    numbers as plan_restore gives them, in the picture's headline too."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr" and "Traceback" in o.text]
    text = "\n".join(_stream(c) for c in code)
    assert "8 devices" in text
    # 1. The tree: treescope's interactive HTML, of a checkpoint whose small leaves are packed.
    trees = [o for o in outputs if o.output_type == "execute_result" and "text/html" in o.data]
    assert len(trees) == 1 and "treescope-container" in trees[0].data["text/html"]
    assert "LeafSummary(" in trees[0].data["text/plain"] and "keystr=\".params['params']['Dense_0']['kernel']\"" in trees[0].data["text/plain"]
    leaves, packed = map(int, re.search(r"(\d+) leaves, [\d,]+ bytes of arrays, (\d+) leaves packed", text).groups())
    assert 0 < packed < leaves
    # 2., 3. and 5. Three pictures: the shard map, the read plan, the run.
    pngs = [o for o in outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]
    assert len(pngs) == 3
    assert all(len(o.data["image/png"]) > 10_000 for o in pngs)  # real figures, not empty axes
    # The plan picture shows plan_restore's numbers.
    needed, read, amplification = re.search(r"plan_restore: ([\d,]+) bytes needed, ([\d,]+) read, read amplification ([\d.]+)",
                                            text).groups()
    assert f"the picture's headline: {needed} bytes needed, {read} read: read amplification {amplification}" in text
    assert float(amplification) == pytest.approx(int(read.replace(",", "")) / int(needed.replace(",", "")), abs=1e-3)
    assert "identical to the saved state: True" in text
    # 4. zarr-python reads an unpacked leaf and it equals the original.
    assert "zarr-python read equals the saved array: True" in text
    # 5. The run: the three steps retention kept.
    assert "committed steps: [2, 3, 4]" in text


def test_the_notebook_is_committed_executed_and_small():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert "XLA_FLAGS" in code[0].source and code[0].source.index("XLA_FLAGS") < code[0].source.index("import jax")
    # Executed top to bottom in one kernel, outputs kept.
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    check_outputs(nb)
    assert NOTEBOOK.stat().st_size < MAX_NOTEBOOK_BYTES
    source = "\n".join(c.source for c in code)
    assert not [s for s in NOT_IN_THE_NOTEBOOK if s in source]
    assert "pack_small_leaves_bytes" not in source  # saved with the defaults


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(tmp_path):
    nb = execute(nbformat.read(NOTEBOOK, as_version=4), tmp_path)
    check_outputs(nb)
    assert not list(tmp_path.glob("inspect-checkpoint-*"))  # the notebook removed its checkpoint folder


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    with tempfile.TemporaryDirectory() as d:
        executed = execute(nbformat.read(NOTEBOOK, as_version=4), pathlib.Path(d), record_timing=False)
    check_outputs(executed)
    nbformat.write(executed, NOTEBOOK)
    print(f"wrote {NOTEBOOK} ({NOTEBOOK.stat().st_size:,} bytes)")
