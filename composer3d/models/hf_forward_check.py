"""Before training: composer3d's forward of a Hugging Face architecture computes what transformers' own does.

composer3d rebuilds the top-level forward (to split it into pipeline stages and shard it); what an architecture
does in its own ``*Model.forward`` / ``*ForCausalLM.forward`` (embedding multipliers, logit scaling, …) would be
skipped without a word, under every layout alike, where parity between layouts cannot see it. So the launcher runs
both forwards on a tiny random replica of the model's config.json — the same architecture and options, a layer of
each attention type, a few heads of the same head size, a small vocabulary — in fp32 on the CPU, in about a second,
and refuses the model on a mismatch.
"""

from __future__ import annotations

import copy
import tempfile

import torch
from omegaconf import OmegaConf

from composer3d.errors import ConfigError

VOCAB = 256
TOKENS = 48
WINDOW = 16  # a sliding window shorter than the tokens, so that windowed attention is exercised
ATOL = 1e-4


def tiny_replica(config):
    """``config`` shrunk to a few million parameters, everything else kept. The head size stays (rotary scaling
    tables are sized by it); widths follow from the number of heads."""
    replica = copy.deepcopy(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    replica_kv = 1 if kv_heads == 1 else 2
    replica.num_attention_heads = replica_kv * (2 if kv_heads < heads else 1)
    if hasattr(config, "num_key_value_heads"):
        replica.num_key_value_heads = replica_kv
    replica.head_dim = head_dim
    replica.hidden_size = replica.num_attention_heads * head_dim
    if hasattr(config, "intermediate_size"):
        replica.intermediate_size = 2 * replica.hidden_size
    replica.vocab_size = VOCAB
    for special in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, special, None)
        if isinstance(value, int) and value >= VOCAB or isinstance(value, list):
            setattr(replica, special, None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:  # the first layer of each type, in their order
        first = sorted({kind: i for i, kind in reversed(list(enumerate(layer_types)))}.values())
        replica.layer_types = [layer_types[i] for i in first]
        replica.num_hidden_layers = len(first)
    else:
        replica.num_hidden_layers = min(config.num_hidden_layers, 2)
    if getattr(config, "sliding_window", None):
        replica.sliding_window = min(config.sliding_window, WINDOW)
    return replica


@torch.no_grad()
def check_forward_matches_transformers(model_cfg) -> None:
    """Raise ConfigError naming the architecture when composer3d's logits differ from transformers' on the replica."""
    from transformers import AutoModelForCausalLM

    from composer3d.models.hf import HFCausalLM, load_hf_config

    config = load_hf_config(model_cfg.path, model_cfg.attn_implementation)
    replica = tiny_replica(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(replica, dtype=torch.float32).eval()
        for name, param in reference.named_parameters():
            if param.dim() == 1:  # norms start at ones or zeros: perturbed, a skipped or swapped norm shows
                param.add_(0.1 * torch.randn_like(param))
        tokens = torch.randint(0, VOCAB, (2, TOKENS))
    with tempfile.TemporaryDirectory() as directory:
        replica.save_pretrained(directory)
        ours = HFCausalLM(OmegaConf.merge(model_cfg, {"path": directory})).eval()
    ours.load_state_dict(reference.state_dict())  # the same names: composer3d keeps transformers'
    expected = reference(tokens).logits
    got = ours(tokens)
    worst = (got - expected).abs().max().item()
    if not worst <= ATOL * max(1.0, expected.abs().max().item()):
        kind = config.model_type
        raise ConfigError(
            f"model.path: composer3d's forward of {kind} ({type(reference).__name__}) does not compute what "
            f"transformers' own does: max |Δlogit| {worst:.3g} on a tiny random replica of its config.json. The "
            f"architecture does something in its top-level forward that composer3d's does not reproduce (as "
            f"embedding or logit multipliers); training it would give wrong numbers. Use an architecture that "
            f"passes this check (llama, qwen2, qwen3, mistral, gemma2, gemma3, phi3 are tested)")
