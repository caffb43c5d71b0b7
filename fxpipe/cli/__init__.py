"""Subcommands of the ``fxpipe`` command line, one module each; :mod:`fxpipe.__main__` wires them."""

__all__: list[str] = []
