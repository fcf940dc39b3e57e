"""What the rest of composer3d asks of a model family — the one door between models/ and the code
that trains them.

Two halves, so that neither ``parallel/`` nor the trainer ever names a family (native, Hugging Face,
…):

- ``ModelSpec``, per family and from its config alone (before any model exists, in the launcher
  too): how to build the model on meta, its tensor-parallel plan, the sizes tensor parallel splits,
  what it refuses, where its pretrained weights are and how they are read into the shards, its
  expert-parallel and context-parallel support.
- ``ComposerModel``, what a built model offers: the block structure every parallelism walks
  (``layers`` and the embedding, norm and head a pipeline stage may drop), its initialization, and
  its mixture-of-experts parts (routed experts, the expert-parallel dispatch, inactive parameters,
  the routing the trainer tracks), and its attention under context parallel, and its cached forward
  for generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn

from composer3d.models.init import InitRule


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[Any], nn.Module]
    # (model, sequence_parallel, float8) -> (plan for root modules, plan for each block)
    tensor_parallel_plan: Callable[[nn.Module, bool, bool], tuple[dict, dict]]
    # Sizes that tensor parallel splits, for validation: (config key, value) pairs
    tp_split_sizes: Callable[[Any], list[tuple[str, int]]]
    # Why the model cannot run tensor parallel at all (None: it can); checked before launch
    tensor_parallel_problem: Callable[[Any], str | None] = lambda cfg: None
    # Directory of pretrained weights to load into the shards after parallelizing (None: initialize)
    pretrained_weights: Callable[[Any], str | None] = lambda cfg: None
    # (model, directory): reads the pretrained weights into the model's (sharded) parameters
    load_pretrained: Callable[[nn.Module, str], None] | None = None
    # (model on meta, directory): raises ConfigError where the directory's weights do not fit the
    # model; before launch
    check_pretrained: Callable[[nn.Module, str], None] | None = None
    # (model config, tp degree): raises ConfigError where composer3d's forward of the model, or its
    # tensor-parallel split, would not compute what its reference computes; run before launch
    check_forward: Callable[[Any, int], None] = lambda cfg, tp: None
    # (model config) -> routed experts of each MoE layer (0: dense) and why expert parallel cannot
    # shard them (None: it can); checked before launch when parallel.ep > 1
    expert_parallel: Callable[[Any], tuple[int, str | None]] = lambda cfg: (cfg.moe.experts, None)
    # (model config) -> why context parallel cannot run the model (None: it can); checked before
    # launch when cp > 1
    context_parallel_problem: Callable[[Any], str | None] = lambda cfg: None
    # (model config) -> each layer's sliding attention window in keys (0: the whole causal prefix):
    # FLOPs per token
    attention_windows: Callable[[Any], list[int]] = lambda cfg: [0] * cfg.n_layers


@dataclass(frozen=True)
class Routing:
    """The mixture-of-experts routing a trainer tracks (``ExpertLoad``)."""

    experts: int  # routed experts of each MoE layer
    # composer3d's own MoE layers: their ``model.moe`` config and the number of MoE layers, for the
    # auxiliary loss and the balancing bias the layers carry; None where the layers do their own
    # balancing (transformers')
    balancing: tuple[Any, int] | None = None
    # transformers' router load-balancing loss, when the model's config asks for it
    # (``models.hf.RouterLoss``)
    router_loss: Any = None


class ComposerModel(Protocol):
    """A model built from a ``ModelSpec`` (on meta); every family offers these, so one
    ``parallelize()`` applies.

    ``tok_embeddings``, ``norm`` and ``output`` are set to None on pipeline stages that do not run
    them; ``layers`` keeps each block under its index, so parameter names are the same under every
    layout.
    """

    # the blocks: the unit of pipeline splitting, checkpointing, compile and FSDP
    layers: nn.ModuleDict
    tok_embeddings: nn.Module | None
    norm: nn.Module | None
    output: nn.Module | None

    def forward(
        self,
        x: torch.Tensor,
        layer_ids: list[str] | None = None,
        embed: bool = True,
        head: bool = True,
        position_ids: torch.Tensor | None = None,
        head_loss: Callable | None = None,
    ) -> torch.Tensor:
        """Tokens (or a previous stage's hidden states) → logits (or hidden states), through
        ``layer_ids``. ``head_loss(h, logits)``, where given, takes the head's place: the final
        hidden states and ``logits`` (this model's) give the loss, e.g. over sequence tiles
        (``parallel.tiling``)."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states ``h`` (any slice of the sequence): final norm, output
        layer and what the family adds to them (logit scaling)."""

    def decoder(
        self, max_len: int, cache: str
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Generation's cached forward over at most ``max_len`` tokens a row, in the
        ``generate.cache`` kind: ``decoder(new_tokens, attention_mask)`` → the logits after each
        row's last new token, (batch, vocab); the mask (1: a real token, 0: left padding) covers
        every token so far (``composer3d.generation``)."""

    def linear_head(self) -> tuple[nn.Module, torch.Tensor] | None:
        """The head as (final norm, weight of a bias-free output layer) where it is only that, for
        the fused loss (``training.fused_loss``); None where the family adds to it (logit scaling,
        soft-capping, a bias)."""

    def feed_forwards(self) -> list[nn.Module]:
        """The blocks' dense feed-forward modules, per token (any cut of the sequence gives the same
        output); mixture-of-experts layers are not among them."""

    def init_rule(self, name: str) -> InitRule:
        """How parameter ``name`` is initialized, whole and layout-independent (``models.init``)."""

    def init_buffers(self, device: torch.device) -> None:
        """Recompute the buffers (rotary tables, …) that materializing left uninitialized."""

    def tie_weights(self) -> None:
        """Share the head with the embedding where the config asks; re-run after parallelisms
        replaced either."""

    def attention_logits(self) -> list[nn.Module] | None:
        """Each block's attention module able to record its heads' largest logit
        (``optim.muon_clip_threshold``): a ``max_logits`` attribute (None: not recording; a tensor
        of this rank's heads: recording), its query and key projections ``wq`` and ``wk`` (heads
        of ``head_dim`` rows), in this stage's blocks. None where the family's attention cannot
        report it."""

    def routed_experts(self) -> list[nn.Module]:
        """Each MoE layer's routed-experts module: its own parameters are stacked by expert on dim
        0, which expert parallel shards; a ``tp_dims`` attribute (weight name → dim) says how tensor
        parallel splits them by width (without it they stay whole on every tp rank). [] for a dense
        model."""

    def use_expert_parallel(self, ep_group) -> None:
        """Route tokens to their experts' ranks over ``ep_group`` (the experts already hold this
        rank's share)."""

    def inactive_params(self) -> int:
        """Parameters a token does not go through ((experts − top_k) of each MoE layer's), counted
        whole."""

    def track_routing(self, device: torch.device) -> Routing | None:
        """Start counting the tokens routed to each expert (``routed_tokens``); None for a dense
        model."""

    def use_context_parallel(self, context) -> None:
        """Hold ``context``'s share of each sequence (``parallel.context.ContextParallel``: token
        indices, the gather of keys and values over cp, the mask); a family refuses what it cannot
        (``context_parallel_problem``)."""


def has_submodule(module: nn.Module, name: str) -> bool:
    """Whether ``module`` holds a submodule at the dotted ``name`` (a plan's or a layout's module
    names)."""
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False
