"""Ready-made experiment configs (``recipe=<name>``) for known Hugging Face models and cluster
sizes.

The YAML files live in ``recipe/`` next to this file; ``pyproject.toml`` maps this directory into
the package as ``composer3d.recipes`` (the YAMLs ship as package data) and ``conf/train.yaml`` puts
``pkg://composer3d.recipes`` on Hydra's search path, so ``composer3d-train recipe=<name>`` works for
any installation and from any working directory. See ``README.md`` here for the table.
"""
