"""Ready-made experiment configs (``recipe=<name>``) for known Hugging Face models and cluster sizes.

The YAML files live in ``recipe/`` next to this file and ship as package data; ``conf/train.yaml`` puts
``pkg://composer3d.recipes`` on Hydra's search path, so ``composer3d-train recipe=<name>`` works for any
installation and from any working directory. See ``recipes/README.md`` in the repository for the table.
"""
