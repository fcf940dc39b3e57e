"""Optimizers and the learning-rate schedule.

- ``build``: the optimizer ``optim.*`` names (AdamW and its kernels, torchao's low-bit AdamW,
  Muon), ZeRO-1's or the host's step around it, and the hyperparameters a resume keeps;
- ``compiled_adamw``: AdamW's update compiled, a graph per shape of block;
- ``schedule``: the learning-rate schedule.
"""
