"""Checkpoint tensors → parameters of a Hugging Face model, by transformers' own conversion mapping.

transformers 5 keeps some weights in memory in another form than in its checkpoints: a
mixture-of-experts layer's experts are stacked into fused parameters (``mlp.experts.gate_up_proj``
[experts, 2·hidden, dim]) but saved one expert at a time (``mlp.experts.3.gate_proj.weight``), and
some families rename modules on the way (Mixtral's ``block_sparse_moe`` → ``mlp``). transformers
lists these conversions per model type (``conversion_mapping.get_model_conversion_mapping``); this
module reads the checkpoint's names through them, so a checkpoint maps onto the model the way
``from_pretrained`` maps it, and a fused parameter's rows (experts) can be built from only the
experts' tensors a rank holds. A checkpoint that already stores the fused tensors
(``save_pretrained(save_original_format=False)``) maps name for name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from composer3d.errors import ConfigError


def model_conversions(causal_lm) -> list:
    """transformers' weight conversions of a ``*ForCausalLM`` (renamings and expert fusions; [] for
    most dense models). Without the legacy renamings (BERT-era ``LayerNorm.gamma``), which
    save_pretrained does not write."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(causal_lm, add_legacy=False)


@dataclass
class Fused:
    """A parameter transformers builds from one checkpoint tensor per expert and source pattern."""

    converter: object  # transformers' WeightConverter (its patterns and operations)
    # source pattern → checkpoint keys, expert by expert
    keys: dict[str, list[str]] = field(default_factory=dict)

    def build(self, read, experts: range) -> torch.Tensor:
        """The fused rows of ``experts`` through transformers' own operations; ``read(key)`` gives a
        tensor."""
        tensors = {pattern: [read(keys[e]) for e in experts] for pattern, keys in self.keys.items()}
        for op in self.converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=self.converter.source_patterns,
                target_patterns=self.converter.target_patterns,
            )
        (fused,) = tensors.values()
        return fused


@dataclass
class CheckpointMap:
    """Where each parameter (by the model's name) comes from in a checkpoint, and the shape it would
    have."""

    plain: dict[str, str]  # parameter → the checkpoint key holding it whole
    fused: dict[str, Fused]  # parameter → the per-expert keys it is stacked from
    shapes: dict[str, tuple[int, ...]]
    problems: list[str]  # per-expert tensors that do not make a whole fused parameter


def map_checkpoint(
    conversions: list, index: dict[str, tuple[tuple[int, ...], str]], path: str
) -> CheckpointMap:
    """Map the checkpoint's tensors (``index``: key → (shape, file)) onto parameter names as
    transformers' loader renames them: renamings first, then at most one converter per key."""
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    plain, fused, problems = {}, {}, []
    experts: dict[tuple[str, str], dict[int, str]] = {}  # (parameter, pattern) → expert index → key
    for key in sorted(index, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            plain[name] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        _check_row_wise(converter, path)
        fused.setdefault(name, Fused(converter))
        expert = _expert_index(pattern, key)
        experts.setdefault((name, pattern), {})[expert] = key
    shapes = {name: index[key][0] for name, key in plain.items()}
    for name, entry in list(fused.items()):
        count = max(len(experts.get((name, p), {})) for p in entry.converter.source_patterns)
        gaps = [
            (p, sorted(experts.get((name, p), {})))
            for p in entry.converter.source_patterns
            if sorted(experts.get((name, p), {})) != list(range(count))
        ]
        if gaps:
            problems += [
                f"{name} is stacked from {p} of experts 0..{count - 1}, but the checkpoint has "
                f"that tensor for experts {found}"
                for p, found in gaps
            ]
            del fused[name]
            continue
        entry.keys = {
            p: [experts[name, p][e] for e in range(count)] for p in entry.converter.source_patterns
        }
        try:  # transformers' operations on meta tensors: the shape they build
            shapes[name] = tuple(
                entry.build(lambda k: torch.empty(index[k][0], device="meta"), range(count)).shape
            )
        except RuntimeError as error:
            problems.append(
                f"{name} cannot be stacked from its per-expert tensors "
                f"({str(error).splitlines()[0]})"
            )
            del fused[name]
    return CheckpointMap(plain, fused, shapes, problems)


def _check_row_wise(converter, path: str) -> None:
    """The operations build each expert's row from that expert's tensors alone (stack the experts on
    dim 0, then combine within a row), so a rank holding some experts builds its rows from those
    experts' tensors."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose

    first, *rest = converter.operations
    row_wise = (
        isinstance(first, MergeModulelist)
        and first.dim == 0
        and all(
            (isinstance(op, Concatenate) and op.dim >= 1)
            or (isinstance(op, Transpose) and min(op.dim0, op.dim1) >= 1)
            for op in rest
        )
    )
    if not row_wise:
        raise ConfigError(
            f"model.path: {path} stores tensors that transformers combines with "
            f"{converter.operations} into {converter.target_patterns}; composer3d reads per-expert "
            "tensors stacked on dim 0 (and combined within each expert), not these. Save the model "
            "with save_pretrained(save_original_format=False) to store the combined tensors, which "
            "load as they are"
        )


def _expert_index(pattern: str, key: str) -> int:
    """The expert number the ``*`` of a converter's source pattern stands for in ``key``."""
    match = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    if match is None:
        raise ConfigError(
            f"model.path: checkpoint tensor {key} matches transformers' per-expert pattern "
            f"{pattern}, but names no expert by number there. Use the directory save_pretrained "
            "wrote, unmodified"
        )
    return int(match.group(1))


def to_checkpoint_names(config, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a model's tensors by parameter name) under the names and in the form
    save_pretrained writes for a model of ``config``: transformers' conversions reversed (fused
    experts split one by one, renamings undone)."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        causal_lm = AutoModelForCausalLM.from_config(config)
    return revert_weight_conversion(causal_lm, state)
