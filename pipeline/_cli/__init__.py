"""The command line, ``python -m pipeline`` (console script ``sluicegate``): the application
around the library, and the only place that names the concrete stages. The library never
imports this package. Entry point: :func:`pipeline._cli.app.main`."""
