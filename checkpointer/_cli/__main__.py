"""`python -m checkpointer._cli`: the command line, as the console script runs it."""

from . import main

raise SystemExit(main())
