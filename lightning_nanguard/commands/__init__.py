"""The ``nanguard demo`` and ``nanguard ablate`` commands (``lightning_nanguard.cli`` dispatches to them)."""
