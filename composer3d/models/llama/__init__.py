"""composer3d's native Llama-3 style decoder (``model.name=llama``; under a ``moe`` config, a
mixture of experts).

One concern a module, as torchtitan lays out a model family:

- ``attention``: RoPE tables (``rope_tables``, ``apply_rope``), the masks of packed documents
  (``document_ids``, ``document_mask``: flex attention on Triton accelerators, else a dense SDPA
  mask) and ``Attention``;
- ``model``: ``FeedForward``, ``TransformerBlock``, ``is_moe_layer``, ``ffn_hidden_dim`` and the
  ``Llama`` model, with its per-parameter init rules;
- ``sharding``: ``tensor_parallel_plan``, the model's tensor/sequence-parallel plan, and the sizes
  it splits;
- ``kv_cache``: ``LlamaDecoder``, generation's static KV cache and the cached forward that fills it
  (``Llama.decoder``);
- ``hf_adapter``: conversion between the native state dict and config and Hugging Face's
  LlamaForCausalLM (``hf_names``, the RoPE row permutations, ``hf_state_dict_from_native`` …), used
  by ``composer3d.convert``.

Their public names are re-exported here (``llama.Llama``, ``from composer3d.models.llama import
ffn_hidden_dim``). Module state, such as ``attention._flex_fits`` and the lazily compiled flex
attention, lives in its module only.
"""

from composer3d.models.interface import ModelSpec
from composer3d.models.llama.attention import (
    Attention,
    apply_rope,
    document_ids,
    document_mask,
    rope_tables,
)
from composer3d.models.llama.hf_adapter import (
    HF_LAYER_NAMES,
    HF_ROOT_NAMES,
    hf_config_from_native,
    hf_names,
    hf_state_dict_from_native,
    native_config_from_hf,
    native_state_dict_from_hf,
    rope_half_to_interleaved,
    rope_interleaved_to_half,
)
from composer3d.models.llama.model import (
    FeedForward,
    Llama,
    TransformerBlock,
    ffn_hidden_dim,
    is_moe_layer,
)
from composer3d.models.llama.sharding import tensor_parallel_plan, tp_split_sizes

SPEC = ModelSpec("llama", Llama, tensor_parallel_plan, tp_split_sizes)

__all__ = [
    "SPEC",
    "HF_LAYER_NAMES",
    "HF_ROOT_NAMES",
    "Attention",
    "FeedForward",
    "Llama",
    "TransformerBlock",
    "apply_rope",
    "document_ids",
    "document_mask",
    "ffn_hidden_dim",
    "hf_config_from_native",
    "hf_names",
    "hf_state_dict_from_native",
    "is_moe_layer",
    "native_config_from_hf",
    "native_state_dict_from_hf",
    "rope_half_to_interleaved",
    "rope_interleaved_to_half",
    "rope_tables",
    "tensor_parallel_plan",
]
