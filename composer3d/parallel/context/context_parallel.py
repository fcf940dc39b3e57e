"""Context parallel: each of the ``cp`` ranks holds 1/cp of every sequence's tokens, and attention
spans all of them.

Which chunks of the sequence a rank holds is its ``Placement`` (``cp_balance``: head-tail, rank r
holding chunks r and 2·cp−1−r of 2·cp, or one balanced by each batch's documents), set per batch by
``place`` before the batch is sharded; inputs, targets and positions are cut by it (``shard``), RoPE
takes each token's global position, and the model's attention plan and gathers read the same
placement. Attention takes its queries locally and spans the keys of the whole sequence, in one of
three styles (``parallel.cp_style``), all exact, under a mask of global token indices and document
ids:

- ``ring`` (the default): keys and values passed round the cp ranks a block at a time, merged by
  log-sum-exp (``ring_attention``); attention memory per rank falls as 1/cp, and blocks a mask
  (documents, a sliding window) leaves empty are skipped;
- ``allgather``: keys and values of the whole sequence all-gathered with autograd (the backward
  reduce-scatters their gradients), one SDPA call: cheapest for short sequences and few KV heads;
- ``ulysses``: an all-to-all trades the sequence split for a head split (each rank attends over the
  whole sequence with heads/cp of the heads), and back: needs the heads and KV heads divisible by
  cp.
- ``hierarchical``: Ulysses inside groups of ``ulysses`` consecutive cp ranks (a node's fast links:
  the all-to-all gives each rank heads/ulysses of the heads over its group's tokens) and the ring
  across the groups (cp/ulysses of them, over the slower links), each group's members' chunks one
  ring share (``Placement.grouped``); then the all-to-all back. The ring passes 1/ulysses as many
  rounds, each with ulysses× the tokens and 1/ulysses the heads (Megatron's a2a+p2p, USP).

The token loss of each rank's targets is summed over dp × cp (the ``loss`` mesh) and FSDP reduces
gradients over ``dp_shard_cp``, so the curve is the single-process one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from composer3d.parallel.context import STYLES
from composer3d.parallel.context.balance import (
    BALANCES,
    Placement,
    document_ids,
    head_tail,
    plan_placement,
    sees,
)
from composer3d.parallel.context.ring_attention import ring_attention, ring_blocks

# torch 2.13 names it all_gather_single_autograd (the older all_gather_tensor_autograd warns there);
# older only so.
_all_gather_autograd = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)


class ContextParallel:
    """The cp group of this rank: which tokens it holds, and the collectives attention needs across
    the group."""

    def __init__(
        self,
        cp_mesh: DeviceMesh,
        style: str = "ring",
        balance: str = "head_tail",
        windows: tuple[int, ...] = (),
        ulysses: int = 0,
    ):
        if style not in STYLES:
            raise ValueError(f"context parallel style {style!r}: one of {STYLES}")
        if balance not in BALANCES:
            raise ValueError(f"context parallel balance {balance!r}: one of {BALANCES}")
        self.group, self.style, self.balance = cp_mesh.get_group(), style, balance
        self.size, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        if style == "hierarchical":
            if not 1 < ulysses < self.size or self.size % ulysses:
                raise ValueError(f"hierarchical cp of {self.size} ranks: ulysses={ulysses}")
            # cp rank = ring rank · ulysses + Ulysses rank: every rank makes every group
            split = cp_mesh._unflatten(0, (self.size // ulysses, ulysses), ("cp_ring", "cp_a2a"))
            self.a2a_group, self.a2a_size = split["cp_a2a"].get_group(), ulysses
            self.ring_group, self.ring_rank = (
                split["cp_ring"].get_group(),
                split["cp_ring"].get_local_rank(),
            )
            assert self.ring_rank * ulysses + split["cp_a2a"].get_local_rank() == self.rank
        # every layer's sliding window of the whole model (0: causal; none: all causal), which the
        # balance weighs: one placement for all pipeline stages, whose activations pass between them
        self.windows = windows
        # the current batch's (``place``); head-tail until one is placed
        self.placed: Placement | None = None

    def place(self, position_ids: torch.Tensor | None, seq_len: int) -> None:
        """Set the placement of the batch about to be sharded, from its whole rows' ``position_ids``
        (None: causal rows). Every cp rank has the same batch and computes the same placement; the
        shards and the model's forwards of this batch (each microbatch of it) all read it."""
        documents = None if position_ids is None else document_ids(position_ids)
        self.placed = plan_placement(self.size, seq_len, self.balance, documents, self.windows)

    def placement(self, seq_len: int) -> Placement:
        """The placement of the current batch; head-tail for a sequence of another length (none
        placed for it)."""
        if self.placed is not None and self.placed.seq_len == seq_len:
            return self.placed
        return head_tail(self.size, seq_len)

    def token_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Global indices (0..seq_len-1) of the tokens this rank holds, in the order it holds
        them."""
        return self.placement(seq_len).token_index(self.rank, device)

    def gathered_index(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """Global indices of the tokens ``gather`` returns: every rank's, in rank order."""
        return self.placement(seq_len).gathered_index(device)

    def shard(self, tensor: torch.Tensor | None, dim: int = 1) -> torch.Tensor | None:
        """This rank's tokens of a whole-sequence tensor (inputs, targets, positions); None stays
        None."""
        if tensor is None:
            return None
        return tensor.index_select(dim, self.token_index(tensor.shape[dim], tensor.device))

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's tokens along ``dim``, in rank order (``gathered_index``); gradients flow
        back to each owner."""
        return _all_gather_autograd(tensor.contiguous(), gather_dim=dim, group=self.group)

    def whole(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence in global order, from each rank's tokens (no gradient: positions and
        ids)."""
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(gathered, tensor.contiguous(), group=self.group)
        stacked = torch.cat(gathered, dim)
        seq_len = stacked.shape[dim]
        order = self.gathered_index(seq_len, tensor.device).argsort()
        return stacked.index_select(dim, order)

    def attention_plan(
        self, seq_len: int, documents: torch.Tensor | None, device: torch.device, window: int = 0
    ) -> "AttentionPlan":
        """What every layer's attention of one forward needs (computed once per window):
        ``documents`` (batch, seq_len) are the document ids in global order, or None for causal
        attention; ``window`` the keys a query sees under a sliding window (itself included; 0: all
        earlier keys)."""
        if self.style == "ring":
            return AttentionPlan(
                ring_blocks(self.rank, self.placement(seq_len), documents, window), window
            )
        if self.style == "hierarchical":  # the ring's shares: each Ulysses group's tokens
            grouped = self.placement(seq_len).grouped(self.a2a_size)
            return AttentionPlan(ring_blocks(self.ring_rank, grouped, documents, window), window)
        queries = (
            self.token_index(seq_len, device)
            if self.style == "allgather"
            else self.gathered_index(seq_len, device)
        )
        keys = self.gathered_index(seq_len, device)
        return AttentionPlan(_mask(queries, keys, documents, window), window)

    # Under compile.enabled the block is compiled around this call, which runs eagerly between its
    # two graphs: the ring's send/receive is a P2P op dynamo refuses to trace, and its plan is
    # Python data (the blocks a step's documents leave) that a graph would guard on and recompile
    # for at every new batch. The other two styles keep the same boundary, so all three run the same
    # compiled code around their collectives.
    @torch.compiler.disable(
        reason="context parallel attention: P2P ring and a per-batch plan, run eagerly"
    )
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: "AttentionPlan"
    ) -> torch.Tensor:
        """Attention of this rank's queries (batch, heads, local tokens, head_dim) over the whole
        sequence's keys; ``k``/``v`` are this rank's (batch, kv heads, local tokens, head_dim).
        Under tensor parallel these are the rank's share of the heads (``q.shape[1]`` = heads / tp):
        each tp rank attends with its own heads."""
        plan = plan.content
        if self.style == "ring":
            return ring_attention(q, k, v, plan, self.group, self.rank, self.size)
        if self.style == "allgather":
            k, v = self.gather(k, dim=2), self.gather(v, dim=2)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=plan, enable_gqa=q.shape[1] != k.shape[1]
            )
        if self.style == "hierarchical":
            group, size = self.a2a_group, self.a2a_size
            q, k, v = (_heads_to_sequence(t, group, size) for t in (q, k, v))
            out = ring_attention(q, k, v, plan, self.ring_group, self.ring_rank, self.size // size)
            return _sequence_to_heads(out, group, size)
        q, k, v = (_heads_to_sequence(t, self.group, self.size) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=plan, enable_gqa=q.shape[1] != k.shape[1]
        )
        return _sequence_to_heads(out, self.group, self.size)


def _heads_to_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """(batch, heads, local tokens, d) → (batch, heads/size, the group's tokens in rank order, d):
    member j of ``group`` keeps the j-th share of the heads, of every member's tokens."""
    batch, heads, tokens, dim = x.shape
    x = x.reshape(batch, size, heads // size, tokens, dim).transpose(0, 1).contiguous()
    # dim 0: to member j / from member j
    x = funcol.all_to_all_single_autograd(x, None, None, group)
    return x.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * tokens, dim)


def _sequence_to_heads(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse of ``_heads_to_sequence``: this rank's tokens, all heads."""
    batch, heads, tokens, dim = x.shape
    x = x.reshape(batch, heads, size, tokens // size, dim).permute(2, 0, 1, 3, 4).contiguous()
    x = funcol.all_to_all_single_autograd(x, None, None, group)
    return x.transpose(0, 1).reshape(batch, size * heads, tokens // size, dim)


class AttentionPlan:
    """One forward's attention plan (the ring's blocks, or the mask of the other styles), passed
    through the blocks as one opaque object: a compiled block guards on its type alone, where a list
    of blocks or a mask would be guarded on its length or shape, which the documents of each batch
    change (a recompile per batch)."""

    __slots__ = ("content", "window")

    def __init__(self, content, window: int = 0):
        self.content, self.window = content, window


def _mask(
    queries: torch.Tensor, keys: torch.Tensor, documents: torch.Tensor | None, window: int = 0
) -> torch.Tensor:
    """Which keys each query attends to, (batch or 1, 1, queries, keys), both given by global token
    index: keys at or before the query (and within its ``window``, where one is given) and, with
    ``documents`` (batch, seq_len) in global order, in its document."""
    mask = sees(queries[:, None] - keys[None, :], window).unsqueeze(0)
    if documents is not None:
        mask = mask & (documents[:, queries, None] == documents[:, None, keys])
    return mask.unsqueeze(1)
