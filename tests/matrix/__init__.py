"""The fault matrix of issue 12 (F): ``python -m tests.matrix --full`` / ``--subset``; see ``spec.py``."""
