"""The command-line entry points, one module per command, on the shared Hydra glue (hydra_entry)."""
