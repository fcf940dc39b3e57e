"""composer3d's Hydra config groups and ``train.yaml``, importable as ``composer3d.conf``.

This directory is mapped into the package by ``pyproject.toml`` (``package-dir``), so the entry
points' ``config_path="pkg://composer3d.conf"`` finds it in a wheel and in an editable install
alike.
"""
