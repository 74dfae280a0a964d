"""The README's Python examples run as written (issue 26 item 2: every example runs in CI,
once). The site's examples run in `make docs` (the executed pages) or in the tests that
name them; the README's are run here: its ```python blocks in order, in one fresh
interpreter with 8 simulated CPU devices, their `/tmp/` paths moved into tmp_path."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readmes_python_examples_run_as_written(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    assert len(blocks) >= 2, "the quick start and the manager loop"
    code = "\n".join(blocks).replace('"/tmp/', f'"{tmp_path}/')
    # The manager's restore is of the newest step, 200: w after train_step of step 200 (the
    # saves are asynchronous, so without a wait the restore could find step 100 newest).
    code += '\nassert float(state["w"][0, 0]) == 202.0, float(state["w"][0, 0])\n'
    assert "/tmp/" not in code.replace(str(tmp_path), "")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert float(done.stdout.split()[0]) < 1.01  # the printed read amplification
    assert sorted(int(n) for n in os.listdir(tmp_path / "run") if n.isdigit()) == [0, 100, 200]  # the interval's steps


def test_the_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 15 and "docs/format.md" in local and "docs/api.md" in local
    assert [link for link in local if not (ROOT / link).exists()] == []
    # No hand-written timings: figures come from the benchmark scripts (benchmarks/RESULTS.md).
    assert not re.search(r"\b\d+(\.\d+)?\s*(s|ms|seconds|minutes?)\b", text.replace("2 × 4", "")), "a timing in the README"
