"""``python -m fxsplit``: the command line (see :mod:`fxsplit.cli`)."""

import sys

from fxsplit.cli import main

if __name__ == "__main__":
    sys.exit(main())
