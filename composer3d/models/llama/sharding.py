"""The native Llama's tensor-parallel plan: Megatron splits, optionally with sequence parallel and
float8 styles.

The model spec hands it to ``composer3d.parallel.tensor``, which applies the root plan to the model
and the block plan to every ``TransformerBlock``.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from composer3d.config.schema import ModelConfig
from composer3d.models.llama.model import Llama, ffn_hidden_dim


def tensor_parallel_plan(
    model: Llama, sequence_parallel: bool, float8: bool = False
) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """Megatron splits: (plan for the root modules, plan applied to every block).

    Column-parallel q/k/v and w1/w3, row-parallel wo and w2 (mixture-of-experts layers split their
    experts themselves: ``parallel.experts``); a vocab-parallel embedding; a column-parallel head
    whose output stays sharded on the vocab dim (a DTensor) so the loss
    (``composer3d.training.loss``) runs on the shards without gathering full-vocabulary logits. With
    sequence parallel the residual stream and the norms hold a slice of the sequence; attention and
    MLP inputs are all-gathered on entry and reduce-scattered on exit. With float8 the block's
    layers use torchao's float8 styles (the all-gathers then move float8 activations).
    """
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as Colwise,
        )
        from torchao.float8.float8_tensor_parallel import (
            Float8RowwiseParallel as Rowwise,
        )
        from torchao.float8.float8_tensor_parallel import (
            PrepareFloat8ModuleInput as PrepareInput,
        )
    else:
        Colwise, Rowwise, PrepareInput = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    residual = Shard(1) if sequence_parallel else Replicate()
    root: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "output": ColwiseParallel(
            input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    block: dict[str, ParallelStyle] = {
        "attention.wq": Colwise(),
        "attention.wk": Colwise(),
        "attention.wv": Colwise(),
        "attention.wo": Rowwise(output_layouts=residual),
        "feed_forward.w1": Colwise(),
        "feed_forward.w3": Colwise(),
        "feed_forward.w2": Rowwise(output_layouts=residual),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update(
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # (x, rope_cos, rope_sin, mask): the sequence is gathered, so RoPE tables and mask
                # cover all of it
                "attention": PrepareInput(
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                "feed_forward": PrepareInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    return root, block


def tp_split_sizes(cfg: ModelConfig) -> list[tuple[str, int]]:
    """The sizes tensor parallel splits, as (config key, value), for validation before launch."""
    hidden = ffn_hidden_dim(cfg.dim, cfg.multiple_of, cfg.ffn_dim_multiplier, cfg.ffn_hidden_dim)
    sizes = [
        ("model.n_heads", cfg.n_heads),
        ("model.n_kv_heads", cfg.n_kv_heads or cfg.n_heads),
        ("model.vocab_size", cfg.vocab_size),
    ]
    moe = cfg.moe
    if moe.experts == 0 or moe.dense_layers > 0:
        sizes.append(("model.ffn_hidden_dim", hidden))
    if moe.experts > 0:  # each expert's width (the shared experts' is a multiple of it)
        sizes.append(("model.moe.expert_hidden_dim", moe.expert_hidden_dim or hidden))
    return sizes
