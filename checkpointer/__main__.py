"""`python -m checkpointer`: the command line, as the `checkpointer` console script runs it."""

from ._cli import main

raise SystemExit(main())
