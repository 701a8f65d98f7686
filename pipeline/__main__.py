"""``python -m pipeline``: the sluicegate command line (see :mod:`pipeline._cli`)."""

import sys

from pipeline._cli import main

if __name__ == "__main__":
    sys.exit(main())
