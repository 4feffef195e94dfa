"""``python -m fxsplit``: the command line (see :mod:`fxsplit.cli`)."""

import sys

from fxsplit.cli import main

sys.exit(main())
