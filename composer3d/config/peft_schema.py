"""The ``peft`` section of the configuration schema (``schema.TrainConfig.peft``): LoRA and QLoRA's
keys. Its comments are the --help text, as ``schema``'s are (``help`` reads both)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PeftConfig:
    # none: train every weight | lora: low-rank adapters on the targeted linears, the rest frozen |
    # qlora: lora with the targeted base weights stored in 4-bit NF4 (torchao), dequantized in the
    # forward. Pick with peft=lora|qlora
    method: str = "none"
    rank: int = 8  # the adapters' rank r (lora_A: r x in, lora_B: out x r)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (training only)
    # module-name patterns (PEFT's rule: a name or the end of one, shell wildcards allowed) of the
    # blocks' linears to adapt; default: the attention and MLP projections of the native and Hugging
    # Face models
    target_modules: list[str] = field(
        default_factory=lambda: [
            "wq",
            "wk",
            "wv",
            "wo",
            "w1",
            "w2",
            "w3",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ]
    )
    # modules trained whole beside the adapters (same patterns), e.g. [output] for the head
    modules_to_save: list[str] = field(default_factory=list)
    # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, e.g.
    # composer3d-convert export's) whose lora_A/lora_B (and modules_to_save) start this run instead
    # of fresh adapters; its r and lora_alpha must be peft.rank and peft.alpha, its tensors those of
    # the targeted linears. A resumed checkpoint takes precedence
    init_from: str | None = None
    # a full composer3d checkpoint (step-N of a run without peft) whose model weights are the frozen
    # base (and where the modules_to_save start), in place of model.path's weights or the
    # initialization; the adapters start fresh. A peft checkpoint never holds its base: it records
    # this source, and a resume reads the base from it again
    base_from: str | None = None
