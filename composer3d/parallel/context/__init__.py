"""Context parallel: sequence shares per cp rank, ring / all-gather / Ulysses attention,
balancing."""
