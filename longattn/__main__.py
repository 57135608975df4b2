"""`python -m longattn SUBCOMMAND ...`: the `longattn` command (longattn.tools.cli)."""

import sys

from longattn.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
