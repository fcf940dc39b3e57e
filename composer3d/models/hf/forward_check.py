"""Before training: composer3d's forward of a Hugging Face architecture computes what transformers'
own does.

composer3d rebuilds the top-level forward (to split it into pipeline stages and shard it); what an
architecture does in its own ``*Model.forward`` / ``*ForCausalLM.forward`` (embedding multipliers,
logit scaling, …) would be skipped without a word, under every layout alike, where parity between
layouts cannot see it. So the launcher runs both forwards on a tiny random replica of the model's
config.json — the same architecture and options, a layer of each attention type, a few heads of the
same head size, a small vocabulary — in fp32 on the CPU, in about a second, and refuses the model on
a mismatch.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from composer3d.errors import ConfigError
from composer3d.models.hf.config import REPLICA_VOCAB, tiny_replica
from composer3d.models.hf.tensor_parallel import (
    LLAMA_LAYOUT_TP_PLAN,
    plan_is_derived,
    use_local_head_counts,
)

TOKENS = 48
ATOL = 1e-4
TESTED = "llama, qwen2, qwen3, mistral, gemma2, gemma3, phi3 and stablelm are tested"


def _random_reference(replica):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(replica, dtype=torch.float32).eval()
    for param in reference.parameters():
        # norms start at ones or zeros: perturbed, a skipped or swapped norm shows
        if param.dim() == 1:
            param.add_(0.1 * torch.randn_like(param))
    return reference


def _mismatch(forward, expected: torch.Tensor) -> str | None:
    """How the logits ``forward()`` returns differ from ``expected`` beyond the tolerance (relative
    to the logits' size), or how it fails; None where they agree."""
    try:
        got = forward()
    except Exception as error:  # noqa: BLE001 — any failure of the forward is a mismatch, reported with its reason
        return f"it fails ({type(error).__name__}: {error})"
    worst = (got - expected).abs().max().item()
    return (
        None
        if worst <= ATOL * max(1.0, expected.abs().max().item())
        else f"max |Δlogit| {worst:.3g}"
    )


@torch.no_grad()
def check_forward_matches_transformers(model_cfg, tensor_parallel: int = 1) -> None:
    """Raise ConfigError naming the architecture when composer3d's logits differ from transformers'
    on the replica, or (with ``tensor_parallel`` > 1 and a plan composer3d derived) when that plan's
    split changes them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from composer3d.models.hf.config import load_hf_config
    from composer3d.models.hf.model import HFCausalLM

    config = load_hf_config(model_cfg.path, model_cfg.attn_implementation)
    kind = (
        f"{config.model_type} "
        f"({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, 'causal LM')})"
    )
    replica = tiny_replica(config, tensor_parallel)
    with torch.random.fork_rng(devices=[]):
        try:
            reference = _random_reference(replica)
            tokens = torch.randint(0, REPLICA_VOCAB, (2, TOKENS))
            expected = reference(tokens).logits
        except Exception as error:  # noqa: BLE001 — whatever stops transformers itself on the replica
            raise ConfigError(
                f"model.path: cannot check composer3d's forward of {kind} against transformers': "
                "transformers' own model fails on a tiny replica of its config.json "
                f"({type(error).__name__}: {error}). Unchecked, it could train on wrong numbers; "
                f"use an architecture that passes the check ({TESTED})"
            ) from None
    with tempfile.TemporaryDirectory() as directory:
        replica.save_pretrained(directory)
        ours = HFCausalLM(OmegaConf.merge(model_cfg, {"path": directory})).eval()
    ours.load_state_dict(reference.state_dict())  # the same names: composer3d keeps transformers'
    mismatch = _mismatch(lambda: ours(tokens), expected)
    if mismatch is not None:
        raise ConfigError(
            f"model.path: composer3d's forward of {kind} does not compute what transformers' own "
            f"does ({mismatch} on a tiny random replica of its config.json). The architecture does "
            "something in its top-level forward that composer3d's does not reproduce (as embedding "
            "or logit multipliers); training it would give wrong numbers. Use an architecture that "
            f"passes this check ({TESTED})"
        )
    if tensor_parallel > 1 and plan_is_derived(config):
        _check_split(ours, tokens, expected, tensor_parallel, kind)


class _SummedShards(nn.Module):
    """What tensor parallel computes for a block under a column/row plan: each rank's slice of the
    block on the whole input, the outputs summed (the row-parallel all-reduce)."""

    def __init__(self, shards: list[nn.Module]):
        super().__init__()
        self.shards = nn.ModuleList(shards)

    def forward(self, *args, **kwargs):
        outputs = [shard(*args, **kwargs) for shard in self.shards]
        if isinstance(outputs[0], tuple):
            return (sum(out[0] for out in outputs), *outputs[0][1:])
        return sum(outputs)


def _shard(
    block: nn.Module, styles: dict[str, str], rank: int, ranks: int, attention: bool
) -> nn.Module:
    shard = copy.deepcopy(block)
    for name, style in styles.items():
        linear = shard.get_submodule(name)
        dim = 0 if style == "colwise" else 1
        linear.weight = nn.Parameter(linear.weight.chunk(ranks, dim)[rank].clone())
        # a column slice keeps its share of the bias; a row-parallel bias is added once
        if linear.bias is not None:
            bias = (
                linear.bias.chunk(ranks)[rank] if style == "colwise" else linear.bias * (rank == 0)
            )
            linear.bias = nn.Parameter(bias.clone())
    if attention:  # it holds 1/ranks of the heads, as under the real plan
        use_local_head_counts(shard, ranks)
    return shard


def _check_split(model, tokens, expected, ranks: int, kind: str) -> None:
    """The derived plan (``tensor_parallel.LLAMA_LAYOUT_TP_PLAN``) on ``ranks`` simulated ranks in
    this process: each attention and MLP block replaced by its slices, summed. An architecture whose
    blocks mix heads or columns in a way the plan does not split changes the logits."""
    blocks: dict[str, dict[str, str]] = {}
    for pattern, style in LLAMA_LAYOUT_TP_PLAN.items():
        block, _, linear = pattern.removeprefix("layers.*.").partition(".")
        blocks.setdefault(block, {})[linear] = style

    def split_forward():
        for layer in model.layers.values():
            for block, styles in blocks.items():
                setattr(
                    layer,
                    block,
                    _SummedShards(
                        [
                            _shard(getattr(layer, block), styles, r, ranks, block == "self_attn")
                            for r in range(ranks)
                        ]
                    ),
                )
        return model(tokens)

    mismatch = _mismatch(split_forward, expected)
    if mismatch is not None:
        raise ConfigError(
            f"parallel.tp: {kind} has no tensor-parallel plan in transformers, and the Llama "
            "family's plan that composer3d derives for its layout does not split it exactly "
            f"({mismatch} over tp={ranks} on a tiny replica of its config.json). Use parallel.tp=1 "
            "(FSDP and pipeline parallel work)"
        )
