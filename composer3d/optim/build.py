"""The optimizer a run steps (AdamW's kernels, torchao's low-bit AdamW, Muon), and its
hyperparameters across a resume."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from composer3d.config.schema import OptimConfig
from composer3d.dtypes import DTYPES
from composer3d.launch.distributed import is_accelerator
from composer3d.memory.optimizer_offload import HostOffloadOptimizer
from composer3d.optim.compiled_adamw import CompiledAdamW
from composer3d.optim.muon import Muon, muon_parameter
from composer3d.parallel.data_parallel.zero import OptimizerStateSharder

log = logging.getLogger("composer3d")


def build_optimizer(
    model: nn.Module,
    optim: OptimConfig,
    zero1_mesh: Callable[[torch.Tensor], DeviceMesh] | None = None,
    offload: str = "none",
    offload_dir: str | None = None,
    device: torch.device | None = None,
    zero1: dict | None = None,
) -> tuple[torch.optim.Optimizer, OptimizerStateSharder | None]:
    """AdamW with weight decay on matrices only (not norms), or Muon (``optim.name=muon``: see
    ``optim.muon``) with AdamW for what Muon does not step. With ``zero1_mesh`` its state is
    sharded (ZeRO-1) and the sharder (``zero1``: its reduce dtype, bucket bytes and backwards a
    step), which also reduces the gradients and saves and loads that state, is returned with it
    (``zero1_mesh``: each parameter's replicas, as ``parallel.zero.replica_mesh`` gives them).
    ``offload="optimizer"``: its state and step on the host (or in files under ``offload_dir``),
    parameters and gradients on ``device``. Frozen parameters (``peft``: the base model) get no
    state."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    decays = [p.ndim >= 2 for p in params]
    sharder = (
        OptimizerStateSharder(params, [zero1_mesh(p) for p in params], **(zero1 or {}))
        if zero1_mesh is not None
        else None
    )
    targets = sharder.shards if sharder else params
    if optim.name == "muon":
        optimizer = _muon(named, targets, sharder, optim, device)
        if sharder:
            sharder.attach(optimizer)
        return optimizer, sharder
    groups = [
        {"params": [t for t, d in zip(targets, decays) if d], "weight_decay": optim.weight_decay},
        {"params": [t for t, d in zip(targets, decays) if not d], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    settings = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)
    if offload == "optimizer":  # the step runs on host copies: the kernels are the host's
        kernels = _kernel_flags(adamw_implementation(optim.implementation, [torch.empty(0)]))
        return HostOffloadOptimizer(
            groups, torch.optim.AdamW, device, offload_dir, **settings, **kernels
        ), None
    implementation = (
        adamw_implementation(optim.implementation, targets) if optim.name == "adamw" else None
    )
    if implementation == "compiled":
        optimizer = CompiledAdamW(
            groups, block_of=numbered_blocks([name for name, _ in named], targets), **settings
        )
    else:
        kernels = _kernel_flags(implementation) if implementation else {}
        optimizer = optimizer_class(optim.name)(groups, **settings, **kernels)
    if sharder:
        sharder.attach(optimizer)
    return optimizer, sharder


def _muon(
    named: list[tuple[str, nn.Parameter]],
    targets: list[torch.Tensor],
    sharder: OptimizerStateSharder | None,
    optim: OptimConfig,
    device,
) -> Muon:
    """Muon for the parameters ``muon_parameter`` picks, AdamW for the rest (decayed where ≥ 2-D,
    as under optim.name=adamw); ``targets``: what it steps of each (ZeRO-1: this rank's slices)."""
    muon = [muon_parameter(name, p, list(optim.muon_adamw_params)) for name, p in named]
    decay = optim.weight_decay
    groups = [
        {"params": [t for t, m in zip(targets, muon) if m], "weight_decay": decay, "muon": True},
        *(
            {
                "params": [
                    t for t, (_, p), m in zip(targets, named, muon) if not m and (p.ndim >= 2) == d
                ],
                "weight_decay": decay if d else 0.0,
                "muon": False,
            }
            for d in (True, False)
        ),
    ]
    # ZeRO-1: each Muon slice's group, every rank's range of its parameter, the parameter's shape
    slices = (
        [
            (*sharder.slices(i), tuple(_local(p).shape))
            for i, ((_, p), m) in enumerate(zip(named, muon))
            if m
        ]
        if sharder
        else None
    )
    ns_dtype = optim.muon_ns_dtype
    if ns_dtype == "auto":
        ns_dtype = "bfloat16" if device is not None and is_accelerator(device) else "float32"
    optimizer = Muon(
        [g for g in groups if g["params"]],
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        momentum=optim.muon_momentum,
        nesterov=optim.muon_nesterov,
        ns_steps=optim.muon_ns_steps,
        ns_dtype=DTYPES[ns_dtype],
        scale=optim.muon_scale,
        bucket_bytes=int(optim.muon_bucket_mb * 2**20),
        slices=slices,
    )
    work = optimizer.orthogonalizer.work()
    log.info(
        "muon: this rank orthogonalizes %d of the %d matrices its meshes hold (%.3g GFLOP a step; "
        "an even share %.3g) and sends %d elements a step, receives %d",
        work["owned"],
        work["matrices"],
        work["flops"] / 1e9,
        work["even_flops"] / 1e9,
        work["sent"],
        work["received"],
    )
    return optimizer


def adamw_implementation(implementation: str, params: list[torch.Tensor]) -> str:
    """The AdamW kernels ``optim.implementation`` names for ``params``.

    ``auto``: compiled where every parameter is on the accelerator — on an H200 it steps a 1.5B
    model (the clip included) in 12.6 ms against the fused kernel's 16.4, and the 1B's compiled step
    runs 2.6% faster, eager 2.1%; its first step compiles a graph per shape of block (seconds), as
    the loss's chunk kernels compile on an accelerator. Elsewhere the fused kernel where every
    parameter's device has one (on the CPU the compiled update's per-element divisions make it 37%
    slower than fused), else foreach. Torch's own default would pick foreach on accelerators and a
    Python loop on the CPU.
    """
    if implementation != "auto":
        return implementation
    devices = {p.device for p in params}
    if devices and all(is_accelerator(d) for d in devices):
        return "compiled"
    return (
        "fused"
        if {d.type for d in devices} <= set(_get_fused_kernels_supported_devices())
        else "foreach"
    )


def numbered_block(name: str) -> str | None:
    """The numbered block a parameter's name is in ("layers.3.attention.wq.weight": "layers.3";
    Hugging Face's "model.layers.3.mlp.up_proj.weight": "model.layers.3"), None outside one
    (embeddings, final norm, head)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return None if index is None else ".".join(parts[: index + 1])


def numbered_blocks(
    names: list[str], tensors: list[torch.Tensor]
) -> Callable[[torch.Tensor], str | None]:
    """``CompiledAdamW``'s ``block_of``: each of ``tensors`` (a parameter, or ZeRO-1's slice of it)
    to the ``numbered_block`` of its parameter's name in ``names``; tensors are looked up by
    identity."""
    blocks = {id(t): numbered_block(name) for name, t in zip(names, tensors)}
    return lambda t: blocks.get(id(t))


def _kernel_flags(implementation: str) -> dict[str, bool]:
    """``torch.optim.AdamW``'s ``fused``/``foreach`` arguments for ``implementation`` (not
    ``compiled``)."""
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """AdamW, or torchao's low-bit AdamW whose moments are stored in 8 bit, 4 bit or float8
    (block-quantized)."""
    if name == "adamw":
        return torch.optim.AdamW
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

    # torchao compiles its optimizer step over quantized-state subclasses; with torch 2.13 the
    # on-disk inductor caches hand back a graph compiled for other parameter shapes ("wrong number
    # of dimensions" asserts, or a missing attribute for fp8 state). Compiling afresh in each
    # process avoids that.
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    # otherwise step 1 comes after a silence that looks like a hang
    log.info(
        "optim.name=%s: torchao compiles its low-bit update during step 1 (tens of seconds on a "
        "CPU, once per process)",
        name,
    )
    return {"adamw_8bit": AdamW8bit, "adamw_4bit": AdamW4bit, "adamw_fp8": AdamWFp8}[name]


HYPERPARAMETERS = (
    "initial_lr",
    "betas",
    "eps",
    "weight_decay",
)  # initial_lr: the schedule's base, set by it
KERNEL_FLAGS = (
    "foreach",
    "fused",
    "capturable",
)  # how the step runs: this run's optim.implementation


def with_configured_kernels(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """An optimizer state dict from a checkpoint, its parameter groups given ``optimizer``'s kernel
    flags. Torch's ``load_state_dict`` takes every group key from the checkpoint: a run resumed with
    another ``optim.implementation`` would step with the saved one, and Adam places its step counts
    (host or device) by those flags."""
    defaults = getattr(optimizer, "defaults", {})
    flags = {k: defaults[k] for k in KERNEL_FLAGS if k in defaults}
    return {**state, "param_groups": [{**g, **flags} for g in state["param_groups"]]}


def configured_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's hyperparameters as this run's config set them (before any checkpoint
    is loaded)."""
    return [{k: _plain(group[k]) for k in HYPERPARAMETERS} for group in optimizer.param_groups]


