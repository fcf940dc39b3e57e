"""Any Hugging Face causal LM as a composer3d model (``model=hf model.path=<dir>``): the adapter to
transformers.

Reached from the rest of composer3d only through this ``__init__`` (``SPEC`` in the model registry,
and the names below); its modules, bottom to top:

- ``config``: ``model.path`` → a local directory, transformers' config, the sizes copied into
  ``model.*``, and the tiny replica of the config that the launch-time checks build;
- ``conversion``: checkpoint names → parameters, through transformers' own conversion mapping;
- ``router_loss``: transformers' router load-balancing loss, kept apart from the logged token loss;
- ``context_parallel``: composer3d's context-parallel attention in transformers' attention
  interface, what it refuses;
- ``experts``: transformers' experts modules under expert parallel (all-to-all dispatch), their
  routing counts;
- ``model``: ``HFCausalLM``, transformers' modules behind composer3d's model interface
  (``models.interface``);
- ``generation``: generation's cached forward in transformers' cache classes
  (``HFCausalLM.decoder``);
- ``tensor_parallel``: the model's TP plan, translated (or derived for Llama-like layouts without
  one);
- ``weights``: reading safetensors straight into the shards, and the files an export copies;
- ``forward_check``: before launch, composer3d's forward against transformers' on a tiny replica.

transformers itself is imported only where a Hugging Face model is used, never by importing this
package.
"""

from composer3d.models.hf.config import (
    attention_windows,
    expert_count,
    fill_model_config,
    load_hf_config,
    moe_sizes,  # noqa: F401  (the planner's MoE shapes of a config.json: plan/shapes.py)
    resolve_model_dir,
)
from composer3d.models.hf.context_parallel import context_parallel_problem
from composer3d.models.hf.conversion import to_checkpoint_names
from composer3d.models.hf.experts import expert_parallel_support
from composer3d.models.hf.forward_check import check_forward_matches_transformers
from composer3d.models.hf.model import HFCausalLM
from composer3d.models.hf.router_loss import wants_router_loss
from composer3d.models.hf.tensor_parallel import (
    tensor_parallel_plan,
    tensor_parallel_problem,
    tp_split_sizes,
)
from composer3d.models.hf.weights import check_pretrained, export_files, load_pretrained
from composer3d.models.interface import ModelSpec

SPEC = ModelSpec(
    "hf",
    HFCausalLM,
    tensor_parallel_plan,
    tp_split_sizes,
    tensor_parallel_problem=tensor_parallel_problem,
    pretrained_weights=lambda cfg: cfg.path if cfg.pretrained else None,
    load_pretrained=load_pretrained,
    check_pretrained=check_pretrained,
    check_forward=check_forward_matches_transformers,
    expert_parallel=expert_parallel_support,
    context_parallel_problem=context_parallel_problem,
    attention_windows=lambda cfg: attention_windows(load_hf_config(resolve_model_dir(cfg.path))),
)

__all__ = [
    "SPEC",
    "HFCausalLM",
    "check_pretrained",
    "expert_count",
    "export_files",
    "fill_model_config",
    "load_hf_config",
    "load_pretrained",
    "resolve_model_dir",
    "to_checkpoint_names",
    "wants_router_loss",
]
