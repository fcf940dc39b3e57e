"""The run's configuration: the typed schema Hydra fills (``schema``, with ``peft_schema`` and
``plan_schema``), which imports nothing of the package; the checks types cannot express
(``checks``); what Hydra needs registered (``registration``), the keys by name (``keys``), the
per-key ``--help`` (``help``) and sweeps (``sweep``). Import each from its module: this package's
``__init__`` imports nothing, so reading the schema runs none of the checks."""
