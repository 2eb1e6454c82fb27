"""The features' parts: what a feature does in a step, driven by the engine through ``engine/parts.py``'s stages and
configured by its callback (``callbacks/``)."""
