"""``python -m pipeline``: the sluicegate command line (see :mod:`pipeline.cli`)."""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main())
