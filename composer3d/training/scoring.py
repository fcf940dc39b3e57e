"""Token scores of whole sequences under any training layout: the log-probability the model gives
each target token and whether that token is its most likely one — what a benchmark harness asks of a
model (``eval.tasks``).

Every rank of the layout runs the forward together (FSDP's gathers, TP's shards, the cp ring, the
pipeline's stages are collectives), and every rank ends with the whole batch's logits: gathered over
the vocabulary (TP), put back in sequence order (cp), and sent from the pipeline's last stage to the
others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composer3d.data import IGNORE_INDEX


def layout_logits(trainer, inputs: torch.Tensor) -> torch.Tensor:
    """fp32 logits (batch, seq, vocab) of ``inputs`` (whole sequences, plain causal attention) on
    every rank.

    Under pipeline parallel the batch is split into the schedule's microbatches (its rows a multiple
    of them)."""
    inputs = inputs.to(trainer.device)
    whole_len = inputs.shape[1]
    if trainer.context is not None:
        inputs = trainer.context.shard(inputs)
    if trainer.pipeline is None:
        logits = trainer.model(inputs)
    else:  # forward only; the targets feed the schedule's loss, which nothing reads
        targets = torch.full_like(inputs, IGNORE_INDEX)
        args = (inputs,) if trainer.runs_first_stage else ()
        logits = trainer.pipeline.eval(*args, target=targets, losses=[])
    # tensor parallel: the head's output is sharded over the vocabulary
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if trainer.pipeline is not None:  # the last stage's logits to every stage: the others add zeros
        group = trainer.mesh["pp"].get_group()
        vocab = torch.tensor(
            logits.shape[-1] if trainer.runs_last_stage else 0, device=trainer.device
        )
        dist.all_reduce(vocab, op=dist.ReduceOp.MAX, group=group)
        received = torch.zeros(
            inputs.shape + (int(vocab),), device=trainer.device, dtype=torch.float32
        )
        if trainer.runs_last_stage:
            received.copy_(logits)
        dist.all_reduce(received, group=group)
        logits = received
    logits = logits.float()
    if trainer.context is not None:
        logits = trainer.context.whole(logits, dim=1)
    assert logits.shape[1] == whole_len
    return logits


def target_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of its targets (IGNORE_INDEX positions skipped, in
    float64) and whether every target is the model's argmax there (ties to the first, as ``argmax``
    breaks them)."""
    scored = targets != IGNORE_INDEX
    safe = targets.clamp(min=0)
    logprobs = torch.log_softmax(logits.double(), dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    greedy = (logits.argmax(dim=-1) == safe) | ~scored
    return (logprobs * scored).sum(dim=1), greedy.all(dim=1)
