"""precision.cast=params's mechanism (parallel.cast_once) on a small model of its own: one copy a
forward, read by checkpointing's recomputation, gone after the backward, fresh after the weights
change; one set for generation."""

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from composer3d.precision.cast_once import CastOnce


class Tied(nn.Module):
    """An embedding whose table is the head's weight, and a checkpointed block between them."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + checkpoint(self.block, h, use_reentrant=False)
        return self.head(h)


def _model_and_seen():
    torch.manual_seed(0)
    model = Tied()
    CastOnce(model, torch.bfloat16).attach(model)
    # the first linear's weight as each call of it (forward, then the recomputation) sees it
    seen = []
    model.block[0].register_forward_pre_hook(lambda module, args: seen.append(module.weight))
    return model, seen


def test_one_copy_a_forward_read_again_in_recomputation_and_dropped_after_backward():
    model, seen = _model_and_seen()
    tokens = torch.randint(0, 16, (2, 5))
    reference = Tied()
    reference.load_state_dict(model.state_dict())
    reference.to(torch.bfloat16)  # the model cast whole, the plain way
    logits = model(tokens)
    # one copy for the tied pair
    assert logits.dtype == torch.bfloat16 and model.head.weight is model.embed.weight
    logits.float().square().mean().backward()
    # cast once, recomputed from it
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].dtype == torch.bfloat16
    assert not any(
        name in m.__dict__ for m in model.modules() for name, _ in m.named_parameters(recurse=False)
    )
    assert (
        {p.dtype for p in model.parameters()}
        == {p.grad.dtype for p in model.parameters()}
        == {torch.float32}
    )
    assert set(model.state_dict()) == set(reference.state_dict())  # the names as they were
    reference(tokens).float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # the tied table's two uses summed in bf16, as plainly
        assert torch.equal(p.grad, q.grad.float()), name


def test_the_next_forward_casts_the_weights_as_they_are_then():
    model, seen = _model_and_seen()
    tokens = torch.randint(0, 16, (2, 5))
    model(tokens).float().sum().backward()
    with torch.no_grad():
        model.block[0].weight.add_(1.0)  # an optimizer step
        after = model(tokens)  # a forward without a graph: its copies go when it returns
    assert (
        torch.equal(seen[-1], model.block[0].weight.to(torch.bfloat16))
        and not seen[-1].requires_grad
    )
    assert after.dtype == torch.bfloat16 and model.block[0].weight.dtype == torch.float32


def test_held_keeps_one_set_of_copies_for_calls_of_the_modules_themselves():
    model, seen = _model_and_seen()
    with model.cast_once.held():
        # as a decoder calls a block, not the model
        model.block(torch.randn(2, 8, dtype=torch.bfloat16))
        model(torch.randint(0, 16, (2, 5)))
        assert model.block[0].weight.dtype == torch.bfloat16
    assert len(seen) == 2 and seen[0] is seen[1] and model.block[0].weight.dtype == torch.float32
