"""The package's layout (issue 19): every module path that tests and configuration name
exists (a list naming a moved module would make its check vacuous), no module holds
two concepts (600 lines at most), and every exception class is defined in `_errors.py`.
The import contracts themselves are import-linter's, run by `make lint`."""

import ast
import builtins
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pathlib
import tomllib

import numpy as np
import pytest
from test_fresh_restore import NOT_FOR_RESTORE

import checkpointer as ckpt
from checkpointer._restore._options import RestoreOptions
from checkpointer._save._options import SaveOptions

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIB = pathlib.Path(ckpt.__file__).resolve().parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _configured_module_paths() -> list[str]:
    """Every module path pyproject.toml names: mypy's strict list, ruff's immutable calls
    (module of the callable), the console script's module, import-linter's packages."""
    paths = []
    for override in PYPROJECT["tool"]["mypy"]["overrides"]:
        paths += [m for m in override["module"] if m.startswith("checkpointer")]
    calls = PYPROJECT["tool"]["ruff"]["lint"]["flake8-bugbear"]["extend-immutable-calls"]
    paths += [c.rsplit(".", 1)[0] for c in calls]
    paths += [v.split(":")[0] for v in PYPROJECT["project"]["scripts"].values()]
    for contract in PYPROJECT["tool"]["importlinter"]["contracts"]:
        for layer in contract.get("layers", ()):
            paths += [f"checkpointer.{m.strip()}" for m in layer.split("|")]
        paths += contract.get("source_modules", []) + contract.get("forbidden_modules", [])
    return paths


@pytest.mark.parametrize("module", sorted(set(_configured_module_paths()) | {m for m in NOT_FOR_RESTORE if m.startswith("checkpointer")}))
def test_every_module_named_in_configuration_and_tests_exists(module):
    assert importlib.util.find_spec(module) is not None, f"{module} is named in pyproject.toml or a test but does not exist"


def test_immutable_calls_and_entry_point_name_real_objects():
    for call in PYPROJECT["tool"]["ruff"]["lint"]["flake8-bugbear"]["extend-immutable-calls"]:
        module, name = call.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), name), call
    for target in PYPROJECT["project"]["scripts"].values():
        module, name = target.split(":")
        assert callable(getattr(importlib.import_module(module), name)), target


def test_the_layers_contract_names_every_package_and_module():
    (layers,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    named = {m.strip() for layer in layers["layers"] for m in layer.split("|")}
    present = {p.name for p in LIB.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.stem for p in LIB.glob("*.py") if p.name != "__init__.py"}
    assert named == present


def test_no_module_is_over_600_lines():
    long = {str(f.relative_to(LIB)): n for f in LIB.rglob("*.py") if (n := len(f.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines (a sign of two concepts in one): {long}"


def _exception_classes(files: list[pathlib.Path], known: set[str]) -> list[str]:
    """`module.py: Class` for each class in `files` that derives, by its bases' names, from
    one of `known` or from another class found so far (a subclass of a subclass)."""
    classes = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))}
                classes.append((f"{f.relative_to(LIB)}: {node.name}", node.name, bases))
    found: dict[str, str] = {}
    while True:
        new = {where: name for where, name, bases in classes if where not in found and bases & (known | set(found.values()))}
        if not new:
            return sorted(found)
        found |= new


def test_every_exception_class_is_defined_in_the_errors_module():
    errors = LIB / "_errors.py"
    builtin = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    defined = [n.name for n in ast.walk(ast.parse(errors.read_text())) if isinstance(n, ast.ClassDef)]
    assert len(_exception_classes([errors], builtin)) == len(defined) >= 15  # the check sees every class of `_errors`
    elsewhere = _exception_classes([f for f in sorted(LIB.rglob("*.py")) if f != errors], builtin | set(defined))
    assert not elsewhere, f"exception classes outside checkpointer/_errors.py: {elsewhere}"


def _keywords(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_save_signatures_keywords_equal_the_save_options_fields():
    fields = {f.name for f in dataclasses.fields(SaveOptions)}
    assert _keywords(ckpt.save) == fields
    assert _keywords(ckpt.save_async) == fields
    # The manager takes the save-wide ones at construction and the per-step ones in
    # save() (`force` is `overwrite`; `metrics` go into `metadata`).
    per_step = {"metadata", "per_process_state"}
    assert fields - per_step - {"overwrite"} <= _keywords(ckpt.CheckpointManager.__init__)
    assert per_step <= _keywords(ckpt.CheckpointManager.save)


def _modules_of_the_package() -> set[str]:
    """Every module and package as the map names it: `_pkg/_mod`, `_pkg/`, `_mod`."""
    out = {"__init__"}
    for f in LIB.rglob("*.py"):
        rel = f.relative_to(LIB)
        if len(rel.parts) == 1:
            if rel.name != "__init__.py":
                out.add(rel.stem)
        elif rel.name == "__init__.py":
            out.add(f"{rel.parts[0]}/")
        else:
            out.add(f"{rel.parts[0]}/{rel.stem}")
    return out


def _map_rows(markdown: str, heading: str) -> set[str]:
    section = markdown[markdown.index(heading):]
    table = section[section.index("| package / module |"):]
    rows = set()
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1].strip().strip("*").strip("`")
        rows.add(cell)
    return rows


@pytest.mark.parametrize("doc, heading", [("docs/DESIGN-decisions.md", "## Module map")])
def test_the_module_map_names_every_module(doc, heading):
    rows = _map_rows((ROOT / doc).read_text(), heading)
    modules = _modules_of_the_package()
    assert rows == modules, f"{doc}: missing {sorted(modules - rows)}, not in the package {sorted(rows - modules)}"


def test_restore_signatures_keywords_equal_the_restore_options_fields():
    from checkpointer._restore._pipeline import restore_from

    fields = {f.name for f in dataclasses.fields(RestoreOptions)}
    assert _keywords(ckpt.restore) == fields
    assert _keywords(ckpt.CheckpointManager.restore) == fields
    assert _keywords(ckpt.plan_restore) == fields - {"stats"} | {"process_index", "processes"}
    assert list(inspect.signature(restore_from).parameters) == ["storage", "path", "target", "options"]


def test_restore_options_check_their_values_once_for_every_entry_point(tmp_path):
    path = str(tmp_path / "1")
    ckpt.save(path, {"w": np.arange(4.0)})
    for bad in ({"max_inflight_bytes": 0}, {"max_inflight_bytes": True}, {"cooperative": "yes"}):
        for call in (functools.partial(ckpt.restore, path, **bad), functools.partial(ckpt.plan_restore, path, None, **bad)):
            with pytest.raises(ValueError, match=next(iter(bad))):
                call()


def test_the_package_imports_saves_and_restores_from_a_zip(tmp_path):
    """The front door's lazy table is read through the module's loader, so a zipped
    install (zipimport) works: it used to read `__init__.py` from the file system."""
    import os
    import subprocess
    import sys
    import zipfile

    package = pathlib.Path(ckpt.__file__).parent
    archive = tmp_path / "checkpointer.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in package.rglob("*.py"):
            z.write(f, f.relative_to(package.parent))
    code = (
        "import os, sys, jax.numpy as jnp, checkpointer as ckpt\n"
        "assert '.zip' in ckpt.__file__, ckpt.__file__\n"
        "p = os.path.join(sys.argv[1], '1'); ckpt.save(p, {'a': jnp.arange(3)})\n"
        "print(ckpt.restore(p)['a'].tolist(), ckpt.KeepLatest.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "PYTHONPATH": str(archive)},
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[0, 1, 2] KeepLatest"
