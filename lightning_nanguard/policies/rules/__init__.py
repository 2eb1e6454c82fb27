"""The evidence rules: one small function per way a cause is decided, ``Findings`` in, a ``Diagnosis`` or ``None``.

``policies/causes.py`` declares the order they are tried in (``EVIDENCE``); ``policies.diagnosis.classify`` walks it,
first match wins. A rule reads findings only: no torch, no Lightning, the same answer on every rank.
"""
