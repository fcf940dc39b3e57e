"""Memory: activation checkpointing and offload, sequence tiling, the optimizer on the host."""
