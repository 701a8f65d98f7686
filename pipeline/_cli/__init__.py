"""The command line, ``python -m pipeline`` (console script ``sluicegate``): the application
around the library. The library never imports this package."""

from pipeline._cli.app import main

__all__ = ["main"]
