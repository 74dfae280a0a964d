"""Sphinx configuration of the checkpointer documentation (`make docs`; docs/DESIGN-decisions.md,
"Documentation site").

Offline: no intersphinx, no fetched themes or fonts (alabaster ships with Sphinx). Warnings are
errors (`-W` in the Makefile). Pages that are MyST-NB text notebooks (`file_format: mystnb` in their
front matter) execute once per build; every other page is static. Files generated at build time
(the command line's help, the API list, the inspection notebook's copy) go to docs/_generated/,
which git ignores.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # this checkout's checkpointer, whatever the venv points at
sys.path.insert(0, str(DOCS / "_ext"))
# The executed pages run in Jupyter kernels (subprocesses): they import this checkout too, and see
# 8 simulated CPU devices as the README and the tests do.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import generate  # noqa: E402  (docs/_ext/generate.py)

generate.all_pages(DOCS)

project = "checkpointer"
author = "the checkpointer authors"
copyright = "the checkpointer authors"  # noqa: A001 (Sphinx's name)

extensions = [
    "myst_nb",  # MyST markdown and text notebooks (includes myst_parser)
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style docstrings
]

exclude_patterns = ["_build", "_ext", "_generated/*.md", "Thumbs.db", ".DS_Store"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Execution: each text notebook once per build, in a fresh kernel; an error fails the build.
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
# The inspection notebook is executed by the test suite (tests/test_notebook.py); the site renders
# the copy generate.py placed here, never executing it again.
nb_execution_excludepatterns = ["notebooks/*"]
nb_merge_streams = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: autodoc documents the members themselves

html_theme = "alabaster"
html_title = "checkpointer"
html_static_path: list[str] = []