def restore_configured_settings(
    optimizer: torch.optim.Optimizer, scheduler, settings: list[dict]
) -> list[str]:
    """Put the config's hyperparameters back after a checkpoint load restored the saved ones;
    returns what the checkpoint had otherwise ("lr 0.0003 -> 0.0001"). The current learning rate is
    the config's schedule at the current step (the checkpoint's is its own schedule's: another base
    rate, train.steps, warmup or decay), so the first resumed step already runs as config.yaml
    says."""
    changed = []
    for i, (group, wanted) in enumerate(zip(optimizer.param_groups, settings)):
        base_changed = False
        for key, value in wanted.items():
            if _plain(group[key]) == value:
                continue
            changed.append(
                f"{'lr' if key == 'initial_lr' else key} {_plain(group[key])} -> {value}"
            )
            if key != "initial_lr":
                group[key] = value
                continue
            base_changed = True
            base = scheduler.base_lrs[i]
            # torchao's optimizers keep learning rates as tensors: keep the type
            scheduler.base_lrs[i] = torch.tensor(value) if isinstance(base, torch.Tensor) else value
            group["initial_lr"] = scheduler.base_lrs[i]
        # as LambdaLR computes it, so an unchanged schedule gives the saved value bit for bit
        lr = scheduler.base_lrs[i] * scheduler.lr_lambdas[i](scheduler.last_epoch)
        # a changed base rate, already named, explains the current rate's change
        if _plain(group["lr"]) != _plain(lr) and not base_changed:
            changed.append(
                f"lr at step {scheduler.last_epoch + 1} {_plain(group['lr']):.4g} -> "
                f"{_plain(lr):.4g} (this run's schedule)"
            )
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
        scheduler._last_lr[i] = group["lr"]
    return sorted(set(changed))


