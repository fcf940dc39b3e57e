"""Optimizers and the learning-rate schedule.

- ``build``: the optimizer ``optim.*`` names (AdamW and its kernels, torchao's low-bit AdamW,
  Muon), ZeRO-1's or the host's step around it, and the hyperparameters a resume keeps;
- ``compiled_adamw``: AdamW's update compiled, a graph per shape of block;
- ``muon``: Muon — momentum orthogonalized by Newton–Schulz for the hidden matrices, AdamW for
  the rest; ``orthogonalize``: Newton–Schulz, each matrix on one rank of those holding its shards;
  ``qk_clip``: Kimi K2's QK-Clip, the attention heads' logits held to a threshold;
- ``schedule``: the learning-rate schedule.
"""
