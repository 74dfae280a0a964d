"""The pages `make docs` generates from the code, written before Sphinx reads the sources.

- `_generated/cli.md`: every subcommand's `--help`, from the argparse parser itself
  (checkpointer/_cli/_parser.py), so the page cannot disagree with the command line.
- `_generated/api.md`: an autodoc entry for every name of `checkpointer.__all__`, grouped into
  functions, classes and errors, so a new public name appears without editing the page.
- `notebooks/inspect_checkpoint.ipynb`: the inspection notebook as committed, with its outputs;
  conf.py excludes it from execution.
"""

from __future__ import annotations

import argparse
import inspect
import os
from pathlib import Path


def _write_if_changed(path: Path, text: str) -> None:
    """Writes `text` to `path` unless it holds it already (so Sphinx's incremental build does not
    re-read every page that includes it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def cli_markdown() -> str:
    """Markdown of the `checkpointer` command's help and every subcommand's, from the parser."""
    from checkpointer._cli._parser import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width; fix it for the page
    try:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        out = ["```text", "$ checkpointer --help", parser.format_help().rstrip(), "```", ""]
        for name, command in sub.choices.items():
            out += [f"## `checkpointer {name}`", "", f"{helps.get(name, '')[:1].upper()}{helps.get(name, '')[1:]}.", "",
                    "```text", f"$ checkpointer {name} --help", command.format_help().rstrip(), "```", ""]
    finally:
        del os.environ["COLUMNS"]
    return "\n".join(out)


def api_markdown() -> str:
    """Markdown with an autodoc directive for every name of `checkpointer.__all__`."""
    import checkpointer

    functions, classes, errors = [], [], []
    for name in sorted(checkpointer.__all__, key=str.lower):
        obj = getattr(checkpointer, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            errors.append(name)
        elif inspect.isclass(obj):
            classes.append(name)
        else:
            functions.append(name)
    out = []
    for title, names, directive in (("Functions", functions, "autofunction"), ("Classes", classes, "autoclass"),
                                    ("Errors", errors, "autoexception")):
        out += [f"## {title}", ""]
        for name in names:
            # A class's methods from its bases too (the manager's restore and listing live in
            # base classes); an error's are BaseException's, which are not ours to document.
            options = ["   :inherited-members:"] if directive == "autoclass" else []
            out += ["```{eval-rst}", f".. {directive}:: checkpointer.{name}", *options, "```", ""]
    return "\n".join(out)


def notebook(docs: Path) -> None:
    """Places the inspection notebook where the toctree finds it, as committed: with the outputs
    of its last run (`python tests/test_notebook.py --write` refreshes them; tests/test_notebook.py
    checks them and executes the notebook again). The site never executes it."""
    source = docs.parent / "notebooks" / "inspect_checkpoint.ipynb"
    _write_if_changed(docs / "notebooks" / "inspect_checkpoint.ipynb", source.read_text(encoding="utf-8"))


def all_pages(docs: Path) -> None:
    _write_if_changed(docs / "_generated" / "cli.md", cli_markdown())
    _write_if_changed(docs / "_generated" / "api.md", api_markdown())
    notebook(docs)
