"""benchmarks/gpu_check.py on the CPU backend: it measures nothing without `--allow-cpu`,
and a CPU run never writes a results file."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _run(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_gpu_check_without_a_gpu_exits_0_saying_so(tmp_path):
    results = tmp_path / "RESULTS.md"
    p = _run("--results", str(results), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "no GPU here" in p.stdout
    assert not results.exists()


def test_gpu_check_on_cpu_runs_every_method_and_writes_no_results(tmp_path):
    results = tmp_path / "RESULTS.md"
    p = _run("--allow-cpu", "--gib", "0.02", "--runs", "1", "--dir", str(tmp_path), "--results", str(results), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "| save: blocking (until `save_async` returns) |" in p.stdout and "| restore (until ready) |" in p.stdout
    assert "snapshot route `pool`" in p.stdout and "the snapshot copied 0.02 GiB per save" in p.stdout
    assert not results.exists()
    assert not [q for q in tmp_path.iterdir() if q.name.startswith("gpu_check_")]  # its checkpoints are removed
