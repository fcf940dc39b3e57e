"""Context parallel: sequence shares per cp rank, ring / all-gather / Ulysses attention,
balancing."""

# The styles of attention across the cp ranks (parallel.cp_style; ``context_parallel``): here, so
# the config checks and the planner read them without importing the attention, whose eager boundary
# (torch.compiler.disable) imports dynamo.
STYLES = ("ring", "allgather", "ulysses", "hierarchical")
# the styles whose attention is the ring's blocks (hierarchical: over its Ulysses groups): no mask,
# blocks a mask leaves empty skipped
RING_STYLES = ("ring", "hierarchical")
