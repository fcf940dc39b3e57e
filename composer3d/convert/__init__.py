"""composer3d-convert: composer3d checkpoints <-> Hugging Face safetensors directories.

    composer3d-convert export CHECKPOINT_DIR OUT_DIR [--dtype bfloat16|float16|float32]
    composer3d-convert import HF_DIR OUT_CHECKPOINT_DIR

``export`` reads the model part of a checkpoint (saved under any layout and world size) in one
process, with no process group, and writes safetensors shards plus a ``config.json`` that
``LlamaForCausalLM.from_pretrained`` loads (a native mixture of experts: ``MixtralForCausalLM``,
when its settings are Mixtral's; ``convert.mixtral``). A run of ``model=hf`` (any transformers
causal LM) already uses the checkpoint's own names: its export writes them unchanged, next to the
source directory's config.json, tokenizer and generation config. ``import`` (native Llama only)
writes a model-only composer3d checkpoint (fp32) that training loads as pretrained weights with
``checkpoint.resume=<dir>``, and prints the overrides that reproduce the model config. A
``peft=lora|qlora`` checkpoint exports as PEFT's adapter directory, or with ``--merge`` as the
merged full model (``peft_export``). The name mapping and the RoPE permutation live in
``composer3d.models.llama``. Nothing is unpickled: safetensors, JSON, and DCP through
``SafeFileSystemReader``.
"""

from composer3d.convert.common import ConvertError, hydra_overrides
from composer3d.convert.export import export, load_model_tensors, stored_model_shapes
from composer3d.convert.import_hf import import_hf, load_hf_state

__all__ = [
    "ConvertError",
    "export",
    "hydra_overrides",
    "import_hf",
    "load_hf_state",
    "load_model_tensors",
    "stored_model_shapes",
]
