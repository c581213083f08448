"""`python -m ampwatch.server.cli`: the `ampwatch` command where no console script is
installed (the tests' subprocesses use it)."""

import sys

from ampwatch.server.cli import main

sys.exit(main())
