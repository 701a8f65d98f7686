"""``python -m pipeline``: the sluicegate command line (see :mod:`pipeline._cli.app`)."""

import sys

from pipeline._cli.app import main

if __name__ == "__main__":
    sys.exit(main())
