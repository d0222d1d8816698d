"""``python -m pipeloom``: the same command line as the ``pipeloom`` console script."""

from pipeloom.cli import main

raise SystemExit(main())