def _plain(value):
    """A hyperparameter as plain numbers (tuples for betas, floats for tensors), for comparison."""
    if isinstance(value, torch.Tensor):
        return float(value)
    if isinstance(value, (list, tuple)):
        return tuple(float(v) for v in value)
    return float(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def groups_by_parameter(state: dict) -> dict:
    """An FQN-keyed optimizer state dict with its parameter groups' settings keyed by parameter
    instead of a list of groups: a checkpoint stores a list as one object, which the ranks of a
    pipeline (each stage with other parameters) would each write whole, one of them winning, and
    the other stages would then read groups that hold none of their parameters. Each parameter's
    settings are one list of (key, value) pairs: one stored object (a dict would be one a key)."""
    groups = {
        name: [[k, v] for k, v in sorted(group.items()) if k != "params"]
        for group in state["param_groups"]
        for name in group["params"]
    }
    return {**state, "param_groups": groups}


def groups_of_this_rank(state: dict, own: dict) -> dict:
    """``groups_by_parameter``'s inverse on this rank: its own groups (``own``: its optimizer's
    state dict, in the same names), each with the saved settings of its first parameter (a group
    with no parameter here keeps its own)."""
    saved = state["param_groups"]
    groups = [
        {
            **(dict(saved[group["params"][0]]) if group["params"] else group),
            "params": group["params"],
        }
        for group in own["param_groups"]
    ]
    return {**state, "param_groups": groups}
