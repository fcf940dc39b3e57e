"""One rank's training: the step and the loop around it, under any layout.

- ``trainer``: the ``Trainer`` — model, optimizer, data, one step (micro-batches, loss over the
  global batch's targets, clipping, fp16 scaling, the update) and evaluation in the training layout;
- ``loop``: ``Trainer.fit``, the loop around the step (when to log, evaluate, save, stop);
- ``readback``: a logging window's metrics, reduced over the mesh and read back in one host sync;
- ``loss``: fp32 cross-entropy over (vocab-sharded) logits in chunks; ``fused_loss``: the head's
  matmul and the loss fused per chunk of rows (``train.loss_impl=fused``); ``grad``: the global
  gradient norm across meshes; ``expert_load``: MoE load metrics and balancing around the step;
  ``garbage``: Python's collector at step boundaries (the optimizer is ``composer3d.optim``'s);
- ``metrics`` (metrics.jsonl, run.json, wandb, tensorboard; memory), ``flops`` (FLOPs per token,
  peak, MFU) and ``console`` (what a run prints): what a run reports.
"""
