"""Context parallel for Hugging Face models, through transformers' attention interface.

transformers' attention modules project, normalize and rotate their queries and keys themselves,
then hand them to the function ``config._attn_implementation`` names in its ``AttentionInterface``.
Under context parallel composer3d registers its own there (``ATTENTION``): the module's queries,
keys and values — this rank's tokens, rotated at their global positions — go to
``ContextParallel.attend`` (ring, all-gather or Ulysses), which attends over the keys of the whole
sequence. What every layer's attention needs is planned once per forward and layer type
(``attention_plan``) and reaches the function where transformers' masks go, as the
``attention_mask`` each layer passes on. Packed documents follow transformers' own rule
(``find_packed_sequence_indices``: a document starts where the position does not go on +1), over the
whole sequence's positions; a sliding window (transformers' ``sliding_window``: the keys a query
sees, itself included) is a mask over global token indices, so the ring skips the blocks wholly
before it.

Refused before launch (``context_parallel_problem``): what this function does not compute — score
soft-capping, attention sinks, attention dropout, an architecture whose attention does not call the
interface with the queries, keys and values it attends with (checked on a tiny replica, windows
included) — and transformers' router loss, a statistic of the whole micro-batch's routing, which
each cp rank sees only its share of.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from composer3d.models.hf.config import (
    REPLICA_WINDOW,
    attention_windows,
    layer_types,
    load_hf_config,
    tiny_replica,
)
from composer3d.models.hf.router_loss import wants_router_loss

ATTENTION = "composer3d_context_parallel"

# Keyword arguments an attention module may pass that change what it computes beyond
# softmax(q·kᵀ·scaling)·v.
_UNSUPPORTED_KWARGS = {
    "softcap": "soft-capped scores",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}


@dataclass(frozen=True)
class Plan:
    """What each layer's attention of one forward takes under context parallel: the cp group and its
    plan (for the layer type's window)."""

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
    # the layer's own window must be the one its type was planned with (the replica's check holds
    # every architecture cp accepts to this)
    window = kwargs.get("sliding_window") or 0
    if window != attention_mask.blocks.window:
        raise ValueError(
            f"attention of {type(module).__name__} asks for a sliding window of {window} keys, "
            f"planned with {attention_mask.blocks.window}"
        )
    out = attention_mask.context.attend(query, key, value, attention_mask.blocks)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


def attention_plan(
    context,
    tokens_held: int,
    position_ids: torch.Tensor | None,
    device: torch.device,
    windows: dict[str, int],
):
    """The global positions of this rank's tokens (for RoPE) and, per layer type, the ``Plan`` of
    its attention over the whole sequence: causal by global index, within the type's sliding window
    (``windows``: type → keys a query sees, 0 for all) and, where ``position_ids`` restart, within
    documents."""
    from transformers.masking_utils import find_packed_sequence_indices

    seq_len = tokens_held * context.size
    if position_ids is None:
        position_ids, documents = context.token_index(seq_len, device).unsqueeze(0), None
    else:
        # None: no restart in any row
        documents = find_packed_sequence_indices(context.whole(position_ids))
    plans = {
        window: Plan(context, context.attention_plan(seq_len, documents, device, window))
        for window in set(windows.values())
    }
    return position_ids, {kind: plans[window] for kind, window in windows.items()}


def windows_by_type(config) -> dict[str, int]:
    """Each layer type's sliding window (0: full attention): transformers' mask for the type."""
    return dict(zip(layer_types(config), attention_windows(config)))


def context_parallel_problem(m) -> str | None:
    """Why context parallel cannot run this model (``model.*`` config), else None; before launch."""
    config = load_hf_config(m.path, m.attn_implementation)
    name = config.model_type
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
    attention interface with queries, keys and values that give its logits (causal attention over
    them, by the given scale, within the sliding window the layer names — its type's); the keyword
    arguments it passes must ask for nothing more."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    config = load_hf_config(path, attn_implementation)
    replica = tiny_replica(config)
    calls, extras, windows = [], set(), []

    def probe(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        calls.append(module)
        extras.update(
            what for arg, what in _UNSUPPORTED_KWARGS.items() if kwargs.get(arg) is not None
        )
        window = kwargs.get("sliding_window") or 0
        windows.append(window)
        behind = torch.arange(query.shape[2])[:, None] - torch.arange(key.shape[2])[None, :]
        allowed = (behind >= 0) & (behind < window) if window else behind >= 0
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=allowed,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None

    probe_name = f"{ATTENTION}_probe"
    AttentionInterface.register(probe_name, probe)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(replica, dtype=torch.float32).eval()
        # longer than the replica's window (REPLICA_WINDOW), so that the window cuts
        tokens = torch.randint(0, replica.vocab_size, (1, 2 * REPLICA_WINDOW))
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
    reached = (
        f"{config.model_type}'s attention is not all reached through transformers' attention "
        f"interface ({len(calls)} calls for {replica.num_hidden_layers} layers)"
    )
    if len(calls) != replica.num_hidden_layers:
        return reached
    if windows != attention_windows(replica):
        return (
            f"{config.model_type}'s layers ask for sliding windows {windows}, where their types "
            f"give {attention_windows(replica)}"
        )
    if (got - expected).abs().max() > 1e-4 * expected.abs().max():
        return f"{reached}, or does more than attend there"
    return None
