"""The ``autopar`` command line (``autopar.cli.main``) and the real training runs it starts
(``autopar.cli.trainer``)."""

__all__: list[str] = []
