"""composer3d-plan: predict a layout's memory, communication, bubble and throughput; search every
layout.

One concern per module: ``hardware`` (devices and links), ``shapes`` (the model's parameters per
layer and per pipeline stage), ``layouts`` (a candidate layout and the enumeration of all of them),
``memory`` (``adapters``: what a LoRA / QLoRA run trains and stores), ``comm`` (bytes per
collective), ``bubble`` (pipeline schedules), ``kernels`` (compute time: GEMMs by shape, attention,
elementwise work eager or compiled, the optimizer step), ``muon`` (optim.name=muon's state,
Newton–Schulz and all-to-alls), ``estimate`` (step time, throughput: the other modules put
together), ``report`` (table / JSON), ``cli`` (the console script) and ``auto`` (``parallel=auto``
in composer3d-train). Each term is a function of its own: expert parallel came as
``comm.expert_parallel`` (its all-to-all), an FSDP unit kind (``shapes.Unit``, the routed experts
sharded over what ep leaves of dp_shard) and the MoE layer's activations, without changing the other
terms; context parallel came the same way (``context``: its traffic and what attention hides of it;
FSDP over dp_shard × cp; its attention memory in ``memory``).
"""

from composer3d.plan.estimate import Estimate, Workload, estimate
from composer3d.plan.layouts import Candidate, candidate_from_config, enumerate_candidates

__all__ = [
    "Candidate",
    "Estimate",
    "Workload",
    "candidate_from_config",
    "enumerate_candidates",
    "estimate",
]
