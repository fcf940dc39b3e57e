"""bf16 compute through FSDP's mixed-precision policy: trains, and stays near the fp32 curve."""

from harness import FAST, train_job


def test_bf16_params_fp32_reduce_tracks_fp32(tmp_path):
    fp32 = train_job(tmp_path / "fp32", *FAST, "train.steps=5", "parallel.dp_shard=2", nproc=2)
    bf16 = train_job(
        tmp_path / "bf16",
        *FAST,
        "train.steps=5",
        "parallel.dp_shard=2",
        "precision.param_dtype=bfloat16",
        nproc=2,
    )
    diffs = [abs(a - b) for a, b in zip(fp32.losses, bf16.losses)]
    assert len(diffs) == 5 and max(diffs) < 0.05, diffs
    assert diffs != [0.0] * 5, (
        "bf16 compute should not be bit-identical to fp32: was the policy applied?"
    )


def _one_rank_cast_worker(rank, world, out_path):
    """One rank, bf16, precision.cast=params: the trainer's model against a plain PyTorch copy of
    its fp32 weights cast to bf16 (``Module.to``; its RoPE tables fp32, as no forward input is
    cast), forward and backward on the same tokens."""
    import json

    import torch
    from hydra import compose, initialize_config_module
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from composer3d.config.checks import validate
    from composer3d.config.registration import register_configs
    from composer3d.data import build_sequences
    from composer3d.models.llama import Llama
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.trainer import Trainer

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            overrides=[
                "run.dir=unused",
                "checkpoint.enabled=false",
                "data=synthetic",
                *FAST,
                "precision.param_dtype=bfloat16",
                "precision.cast=params",
            ],
        )
    layout = validate(cfg, world)
    sequences = build_sequences(
        cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
    )
    trainer = Trainer(cfg, ParallelMesh(layout, "cpu"), torch.device("cpu"), sequences)
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    params = dict(trainer.model.named_parameters())
    plain = Llama(cfg.model)
    plain.load_state_dict({name: whole(p).detach() for name, p in params.items()})
    plain.to(torch.bfloat16)
    plain.init_buffers(torch.device("cpu"))  # fp32 RoPE tables
    tokens = sequences.tokens[:2, :-1]
    losses, grads = [], []
    for model in (trainer.model, plain):
        logits = model(tokens)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({name: whole(p.grad).float() for name, p in model.named_parameters()})
    result = {
        "logits_dtype": str(logits.dtype),
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in trainer.model.modules()),
        "losses": losses,
        "grad_dtypes": sorted({str(p.grad.dtype) for p in trainer.model.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        # per parameter: the largest difference, and the largest gradient element (for a bf16 ulp's
        # size)
        "diffs": {
            n: [(grads[0][n] - grads[1][n]).abs().max().item(), grads[1][n].abs().max().item()]
            for n in params
        },
        "matrices": [n for n, p in params.items() if p.ndim >= 2],
    }
    json.dump(result, open(out_path, "w"))


def test_one_rank_cast_params_computes_as_the_model_cast_to_bf16(tmp_path):
    """On one rank, precision.cast=params (``parallel.cast_once``) runs the forward and backward of
    the model cast to bf16 (the same loss and matrices' gradients to the bit, the norms' within one
    bf16 rounding), with fp32 parameters and gradients for the step, and no FSDP."""
    import json

    from harness import spawn

    out = tmp_path / "result.json"
    spawn(_one_rank_cast_worker, 1, tmp_path, str(out))
    result = json.loads(out.read_text())
    assert result["param_dtypes"] == result["grad_dtypes"] == ["torch.float32"], result
    assert result["fsdp_modules"] == 0 and result["logits_dtype"] == "torch.bfloat16", result
    assert result["losses"][0] == result["losses"][1], result["losses"]
    diffs = result["diffs"]
    assert all(diffs[n] == [0.0, diffs[n][1]] and diffs[n][1] > 0 for n in result["matrices"]), (
        diffs
    )
    # The norms' weights: torch 2.15's RMSNorm backward summed their bf16 gradient in another order
    # over FSDP's unsharded views than over a plain parameter (2.13: bit-identical too), one bf16
    # rounding step at most.
    assert all(diff <= largest * 2**-7 for diff, largest in diffs.values()), diffs
