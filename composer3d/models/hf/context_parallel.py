"""Context parallel for Hugging Face models, through transformers' attention interface.

transformers' attention modules project, normalize and rotate their queries and keys themselves,
then hand them to the function ``config._attn_implementation`` names in its ``AttentionInterface``.
Under context parallel composer3d registers its own there (``ATTENTION``): the module's queries,
keys and values — this rank's tokens, rotated at their global positions — go to
``ContextParallel.attend`` (ring, all-gather or Ulysses), which attends over the keys of the whole
sequence. What every layer's attention needs is planned once per forward (``attention_plan``) and
reaches the function where transformers' masks go, as the ``attention_mask`` each layer passes on.
Packed documents follow transformers' own rule (``find_packed_sequence_indices``: a document starts
where the position does not go on +1), over the whole sequence's positions.

Refused before launch (``context_parallel_problem``): what this function does not compute — sliding
windows, score soft-capping, attention dropout, an architecture whose attention does not call the
interface with the queries, keys and values it attends with (checked on a tiny replica) — and
transformers' router loss, a statistic of the whole micro-batch's routing, which each cp rank sees
only its share of.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from composer3d.models.hf.config import load_hf_config, tiny_replica
from composer3d.models.hf.router_loss import wants_router_loss

ATTENTION = "composer3d_context_parallel"

# Keyword arguments an attention module may pass that change what it computes beyond
# softmax(q·kᵀ·scaling)·v.
_UNSUPPORTED_KWARGS = {
    "sliding_window": "a sliding window",
    "softcap": "soft-capped scores",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}


@dataclass(frozen=True)
class Plan:
    """What each layer's attention of one forward takes under context parallel: the cp group and its
    plan."""

    context: Any  # parallel.context.ContextParallel
    blocks: Any  # its attention_plan for this forward


def attention(
    module,
    query,
    key,
    value,
    attention_mask: Plan,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers' attention-function contract: ``query`` (batch, heads, local tokens, head_dim),
    ``key``/``value`` (batch, kv heads, …) → (output (batch, local tokens, heads, head_dim), no
    weights)."""
    if dropout:
        raise ValueError(
            "context parallel attention has no dropout (config.attention_dropout must be 0)"
        )
    # The kernels scale scores by head_dim**-0.5: a model's own scale is folded into the queries
    # (Llama's is that one)
    factor = 1.0 if scaling is None else scaling * query.shape[-1] ** 0.5
    if abs(factor - 1.0) > 2**-24:
        query = query * factor
    out = attention_mask.context.attend(query, key, value, attention_mask.blocks)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def attention_plan(
    context, tokens_held: int, position_ids: torch.Tensor | None, device: torch.device
):
    """The global positions of this rank's tokens (for RoPE) and the ``Plan`` of its attention over
    the whole sequence: causal by global index and, where ``position_ids`` restart, within
    documents."""
    from transformers.masking_utils import find_packed_sequence_indices

    seq_len = tokens_held * context.size
    if position_ids is None:
        position_ids, documents = context.token_index(seq_len, device).unsqueeze(0), None
    else:
        # None: no restart in any row
        documents = find_packed_sequence_indices(context.whole(position_ids))
    return position_ids, Plan(context, context.attention_plan(seq_len, documents, device))


def context_parallel_problem(m) -> str | None:
    """Why context parallel cannot run this model (``model.*`` config), else None; before launch."""
    config = load_hf_config(m.path, m.attn_implementation)
    name = config.model_type
    types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in types or (not types and getattr(config, "sliding_window", None)):
        return (
            f"{name} has sliding-window attention layers, which composer3d's context-parallel "
            "attention does not compute (it attends over the whole sequence)"
        )
    if getattr(config, "attn_logit_softcapping", None):
        return f"{name} soft-caps its attention scores, which the context-parallel kernels do not"
    if getattr(config, "attention_dropout", 0.0):
        return (
            f"{name} has attention dropout ({config.attention_dropout}), which context parallel "
            "does not draw"
        )
    if wants_router_loss(config):
        return (
            f"{name}'s router load-balancing loss (output_router_logits) pools the routing of "
            "whole sequences, and each cp rank holds a share of every sequence"
        )
    return _interface_problem(m.path, m.attn_implementation)


@functools.cache
def _interface_problem(path: str, attn_implementation: str | None) -> str | None:
    """Whether every layer's attention of a tiny replica of the model reaches transformers'
    attention interface with queries, keys and values that give its logits (plain causal attention
    over them, by the given scale); the keyword arguments it passes must ask for nothing more."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    config = load_hf_config(path, attn_implementation)
    replica = tiny_replica(config)
    calls, extras = [], set()

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(module)
        extras.update(
            what for arg, what in _UNSUPPORTED_KWARGS.items() if kwargs.get(arg) is not None
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            is_causal=True,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    probe_name = f"{ATTENTION}_probe"
    AttentionInterface.register(probe_name, probe)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(replica, dtype=torch.float32).eval()
        tokens = torch.randint(0, replica.vocab_size, (1, 16))
        expected = model(tokens).logits
        model.config._attn_implementation = probe_name
        try:
            got = model(tokens).logits
        except Exception as error:  # noqa: BLE001 — any failure under the interface is a reason to refuse
            return (
                f"{config.model_type}'s attention fails through transformers' attention interface "
                f"({error})"
            )
    if extras:
        return (
            f"{config.model_type}'s attention asks for {', '.join(sorted(extras))}, which context "
            "parallel does not compute"
        )
    if (
        len(calls) != replica.num_hidden_layers
        or (got - expected).abs().max() > 1e-4 * expected.abs().max()
    ):
        return (
            f"{config.model_type}'s attention is not all reached through transformers' attention "
            f"interface ({len(calls)} calls for {replica.num_hidden_layers} layers), or does more "
            "than attend there"
        )
    return None
