"""Any Hugging Face causal LM as a composer3d model (``model=hf model.path=<dir>``).

transformers builds the model on the meta device (``AutoModelForCausalLM.from_config``);
``HFCausalLM`` keeps its base model (``model``) and head (``lm_head``) as children, so every
parameter keeps the checkpoint's own name (``model.layers.3.self_attn.q_proj.weight``): loading,
saving and exporting need no name mapping. It offers the protocol every composer3d model has —
``tok_embeddings``, ``layers`` (a ModuleDict by index), ``norm``, ``output``, and a ``forward`` that
can run a slice of layers — so the same ``parallelize()`` (PP split, TP/SP, activation
checkpointing, compile, FSDP) applies, with no second code path.

The forward is the decoder loop of transformers' text models (embed → masks and rotary embeddings →
decoder layers → norm → head), written once over the modules transformers built, so a pipeline stage
can start at any layer. Attention masks come from transformers' own mask functions, per layer type
(full or sliding window), and from ``position_ids``: positions that restart mark packed documents,
which the mask functions keep apart. Under context parallel the attention modules call composer3d's
attention through transformers' interface instead, with a plan made once per forward
(``context_parallel``).

Tensor parallel: ``tensor_parallel``; reading and exporting weights: ``weights``; the config:
``config``.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from composer3d.config.schema import ModelConfig
from composer3d.errors import ConfigError
from composer3d.models.hf.config import expert_count, layer_types, load_hf_config, resolve_model_dir
from composer3d.models.hf.context_parallel import (
    ATTENTION,
    attention_plan,
    register_attention,
    windows_by_type,
)
from composer3d.models.hf.conversion import model_conversions
from composer3d.models.hf.experts import (
    count_routing,
    hf_expert_modules,
    inactive_params,
    use_expert_parallel,
)
from composer3d.models.hf.router_loss import RouterLoss, wants_router_loss
from composer3d.models.init import InitRule
from composer3d.models.interface import Routing, has_submodule

# Layer type (config.layer_types) → transformers' function building its attention mask.
_MASKS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
}

_REQUIRED = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")

# What transformers' top-level forwards (``*Model.forward``, ``*ForCausalLM.forward``) do beyond
# embed → layers → norm → head, by model type: (config key multiplying the embeddings, config key
# scaling the logits, whether the logits are divided by it). The same key means opposite things in
# different families (Granite divides by ``logits_scaling``, HyperCLOVA X multiplies), so this is
# per family. An architecture missing here that needs it fails the forward check (``forward_check``)
# before launch.
_TOP_LEVEL_SCALING: dict[str, tuple[str | None, str | None, bool]] = {
    "granite": ("embedding_multiplier", "logits_scaling", True),
    "granite_swa": ("embedding_multiplier", "logits_scaling", True),
    "granitemoe": ("embedding_multiplier", "logits_scaling", True),
    "granitemoeshared": ("embedding_multiplier", "logits_scaling", True),
    "granitemoe_swa": ("embedding_multiplier", "logits_scaling", True),
    "minicpm3": (
        None,
        "logits_scaling",
        True,
    ),  # it divides the final hidden states: the same, the head has no bias
    "hyperclovax": ("embedding_multiplier", "logits_scaling", False),
    "cohere": (None, "logit_scale", False),
    "cohere2": (None, "logit_scale", False),
    "cohere2_moe": (None, "logit_scale", False),
}


class HFCausalLM(nn.Module):
    """A transformers causal LM (built on meta) behind composer3d's model protocol; names stay
    transformers'."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from transformers import AutoModelForCausalLM

        config = load_hf_config(resolve_model_dir(cfg.path), cfg.attn_implementation)
        causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing = [name for name in _REQUIRED if not has_submodule(causal, name)]
        if missing:
            raise ConfigError(
                f"model.path: {type(causal).__name__} lacks {missing}; composer3d runs "
                "decoder-only text models laid out as transformers' Llama family "
                "(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head)"
            )
        unknown = sorted(set(getattr(config, "layer_types", None) or []) - set(_MASKS))
        if unknown:
            raise ConfigError(
                f"model.path: {config.model_type} has layers of type {unknown}; composer3d runs "
                f"attention layers of the types {sorted(_MASKS)} (transformers' mask functions)"
            )
        self.config = causal.config
        # How checkpoint names map onto these parameters (per-expert tensors → fused ones):
        # transformers' mapping.
        self.weight_conversions = model_conversions(causal)
        self.model = causal.model
        self.lm_head = causal.lm_head
        # transformers' router load-balancing loss, when config.json asks for it (``router_loss``)
        self.router_loss = (
            RouterLoss(causal, expert_count(config)) if wants_router_loss(config) else None
        )
        if self.router_loss is not None:
            self.router_loss.install(self.model)
        # A dict keyed by layer index keeps names ("model.layers.3…") when a pipeline stage drops
        # layers.
        self.model.layers = nn.ModuleDict(
            {str(i): layer for i, layer in enumerate(self.model.layers)}
        )
        # the residual stream is split over this many ranks (set by sequence parallel)
        self.sequence_shards = 1
        # this rank's share of each sequence under context parallel (parallel.context)
        self.context_parallel = None
        self.tie_weights()
        self.full_shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        # Each parameter's owner, copied while still whole and on meta: its init runs on that copy
        # (init_rule).
        self._owners = {
            name: copy.deepcopy(self.get_submodule(name.rpartition(".")[0]))
            for name in self.full_shapes
        }
        self._rotary_by_type = (
            "layer_type" in inspect.signature(self.model.rotary_emb.forward).parameters
        )
        self._layer_types = layer_types(self.config)
        self._windows = windows_by_type(self.config)
        embedding_key, logits_key, self._divide_logits = _TOP_LEVEL_SCALING.get(
            self.config.model_type, (None, None, False)
        )
        self._embedding_multiplier = getattr(self.config, embedding_key) if embedding_key else None
        self._logits_scale = getattr(self.config, logits_key) if logits_key else None

    # The protocol's names for transformers' modules (a pipeline stage sets those it does not run to
    # None).
    @property
    def tok_embeddings(self):
        return self.model.embed_tokens

    @tok_embeddings.setter
    def tok_embeddings(self, module):
        self.model.embed_tokens = module

    @property
    def layers(self) -> nn.ModuleDict:
        return self.model.layers

    @property
    def norm(self):
        return self.model.norm

    @norm.setter
    def norm(self, module):
        self.model.norm = module

    @property
    def output(self):
        return self.lm_head

    @output.setter
    def output(self, module):
        self.lm_head = module

    def tie_weights(self) -> None:
        if (
            getattr(self.config, "tie_word_embeddings", False)
            and self.tok_embeddings is not None
            and self.lm_head is not None
        ):
            self.lm_head.weight = self.tok_embeddings.weight

    def init_rule(self, name: str) -> InitRule:
        """transformers' own ``_init_weights`` for the parameter's module, on a whole CPU copy of
        that module, with the global RNG seeded by (seed, name): the model's init scheme,
        independent of the layout."""
        owner, attr = self._owners[name], name.rpartition(".")[2]

        def rule(shape, generator, device):
            module = copy.deepcopy(owner).to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(generator.initial_seed())
                self.model._init_weights(module)
            return getattr(module, attr).detach().to(device)

        return rule

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute buffers (rotary frequencies, embedding scales) that ``to_empty`` left
        uninitialized, through transformers' ``_init_weights`` with every parameter marked
        initialized so only buffers are written."""
        params = list(self.parameters())
        for p in params:
            p._is_hf_initialized = True
        try:
            for module in self.modules():
                if any(True for _ in module.buffers(recurse=False)):
                    self.model._init_weights(module)
        finally:
            for p in params:
                del p._is_hf_initialized

    # Mixture of experts (``models.interface.ComposerModel``): transformers' experts modules, by
    # expert only.
    def attention_logits(self) -> None:
        return None  # transformers' attention modules do not report their logits

    def routed_experts(self) -> list[nn.Module]:
        return hf_expert_modules(self)

    def use_expert_parallel(self, ep_group) -> None:
        use_expert_parallel(self, ep_group)

    def inactive_params(self) -> int:
        return inactive_params(self)

    def track_routing(self, device: torch.device) -> Routing | None:
        """Counted from the router's choices each experts module is called with
        (``experts.count_routing``); a pipeline stage without MoE layers tracks none, but takes part
        in the counts' collectives alike."""
        experts = expert_count(self.config)
        if not experts:
            return None
        count_routing(hf_expert_modules(self), device)
        return Routing(experts, router_loss=self.router_loss)

    def use_context_parallel(self, context) -> None:
        """Attend over the whole sequence while holding ``context``'s share of it: every attention
        module calls composer3d's function through transformers' attention interface
        (``context_parallel``)."""
        register_attention()
        self.context_parallel = context
        self.config._attn_implementation = ATTENTION

    def _layer_type(self, layer_id: str) -> str:
        return self._layer_types[int(layer_id)]

    def _masks(
        self,
        reference: torch.Tensor,
        position_ids: torch.Tensor,
        kinds: set[str],
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> dict[str, Any]:
        """transformers' attention mask per layer type; generation gives its padding mask and its
        cache."""
        import transformers.masking_utils

        # Passed by position: the cache's keyword is past_key_values in transformers 5.17 and cache
        # in 5.24, which warns that past_key_values goes in 5.40.
        return {
            kind: getattr(transformers.masking_utils, _MASKS[kind])(
                self.config, reference, attention_mask, cache, position_ids=position_ids
            )
            for kind in kinds
        }

    def _rotary(
        self, reference: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]
    ) -> dict[str, Any]:
        """The rotary embeddings (cos, sin) at ``position_ids`` per layer type (Gemma 3 has one per
        type)."""
        if self._rotary_by_type:
            return {kind: self.model.rotary_emb(reference, position_ids, kind) for kind in kinds}
        shared = self.model.rotary_emb(reference, position_ids)
        return {kind: shared for kind in kinds}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times the family's multiplier where it has one
        (``_TOP_LEVEL_SCALING``)."""
        h = self.tok_embeddings(x)
        return h if self._embedding_multiplier is None else h * self._embedding_multiplier

    def decoder(self, max_len: int, cache: str, compiled: bool = False):
        """Generation's cached forward over at most ``max_len`` tokens a row, in transformers'
        ``cache`` class (static: StaticCache; dynamic: DynamicCache). Never compiled here (the
        config checks refuse generate.compile for model=hf)."""
        from composer3d.models.hf.generation import HFDecoder

        return HFDecoder(self, max_len, cache)

    def feed_forwards(self) -> list[nn.Module]:
        """Each decoder layer's ``mlp`` that holds no routed experts (a sparse MoE block routes per
        tile)."""
        experts = {id(module) for module in self.routed_experts()}
        return [
            layer.mlp
            for layer in self.layers.values()
            if isinstance(getattr(layer, "mlp", None), nn.Module)
            and not any(id(module) in experts for module in layer.mlp.modules())
        ]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, the head and the family's logit scaling (``_TOP_LEVEL_SCALING``,
        soft-capping)."""
        logits = self.lm_head(self.norm(h))
        if self._logits_scale is not None:
            logits = (
                logits / self._logits_scale if self._divide_logits else logits * self._logits_scale
            )
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def linear_head(self) -> tuple[nn.Module, torch.Tensor] | None:
        """(norm, lm_head's weight) where ``logits`` adds nothing to them (``models.interface``)."""
        adds = (
            self._logits_scale is not None
            or getattr(self.config, "final_logit_softcapping", None)
            or self.lm_head.bias is not None
        )
        return None if adds else (self.norm, self.lm_head.weight)

    def forward(
        self,
        x: torch.Tensor,
        layer_ids: list[str] | None = None,
        embed: bool = True,
        head: bool = True,
        position_ids: torch.Tensor | None = None,
        head_loss=None,
    ) -> torch.Tensor:
        """Tokens (or a previous stage's hidden states) → logits (or hidden states) over
        ``layer_ids``; ``head_loss(h, self.logits)``, where given, takes the head's place
        (``models.interface``)."""
        h = self.embed(x) if embed else x
        layer_ids = list(self.layers.keys()) if layer_ids is None else layer_ids
        if layer_ids:
            # Under sequence parallel a stage's input holds a slice of the sequence; masks and
            # rotary embeddings are built for the whole of it (attention all-gathers the sequence).
            seq = x.shape[1] if embed else h.shape[1] * self.sequence_shards
            if position_ids is None and self.context_parallel is None:
                position_ids = torch.arange(seq, device=h.device).unsqueeze(0)
            local = h.to_local() if isinstance(h, DTensor) else h
            # masks read batch, length, dtype, device
            reference = local.new_empty((local.shape[0], seq, 0))
            kinds = {self._layer_type(i) for i in layer_ids}
            # the global positions of this rank's tokens, one plan for all
            if self.context_parallel is not None:
                position_ids, masks = attention_plan(
                    self.context_parallel,
                    seq,
                    position_ids,
                    h.device,
                    {kind: self._windows[kind] for kind in kinds},
                )
            else:
                masks = self._masks(reference, position_ids, kinds)
            rotary = self._rotary(reference, position_ids, kinds)
            for i in layer_ids:
                kind = self._layer_type(i)
                out = self.layers[i](
                    h,
                    attention_mask=masks[kind],
                    position_embeddings=rotary[kind],
                    position_ids=position_ids,
                )
                h = out[0] if isinstance(out, tuple) else out
        if not head:
            return h
        if self.router_loss is not None:
            h = self.router_loss.attach(h)
        return self.logits(h) if head_loss is None else head_loss(h, self.logits)
