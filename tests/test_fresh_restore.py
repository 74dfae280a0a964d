"""A restore in a fresh process (issue 15 item 1): what `import checkpointer` loads, and
the destination buffers the reader fills."""

import os
import subprocess
import sys
import textwrap

import checkpointer as ckpt

# Modules a process that only restores local files must never load.
_NOT_FOR_RESTORE = (
    "checkpointer._api", "checkpointer._save", "checkpointer._async", "checkpointer._manager",
    "checkpointer._tier_manager", "checkpointer._cli", "checkpointer._export", "checkpointer._orbax_import",
    "checkpointer._drill", "checkpointer._timeline", "checkpointer._verify", "checkpointer._stream_save",
    "tensorstore",
)


def _fresh_modules(code: str) -> set[str]:
    """The names in sys.modules after running `code` in a new interpreter."""
    script = textwrap.dedent(code) + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    return set(out.stdout.split())


def test_import_checkpointer_loads_only_the_errors():
    mods = _fresh_modules("import checkpointer")
    assert {m for m in mods if m.startswith("checkpointer")} == {"checkpointer", "checkpointer._errors"}


def test_restore_of_local_files_loads_no_save_manager_cli_or_tensorstore(tmp_path):
    import jax.numpy as jnp

    path = str(tmp_path / "1")
    ckpt.save(path, {"w": jnp.arange(16.0)})
    mods = _fresh_modules(f"""
        import checkpointer, numpy as np
        out = checkpointer.restore({path!r})
        assert np.array_equal(out["w"], np.arange(16.0)), out
    """)
    assert "checkpointer._restore" in mods
    assert not mods & set(_NOT_FOR_RESTORE), sorted(mods & set(_NOT_FOR_RESTORE))


def test_every_public_name_resolves_and_star_import_works():
    namespace: dict = {}
    exec("from checkpointer import *", namespace)
    assert set(ckpt.__all__) <= set(namespace)
    assert set(ckpt.__all__) <= set(dir(ckpt))
    from checkpointer._manager import CheckpointManager
    from checkpointer._restore import restore

    assert ckpt.restore is restore and ckpt.CheckpointManager is CheckpointManager
    assert isinstance(ckpt.__version__, str)


def test_unknown_attribute_raises_attribute_error():
    try:
        ckpt.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("checkpointer.no_such_name did not raise")
