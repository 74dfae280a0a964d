# The README's two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: venv demo lint test docs bench scale clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

demo: venv
	$(PY) examples/elastic_resume.py

# ruff, mypy and import-linter (the layers) read their configuration from pyproject.toml;
# `make test` runs them first.
lint: venv
	$(VENV)/bin/ruff check checkpointer
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q

# The documentation site (docs/, Sphinx + MyST-NB) into docs/_build/html: offline, warnings are
# errors, every executed page run once in a fresh kernel (docs/conf.py).
docs: venv
	rm -rf docs/_build/html docs/_build/.doctrees
	$(PY) -m sphinx -W --keep-going -j 1 -b html -d docs/_build/.doctrees docs docs/_build/html

bench: venv
	$(PY) benchmarks/save_bench.py
	$(PY) benchmarks/restore_bench.py
	$(PY) benchmarks/fresh_restore_bench.py
	$(PY) benchmarks/distinct_shapes_bench.py
	$(PY) benchmarks/first_step_bench.py
	$(PY) benchmarks/train_loss_bench.py
	$(PY) benchmarks/small_leaves_bench.py
	$(PY) benchmarks/replicated_save_bench.py
	$(PY) benchmarks/safetensors_bench.py
	$(PY) benchmarks/page_cache_bench.py

# How cost grows with state size, leaf count and process count, beside Orbax (issue 28 item 4):
# long (tens of minutes; run it on a quiet machine), so not part of `make bench`. It writes
# benchmarks/scale_*.png and the scale_bench section of benchmarks/RESULTS.md.
scale: venv
	$(PY) benchmarks/scale_bench.py

clean:
	rm -rf $(VENV) build *.egg-info demo_out .mypy_cache .ruff_cache docs/_build docs/_generated docs/notebooks
