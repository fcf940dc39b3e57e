"""Tied embeddings under pipeline parallel: the embedding on the first stage, its twin as the head
on the last.

A head tied to the embedding cannot stay one parameter when the first and the last stage run on
different ranks. As Megatron does, the last stage keeps a twin of the embedding as its head: the
twin is initialized or loaded as the embedding (same name for the seed and the rule, same tensor
from the file), and the twins' gradients are summed over the embedding group (this pipeline's first-
and last-stage ranks at one data-parallel/cp/tp coordinate, which hold the same shard of the weight)
before clipping and the optimizer step, so equal gradients meet equal optimizer states and the twins
stay equal. The gradient norm counts the tied weight once (the embedding's), and a checkpoint holds
one tensor under the embedding's name, whatever the layout: what a checkpoint calls a parameter
(``to_checkpoint_names``) and back (``from_checkpoint_names``) is also where a model without PP
drops the second name of its shared head.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

TWINS_ATTRIBUTE = "pipeline_twins"  # where a model split by PP keeps its PipelineTwins


@dataclass(frozen=True)
class PipelineTwins:
    embedding: str  # the embedding weight's name: the one tensor a checkpoint holds
    head: str  # the head weight's name: on the last stage, the embedding's twin
    # this rank's embedding group (None: a middle stage, which holds neither)
    group: dist.ProcessGroup | None
    device: torch.device  # where the group reduces (offloaded gradients travel there and back)


def is_tied(model: nn.Module) -> bool:
    return (
        model.output is not None
        and model.tok_embeddings is not None
        and model.output.weight is model.tok_embeddings.weight
    )


def split_tied_embedding(
    model: nn.Module,
    pp_dim_ranks: torch.Tensor,
    device: torch.device,
    timeout: timedelta | None = None,
) -> None:
    """Before the pipeline split of a tied model: name its twins and build the embedding groups.

    ``pp_dim_ranks``: the world mesh's ranks with the pp dim first (first stage on pp rank 0, last
    on pp−1; the V-shaped schedules, which put both on one rank, are refused by the config checks).
    Every rank creates every group, as torch requires; ``timeout``: the run's collective timeout,
    which the mesh's groups have too."""
    if not is_tied(model):
        return
    names = {id(module): name for name, module in model.named_modules()}
    ranks = pp_dim_ranks.reshape(pp_dim_ranks.shape[0], -1)
    mine = None
    for first, last in zip(ranks[0].tolist(), ranks[-1].tolist()):
        group = dist.new_group([first, last], timeout=timeout)
        if dist.get_rank() in (first, last):
            mine = group
    setattr(
        model,
        TWINS_ATTRIBUTE,
        PipelineTwins(
            f"{names[id(model.tok_embeddings)]}.weight",
            f"{names[id(model.output)]}.weight",
            mine,
            device,
        ),
    )


def twins_of(model: nn.Module) -> PipelineTwins | None:
    return getattr(model, TWINS_ATTRIBUTE, None)


def init_aliases(model: nn.Module) -> dict[str, str]:
    """Parameters initialized as another: the head twin as the embedding (its seed and its rule)."""
    twins = twins_of(model)
    return {} if twins is None else {twins.head: twins.embedding}


def _held_twin(model: nn.Module) -> nn.Parameter | None:
    twins = twins_of(model)
    if twins is None or twins.group is None:
        return None
    params = dict(model.named_parameters())
    return params.get(twins.embedding, params.get(twins.head))


def uncounted_in_norm(model: nn.Module) -> list[nn.Parameter]:
    """The head twin: the gradient norm counts the tied weight once, as the embedding on the first
    stage."""
    twins = twins_of(model)
    held = _held_twin(model)
    return (
        [held] if held is not None and twins.embedding not in dict(model.named_parameters()) else []
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def check_twins_match(model: nn.Module) -> None:
    """Both twins must hold the same shard (placements and local shape) for their gradients to add
    up element by element: the tensor-parallel plan splits the embedding and the head on the
    vocabulary alike."""
    twins, held = twins_of(model), _held_twin(model)
    if held is None:
        return
    mine = (str(getattr(held, "placements", "plain")), tuple(_local(held).shape))
    both: list = [None, None]
    dist.all_gather_object(both, mine, group=twins.group)
    if both[0] != both[1]:
        raise RuntimeError(
            f"the tied embedding {twins.embedding} and its twin {twins.head} on the last pipeline "
            f"stage are split differently ({both[0]} vs {both[1]}), so their gradients cannot be "
            "summed"
        )


@torch.no_grad()
def sum_twin_grads(model: nn.Module) -> None:
    """Each twin's gradient becomes the sum of both (the tied weight's whole gradient), on both
    ranks alike."""
    held = _held_twin(model)
    if held is None:
        return
    twins = twins_of(model)
    # a stage that took no gradient still contributes, or the other rank would wait
    if held.grad is None:
        held.grad = torch.zeros_like(held)
    local = _local(held.grad)
    buffer = local.to(twins.device)
    dist.all_reduce(buffer, group=twins.group)
    if buffer is not local:
        local.copy_(buffer)


def shared_second_names(model: nn.Module) -> dict[str, str]:
    """Second names of shared parameters (a tied head without PP) → the first (the embedding's)."""
    first: dict[int, str] = {}
    later = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            later[name] = first[id(param)]
        else:
            first[id(param)] = name
    return later


def to_checkpoint_names(model: nn.Module, state: dict) -> dict:
    """A model's FQN-keyed state (``get_model_state_dict``) as a checkpoint holds it: the tied
    weight once, under the embedding's name (a shared head's second name dropped; the last stage's
    twin renamed)."""
    later = shared_second_names(model)
    twins = twins_of(model)
    rename = {} if twins is None else {twins.head: twins.embedding}
    return {rename.get(k, k): v for k, v in state.items() if k not in later}


def from_checkpoint_names(model: nn.Module, state: dict) -> dict:
    """``to_checkpoint_names`` undone: what ``set_model_state_dict`` expects of this rank's
    model."""
    twins = twins_of(model)
    if twins is not None and twins.head in dict(model.named_parameters()):
        state = {(twins.head if k == twins.embedding else k): v for k, v in state.items()}
    return {
        **state,
        **{
            name: state[first]
            for name, first in shared_second_names(model).items()
            if first in state
        },
    }


def optimizer_to_checkpoint_names(model: nn.Module, state: dict) -> dict:
    """An FQN-keyed optimizer state (``get_optimizer_state_dict``) with the head twin's under the
    embedding's name, which its state equals (equal gradients from an equal start)."""
    twins = twins_of(model)
    return state if twins is None else _rename_optimizer_state(state, twins.head, twins.embedding)


def optimizer_from_checkpoint_names(model: nn.Module, state: dict) -> dict:
    twins = twins_of(model)
    if twins is None or twins.head not in dict(model.named_parameters()):
        return state
    return _rename_optimizer_state(state, twins.embedding, twins.head)


def _rename_optimizer_state(state: dict, old: str, new: str) -> dict:
    rename = lambda name: new if name == old else name  # noqa: E731
    return {
        **state,
        "state": {rename(k): v for k, v in state["state"].items()},
        "param_groups": [
            {**group, "params": [rename(p) for p in group["params"]]}
            for group in state["param_groups"]
        ],
    }
